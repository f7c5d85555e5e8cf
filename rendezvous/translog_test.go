package rendezvous

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"

	"github.com/gdrlink/gdrlink/tensor"
)

// lockedBuffer is a bytes.Buffer safe for a log handler and a test.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// TestTransferLog checks that a Recv logs its transfer at debug level, and
// only when the logger takes debug records.
func TestTransferLog(t *testing.T) {
	for _, level := range []slog.Level{slog.LevelDebug, slog.LevelInfo} {
		t.Run(level.String(), func(t *testing.T) {
			var buf lockedBuffer
			log := slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: level}))
			a, err := openSide("tcp", "a")
			if err != nil {
				t.Skipf("provider tcp unavailable here: %v", err)
			}
			defer a.close()
			c, err := openSide("tcp", "b", WithLogger(log))
			if err != nil {
				t.Skipf("provider tcp unavailable here: %v", err)
			}
			defer c.close()
			ctx := context.Background()
			errc := make(chan error, 1)
			go func() { errc <- a.ch.Connect(ctx, c.ch.Hello()) }()
			if err := c.ch.Connect(ctx, a.ch.Hello()); err != nil {
				t.Fatal(err)
			}
			if err := <-errc; err != nil {
				t.Fatal(err)
			}
			meta, _ := tensor.MetaFor(tensor.Uint8, tensor.Shape{4096})
			src, err := a.pool.NewTensor(meta)
			if err != nil {
				t.Fatal(err)
			}
			defer src.Release()
			if err := a.ch.SendFunc("logged", 0, src, func(error) {}); err != nil {
				t.Fatal(err)
			}
			got, _, err := c.ch.Recv(ctx, "logged", 0)
			if err != nil {
				t.Fatal(err)
			}
			_ = got.Release()
			logged := strings.Contains(buf.String(), "rendezvous: transfer") && strings.Contains(buf.String(), "transfer.key=logged")
			if want := level == slog.LevelDebug; logged != want {
				t.Fatalf("transfer logged: %v, want %v; log:\n%s", logged, want, buf.String())
			}
		})
	}
}

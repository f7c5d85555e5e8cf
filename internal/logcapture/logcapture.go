// Package logcapture is a log destination for tests that check what a
// component logged: a buffer safe for concurrent writers, a text logger
// over it, and a wait for a line.
package logcapture

import (
	"bytes"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"
)

// Buffer collects log output. The zero value is ready to use.
type Buffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

// Write implements io.Writer.
func (b *Buffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

// Lines is what was written so far, a line each.
func (b *Buffer) Lines() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return strings.Split(strings.TrimSpace(b.buf.String()), "\n")
}

// Logger is a text logger (slog.TextHandler, default level Info) writing
// to b.
func (b *Buffer) Logger() *slog.Logger { return slog.New(slog.NewTextHandler(b, nil)) }

// WaitLine polls for up to 20 s until a line contains every part, and
// returns it; otherwise the test fails with what was logged.
func (b *Buffer) WaitLine(t testing.TB, parts ...string) string {
	t.Helper()
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		for _, l := range b.Lines() {
			all := true
			for _, p := range parts {
				all = all && strings.Contains(l, p)
			}
			if all {
				return l
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no log line with %q in:\n%s", parts, strings.Join(b.Lines(), "\n"))
		}
	}
}

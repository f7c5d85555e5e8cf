package proxy_test

import (
	"context"
	"errors"
	"testing"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/gpusim"
	"github.com/gdrlink/gdrlink/proxy"
)

// FuzzReceiverChunks feeds a receiver arbitrary chunk reports and checks
// them against a model: a chunk is accepted exactly when it lies inside the
// tensor, overlaps no accepted chunk and the tensor is not complete; refused
// chunks get ErrOutOfRange or ErrBadChunk; a complete tensor lands on the
// device intact; the proxy tensor always returns to the pool.
func FuzzReceiverChunks(f *testing.F) {
	f.Add([]byte{16, 0, 255})
	f.Add([]byte{1, 0, 1})
	f.Add([]byte{8, 0, 64, 64, 64})
	f.Add([]byte{4, 32, 32, 0, 32, 0, 200})
	f.Add([]byte{200, 255, 255, 0, 0, 3, 7, 128, 1})
	sim := gpusim.New(gpusim.Config{})
	pool, err := alloc.New(alloc.NewMmapSource(alloc.MmapOptions{}), alloc.WithVisitors(sim.HostRegisterVisitor()))
	if err != nil {
		f.Fatal(err)
	}
	px, err := proxy.New(sim, pool)
	if err != nil {
		f.Fatal(err)
	}
	const maxN = 255 * 16
	dst, err := sim.Alloc(maxN)
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { px.Close(); pool.Close(); sim.Close() })

	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) == 0 {
			return
		}
		n := 1 + int(data[0])*16 - int(data[0])%7
		rc, err := px.Receive(dst, n, nil)
		if err != nil {
			t.Fatal(err)
		}
		buf := rc.Block().Bytes()[:n]
		for i := range buf {
			buf[i] = byte(i*13 + n)
		}
		got := make([]bool, n)
		have := 0
		for i := 1; i+1 < len(data); i += 2 {
			off := int(data[i])*17 - 16
			c := int(data[i+1])*9 - 4
			inRange := off >= 0 && c > 0 && off+c <= n
			free := inRange
			for j := off; free && j < off+c; j++ {
				free = !got[j]
			}
			want := inRange && free && have < n
			err := rc.ChunkArrived(off, c)
			if (err == nil) != want {
				t.Fatalf("chunk [%d,+%d) of %d (have %d): err %v, model accepts %v", off, c, n, have, err, want)
			}
			if err != nil && !errors.Is(err, proxy.ErrOutOfRange) && !errors.Is(err, proxy.ErrBadChunk) {
				t.Fatalf("chunk [%d,+%d): untyped error %v", off, c, err)
			}
			if want {
				for j := off; j < off+c; j++ {
					got[j] = true
				}
				have += c
			}
		}
		if have < n {
			rc.Abort(nil)
		}
		err = rc.Wait(context.Background())
		switch {
		case have == n && err != nil:
			t.Fatalf("complete tensor: %v", err)
		case have < n && !errors.Is(err, proxy.ErrCanceled):
			t.Fatalf("aborted tensor: %v", err)
		}
		if have == n {
			dev, _ := sim.Peek(dst, n)
			for i := range dev {
				if dev[i] != byte(i*13+n) {
					t.Fatalf("device byte %d: %d", i, dev[i])
				}
			}
		}
		if u := pool.Stats().InUse; u != 0 {
			t.Fatalf("pool has %d bytes in use", u)
		}
	})
}

package onnode

import (
	"testing"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/verbsio"
)

// TestPoolArenas registers the arenas of an alloc pool from a visitor:
// memfd arenas are file-backed (peers map them), anonymous ones are not,
// whether detected or passed with RegisterMemoryFD.
func TestPoolArenas(t *testing.T) {
	n, _ := loopback(t, Options{}, 0)
	type key struct{}
	for _, c := range []struct {
		name   string
		src    alloc.Source
		useFD  bool
		backed bool
	}{
		{"memfd detected", alloc.NewMemfdSource("gdrlink-onnode-test", alloc.MmapOptions{}), false, true},
		{"memfd with fd", alloc.NewMemfdSource("gdrlink-onnode-test", alloc.MmapOptions{}), true, true},
		{"mmap", alloc.NewMmapSource(alloc.MmapOptions{}), false, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			v := alloc.NewVisitor("onnode-mr", func(a *alloc.Arena) error {
				var mr verbsio.MemoryRegion
				var err error
				if r := a.Region(); c.useFD && r.FD >= 0 {
					mr, err = n.pd.(FDRegistrar).RegisterMemoryFD(a.Base(), a.Size(), rw, r.FD, 0)
				} else {
					mr, err = n.pd.RegisterMemory(a.Base(), a.Size(), rw)
				}
				if err != nil {
					return err
				}
				a.SetHandle(key{}, mr)
				return nil
			}, func(a *alloc.Arena) error {
				mr, _ := a.Handle(key{})
				return mr.(verbsio.MemoryRegion).Close()
			})
			pool, err := alloc.New(c.src, alloc.WithVisitors(v))
			if err != nil {
				t.Fatal(err)
			}
			defer pool.Close()
			blk, err := pool.Alloc(1 << 20)
			if err != nil {
				t.Fatal(err)
			}
			defer blk.Free()
			a, ok := pool.ArenaOf(blk.Addr())
			if !ok {
				t.Fatal("no arena for the block")
			}
			h, _ := a.Handle(key{})
			if got := h.(*memoryRegion).FileBacked(); got != c.backed {
				t.Fatalf("file-backed %v, want %v", got, c.backed)
			}
		})
	}
}

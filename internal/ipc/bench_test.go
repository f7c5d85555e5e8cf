package ipc

import (
	"fmt"
	"testing"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/alloc/visitor"
)

// BenchmarkPull compares, per size, a pull through a second mapping of the
// sender's memfd arena (what a peer process does) with a copy inside one
// mapping and with staging through a host buffer (two copies).
func BenchmarkPull(b *testing.B) {
	for _, n := range []int{4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20} {
		pool, err := alloc.New(alloc.NewMemfdSource("ipc-bench", alloc.MmapOptions{}),
			alloc.WithVisitors(visitor.NewIPCExport()), alloc.WithInitialArena(2*n+(1<<20)))
		if err != nil {
			b.Fatal(err)
		}
		blk, err := pool.Alloc(n)
		if err != nil {
			b.Fatal(err)
		}
		pattern(blk.Bytes()[:n], 1)
		a, _ := pool.ArenaOf(blk.Addr())
		em, fd, _ := ExportOf(1, a)
		dup, err := dupFD(fd)
		if err != nil {
			b.Fatal(err)
		}
		mp, err := MemfdOpener{}.Open(1, em, dup)
		if err != nil {
			b.Fatal(err)
		}
		pm := Msg{Kind: KindPull, Arena: em.Arena, Offset: uint64(blk.Addr() - a.Base()), Size: uint64(n)}
		dst := make([]byte, n)
		stage := make([]byte, n)
		name := fmt.Sprintf("%dKiB", n>>10)
		b.Run("mapped/"+name, func(b *testing.B) {
			b.SetBytes(int64(n))
			for b.Loop() {
				ev, err := Pull(dst, mp, pm)
				if err != nil {
					b.Fatal(err)
				}
				<-ev.Done()
			}
		})
		b.Run("inprocess/"+name, func(b *testing.B) {
			b.SetBytes(int64(n))
			src := blk.Bytes()[:n]
			for b.Loop() {
				copy(dst, src)
			}
		})
		b.Run("staged/"+name, func(b *testing.B) {
			b.SetBytes(int64(n))
			src := blk.Bytes()[:n]
			for b.Loop() {
				copy(stage, src)
				copy(dst, stage)
			}
		})
		mp.Close()
		blk.Free()
		pool.Close()
	}
}

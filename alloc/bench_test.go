package alloc

import (
	"runtime"
	"testing"

	"golang.org/x/sys/unix"
)

// threadCPU reports, as "cpu-ns/op", the CPU time the benchmark's thread
// spent per operation: on a shared machine it leaves out the time other
// processes held the CPU, which ns/op (wall clock) counts. Call the returned
// function when the loop is done; the goroutine stays on its thread until
// then.
func threadCPU(b *testing.B) func() {
	runtime.LockOSThread()
	start := threadNs()
	return func() {
		b.ReportMetric(float64(threadNs()-start)/float64(b.N), "cpu-ns/op")
		runtime.UnlockOSThread()
	}
}

func threadNs() int64 {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_THREAD_CPUTIME_ID, &ts); err != nil {
		return 0
	}
	return ts.Nano()
}

// BenchmarkAllocFree measures an Alloc and Free pair: of one cached size, of
// mixed sizes with a working set of live blocks, and from parallel goroutines.
func BenchmarkAllocFree(b *testing.B) {
	b.Run("cached-4KiB", func(b *testing.B) {
		p := newTestPool(b, NewMmapSource(MmapOptions{}))
		mustFree(b, mustAlloc(b, p, 4096)) // the arena exists before timing
		b.ReportAllocs()
		done := threadCPU(b)
		for b.Loop() {
			blk, err := p.Alloc(4096)
			if err != nil {
				b.Fatal(err)
			}
			if err := p.free(blk); err != nil {
				b.Fatal(err)
			}
		}
		done()
	})
	b.Run("mixed", func(b *testing.B) {
		p := newTestPool(b, NewMmapSource(MmapOptions{}))
		rng := newRand(7)
		sizes := make([]int, 1024)
		for i := range sizes {
			sizes[i] = 1 + rng.IntN(256<<uint(rng.IntN(10)))
		}
		// A working set of 64 live blocks; each op frees one and allocates.
		ring := make([]Block, 64)
		for i := range ring {
			ring[i] = mustAlloc(b, p, sizes[i])
		}
		b.ReportAllocs()
		done := threadCPU(b)
		i := 0
		for b.Loop() {
			k := i % len(ring)
			if err := p.free(ring[k]); err != nil {
				b.Fatal(err)
			}
			blk, err := p.Alloc(sizes[i%len(sizes)])
			if err != nil {
				b.Fatal(err)
			}
			ring[k] = blk
			i++
		}
		done()
		for _, blk := range ring {
			mustFree(b, blk)
		}
	})
	b.Run("parallel-4KiB", func(b *testing.B) {
		p := newTestPool(b, NewMmapSource(MmapOptions{}))
		mustFree(b, mustAlloc(b, p, 4096))
		b.ReportAllocs()
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				blk, err := p.Alloc(4096)
				if err != nil {
					b.Error(err)
					return
				}
				if err := p.free(blk); err != nil {
					b.Error(err)
					return
				}
			}
		})
	})
}

// BenchmarkArenaOf measures the lock-free address lookup over 16 arenas.
func BenchmarkArenaOf(b *testing.B) {
	p := newTestPool(b, NewMmapSource(MmapOptions{}), WithInitialArena(1<<20), WithMaxArena(1<<20))
	var blocks []Block
	for range 16 {
		blocks = append(blocks, mustAlloc(b, p, 1<<20))
	}
	i := 0
	for b.Loop() {
		if _, ok := p.ArenaOf(blocks[i&15].Addr() + 100); !ok {
			b.Fatal("miss")
		}
		i++
	}
	for _, blk := range blocks {
		mustFree(b, blk)
	}
}

package onnode

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/verbsio"
)

var benchSizes = []int{4 << 10, 1 << 20, 16 << 20}

func sizeName(n int) string {
	if n >= 1<<20 {
		return fmt.Sprintf("%dMiB", n>>20)
	}
	return fmt.Sprintf("%dKiB", n>>10)
}

// BenchmarkWrite measures RDMA WRITE into a region of a second process for
// each mechanism and page size of the memory on both sides, next to a
// single-thread memcpy between buffers of the same kind in this process.
func BenchmarkWrite(b *testing.B) {
	cases := []struct {
		name string
		mech Mechanism
		kind string // of the target; the source is "anon" or "thp" to match
	}{
		{"vm-4k", MechVM, "anon"},
		{"vm-huge", MechVM, "thp"},
		{"vm-memfd", MechVM, "memfd"},
		{"shm-memfd", MechSHM, "memfd"},
	}
	for _, c := range cases {
		b.Run(c.name, func(b *testing.B) {
			n, p := pair(b, c.mech)
			srcKind := "anon"
			if c.kind == "thp" {
				srcKind = "thp"
			}
			max := benchSizes[len(benchSizes)-1]
			src, err := n.register(srcKind, max, verbsio.AccessLocalWrite, 1)
			if err != nil {
				b.Fatal(err)
			}
			f := p.one("mr", "reg %s %d %d 0", c.kind, max, rw)
			addr, rkey := atoi(b, f[0]), uint32(atoi(b, f[1]))
			for _, size := range benchSizes {
				b.Run(sizeName(size), func(b *testing.B) {
					wr := []verbsio.SendWR{{Op: verbsio.OpWrite, RemoteAddr: addr, RKey: rkey, SG: []verbsio.SGE{{Addr: src.Addr(), Length: uint32(size), LKey: src.LKey()}}}}
					// One write before the clock starts maps the target and
					// faults its pages in.
					if err := n.qp.PostSend(wr); err != nil {
						b.Fatal(err)
					}
					b.SetBytes(int64(size))
					b.ResetTimer()
					for i := 0; i < b.N; i++ {
						wr[0].Signaled = i == b.N-1
						if err := n.qp.PostSend(wr); err != nil {
							b.Fatal(err)
						}
					}
					if c := waitOne(b, n.scq, 0x7fffffff); c.Status != verbsio.StatusSuccess {
						b.Fatalf("write: %+v", c)
					}
				})
			}
		})
	}
	// The baselines copy between the same kinds of memory as the cases above.
	for _, c := range []struct{ name, src, dst string }{{"memcpy-4k", "anon", "anon"}, {"memcpy-huge", "thp", "thp"}, {"memcpy-memfd", "anon", "memfd"}} {
		b.Run(c.name, func(b *testing.B) {
			max := benchSizes[len(benchSizes)-1]
			src, err := allocMemory(c.src, max)
			if err != nil {
				b.Fatal(err)
			}
			defer src.free()
			// Written, so the source is real pages, not the shared zero
			// page (reading that is a cache hit and flatters the copy).
			pattern(src.b, 1)
			dst, err := allocMemory(c.dst, max)
			if err != nil {
				b.Fatal(err)
			}
			defer dst.free()
			copy(dst.b, src.b)
			for _, size := range benchSizes {
				b.Run(sizeName(size), func(b *testing.B) {
					b.SetBytes(int64(size))
					for i := 0; i < b.N; i++ {
						copy(dst.b[:size], src.b[:size])
					}
				})
			}
		})
	}
}

// BenchmarkPingPong measures the round trip of a write with immediate and
// its answer between two processes; half of it is the one-way latency.
func BenchmarkPingPong(b *testing.B) {
	for _, c := range []struct {
		name string
		size int
		kind string // memfd: MechSHM; anon: process_vm_writev
	}{{"shm-8B", 8, "memfd"}, {"shm-4KiB", 4096, "memfd"}, {"vm-8B", 8, "anon"}, {"vm-4KiB", 4096, "anon"}} {
		size := c.size
		b.Run(c.name, func(b *testing.B) {
			n, p := pair(b, MechAuto)
			// Each side writes into the first half of the other's
			// region from the second half of its own, which the peer
			// never writes (a source the peer has just written would
			// cost every copy cache misses no sender has).
			mine, err := n.register(c.kind, 8192, rw, 0)
			if err != nil {
				b.Fatal(err)
			}
			f := p.one("mr", "reg %s 8192 %d 0", c.kind, rw)
			addr, rkey := atoi(b, f[0]), uint32(atoi(b, f[1]))
			recvs := make([]verbsio.RecvWR, 64)
			if err := n.qp.PostRecv(recvs); err != nil {
				b.Fatal(err)
			}
			p.mu.Lock()
			fmt.Fprintf(p.in, "pong %d %d %d %d %d\n", rkey, mine.Addr(), mine.RKey(), size, b.N+1)
			p.mu.Unlock()
			wr := []verbsio.SendWR{{Op: verbsio.OpWriteImm, RemoteAddr: addr, RKey: rkey, SG: []verbsio.SGE{{Addr: mine.Addr() + 4096, Length: uint32(size), LKey: mine.LKey()}}}}
			var c [1]verbsio.Completion
			ping := func() {
				if err := n.qp.PostSend(wr); err != nil {
					b.Fatal(err)
				}
				if _, err := n.rcq.Wait(context.Background(), c[:]); err != nil || c[0].Status != verbsio.StatusSuccess {
					b.Fatal(err, c[0])
				}
				if err := n.qp.PostRecv(recvs[:1]); err != nil {
					b.Fatal(err)
				}
			}
			ping()
			rtts := make([]time.Duration, b.N)
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				t := time.Now()
				ping()
				rtts[i] = time.Since(t)
			}
			b.StopTimer()
			slices.Sort(rtts)
			b.ReportMetric(float64(rtts[len(rtts)/2].Nanoseconds())/2, "one-way-p50-ns")
			p.mu.Lock()
			for p.out.Scan() && p.out.Text() != "." {
			}
			p.mu.Unlock()
		})
	}
}

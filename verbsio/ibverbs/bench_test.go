package ibverbs

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/verbsio"
)

// BenchmarkWrite streams RDMA writes between two queue pairs of this
// process on the test device, keeping a window of writes in flight and
// asking for a completion every signalEvery writes, as ib_write_bw does.
// Its MB/s compares with ib_write_bw's on the same device.
func BenchmarkWrite(b *testing.B) {
	d := openTest(b)
	const window, signalEvery = 64, 16
	for _, size := range []int{64 << 10, 1 << 20} {
		b.Run(fmt.Sprintf("%dKiB", size>>10), func(b *testing.B) {
			pdi, err := d.AllocPD()
			if err != nil {
				b.Fatal(err)
			}
			defer mustClose(b, "pd", pdi)
			var cqs [2]verbsio.CompletionQueue
			var qps [2]verbsio.QueuePair
			for i := range qps {
				if cqs[i], err = d.CreateCQ(2 * window); err != nil {
					b.Fatal(err)
				}
				defer mustClose(b, "cq", cqs[i])
				if qps[i], err = pdi.CreateQP(verbsio.QPConfig{SendCQ: cqs[i], RecvCQ: cqs[i], MaxSendWR: window, MaxRecvWR: 1}); err != nil {
					b.Fatal(err)
				}
				defer mustClose(b, "qp", qps[i])
			}
			for i := range qps {
				if err := qps[i].Connect(context.Background(), qps[1-i].Endpoint()); err != nil {
					b.Fatal(err)
				}
			}
			src, dst := mapMem(b, size), mapMem(b, size)
			ms, err := pdi.RegisterMemory(src.addr(), size, verbsio.AccessLocalWrite)
			if err != nil {
				b.Fatal(err)
			}
			defer mustClose(b, "mr", ms)
			md, err := pdi.RegisterMemory(dst.addr(), size, verbsio.AccessLocalWrite|verbsio.AccessRemoteWrite)
			if err != nil {
				b.Fatal(err)
			}
			defer mustClose(b, "mr", md)
			chain := make([]verbsio.SendWR, signalEvery)
			for i := range chain {
				chain[i] = verbsio.SendWR{Op: verbsio.OpWrite, SG: []verbsio.SGE{{Addr: ms.Addr(), Length: uint32(size), LKey: ms.LKey()}},
					RemoteAddr: uint64(md.Addr()), RKey: md.RKey(), Signaled: i == signalEvery-1}
			}
			out := make([]verbsio.Completion, window/signalEvery)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
			defer cancel()
			b.SetBytes(int64(size))
			before := d.Stats()
			b.ResetTimer()
			posted, done := 0, 0
			for done < b.N {
				for posted < b.N && posted-done+signalEvery <= window {
					if err := qps[0].PostSend(chain); err != nil {
						b.Fatal(err)
					}
					posted += signalEvery
				}
				n, err := cqs[0].Wait(ctx, out)
				if err != nil {
					b.Fatal(err)
				}
				for _, c := range out[:n] {
					if c.Status != verbsio.StatusSuccess {
						b.Fatalf("completion %+v", c)
					}
				}
				done += n * signalEvery
			}
			b.StopTimer()
			s := d.Stats()
			b.ReportMetric(float64(s.Crossings-before.Crossings)/float64(s.SendWRs-before.SendWRs), "crossings/write")
		})
	}
}

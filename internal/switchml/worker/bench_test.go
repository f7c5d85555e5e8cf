package worker

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/internal/jobauth"
	"github.com/gdrlink/gdrlink/internal/switchml/aggsrv"
)

// team sets up n workers in this process against an aggregator in this
// process.
func team(b *testing.B, n int) (*aggsrv.Server, []*Worker) {
	key, _, err := jobauth.Generate()
	if err != nil {
		b.Fatal(err)
	}
	port := freePort(b, n)
	cl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	dc, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		b.Fatal(err)
	}
	dc.SetReadBuffer(8 << 20)
	s, err := aggsrv.New(aggsrv.Config{Key: key, Control: cl, Data: dc, PeerPort: uint16(port), SetupTimeout: 30 * time.Second})
	if err != nil {
		b.Fatal(err)
	}
	go s.Serve()
	ws := make([]*Worker, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for r := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			ws[r], errs[r] = New(ctx, Config{Control: cl.Addr().String(), Key: key, Job: "bench", Workers: n, Rank: r,
				Local: [4]byte{127, 0, 0, byte(2 + r)}, Port: uint16(port), DataPort: uint16(dc.LocalAddr().(*net.UDPAddr).Port),
				Timeout: 200 * time.Millisecond})
			if ws[r] != nil {
				ws[r].tr.(*udpLink).sock.SetReadBuffer(8 << 20)
			}
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		b.Fatal(err)
	}
	return s, ws
}

// BenchmarkAllReduce all-reduces float32 tensors through the software
// aggregator: throughput is the tensor's bytes per second (algorithm
// bandwidth); sent-B/op and recv-B/op are one worker's RDMA payload bytes;
// agg-pkt/s is the packets the aggregator took and sent per second.
func BenchmarkAllReduce(b *testing.B) {
	for _, n := range []int{2, 4} {
		for _, size := range []int{64 << 10, 1 << 20, 16 << 20} {
			b.Run(fmt.Sprintf("workers=%d/size=%dKiB", n, size>>10), func(b *testing.B) {
				s, ws := team(b, n)
				defer s.Close()
				xs := make([][]float32, n)
				for r := range xs {
					xs[r] = make([]float32, size/4)
					for i := range xs[r] {
						xs[r][i] = float32(i%1000) * 0.001
					}
				}
				b.SetBytes(int64(size))
				st0 := ws[0].Stats()
				a0 := s.Stats()
				b.ResetTimer()
				start := time.Now()
				for range b.N {
					var wg sync.WaitGroup
					errs := make([]error, n)
					for r, w := range ws {
						wg.Add(1)
						go func() {
							defer wg.Done()
							errs[r] = w.AllReduceFloat32(context.Background(), xs[r])
						}()
					}
					wg.Wait()
					if err := errors.Join(errs...); err != nil {
						b.Fatal(err)
					}
				}
				el := time.Since(start)
				b.StopTimer()
				st := ws[0].Stats()
				a := s.Stats()
				b.ReportMetric(float64(st.BytesSent-st0.BytesSent)/float64(b.N), "sent-B/op")
				b.ReportMetric(float64(st.BytesReceived-st0.BytesReceived)/float64(b.N), "recv-B/op")
				b.ReportMetric(float64(st.Resent-st0.Resent)/float64(b.N), "resent/op")
				b.ReportMetric(float64(a.Applied+a.Duplicates+a.ReplyPackets-a0.Applied-a0.Duplicates-a0.ReplyPackets)/el.Seconds(), "agg-pkt/s")
				var wg sync.WaitGroup
				for _, w := range ws {
					wg.Add(1)
					go func() { defer wg.Done(); w.Close() }()
				}
				wg.Wait()
			})
		}
	}
}

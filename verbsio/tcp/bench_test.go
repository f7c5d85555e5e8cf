package tcp_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/gdrlink/gdrlink/verbsio"
	"github.com/gdrlink/gdrlink/verbsio/tcp"
)

var benchSizes = []int{4 << 10, 1 << 20, 16 << 20}

// cpuTime is the CPU time (user and system) this process has used. On a
// shared host the wall-clock rate depends on the neighbours; the CPU cost of
// a byte moved, reported as cpu-ns/op next to it, much less.
func cpuTime() time.Duration {
	var ru unix.Rusage
	unix.Getrusage(unix.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// reportCPU reports the CPU time per operation since start, and per byte.
func reportCPU(b *testing.B, start time.Duration, n int) {
	d := cpuTime() - start
	b.ReportMetric(float64(d.Nanoseconds())/float64(b.N), "cpu-ns/op")
	b.ReportMetric(float64(b.N)*float64(n)/d.Seconds()/1e6, "MB/cpu-s")
}

// BenchmarkWrite measures RDMA WRITE over the tcp provider on loopback
// between two devices of this process, with up to 8 writes in flight, for
// 1, 2 and 4 lanes; BenchmarkWrite/raw is a plain loopback TCP stream of the
// same sizes into the same kind of memory, the baseline.
func BenchmarkWrite(b *testing.B) {
	for _, n := range benchSizes {
		b.Run(fmt.Sprintf("raw/%s", size(n)), func(b *testing.B) { benchRaw(b, n) })
		for _, lanes := range []int{1, 2, 4} {
			b.Run(fmt.Sprintf("lanes=%d/%s", lanes, size(n)), func(b *testing.B) { benchWrite(b, n, lanes) })
		}
	}
}

func size(n int) string {
	if n >= 1<<20 {
		return fmt.Sprintf("%dMiB", n>>20)
	}
	return fmt.Sprintf("%dKiB", n>>10)
}

func benchMem(b *testing.B, n int) []byte {
	m, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		b.Fatal(err)
	}
	for i := range m {
		m[i] = byte(i)
	}
	b.Cleanup(func() { unix.Munmap(m) })
	return m
}

func benchRaw(b *testing.B, n int) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	defer ln.Close()
	dst, src := benchMem(b, n), benchMem(b, n)
	done := make(chan error, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			done <- err
			return
		}
		defer c.Close()
		for i := 0; i < b.N; i++ {
			if _, err := io.ReadFull(c, dst); err != nil {
				done <- err
				return
			}
		}
		done <- nil
	}()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	b.SetBytes(int64(n))
	b.ResetTimer()
	start := cpuTime()
	for i := 0; i < b.N; i++ {
		if _, err := c.Write(src); err != nil {
			b.Fatal(err)
		}
	}
	if err := <-done; err != nil {
		b.Fatal(err)
	}
	reportCPU(b, start, n)
}

type benchSide struct {
	dev verbsio.Device
	pd  verbsio.ProtectionDomain
	cq  verbsio.CompletionQueue
	qp  verbsio.QueuePair
}

func openSide(b *testing.B, lanes int) *benchSide {
	opt, err := tcp.OptionsFromEnv() // GDRLINK_TCP_SOCKET_BUFFER, to compare
	if err != nil {
		b.Fatal(err)
	}
	opt.Lanes = lanes
	dev, err := tcp.OpenDevice(verbsio.Config{}, opt)
	if err != nil {
		b.Fatal(err)
	}
	s := &benchSide{dev: dev}
	if s.pd, err = dev.AllocPD(); err != nil {
		b.Fatal(err)
	}
	if s.cq, err = dev.CreateCQ(1024); err != nil {
		b.Fatal(err)
	}
	if s.qp, err = s.pd.CreateQP(verbsio.QPConfig{SendCQ: s.cq, RecvCQ: s.cq}); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		s.qp.Close()
		s.cq.Close()
		s.pd.Close()
		s.dev.Close()
	})
	return s
}

func benchWrite(b *testing.B, n, lanes int) {
	a, z := openSide(b, lanes), openSide(b, lanes)
	ctx := context.Background()
	errc := make(chan error, 1)
	go func() { errc <- z.qp.Connect(ctx, a.qp.Endpoint()) }()
	if err := a.qp.Connect(ctx, z.qp.Endpoint()); err != nil {
		b.Fatal(err)
	}
	if err := <-errc; err != nil {
		b.Fatal(err)
	}
	src, dst := benchMem(b, n), benchMem(b, n)
	smr, err := a.pd.RegisterMemory(uintptr(unsafe.Pointer(&src[0])), n, verbsio.AccessLocalWrite)
	if err != nil {
		b.Fatal(err)
	}
	defer smr.Close()
	dmr, err := z.pd.RegisterMemory(uintptr(unsafe.Pointer(&dst[0])), n, verbsio.AccessLocalWrite|verbsio.AccessRemoteWrite)
	if err != nil {
		b.Fatal(err)
	}
	defer dmr.Close()
	wr := []verbsio.SendWR{{Op: verbsio.OpWrite, Signaled: true, SG: []verbsio.SGE{{Addr: smr.Addr(), Length: uint32(n), LKey: smr.LKey()}}, RemoteAddr: uint64(dmr.Addr()), RKey: dmr.RKey()}}
	const inflight = 8
	buf := make([]verbsio.Completion, inflight)
	b.SetBytes(int64(n))
	b.ResetTimer()
	start := cpuTime()
	posted, done := 0, 0
	for done < b.N {
		for posted < b.N && posted-done < inflight {
			wr[0].WRID = uint64(posted)
			if err := a.qp.PostSend(wr); err != nil {
				b.Fatal(err)
			}
			posted++
		}
		k, err := a.cq.Wait(ctx, buf)
		if err != nil {
			b.Fatal(err)
		}
		for _, c := range buf[:k] {
			if c.Status != verbsio.StatusSuccess {
				b.Fatalf("completion %+v", c)
			}
		}
		done += k
	}
	reportCPU(b, start, n)
}

package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/dustin/go-humanize"
	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/alloc/visitor"
	"github.com/gdrlink/gdrlink/verbsio"

	// The providers the selftest runs; each says itself whether it has a
	// device here.
	_ "github.com/gdrlink/gdrlink/verbsio/ibverbs"
	_ "github.com/gdrlink/gdrlink/verbsio/onnode"
	_ "github.com/gdrlink/gdrlink/verbsio/tcp"
)

// Selftest is the outcome of --selftest.
type Selftest struct {
	// Size is the bytes of each write.
	Size   int           `json:"size"`
	Runs   []SelftestRun `json:"runs"`
	Failed int           `json:"failed"`
}

// SelftestRun is one provider and memory path.
type SelftestRun struct {
	Provider string `json:"provider"`
	// Path is the memory written from and to ("mmap", "memfd", "gpu").
	Path string `json:"path"`
	// Status is "ok", "failed" or "skipped".
	Status string `json:"status"`
	Detail string `json:"detail"`
	// GBps is the bandwidth of back-to-back writes of Size bytes, in 1e9
	// bytes per second.
	GBps float64 `json:"gbps"`
}

// poolAlignment is the alignment of the blocks of the selftest's pool:
// alloc's default, 256 bytes.
const poolAlignment = 256

// selftestPaths are the memory a selftest writes from and to.
var selftestPaths = []string{"mmap", "memfd", "gpu"}

// runSelftest moves a pattern through every registered provider and memory
// path over a loopback connection, checks it, and measures bandwidth.
func runSelftest(ctx context.Context, size int) *Selftest {
	s := &Selftest{Size: size, Runs: []SelftestRun{}}
	if size < 1 || size > 1<<30 {
		s.Runs = append(s.Runs, SelftestRun{Status: "failed", Detail: fmt.Sprintf("--selftest-size %d is outside 1..1 GiB", size)})
		s.Failed++
		return s
	}
	for _, name := range verbsio.Providers() {
		for _, path := range selftestPaths {
			r := selftestOne(ctx, name, path, size)
			if r.Status == "failed" {
				s.Failed++
			}
			s.Runs = append(s.Runs, r)
		}
	}
	return s
}

func selftestOne(ctx context.Context, name, path string, size int) (r SelftestRun) {
	r = SelftestRun{Provider: name, Path: path}
	skip := func(format string, a ...any) SelftestRun {
		r.Status, r.Detail = "skipped", fmt.Sprintf(format, a...)
		return r
	}
	fail := func(step string, err error) SelftestRun {
		r.Status, r.Detail = "failed", step+": "+err.Error()
		return r
	}
	p, err := verbsio.Lookup(name)
	if err != nil {
		return fail("lookup", err)
	}
	if _, err := p.Devices(); err != nil {
		return skip("%v", err)
	}
	var src alloc.Source
	switch path {
	case "mmap":
		src = alloc.NewMmapSource(alloc.MmapOptions{})
	case "memfd":
		src = alloc.NewMemfdSource("gdrcheck-selftest", alloc.MmapOptions{})
	case "gpu":
		cs, err := alloc.NewCUDADeviceSource(0)
		if err != nil {
			return skip("no GPU memory: %v", err)
		}
		// Checking bytes in GPU memory needs device copies that this
		// version of the selftest does not make.
		cs.Close()
		return skip("GPU memory path not exercised by this selftest version; see bench scenarios")
	}
	cfg := verbsio.DefaultConfig()
	dev, err := p.Open(cfg)
	if errors.Is(err, verbsio.ErrNotSupported) || errors.Is(err, verbsio.ErrNoDevice) {
		return skip("%v", err)
	}
	if err != nil {
		return fail("open", err)
	}
	defer dev.Close()
	caps := dev.Caps()
	if !caps.WriteWithImmediate {
		return skip("%s has no write with immediate", name)
	}
	if caps.MaxMessage > 0 && int64(size) > caps.MaxMessage {
		return skip("%s writes at most %d bytes", name, caps.MaxMessage)
	}
	pd, err := dev.AllocPD()
	if err != nil {
		return fail("protection domain", err)
	}
	defer pd.Close()
	reg := visitor.NewMemoryRegistration(pd, verbsio.AccessLocalWrite|verbsio.AccessRemoteWrite|verbsio.AccessRemoteRead)
	arena := 2*size + 2*poolAlignment
	pool, err := alloc.New(src, alloc.WithVisitors(reg), alloc.WithInitialArena(arena), alloc.WithName("gdrcheck-selftest"))
	if err != nil {
		return fail("pool", err)
	}
	defer pool.Close()
	a, err := pool.Alloc(size)
	if err != nil {
		return fail("alloc", err)
	}
	defer a.Free()
	b, err := pool.Alloc(size)
	if err != nil {
		return fail("alloc", err)
	}
	defer b.Free()
	cqA, err := dev.CreateCQ(64)
	if err != nil {
		return fail("completion queue", err)
	}
	defer cqA.Close()
	cqB, err := dev.CreateCQ(64)
	if err != nil {
		return fail("completion queue", err)
	}
	defer cqB.Close()
	qpA, err := pd.CreateQP(verbsio.QPConfig{SendCQ: cqA, RecvCQ: cqA})
	if err != nil {
		return fail("queue pair", err)
	}
	defer qpA.Close()
	qpB, err := pd.CreateQP(verbsio.QPConfig{SendCQ: cqB, RecvCQ: cqB})
	if err != nil {
		return fail("queue pair", err)
	}
	defer qpB.Close()
	cctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	errc := make(chan error, 2)
	go func() { errc <- qpA.Connect(cctx, qpB.Endpoint()) }()
	go func() { errc <- qpB.Connect(cctx, qpA.Endpoint()) }()
	for i := 0; i < 2; i++ {
		if err := <-errc; err != nil {
			return fail("connect", err)
		}
	}
	sge, _, err := visitor.SGEOf(pool, a.Addr(), size)
	if err != nil {
		return fail("local key", err)
	}
	rkey, err := visitor.RemoteKeyOf(pool, b.Addr(), size)
	if err != nil {
		return fail("remote key", err)
	}
	src8, dst := a.Bytes(), b.Bytes()
	seed := byte(time.Now().UnixNano())
	for i := range src8 {
		src8[i] = byte(i*131+i>>8) ^ seed
	}
	clear(dst)

	comp := make([]verbsio.Completion, 16)
	wait := func(cq verbsio.CompletionQueue) (verbsio.Completion, error) {
		n, err := cq.Wait(cctx, comp[:1])
		if err != nil {
			return verbsio.Completion{}, err
		}
		if n != 1 {
			return verbsio.Completion{}, fmt.Errorf("%w: %d completions", verbsio.ErrCompletion, n)
		}
		return comp[0], comp[0].Status.Err()
	}
	write := verbsio.SendWR{Op: verbsio.OpWrite, SG: []verbsio.SGE{sge}, RemoteAddr: uint64(b.Addr()), RKey: rkey, Signaled: true}
	// Bandwidth: back-to-back writes, one outstanding at a time, for about
	// half a second.
	start := time.Now()
	n := 0
	for n < 1024 && (n < 4 || time.Since(start) < 500*time.Millisecond) {
		write.WRID = uint64(n)
		if err := qpA.PostSend([]verbsio.SendWR{write}); err != nil {
			return fail("write", err)
		}
		if _, err := wait(cqA); err != nil {
			return fail("write completion", err)
		}
		n++
	}
	elapsed := time.Since(start)
	// The check: a write with immediate that the receiver sees complete,
	// then the bytes compared.
	clear(dst)
	if err := qpB.PostRecv([]verbsio.RecvWR{{WRID: 1}}); err != nil {
		return fail("post receive", err)
	}
	imm := uint32(seed)<<8 | 0x5e
	if err := qpA.PostSend([]verbsio.SendWR{{WRID: 2, Op: verbsio.OpWriteImm, SG: []verbsio.SGE{sge}, RemoteAddr: uint64(b.Addr()), RKey: rkey, Imm: imm, Signaled: true}}); err != nil {
		return fail("write with immediate", err)
	}
	if _, err := wait(cqA); err != nil {
		return fail("write with immediate completion", err)
	}
	c, err := wait(cqB)
	if err != nil {
		return fail("receive completion", err)
	}
	if !c.HasImm || c.Imm != imm {
		return fail("receive completion", fmt.Errorf("immediate %#x (set %v), want %#x", c.Imm, c.HasImm, imm))
	}
	if !bytes.Equal(src8, dst) {
		i := 0
		for i < len(dst) && dst[i] == src8[i] {
			i++
		}
		return fail("verify", fmt.Errorf("byte %d is %#x, want %#x", i, dst[i], src8[i]))
	}
	r.Status = "ok"
	r.GBps = float64(n) * float64(size) / elapsed.Seconds() / 1e9
	r.Detail = fmt.Sprintf("%d writes of %s in %s, pattern verified after a write with immediate", n, humanize.IBytes(uint64(size)), elapsed.Round(time.Microsecond))
	return r
}

func writeSelftest(w io.Writer, s *Selftest, p painter) {
	fmt.Fprintf(w, "\nSelftest (loopback, %s per write)\n", humanize.IBytes(uint64(s.Size)))
	if len(s.Runs) == 0 {
		fmt.Fprintf(w, "  no provider registered\n")
	}
	for _, r := range s.Runs {
		st := r.Status
		switch st {
		case "ok":
			st = p.paint("32", "ok     ")
		case "failed":
			st = p.paint("31", "FAILED ")
		default:
			st = p.paint("33", "skipped")
		}
		rate := "        "
		if r.Status == "ok" {
			rate = fmt.Sprintf("%6.2f GB/s", r.GBps)
		}
		fmt.Fprintf(w, "  %-8s %-6s %s %s  %s\n", r.Provider, r.Path, st, rate, r.Detail)
	}
}

package verbstest

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"net"
	"slices"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gdrlink/gdrlink/internal/bootstrap"
	"github.com/gdrlink/gdrlink/internal/offheap"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

const (
	rw  = verbsio.AccessLocalWrite | verbsio.AccessRemoteWrite
	all = verbsio.AccessLocalWrite | verbsio.AccessRemoteWrite | verbsio.AccessRemoteRead
)

func (s *suite) testCaps(t *testing.T) {
	c := s.dev.Caps()
	if c.Provider != s.h.Provider {
		t.Errorf("Caps.Provider = %q, want %q", c.Provider, s.h.Provider)
	}
	if info := s.dev.Info(); info.Provider != s.h.Provider {
		t.Errorf("Info().Provider = %q, want %q", info.Provider, s.h.Provider)
	}
	if c.MaxSGE < 1 || c.MaxQPDepth < 1 || c.MaxMessage < 1<<20 {
		t.Errorf("Caps = %+v: MaxSGE, MaxQPDepth must be positive and MaxMessage at least 1 MiB", c)
	}
	if !slices.Contains(c.MemoryTypes, tensor.CPU) {
		t.Errorf("Caps.MemoryTypes = %v lacks host memory, which every provider must register", c.MemoryTypes)
	}
	if !c.DMABuf {
		// A provider that says no must say so when asked.
		fd, err := unix.MemfdCreate("verbstest", 0)
		if err != nil {
			t.Fatal(err)
		}
		defer unix.Close(fd)
		unix.Ftruncate(fd, 1<<16)
		mr, err := s.pd.RegisterDMABuf(fd, 0, 1<<16, 0, rw)
		if err == nil {
			mr.Close()
			t.Error("Caps.DMABuf is false but RegisterDMABuf succeeded")
		} else if !errors.Is(err, verbsio.ErrNotSupported) {
			t.Errorf("RegisterDMABuf with Caps.DMABuf false: %v, want an error wrapping ErrNotSupported", err)
		}
	}
	// WriteWithImmediate and MaxInline are checked against behaviour in
	// WriteImm and Inline.
}

func (s *suite) testRegister(t *testing.T) {
	mem := mmap(t, 1<<20)
	seen := map[uint32]verbsio.Access{}
	for i, acc := range []verbsio.Access{verbsio.AccessLocalWrite, rw, verbsio.AccessRemoteRead, verbsio.AccessLocalWrite | verbsio.AccessRemoteRead, all} {
		off, n := i*4096, 65536
		mr, err := s.pd.RegisterMemory(offheap.Addr(mem[off:]), n, acc)
		if err != nil {
			t.Fatalf("RegisterMemory(%v): %v", acc, err)
		}
		if mr.Addr() != offheap.Addr(mem[off:]) || mr.Len() != n || mr.Access() != acc {
			t.Errorf("region = [%#x+%d %v], want [%#x+%d %v]", mr.Addr(), mr.Len(), mr.Access(), offheap.Addr(mem[off:]), n, acc)
		}
		if prev, dup := seen[mr.RKey()]; dup {
			t.Errorf("rkey %#x of a %v region repeats that of a live %v region", mr.RKey(), acc, prev)
		}
		seen[mr.RKey()] = acc
		defer func() {
			if err := mr.Close(); err != nil {
				t.Errorf("Close: %v", err)
			}
			if err := mr.Close(); err != nil {
				t.Errorf("second Close: %v", err)
			}
		}()
	}
	if mr, err := s.pd.RegisterMemory(offheap.Addr(mem), 0, rw); err == nil {
		mr.Close()
		t.Error("registering 0 bytes succeeded")
	}
	hole := mmap(t, 3*4096)
	if _, _, errno := unix.Syscall(unix.SYS_MUNMAP, offheap.Addr(hole[4096:]), 4096, 0); errno != 0 {
		t.Fatal(errno)
	}
	if mr, err := s.pd.RegisterMemory(offheap.Addr(hole), len(hole), rw); err == nil {
		mr.Close()
		t.Error("registering a range with an unmapped page succeeded")
	}
}

func (s *suite) testCloseBusy(t *testing.T) {
	dev, err := verbsio.Open(s.h.Provider, s.h.Config)
	if err != nil {
		t.Fatalf("opening a second device: %v", err)
	}
	pd, err := dev.AllocPD()
	if err != nil {
		t.Fatal(err)
	}
	if err := dev.Close(); !errors.Is(err, verbsio.ErrBusy) {
		t.Errorf("closing a device with a live protection domain: %v, want ErrBusy", err)
	}
	mem := mmap(t, 65536)
	mr, err := pd.RegisterMemory(offheap.Addr(mem), len(mem), rw)
	if err != nil {
		t.Fatal(err)
	}
	if err := pd.Close(); !errors.Is(err, verbsio.ErrBusy) {
		t.Errorf("closing a protection domain with a live region: %v, want ErrBusy", err)
	}
	cq, err := dev.CreateCQ(16)
	if err != nil {
		t.Fatal(err)
	}
	qp, err := pd.CreateQP(verbsio.QPConfig{SendCQ: cq, RecvCQ: cq})
	if err != nil {
		t.Fatal(err)
	}
	if err := cq.Close(); !errors.Is(err, verbsio.ErrBusy) {
		t.Errorf("closing a completion queue used by a queue pair: %v, want ErrBusy", err)
	}
	// Children first, then parents; each Close twice.
	for _, c := range []struct {
		name  string
		close func() error
	}{{"queue pair", qp.Close}, {"region", mr.Close}, {"completion queue", cq.Close}, {"protection domain", pd.Close}, {"device", dev.Close}} {
		for i := 0; i < 2; i++ {
			if err := c.close(); err != nil {
				t.Errorf("Close #%d of the %s: %v", i+1, c.name, err)
			}
		}
		if c.name == "queue pair" {
			if st := qp.State(); st != verbsio.QPClosed {
				t.Errorf("state after Close = %v, want closed", st)
			}
		}
	}
}

func (s *suite) testWaitCancel(t *testing.T) {
	cq, err := s.dev.CreateCQ(16)
	if err != nil {
		t.Fatal(err)
	}
	defer cq.Close()
	buf := make([]verbsio.Completion, 4)
	if n, err := cq.Poll(buf); n != 0 || err != nil {
		t.Errorf("Poll of an empty queue = %d, %v", n, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(50*time.Millisecond, cancel)
	done := make(chan error, 1)
	go func() { _, err := cq.Wait(ctx, buf); done <- err }()
	select {
	case err := <-done:
		if !errors.Is(err, context.Canceled) {
			t.Errorf("Wait after cancel: %v, want context.Canceled", err)
		}
	case <-time.After(s.h.timeout()):
		t.Fatal("Wait did not return after its context was cancelled")
	}
	ctx, cancel2 := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel2()
	if _, err := cq.Wait(ctx, buf); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Wait past its deadline: %v, want context.DeadlineExceeded", err)
	}
}

func (s *suite) testConnectBootstrap(t *testing.T) {
	c := s.newQP(t, verbsio.QPConfig{})
	rep := s.peer.call(t, request{Op: "qp", Count: 64})
	t.Cleanup(func() { s.peer.try(request{Op: "closeqp", ID: rep.ID}) })
	ln, err := net.Listen("tcp", rootListenAddr(s.h.Config))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), s.h.timeout())
	defer cancel()
	peerDone := make(chan error, 1)
	go func() {
		_, err := s.peer.try(request{Op: "bootstrap", ID: rep.ID, Root: ln.Addr().String()})
		peerDone <- err
	}()
	g, err := bootstrap.Join(ctx, harnessBootstrap(s.h.Config, bootstrap.Config{Rank: 0, Size: 2, Listener: ln}))
	if err != nil {
		t.Fatalf("Join: %v", err)
	}
	defer g.Close()
	b, err := g.Exchange(ctx, 1, bootstrap.EncodeEndpoint(nil, c.qp.Endpoint()))
	if err != nil {
		t.Fatalf("Exchange: %v", err)
	}
	ep, err := bootstrap.DecodeEndpoint(b)
	if err != nil {
		t.Fatal(err)
	}
	if ep.Provider != s.h.Provider {
		t.Errorf("peer endpoint of provider %q", ep.Provider)
	}
	if err := c.qp.Connect(ctx, ep); err != nil {
		t.Fatalf("Connect: %v", err)
	}
	if err := g.Barrier(ctx); err != nil {
		t.Fatalf("Barrier: %v", err)
	}
	if err := <-peerDone; err != nil {
		t.Fatalf("peer: %v", err)
	}
	// The connection carries a write.
	src := s.local(t, 4096, verbsio.AccessLocalWrite)
	pattern(src.mem, 9)
	dst := s.peerRegion(t, s.peer, 4096, 0, 0, rw)
	c.peerQP, c.p = rep.ID, s.peer
	if cpl := c.post(t, verbsio.SendWR{WRID: 1, Op: verbsio.OpWrite, SG: []verbsio.SGE{src.sge(0, 4096)}, RemoteAddr: dst.addr, RKey: dst.rkey}); cpl.Status != verbsio.StatusSuccess {
		t.Fatalf("write: %v", cpl.Status)
	}
	if got := peerBytes(t, s.peer, dst); !bytes.Equal(got, src.mem) {
		t.Error("bytes written over the bootstrapped connection differ")
	}
}

// checkGuarded checks the peer's mapping: the region holds want and the
// guards on both sides still hold fill.
func checkGuarded(t testing.TB, got []byte, r remoteRegion, want []byte, fill byte) {
	t.Helper()
	if len(got) != r.size+2*r.guard {
		t.Fatalf("peer mapping of %d bytes, want %d", len(got), r.size+2*r.guard)
	}
	for i, b := range got {
		if i >= r.guard && i < r.guard+r.size {
			continue
		}
		if b != fill {
			t.Fatalf("guard byte %d (region offset %d) = %#x, want %#x: a write went outside the region", i, i-r.guard, b, fill)
		}
	}
	if want != nil && !bytes.Equal(got[r.guard:r.guard+r.size], want) {
		i := 0
		for i < r.size && got[r.guard+i] == want[i] {
			i++
		}
		t.Fatalf("region differs from what was written, first at offset %d", i)
	}
}

func (s *suite) testWrite(t *testing.T) {
	c := s.connect(t, s.peer, verbsio.QPConfig{})
	const n, guard = 1 << 20, 4096
	src := s.local(t, n, verbsio.AccessLocalWrite)
	pattern(src.mem, 1)
	dst := s.peerRegion(t, s.peer, n, guard, 0xA5, rw)
	if cpl := c.post(t, verbsio.SendWR{WRID: 7, Op: verbsio.OpWrite, SG: []verbsio.SGE{src.sge(0, n)}, RemoteAddr: dst.addr, RKey: dst.rkey}); cpl.Status != verbsio.StatusSuccess || cpl.Op != verbsio.OpWrite {
		t.Fatalf("write completion %+v", cpl)
	}
	checkGuarded(t, peerBytes(t, s.peer, dst), dst, src.mem, 0xA5)
	// A write into the middle touches only its range.
	want := slices.Clone(src.mem)
	pattern(src.mem[:100], 77)
	copy(want[5000:], src.mem[:100])
	if cpl := c.post(t, verbsio.SendWR{WRID: 8, Op: verbsio.OpWrite, SG: []verbsio.SGE{src.sge(0, 100)}, RemoteAddr: dst.addr + 5000, RKey: dst.rkey}); cpl.Status != verbsio.StatusSuccess {
		t.Fatalf("write completion %+v", cpl)
	}
	checkGuarded(t, peerBytes(t, s.peer, dst), dst, want, 0xA5)
}

// testLargeWrite moves 32 MiB in one write with immediate (providers that
// split or stripe large writes do it here) and compares digests of the
// peer's whole mapping, guards included.
func (s *suite) testLargeWrite(t *testing.T) {
	caps := s.dev.Caps()
	n := 32 << 20
	if int64(n) > caps.MaxMessage {
		n = int(caps.MaxMessage)
	}
	c := s.connect(t, s.peer, verbsio.QPConfig{})
	const guard = 4096
	src := s.local(t, n, verbsio.AccessLocalWrite)
	pattern(src.mem, 12)
	for i := 0; i < n; i += 4096 {
		src.mem[i] = byte(i >> 12) // so shifted pages differ
	}
	dst := s.peerRegion(t, s.peer, n, guard, 0x6B, rw)
	op := verbsio.OpWrite
	if caps.WriteWithImmediate {
		op = verbsio.OpWriteImm
		s.peer.call(t, request{Op: "postrecv", ID: c.peerQP, WRID: 5, Count: 1})
	}
	if cpl := c.post(t, verbsio.SendWR{WRID: 1, Op: op, Imm: 7, SG: []verbsio.SGE{src.sge(0, n)}, RemoteAddr: dst.addr, RKey: dst.rkey}); cpl.Status != verbsio.StatusSuccess {
		t.Fatalf("write of %d bytes: %v", n, cpl.Status)
	}
	if caps.WriteWithImmediate {
		if got := c.peerPoll(t, 1); len(got) != 1 || got[0].ByteLen != uint32(n) || got[0].Imm != 7 {
			t.Errorf("receiver completions %+v, want one of %d bytes with immediate 7", got, n)
		}
	}
	want := make([]byte, 0, n+2*guard)
	want = append(want, bytes.Repeat([]byte{0x6B}, guard)...)
	want = append(want, src.mem...)
	want = append(want, bytes.Repeat([]byte{0x6B}, guard)...)
	sum := sha256.Sum256(want)
	if got := s.peer.call(t, request{Op: "digest", ID: dst.id}).Data; !bytes.Equal(got, sum[:]) {
		checkGuarded(t, peerBytes(t, s.peer, dst), dst, src.mem, 0x6B)
		t.Fatal("the peer's mapping differs from what was written")
	}
}

func (s *suite) testWriteImm(t *testing.T) {
	c := s.connect(t, s.peer, verbsio.QPConfig{})
	if !s.dev.Caps().WriteWithImmediate {
		// A device that says no must refuse the opcode.
		src := s.local(t, 4096, verbsio.AccessLocalWrite)
		err := c.qp.PostSend([]verbsio.SendWR{{WRID: 1, Op: verbsio.OpWriteImm, SG: []verbsio.SGE{src.sge(0, 16)}}})
		if !errors.Is(err, verbsio.ErrNotSupported) {
			t.Errorf("OpWriteImm with Caps.WriteWithImmediate false: %v, want ErrNotSupported", err)
		}
		return
	}
	const n = 12345
	src := s.local(t, 16384, verbsio.AccessLocalWrite)
	pattern(src.mem, 2)
	dst := s.peerRegion(t, s.peer, n, 4096, 0x5A, rw)
	s.peer.call(t, request{Op: "postrecv", ID: c.peerQP, WRID: 77, Count: 2})
	cpl := c.post(t, verbsio.SendWR{WRID: 3, Op: verbsio.OpWriteImm, Imm: 0xDEADBEEF, SG: []verbsio.SGE{src.sge(0, n)}, RemoteAddr: dst.addr, RKey: dst.rkey})
	if cpl.Status != verbsio.StatusSuccess || cpl.Op != verbsio.OpWriteImm {
		t.Fatalf("sender completion %+v", cpl)
	}
	got := c.peerPoll(t, 1)
	if len(got) != 1 {
		t.Fatalf("peer got %d receive completions, want 1", len(got))
	}
	r := got[0]
	if r.Status != verbsio.StatusSuccess || r.Op != verbsio.OpRecvImm || !r.HasImm || r.Imm != 0xDEADBEEF || r.ByteLen != n || r.WRID != 77 {
		t.Errorf("receiver completion %+v, want success recv-imm, imm 0xdeadbeef, %d bytes, WRID 77", r, n)
	}
	checkGuarded(t, peerBytes(t, s.peer, dst), dst, src.mem[:n], 0x5A)
	// A zero-length write with immediate is a notification alone.
	c.post(t, verbsio.SendWR{WRID: 4, Op: verbsio.OpWriteImm, Imm: 1, RemoteAddr: dst.addr, RKey: dst.rkey})
	if got := c.peerPoll(t, 1); len(got) != 1 || got[0].Imm != 1 || got[0].ByteLen != 0 || got[0].WRID != 78 {
		t.Errorf("zero-length write with immediate: receiver completions %+v", got)
	}
}

func (s *suite) testInline(t *testing.T) {
	max := s.dev.Caps().MaxInline
	if max == 0 {
		t.Skip("the device advertises no inline sends")
	}
	c := s.connect(t, s.peer, verbsio.QPConfig{MaxInline: max})
	// The source of an inline write need not be registered.
	src := mmap(t, max+1)
	pattern(src, 3)
	dst := s.peerRegion(t, s.peer, max, 64, 0x11, rw)
	wr := verbsio.SendWR{WRID: 5, Op: verbsio.OpWrite, Inline: true, SG: []verbsio.SGE{{Addr: offheap.Addr(src), Length: uint32(max)}}, RemoteAddr: dst.addr, RKey: dst.rkey}
	if cpl := c.post(t, wr); cpl.Status != verbsio.StatusSuccess {
		t.Fatalf("inline write of Caps.MaxInline=%d bytes: %v", max, cpl.Status)
	}
	checkGuarded(t, peerBytes(t, s.peer, dst), dst, src[:max], 0x11)
	wr.SG[0].Length = uint32(max + 1)
	if err := c.qp.PostSend([]verbsio.SendWR{wr}); err == nil {
		t.Errorf("inline write of %d bytes, past Caps.MaxInline, was accepted", max+1)
	}
}

// testGather checks Caps.MaxSGE against behaviour: a write and a send
// gathering that many pieces (at most 16) from scattered places of a region
// arrive as one contiguous run.
func (s *suite) testGather(t *testing.T) {
	k := min(s.dev.Caps().MaxSGE, 16)
	c := s.connect(t, s.peer, verbsio.QPConfig{MaxSGE: k})
	src := s.local(t, 64<<10, verbsio.AccessLocalWrite)
	pattern(src.mem, 13)
	var sg []verbsio.SGE
	var want []byte
	for i := 0; i < k; i++ {
		off, n := i*4000+i*i, 100+i*37 // uneven pieces, in order
		sg = append(sg, src.sge(off, n))
		want = append(want, src.mem[off:off+n]...)
	}
	dst := s.peerRegion(t, s.peer, 2*len(want), 64, 0x2D, rw|verbsio.AccessLocalWrite)
	if cpl := c.post(t, verbsio.SendWR{WRID: 1, Op: verbsio.OpWrite, SG: sg, RemoteAddr: dst.addr, RKey: dst.rkey}); cpl.Status != verbsio.StatusSuccess {
		t.Fatalf("write gathering %d SGEs (Caps.MaxSGE %d): %v", k, s.dev.Caps().MaxSGE, cpl.Status)
	}
	s.peer.call(t, request{Op: "postrecv", ID: c.peerQP, Region: dst.id, Off: len(want), Len: len(want), WRID: 3, Count: 1})
	if cpl := c.post(t, verbsio.SendWR{WRID: 2, Op: verbsio.OpSend, SG: sg}); cpl.Status != verbsio.StatusSuccess {
		t.Fatalf("send gathering %d SGEs: %v", k, cpl.Status)
	}
	if got := c.peerPoll(t, 1); len(got) != 1 || got[0].ByteLen != uint32(len(want)) || got[0].Status != verbsio.StatusSuccess {
		t.Fatalf("receive completions %+v, want one of %d bytes", got, len(want))
	}
	checkGuarded(t, peerBytes(t, s.peer, dst), dst, append(slices.Clone(want), want...), 0x2D)
}

func (s *suite) testSendRecv(t *testing.T) {
	c := s.connect(t, s.peer, verbsio.QPConfig{})
	const slot = 256
	box := s.peerRegion(t, s.peer, 4*slot, 64, 0xEE, verbsio.AccessLocalWrite)
	s.peer.call(t, request{Op: "postrecv", ID: c.peerQP, Region: box.id, Len: slot, WRID: 100, Count: 4})
	src := s.local(t, 4096, verbsio.AccessLocalWrite)
	pattern(src.mem, 4)
	lens := []int{1, 100, slot, 0}
	wrs := make([]verbsio.SendWR, len(lens))
	for i, n := range lens {
		wrs[i] = verbsio.SendWR{WRID: uint64(i), Op: verbsio.OpSend, Signaled: true, RemoteAddr: 0}
		if n > 0 {
			wrs[i].SG = []verbsio.SGE{src.sge(i*512, n)}
		}
	}
	if err := c.qp.PostSend(wrs); err != nil {
		t.Fatal(err)
	}
	for i, cpl := range s.wait(t, c.scq, len(lens)) {
		if cpl.Status != verbsio.StatusSuccess || cpl.WRID != uint64(i) || cpl.Op != verbsio.OpSend {
			t.Errorf("send completion %d: %+v", i, cpl)
		}
	}
	got := c.peerPoll(t, len(lens))
	if len(got) != len(lens) {
		t.Fatalf("peer got %d receive completions, want %d", len(got), len(lens))
	}
	want := bytes.Repeat([]byte{0xEE}, 4*slot)
	for i, r := range got {
		if r.Status != verbsio.StatusSuccess || r.Op != verbsio.OpRecv || r.WRID != uint64(100+i) || r.ByteLen != uint32(lens[i]) || r.HasImm {
			t.Errorf("receive completion %d: %+v, want recv of %d bytes, WRID %d", i, r, lens[i], 100+i)
		}
		copy(want[i*slot:], src.mem[i*512:i*512+lens[i]])
	}
	checkGuarded(t, peerBytes(t, s.peer, box), box, want, 0xEE)
}

func (s *suite) testRecvTooSmall(t *testing.T) {
	c := s.connect(t, s.peer, verbsio.QPConfig{})
	box := s.peerRegion(t, s.peer, 16, 64, 0xC3, verbsio.AccessLocalWrite)
	s.peer.call(t, request{Op: "postrecv", ID: c.peerQP, Region: box.id, Len: 16, WRID: 9, Count: 1})
	src := s.local(t, 4096, verbsio.AccessLocalWrite)
	cpl := c.post(t, verbsio.SendWR{WRID: 1, Op: verbsio.OpSend, SG: []verbsio.SGE{src.sge(0, 64)}})
	if cpl.Status == verbsio.StatusSuccess {
		t.Errorf("a 64-byte send into a 16-byte receive completed successfully at the sender")
	}
	got := c.peerPoll(t, 1)
	if len(got) != 1 || got[0].Status != verbsio.StatusLocalLength || got[0].WRID != 9 {
		t.Errorf("receiver completions %+v, want one local length error for WRID 9", got)
	}
	checkGuarded(t, peerBytes(t, s.peer, box), box, nil, 0xC3)
}

func (s *suite) testRead(t *testing.T) {
	c := s.connect(t, s.peer, verbsio.QPConfig{})
	const n = 300000
	srcData := make([]byte, n)
	pattern(srcData, 5)
	r := s.peerRegion(t, s.peer, n, 64, 0, verbsio.AccessLocalWrite|verbsio.AccessRemoteRead)
	s.peer.call(t, request{Op: "set", ID: r.id, Data: srcData})
	dst := s.local(t, n+8192, verbsio.AccessLocalWrite)
	for i := range dst.mem {
		dst.mem[i] = 0x77
	}
	if cpl := c.post(t, verbsio.SendWR{WRID: 2, Op: verbsio.OpRead, SG: []verbsio.SGE{dst.sge(4096, n)}, RemoteAddr: r.addr, RKey: r.rkey}); cpl.Status != verbsio.StatusSuccess || cpl.Op != verbsio.OpRead {
		t.Fatalf("read completion %+v", cpl)
	}
	if !bytes.Equal(dst.mem[4096:4096+n], srcData) {
		t.Error("bytes read differ from the peer's")
	}
	for _, i := range []int{0, 4095, 4096 + n, len(dst.mem) - 1} {
		if dst.mem[i] != 0x77 {
			t.Fatalf("local byte %d outside the read's destination changed", i)
		}
	}
}

func (s *suite) testChain(t *testing.T) {
	c := s.connect(t, s.peer, verbsio.QPConfig{MaxSendWR: 512})
	const k, n = 256, 4096
	src := s.local(t, k*n, verbsio.AccessLocalWrite)
	pattern(src.mem, 6)
	dst := s.peerRegion(t, s.peer, k*n, 4096, 0x3C, rw)
	wrs := make([]verbsio.SendWR, k)
	for i := range wrs {
		// Fill the remote region back to front, so order mistakes show.
		j := k - 1 - i
		wrs[i] = verbsio.SendWR{WRID: uint64(1000 + i), Op: verbsio.OpWrite, Signaled: true, SG: []verbsio.SGE{src.sge(j*n, n)}, RemoteAddr: dst.addr + uint64(j*n), RKey: dst.rkey}
	}
	if err := c.qp.PostSend(wrs); err != nil {
		t.Fatalf("PostSend of a chain of %d: %v", k, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), s.h.timeout())
	defer cancel()
	var got []verbsio.Completion
	buf := make([]verbsio.Completion, 16)
	for len(got) < k && ctx.Err() == nil {
		m, err := c.scq.Poll(buf)
		if err != nil {
			t.Fatal(err)
		}
		if m > len(buf) {
			t.Fatalf("Poll returned %d for a buffer of %d", m, len(buf))
		}
		got = append(got, buf[:m]...)
		if m == 0 {
			time.Sleep(100 * time.Microsecond)
		}
	}
	if len(got) != k {
		t.Fatalf("%d of %d completions before the deadline", len(got), k)
	}
	for i, cpl := range got {
		if cpl.WRID != uint64(1000+i) || cpl.Status != verbsio.StatusSuccess {
			t.Fatalf("completion %d: %+v, want success for WRID %d (completions come in post order)", i, cpl, 1000+i)
		}
	}
	checkGuarded(t, peerBytes(t, s.peer, dst), dst, src.mem, 0x3C)
}

func (s *suite) testRemoteAccess(t *testing.T) {
	const n, guard = 8192, 4096
	cases := []struct {
		name   string
		access verbsio.Access
		op     verbsio.Opcode
		off    int64
		badKey bool
	}{
		{"WrongRKey", rw, verbsio.OpWrite, 0, true},
		{"OnePastTheEnd", rw, verbsio.OpWrite, 1, false},
		{"BeforeTheStart", rw, verbsio.OpWrite, -1 - n, false},
		{"NoRemoteWrite", verbsio.AccessLocalWrite | verbsio.AccessRemoteRead, verbsio.OpWrite, 0, false},
		{"NoRemoteWriteImm", verbsio.AccessLocalWrite | verbsio.AccessRemoteRead, verbsio.OpWriteImm, 0, false},
		{"NoRemoteRead", rw, verbsio.OpRead, 0, false},
		{"ReadOnePastTheEnd", all, verbsio.OpRead, 1, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := s.connect(t, s.peer, verbsio.QPConfig{})
			local := s.local(t, n, verbsio.AccessLocalWrite)
			pattern(local.mem, 8)
			r := s.peerRegion(t, s.peer, n, guard, 0x99, tc.access)
			if tc.op == verbsio.OpWriteImm {
				s.peer.call(t, request{Op: "postrecv", ID: c.peerQP, WRID: 1, Count: 1})
			}
			wr := verbsio.SendWR{WRID: 42, Op: tc.op, SG: []verbsio.SGE{local.sge(0, n)}, RemoteAddr: uint64(int64(r.addr) + tc.off), RKey: r.rkey}
			if tc.badKey {
				wr.RKey ^= 0x5A5A0000
			}
			cpl := c.post(t, wr)
			if cpl.Status != verbsio.StatusRemoteAccess {
				t.Errorf("completion status %v, want %v", cpl.Status, verbsio.StatusRemoteAccess)
			}
			if !errors.Is(cpl.Status.Err(), verbsio.ErrRemoteAccess) {
				t.Errorf("Status.Err() = %v, want ErrRemoteAccess", cpl.Status.Err())
			}
			checkGuarded(t, peerBytes(t, s.peer, r), r, bytes.Repeat([]byte{0x99}, n), 0x99)
			// As on a verbs queue pair, the error moves the queue pair to the
			// error state.
			if st := c.qp.State(); st != verbsio.QPError {
				t.Errorf("state after a remote access error = %v, want error", st)
			}
		})
	}
}

func (s *suite) testDeregister(t *testing.T) {
	c := s.connect(t, s.peer, verbsio.QPConfig{})
	const n = 4096
	src := s.local(t, n, verbsio.AccessLocalWrite)
	pattern(src.mem, 10)
	r := s.peerRegion(t, s.peer, n, 256, 0x42, rw)
	wr := verbsio.SendWR{WRID: 1, Op: verbsio.OpWrite, SG: []verbsio.SGE{src.sge(0, n)}, RemoteAddr: r.addr, RKey: r.rkey}
	if cpl := c.post(t, wr); cpl.Status != verbsio.StatusSuccess {
		t.Fatalf("write before deregistration: %v", cpl.Status)
	}
	before := peerBytes(t, s.peer, r)
	s.peer.call(t, request{Op: "dereg", ID: r.id})
	pattern(src.mem, 11)
	wr.WRID = 2
	if cpl := c.post(t, wr); cpl.Status != verbsio.StatusRemoteAccess {
		t.Errorf("write with the rkey of a deregistered region: %v, want remote access error", cpl.Status)
	}
	if after := peerBytes(t, s.peer, r); !bytes.Equal(before, after) {
		t.Error("the peer's memory changed after its region was deregistered")
	}
}

func (s *suite) testPeerKilled(t *testing.T) {
	p := startPeer(t, s.h)
	c := s.connect(t, p, verbsio.QPConfig{MaxSendWR: 4096})
	const chunk = 4 << 20
	src := s.local(t, chunk, verbsio.AccessLocalWrite)
	dst := s.peerRegion(t, p, chunk, 0, 0, rw)
	wr := func(id uint64) verbsio.SendWR {
		return verbsio.SendWR{WRID: id, Op: verbsio.OpWrite, Signaled: true, SG: []verbsio.SGE{src.sge(0, chunk)}, RemoteAddr: dst.addr, RKey: dst.rkey}
	}
	var posted uint64
	for ; posted < 16; posted++ {
		if err := c.qp.PostSend([]verbsio.SendWR{wr(posted)}); err != nil {
			t.Fatal(err)
		}
	}
	p.kill()
	// Keep posting until the queue pair notices: the writes already in
	// flight may all have landed before the kill.
	deadline := time.Now().Add(s.h.timeout())
	var got []verbsio.Completion
	failed := false
	buf := make([]verbsio.Completion, 32)
	for !failed && time.Now().Before(deadline) {
		err := c.qp.PostSend([]verbsio.SendWR{wr(posted)})
		if err == nil {
			posted++
		} else if !errors.Is(err, verbsio.ErrQPState) && !errors.Is(err, verbsio.ErrQueueFull) {
			t.Fatalf("PostSend after the peer died: %v, want nil, ErrQPState or ErrQueueFull", err)
		}
		m, _ := c.scq.Poll(buf)
		for _, cpl := range buf[:m] {
			got = append(got, cpl)
			failed = failed || cpl.Status != verbsio.StatusSuccess
		}
		time.Sleep(5 * time.Millisecond)
	}
	if !failed {
		t.Fatalf("no work request failed within %v of the peer's death (%d posted, %d completed)", s.h.timeout(), posted, len(got))
	}
	// Every work request posted completes, none hangs.
	got = append(got, s.wait(t, c.scq, int(posted)-len(got))...)
	seen := map[uint64]bool{}
	for _, cpl := range got {
		if seen[cpl.WRID] {
			t.Errorf("WRID %d completed twice", cpl.WRID)
		}
		seen[cpl.WRID] = true
		switch cpl.Status {
		case verbsio.StatusSuccess, verbsio.StatusRetryExceeded, verbsio.StatusFlushed, verbsio.StatusRemoteOperation, verbsio.StatusGeneral:
		default:
			t.Errorf("WRID %d: status %v after the peer's death", cpl.WRID, cpl.Status)
		}
		if cpl.Status == verbsio.StatusRetryExceeded && !errors.Is(cpl.Status.Err(), verbsio.ErrPeerLost) {
			t.Errorf("StatusRetryExceeded.Err() = %v, want ErrPeerLost", cpl.Status.Err())
		}
	}
	if st := c.qp.State(); st != verbsio.QPError {
		t.Errorf("state after the peer died = %v, want error", st)
	}
	if err := c.qp.PostSend([]verbsio.SendWR{wr(posted)}); !errors.Is(err, verbsio.ErrQPState) {
		t.Errorf("PostSend on a queue pair in the error state: %v, want ErrQPState", err)
	}
}

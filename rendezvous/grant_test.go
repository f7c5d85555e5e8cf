package rendezvous

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/internal/ibvdiag"
	"github.com/gdrlink/gdrlink/internal/offheap"
	"github.com/gdrlink/gdrlink/internal/wire"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

// TestTwoProcessGrants: over tcp and onnode, whose regions give grants,
// every result buffer is asked for with a grant of its own, not the
// arena's rkey, and transfers of every kind (cached meta-data, a shape
// change and its re-request, strings, a large tensor, a withdrawn Recv)
// still arrive.
func TestTwoProcessGrants(t *testing.T) {
	forEachProvider(t, testTwoProcessGrants)
}

func testTwoProcessGrants(t *testing.T, provider string) {
	requireGrants(t, provider)
	// Every Recv by request, each with its grant: none taken eagerly.
	p := startPeerWith(t, provider, nil, nil, nil, WithEager(0))
	ctx := recvCtx(t)
	recv := func(key string, step int64, kind string, shape tensor.Shape) {
		t.Helper()
		p.send("send %s %d %s %s", key, step, kind, dims(shape))
		got, _, err := p.local.ch.Recv(ctx, key, step)
		if err != nil {
			t.Fatalf("%s step %d: %v", key, step, err)
		}
		if err := checkTensor(got, kind, shape, key, step); err != nil {
			t.Fatalf("%s step %d: %v", key, step, err)
		}
		_ = got.Release()
	}
	grants := func() uint64 { return p.local.ch.rcv.stats.grants.Load() }
	recv("w", 0, "float32", tensor.Shape{1024}) // meta-data round trip, then a grant
	if grants() == 0 {
		t.Fatalf("no grant given for a result buffer over %s", provider)
	}
	for step := int64(1); step < 4; step++ {
		before := grants()
		recv("w", step, "float32", tensor.Shape{1024}) // cached: the request carries the grant
		if d := grants() - before; d != 1 {
			t.Fatalf("step %d: %d grants given, want 1", step, d)
		}
	}
	before := grants()
	recv("w", 4, "float32", tensor.Shape{2048}) // re-request: a grant for the new buffer
	if d := grants() - before; d != 2 {
		t.Fatalf("shape change: %d grants given, want 2 (the stale buffer's and the new one's)", d)
	}
	recv("s", 0, "string", tensor.Shape{40})
	recv("s", 1, "string", tensor.Shape{40})
	recv("big", 0, "uint8", tensor.Shape{6 << 20})
	recv("big", 1, "uint8", tensor.Shape{6 << 20})

	// A Recv withdrawn before its tensor is sent: its grant ends with it,
	// and the channel goes on.
	cctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	p.local.ch.RecvFunc(cctx, "w", 5, func(t *tensor.Tensor, _ Transfer, err error) {
		if t != nil {
			_ = t.Release()
		}
		done <- err
	})
	cancel()
	if err := <-done; !errors.Is(err, ErrCancelled) {
		t.Fatalf("withdrawn Recv: %v", err)
	}
	p.sync()
	recv("w", 6, "float32", tensor.Shape{2048})
	p.local.ch.mu.Lock()
	for _, r := range p.local.ch.rcv.reqs {
		if len(r.grants) > 0 && !r.cancelled {
			t.Errorf("request %d (%q step %d) still holds %d grants", r.idx, r.key.name, r.key.step, len(r.grants))
		}
	}
	p.local.ch.mu.Unlock()
	t.Logf("%d grants given; stats %+v", grants(), p.local.ch.Stats())
}

// TestGrantRails: a striped write comes through a grant on each rail as
// well as on the channel's queue pair.
func TestGrantRails(t *testing.T) {
	lo := []string{"127.0.0.1:0", "127.0.0.1:0"}
	a, b := pairRails(t, "tcp", lo, lo, withStripeMin(1<<20))
	ctx := recvCtx(t)
	for step, sh := range []tensor.Shape{{3 << 20}, {3 << 20}} {
		src, err := makeTensor(a.pool, "uint8", sh, "r", int64(step))
		if err != nil {
			t.Fatal(err)
		}
		if err := a.ch.Send("r", int64(step), src); err != nil {
			t.Fatal(err)
		}
		before := b.ch.rcv.stats.grants.Load()
		got, _, err := b.ch.Recv(ctx, "r", int64(step))
		if err != nil {
			t.Fatalf("step %d: %v", step, err)
		}
		if err := checkTensor(got, "uint8", sh, "r", int64(step)); err != nil {
			t.Fatalf("step %d: %v", step, err)
		}
		_ = got.Release()
		if d := b.ch.rcv.stats.grants.Load() - before; step == 1 && d != 2 {
			t.Errorf("step %d: %d grants, want 2 (the channel's queue pair and the rail's)", step, d)
		}
	}
	if n := a.ch.Stats().Striped; n != 2 {
		t.Fatalf("%d writes striped, want 2", n)
	}
}

// hostileSender is a sending peer that speaks the protocol by hand over a
// raw tcp queue pair, so that it can answer a request with any write.
type hostileSender struct {
	t   *testing.T
	dev verbsio.Device
	pd  verbsio.ProtectionDomain
	cq  verbsio.CompletionQueue
	qp  verbsio.QueuePair
	mem []byte // receive slots, then the source of writes
	mr  verbsio.MemoryRegion
}

const hostileRing = 8

// newHostileSender connects a hostile sender to victim's channel.
func newHostileSender(t *testing.T, provider string, victim *side) *hostileSender {
	t.Helper()
	h := &hostileSender{t: t}
	var err error
	cfg, err := verbsio.ConfigFromEnv()
	if err != nil {
		t.Fatal(err)
	}
	if h.dev, err = verbsio.Open(provider, cfg); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.dev.Close() })
	if h.pd, err = h.dev.AllocPD(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.pd.Close() })
	if h.mem, err = unix.Mmap(-1, 0, hostileRing*wire.MaxFrame+1<<20, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Munmap(h.mem) })
	if h.mr, err = h.pd.RegisterMemory(offheap.Addr(h.mem), len(h.mem), verbsio.AccessLocalWrite); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.mr.Close() })
	if h.cq, err = h.dev.CreateCQ(64); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.cq.Close() })
	if h.qp, err = h.pd.CreateQP(verbsio.QPConfig{SendCQ: h.cq, RecvCQ: h.cq, MaxSendWR: 16, MaxRecvWR: hostileRing}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.qp.Close() })
	for i := 0; i < hostileRing; i++ {
		h.repost(i)
	}
	hello := wire.Message{Type: wire.TypeHello, Ring: hostileRing, Slot: wire.MaxFrame, Text: []byte("hostile"), NumEndpoints: 1}
	ep := h.qp.Endpoint()
	hello.Endpoints[0] = wire.Endpoint{Provider: []byte(ep.Provider), Host: []byte(ep.Host), Data: ep.Data}
	var vh wire.Message
	if _, err := wire.Decode(victim.ch.Hello(), &vh); err != nil {
		t.Fatal(err)
	}
	e := vh.Endpoints[0]
	vep := verbsio.Endpoint{Provider: string(e.Provider), Host: string(e.Host), Data: append([]byte(nil), e.Data...)}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	errc := make(chan error, 1)
	go func() { errc <- h.qp.Connect(ctx, vep) }()
	if err := victim.ch.Connect(ctx, hello.Append(nil)); err != nil {
		t.Fatalf("victim Connect: %v", err)
	}
	if err := <-errc; err != nil {
		t.Fatalf("hostile Connect: %v", err)
	}
	return h
}

func (h *hostileSender) repost(slot int) {
	h.t.Helper()
	sge := verbsio.SGE{Addr: offheap.Addr(h.mem) + uintptr(slot*wire.MaxFrame), Length: wire.MaxFrame, LKey: h.mr.LKey()}
	if err := h.qp.PostRecv([]verbsio.RecvWR{{WRID: uint64(slot), SG: []verbsio.SGE{sge}}}); err != nil {
		h.t.Fatal(err)
	}
}

// awaitRequest returns the next TENSOR_REQUEST the victim sends.
func (h *hostileSender) awaitRequest() wire.Message {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var wc [4]verbsio.Completion
	for {
		n, err := h.cq.Wait(ctx, wc[:])
		if err != nil {
			h.t.Fatalf("hostile: no request came: %v", err)
		}
		for _, c := range wc[:n] {
			if c.Op != verbsio.OpRecv || c.Status != verbsio.StatusSuccess {
				h.t.Fatalf("hostile: completion %+v while waiting for a request", c)
			}
			slot := int(c.WRID)
			b := h.mem[slot*wire.MaxFrame : slot*wire.MaxFrame+int(c.ByteLen)]
			var req *wire.Message
			for len(b) > 0 {
				var m wire.Message
				k, err := wire.Decode(b, &m)
				if err != nil {
					h.t.Fatalf("hostile: frame from the victim: %v", err)
				}
				b = b[k:]
				if m.Type == wire.TypeRequest {
					m.Name = append([]byte(nil), m.Name...)
					req = &m
				}
			}
			h.repost(slot)
			if req != nil {
				return *req
			}
		}
	}
}

// write writes n bytes of fill at addr with rkey (with the immediate imm)
// and returns the status its completion says.
func (h *hostileSender) write(addr uint64, rkey uint32, n int, fill byte, imm uint32) verbsio.Status {
	h.t.Helper()
	src := h.mem[hostileRing*wire.MaxFrame:]
	for i := range src[:n] {
		src[i] = fill
	}
	return h.post(verbsio.SendWR{WRID: 1 << 40, Op: verbsio.OpWriteImm, Imm: imm, Signaled: true, RemoteAddr: addr, RKey: rkey,
		SG: []verbsio.SGE{{Addr: offheap.Addr(src), Length: uint32(n), LKey: h.mr.LKey()}}})
}

// read has the hostile peer read n bytes at addr with rkey (an RDMA READ,
// which the protocol never issues) and returns the completion's status;
// what it read, if anything, is in h.readBack(n).
func (h *hostileSender) read(addr uint64, rkey uint32, n int) verbsio.Status {
	h.t.Helper()
	dst := h.mem[hostileRing*wire.MaxFrame:]
	clear(dst[:n])
	return h.post(verbsio.SendWR{WRID: 1 << 40, Op: verbsio.OpRead, Signaled: true, RemoteAddr: addr, RKey: rkey,
		SG: []verbsio.SGE{{Addr: offheap.Addr(dst), Length: uint32(n), LKey: h.mr.LKey()}}})
}

func (h *hostileSender) readBack(n int) []byte { return h.mem[hostileRing*wire.MaxFrame:][:n] }

// post posts wr and returns its completion's status.
func (h *hostileSender) post(wr verbsio.SendWR) verbsio.Status {
	h.t.Helper()
	if err := h.qp.PostSend([]verbsio.SendWR{wr}); err != nil {
		h.t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var wc [4]verbsio.Completion
	for {
		n, err := h.cq.Wait(ctx, wc[:])
		if err != nil {
			h.t.Fatalf("hostile: the write never completed: %v", err)
		}
		for _, c := range wc[:n] {
			if c.WRID == wr.WRID {
				return c.Status
			}
			if c.Op == verbsio.OpRecv && c.Status == verbsio.StatusSuccess {
				h.repost(int(c.WRID)) // a keepalive or credits
			}
		}
	}
}

// readNothing reads with the hostile peer and fails the test if a byte came
// back.
func readNothing(h *hostileSender, addr uint64, rkey uint32, n int) verbsio.Status {
	h.t.Helper()
	st := h.read(addr, rkey, n)
	for i, b := range h.readBack(n) {
		if b != 0 {
			h.t.Fatalf("the hostile read (status %v) brought back %#x at offset %d", st, b, i)
		}
	}
	return st
}

// arenaWindow is the victim's result buffer with a guard tensor allocated
// just before it and one just after, in the same arena.
type arenaWindow struct {
	before, after tensor.Buffer
	lo, hi        uintptr // [lo, hi): from before's start to after's end
	snap          []byte
}

func (w *arenaWindow) bytes() []byte { return offheap.Bytes(w.lo, int(w.hi-w.lo)) }

// unchanged fails the test if a byte of the window other than those of
// [from, to) changed since the snapshot.
func (w *arenaWindow) unchanged(t *testing.T, what string, from, to uintptr) {
	t.Helper()
	now := w.bytes()
	for i := range now {
		a := w.lo + uintptr(i)
		if a >= from && a < to {
			continue
		}
		if now[i] != w.snap[i] {
			t.Fatalf("%s: byte at %#x (%+d from the result buffer) changed from %#x to %#x", what, a, int(a)-int(from), w.snap[i], now[i])
		}
	}
}

// TestGrantHostileSender: a sender that answers a request with a write
// through the arena's rkey, or through the request's grant but outside
// the result buffer, or again after the write that completed it, is
// refused (its write completes with a remote access error) and no byte of
// the result or of the tensors beside it in the arena changes; over tcp
// and onnode (where the sender's provider checks the receiver's grant
// table before it copies).
func TestGrantHostileSender(t *testing.T) {
	forEachProvider(t, testGrantHostileSender)
}

func testGrantHostileSender(t *testing.T, provider string) {
	const size = 4096
	unbounded := requireGrants(t, provider)
	meta, _ := tensor.MetaFor(tensor.Uint8, tensor.Shape{size})
	type recvResult struct {
		t   *tensor.Tensor
		err error
	}
	// setup makes a victim channel, its Recv of "t" step 0 with the
	// meta-data cached (so the request carries the buffer), guard tensors
	// around its buffer, and a hostile sender with the request in hand.
	setup := func(t *testing.T) (*side, *hostileSender, wire.Message, verbsio.MemoryRegion, *arenaWindow, chan recvResult) {
		v, err := openSide(provider, "victim")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			if err := v.close(); err != nil {
				t.Errorf("closing the victim: %v", err)
			}
		})
		h := newHostileSender(t, provider, v)
		v.ch.mu.Lock()
		v.ch.rcv.cache["t"] = meta
		v.ch.mu.Unlock()
		w := &arenaWindow{}
		if w.before, err = v.pool.Alloc(size); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { w.before.Free() })
		res := make(chan recvResult, 1)
		v.ch.RecvFunc(context.Background(), "t", 0, func(t *tensor.Tensor, _ Transfer, err error) { res <- recvResult{t, err} })
		if w.after, err = v.pool.Alloc(size); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { w.after.Free() })
		fill(w.before.Bytes(), 0x3C)
		fill(w.after.Bytes(), 0xC3)
		m := h.awaitRequest()
		if m.Addr == 0 || m.Capacity < size {
			t.Fatalf("request without a result buffer: %+v", m)
		}
		r := uintptr(m.Addr)
		w.lo, w.hi = w.before.Addr(), w.after.Addr()+uintptr(w.after.Len())
		if !(w.before.Addr()+uintptr(w.before.Len()) <= r && r+uintptr(m.Capacity) <= w.after.Addr()) {
			t.Fatalf("layout: guard [%#x+%d), result [%#x+%d), guard [%#x+%d): the result is not between its guards", w.before.Addr(), w.before.Len(), r, m.Capacity, w.after.Addr(), w.after.Len())
		}
		a1, _ := v.pool.ArenaOf(w.lo)
		a2, _ := v.pool.ArenaOf(w.hi - 1)
		if a1 == nil || a1 != a2 {
			t.Fatal("the guards are not in one arena")
		}
		fill(offheap.Bytes(r, int(m.Capacity)), 0x5A)
		w.snap = append([]byte(nil), w.bytes()...)
		mr, ok := v.mem.Region(r, int(m.Capacity))
		if !ok {
			t.Fatal("the result buffer has no region")
		}
		if m.RKey == mr.RKey() {
			t.Fatalf("the request carries the arena's rkey %#x, not a grant", m.RKey)
		}
		if v.ch.rcv.stats.grants.Load() == 0 {
			t.Fatal("no grant counted")
		}
		return v, h, m, mr, w, res
	}
	// refused checks that the write failed at the hostile sender, that
	// the window did not change, and that the victim's Recv failed (the
	// queue pair is in error) rather than hang.
	refused := func(t *testing.T, what string, st verbsio.Status, w *arenaWindow, res chan recvResult) {
		t.Helper()
		if st != verbsio.StatusRemoteAccess {
			t.Fatalf("%s: the hostile write completed with %v, want %v", what, st, verbsio.StatusRemoteAccess)
		}
		w.unchanged(t, what, 0, 0)
		select {
		case r := <-res:
			if r.err == nil {
				t.Fatalf("%s: the Recv succeeded", what)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("%s: the Recv neither failed nor completed", what)
		}
		w.unchanged(t, what+" (after the channel failed)", 0, 0)
	}

	cases := []struct {
		name  string
		space bool // refused only where the device bounds a grant in space
		write func(h *hostileSender, m wire.Message, mr verbsio.MemoryRegion, w *arenaWindow) verbsio.Status
	}{
		{"ArenaRKeyIntoTheResult", false, func(h *hostileSender, m wire.Message, mr verbsio.MemoryRegion, w *arenaWindow) verbsio.Status {
			return h.write(m.Addr, mr.RKey(), size, 0x11, m.Req)
		}},
		{"ArenaRKeyIntoTheNextTensor", false, func(h *hostileSender, m wire.Message, mr verbsio.MemoryRegion, w *arenaWindow) verbsio.Status {
			return h.write(uint64(w.after.Addr()), mr.RKey(), size, 0x12, m.Req)
		}},
		{"GrantOneByteBefore", true, func(h *hostileSender, m wire.Message, mr verbsio.MemoryRegion, w *arenaWindow) verbsio.Status {
			return h.write(m.Addr-1, m.RKey, 16, 0x13, m.Req)
		}},
		{"GrantOneBytePast", true, func(h *hostileSender, m wire.Message, mr verbsio.MemoryRegion, w *arenaWindow) verbsio.Status {
			return h.write(m.Addr+m.Capacity-15, m.RKey, 16, 0x14, m.Req)
		}},
		{"GrantIntoTheNextTensor", true, func(h *hostileSender, m wire.Message, mr verbsio.MemoryRegion, w *arenaWindow) verbsio.Status {
			return h.write(uint64(w.after.Addr()), m.RKey, size, 0x15, m.Req)
		}},
		{"GrantIntoThePreviousTensor", true, func(h *hostileSender, m wire.Message, mr verbsio.MemoryRegion, w *arenaWindow) verbsio.Status {
			return h.write(uint64(w.before.Addr()), m.RKey, size, 0x16, m.Req)
		}},
		// No read grant: neither the request's grant nor the arena's key
		// reads anything (the guard tensors hold 0x3C and 0xC3).
		{"ReadThroughTheGrant", false, func(h *hostileSender, m wire.Message, mr verbsio.MemoryRegion, w *arenaWindow) verbsio.Status {
			return readNothing(h, m.Addr, m.RKey, size)
		}},
		{"ReadTheNextTensorWithTheArenaRKey", false, func(h *hostileSender, m wire.Message, mr verbsio.MemoryRegion, w *arenaWindow) verbsio.Status {
			return readNothing(h, uint64(w.after.Addr()), mr.RKey(), size)
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if tc.space && unbounded != "" {
				t.Skipf("the device does not bound a grant in space: %s", unbounded)
			}
			_, h, m, mr, w, res := setup(t)
			refused(t, tc.name, tc.write(h, m, mr, w), w, res)
		})
	}

	// An arena that never gave a grant admits no write through its own
	// rkey either: the front door registers memory for local write only
	// where the device gives grants.
	t.Run("ArenaRKeyIntoAnArenaThatNeverGranted", func(t *testing.T) {
		v, h, m, _, w, res := setup(t)
		fresh, err := alloc.New(alloc.NewMmapSource(alloc.MmapOptions{NUMANode: -1}), alloc.WithVisitors(frontDoorRegistration(v.dev, v.pd, 0)), alloc.WithName("never granted"))
		if err != nil {
			t.Fatal(err)
		}
		defer fresh.Close()
		b, err := fresh.Alloc(size)
		if err != nil {
			t.Fatal(err)
		}
		defer b.Free()
		fill(b.Bytes(), 0x77)
		snap := append([]byte(nil), b.Bytes()...)
		a, _ := fresh.ArenaOf(b.Addr())
		mr, ok := regionOf(a)
		if !ok {
			t.Fatal("the fresh arena has no region")
		}
		st := h.write(uint64(b.Addr()), mr.RKey(), size, 0x17, m.Req)
		if !bytes.Equal(b.Bytes(), snap) {
			t.Fatalf("the write through the arena's own rkey (%v, region %v) changed the fresh arena: % x", st, mr.Access(), b.Bytes()[:8])
		}
		refused(t, "the arena's own rkey into an arena that never granted", st, w, res)
	})

	t.Run("GrantUsedUp", func(t *testing.T) {
		_, h, m, _, w, res := setup(t)
		if st := h.write(m.Addr, m.RKey, size, 0x21, m.Req); st != verbsio.StatusSuccess {
			t.Fatalf("the write the request asked for: %v", st)
		}
		var got *tensor.Tensor
		select {
		case r := <-res:
			if r.err != nil {
				t.Fatalf("Recv: %v", r.err)
			}
			got = r.t
		case <-time.After(10 * time.Second):
			t.Fatal("the Recv did not complete")
		}
		defer got.Release()
		gb, _ := got.Bytes()
		if !bytes.Equal(gb, bytes.Repeat([]byte{0x21}, size)) {
			t.Fatal("the result does not hold the write")
		}
		w.unchanged(t, "the write inside the grant", uintptr(m.Addr), uintptr(m.Addr)+size)
		// The result is the caller's now: the grant is spent.
		w.snap = append(w.snap[:0], w.bytes()...)
		if st := h.write(m.Addr, m.RKey, size, 0x22, m.Req); st != verbsio.StatusRemoteAccess {
			t.Fatalf("a second write through the spent grant: %v, want %v", st, verbsio.StatusRemoteAccess)
		}
		w.unchanged(t, "a second write through the spent grant", 0, 0)
	})
}

// requireGrants skips unless provider's devices give grants, and returns
// why those grants are not bounded in space ("" where they are).
func requireGrants(t *testing.T, provider string) string {
	t.Helper()
	cfg, err := verbsio.ConfigFromEnv()
	if err != nil {
		t.Fatal(err)
	}
	dev, err := verbsio.Open(provider, cfg)
	if err != nil {
		skipUnavailable(t, provider, err)
	}
	defer dev.Close()
	if !dev.Caps().Grants {
		why := "no reason given"
		if d, ok := ibvdiag.Of(dev); ok {
			why = d.GrantsReason()
		}
		t.Skipf("%s gives no grants here (%s); on ibverbs %s=force tries the window path on a device that does not bound windows", provider, why, "GDRLINK_IBVERBS_WINDOWS")
	}
	return grantsUnbounded(dev)
}

// noGrants hides the regions' Granter, so that a channel asks for its
// results with the arena's rkey, as before grants.
type noGrants struct{ Memory }

type plainRegion struct{ verbsio.MemoryRegion }

func (m noGrants) Region(addr uintptr, n int) (verbsio.MemoryRegion, bool) {
	r, ok := m.Memory.Region(addr, n)
	if !ok {
		return nil, false
	}
	return plainRegion{r}, true
}

// openGrantSide is openSide over provider, with grants or without.
func openGrantSide(provider, name string, grants bool) (*side, error) {
	s := &side{}
	cfg, err := verbsio.ConfigFromEnv()
	if err != nil {
		return nil, err
	}
	if s.dev, err = verbsio.Open(provider, cfg); err != nil {
		return nil, err
	}
	if s.pd, err = s.dev.AllocPD(); err != nil {
		_ = s.close()
		return nil, err
	}
	reg := registration(s.pd, 0)
	if grants {
		reg = frontDoorRegistration(s.dev, s.pd, 0)
	}
	if s.pool, err = alloc.New(alloc.NewMmapSource(alloc.MmapOptions{NUMANode: -1}), alloc.WithVisitors(reg), alloc.WithName(name)); err != nil {
		_ = s.close()
		return nil, err
	}
	s.mem = PoolMemory(regionOf, s.pool)
	if !grants {
		s.mem = noGrants{s.mem}
	}
	// The request path's grants are what is measured: nothing eagerly.
	if s.ch, err = New(s.dev, s.pd, s.mem, WithName(name), WithEager(0)); err != nil {
		_ = s.close()
		return nil, err
	}
	return s, nil
}

// BenchmarkRecvGrants compares one steady-state Recv over tcp and onnode
// with a grant per result buffer (given with the request, revoked when it
// completes) and with the arena's rkey, for a small and a large tensor.
// Run it with -count to see the spread: the pairs run one after the other
// in each run.
func BenchmarkRecvGrants(b *testing.B) {
	for _, provider := range []string{"tcp", "onnode"} {
		for _, size := range []int64{4 << 10, 16 << 20} {
			for _, grants := range []bool{false, true} {
				name := "arena-rkey"
				if grants {
					name = "grants"
				}
				b.Run(fmt.Sprintf("%s/%s/%dB", provider, name, size), func(b *testing.B) {
					a, err := openGrantSide(provider, "a", grants)
					if err != nil {
						b.Skipf("%s unavailable: %v", provider, err)
					}
					defer a.close()
					c, err := openGrantSide(provider, "b", grants)
					if err != nil {
						b.Skipf("%s unavailable: %v", provider, err)
					}
					defer c.close()
					before := c.ch.rcv.stats.grants.Load()
					benchRecvLoop(b, a, c, size, nil)
					if given := c.ch.rcv.stats.grants.Load() - before; (given > 0) != grants {
						b.Fatalf("%d grants given with grants %v", given, grants)
					}
				})
			}
		}
	}
}

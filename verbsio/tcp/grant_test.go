package tcp

import (
	"bytes"
	"errors"
	"io"
	"net"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gdrlink/gdrlink/internal/offheap"
	"github.com/gdrlink/gdrlink/verbsio"
)

// mmapT maps n bytes off the Go heap, unmapped at cleanup.
func mmapT(t testing.TB, n int) []byte {
	t.Helper()
	b, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Munmap(b) })
	return b
}

// grantOn gives the peer of q a grant of the target region's bytes [off,
// off+n), revoked at cleanup.
func (tg *target) grantOn(t testing.TB, q verbsio.QueuePair, off, n, imms int) verbsio.Grant {
	t.Helper()
	g, err := tg.mr.(verbsio.Granter).Grant(tg.mr.Addr()+uintptr(off), n, q, imms)
	if err != nil {
		t.Fatalf("Grant(+%d, %d): %v", off, n, err)
	}
	t.Cleanup(func() { g.Revoke() })
	return g
}

// exchange writes one frame on c and returns the response.
func exchange(t testing.TB, c net.Conn, h header, payload []byte) header {
	t.Helper()
	if _, err := c.Write(frame(h, payload)); err != nil {
		t.Fatal(err)
	}
	r := readResponse(t, c)
	if r.token != h.token {
		t.Fatalf("response for token %d, want %d", r.token, h.token)
	}
	return r
}

func wantNak(t testing.TB, what string, r header) {
	t.Helper()
	if r.op != opNak || r.status != verbsio.StatusRemoteAccess {
		t.Fatalf("%s: response %s status %v, want a nak with remote access error", what, opName(r.op), r.status)
	}
}

func wantAck(t testing.TB, what string, r header) {
	t.Helper()
	if r.op != opAck {
		t.Fatalf("%s: response %s status %v, want an ack", what, opName(r.op), r.status)
	}
}

// region returns a copy of the target's registered page.
func (tg *target) region() []byte {
	return append([]byte(nil), tg.mem[tg.page:2*tg.page]...)
}

// TestGrantRawFrames plays the peer of a grant with raw frames, on one
// lane that stays in step across the refusals: every refused write leaves
// the whole mapping as it was.
func TestGrantRawFrames(t *testing.T) {
	tg := newTarget(t, verbsio.AccessLocalWrite|verbsio.AccessRemoteWrite)
	if !tg.dev.Caps().Grants {
		t.Fatal("Caps.Grants is false, but the regions implement verbsio.Granter")
	}
	if err := tg.qp.PostRecv([]verbsio.RecvWR{{WRID: 1}, {WRID: 2}, {WRID: 3}, {WRID: 4}}); err != nil {
		t.Fatal(err)
	}
	c := tg.dial(t)
	base := tg.base()
	// Before any grant, the region's own rkey admits writes, as ever.
	wantAck(t, "region rkey before any grant", exchange(t, c, header{op: opWrite, token: 1, raddr: base + 4000, rkey: tg.mr.RKey()}, []byte{0xA5}))

	g := tg.grantOn(t, tg.qp, 100, 100, 1)
	if g.RKey()&grantKeyBit == 0 || g.RKey() == tg.mr.RKey() || g.RKey() == tg.mr.LKey() {
		t.Fatalf("grant rkey %#x: want the grant bit, distinct from the region's keys %#x/%#x", g.RKey(), tg.mr.LKey(), tg.mr.RKey())
	}
	before := tg.region()
	refused := []struct {
		name string
		h    header
		n    int
	}{
		{"OneByteBefore", header{op: opWrite, raddr: base + 99, rkey: g.RKey()}, 100},
		{"OneByteAfter", header{op: opWrite, raddr: base + 101, rkey: g.RKey()}, 100},
		{"Larger", header{op: opWrite, raddr: base + 100, rkey: g.RKey()}, 101},
		{"RegionRKeyAfterAGrant", header{op: opWrite, raddr: base + 300, rkey: tg.mr.RKey()}, 10},
		{"RegionRKeyInsideTheGrant", header{op: opWrite, raddr: base + 100, rkey: tg.mr.RKey()}, 10},
		{"UnknownRKey", header{op: opWrite, raddr: base + 100, rkey: g.RKey() ^ 0x100}, 10},
	}
	for i, tc := range refused {
		tc.h.token = uint64(10 + i)
		wantNak(t, tc.name, exchange(t, c, tc.h, bytes.Repeat([]byte{0x11}, tc.n)))
		if !bytes.Equal(tg.region(), before) {
			t.Fatalf("%s: the region changed", tc.name)
		}
		tg.intact(t, false)
	}
	// A read through a grant is refused: grants are for writing.
	if _, err := c.Write(header{op: opReadReq, token: 30, length: 10, raddr: base + 100, rkey: g.RKey()}.appendTo()); err != nil {
		t.Fatal(err)
	}
	wantNak(t, "read through a grant", readResponse(t, c))
	// A region registered for remote read as well reads through its rkey
	// until it gives a grant, and not after.
	rw, err := tg.pd.RegisterMemory(tg.mr.Addr(), tg.page, verbsio.AccessLocalWrite|verbsio.AccessRemoteWrite|verbsio.AccessRemoteRead)
	if err != nil {
		t.Fatal(err)
	}
	defer rw.Close()
	if _, err := c.Write(header{op: opReadReq, token: 31, length: 10, raddr: base, rkey: rw.RKey()}.appendTo()); err != nil {
		t.Fatal(err)
	}
	if r := readResponse(t, c); r.op != opReadResp || r.length != 10 {
		t.Fatalf("read before any grant: %+v", r)
	}
	if _, err := io.ReadFull(c, make([]byte, 10)); err != nil {
		t.Fatal(err)
	}
	rg, err := rw.(verbsio.Granter).Grant(rw.Addr()+3000, 10, tg.qp, 1)
	if err != nil {
		t.Fatal(err)
	}
	rg.Revoke()
	if _, err := c.Write(header{op: opReadReq, token: 32, length: 10, raddr: base, rkey: rw.RKey()}.appendTo()); err != nil {
		t.Fatal(err)
	}
	wantNak(t, "read through the rkey of a region that gives grants", readResponse(t, c))

	// Inside: a plain write, then the write with immediate that uses the
	// grant up.
	wantAck(t, "inside", exchange(t, c, header{op: opWrite, token: 40, raddr: base + 100, rkey: g.RKey()}, bytes.Repeat([]byte{0x22}, 50)))
	wantAck(t, "inside, with immediate", exchange(t, c, header{op: opWriteImm, flags: flagLast, total: 50, imm: 9, token: 41, raddr: base + 150, rkey: g.RKey()}, bytes.Repeat([]byte{0x33}, 50)))
	want := append(append(append([]byte(nil), before[:100]...), bytes.Repeat([]byte{0x22}, 50)...), bytes.Repeat([]byte{0x33}, 50)...)
	want = append(want, before[200:]...)
	if !bytes.Equal(tg.region(), want) {
		t.Fatal("the writes inside the grant did not land exactly")
	}
	var wc [4]verbsio.Completion
	if n, _ := tg.cq.Poll(wc[:]); n != 1 || wc[0].Imm != 9 || wc[0].WRID != 1 || wc[0].Status != verbsio.StatusSuccess {
		t.Fatalf("receive completions %+v, want one with immediate 9", wc[:n])
	}
	// Used up: refused, whatever the write.
	after := tg.region()
	wantNak(t, "used grant", exchange(t, c, header{op: opWrite, token: 42, raddr: base + 100, rkey: g.RKey()}, []byte{0x44}))
	wantNak(t, "used grant, with immediate", exchange(t, c, header{op: opWriteImm, flags: flagLast, total: 1, imm: 10, token: 43, raddr: base + 100, rkey: g.RKey()}, []byte{0x44}))
	if !bytes.Equal(tg.region(), after) {
		t.Fatal("a write through a used grant changed the region")
	}
	if n, _ := tg.cq.Poll(wc[:]); n != 0 {
		t.Fatalf("refused writes with immediate completed receives: %+v", wc[:n])
	}
	if err := g.Revoke(); err != nil {
		t.Fatalf("Revoke of a used grant: %v", err)
	}

	// Revoked before use.
	r := tg.grantOn(t, tg.qp, 500, 100, 1)
	if err := r.Revoke(); err != nil {
		t.Fatal(err)
	}
	if err := r.Revoke(); err != nil {
		t.Fatalf("second Revoke: %v", err)
	}
	wantNak(t, "revoked grant", exchange(t, c, header{op: opWrite, token: 50, raddr: base + 500, rkey: r.RKey()}, []byte{0x55}))

	// Given to another queue pair of the same domain.
	q2, err := tg.pd.CreateQP(verbsio.QPConfig{SendCQ: tg.cq, RecvCQ: tg.cq})
	if err != nil {
		t.Fatal(err)
	}
	defer q2.Close()
	o := tg.grantOn(t, q2, 600, 100, 1)
	wantNak(t, "grant of another queue pair", exchange(t, c, header{op: opWrite, token: 60, raddr: base + 600, rkey: o.RKey()}, []byte{0x66}))

	// Plain writes only: a write with immediate is refused, plain writes
	// land until Revoke.
	p := tg.grantOn(t, tg.qp, 700, 100, 0)
	wantNak(t, "write with immediate through a plain grant", exchange(t, c, header{op: opWriteImm, flags: flagLast, total: 1, imm: 11, token: 70, raddr: base + 700, rkey: p.RKey()}, []byte{0x77}))
	wantAck(t, "plain write through a plain grant", exchange(t, c, header{op: opWrite, token: 71, raddr: base + 700, rkey: p.RKey()}, []byte{0x77}))
	wantAck(t, "again", exchange(t, c, header{op: opWrite, token: 72, raddr: base + 701, rkey: p.RKey()}, []byte{0x78}))

	// Chunks: a grant for two writes with immediate takes two, not three.
	k := tg.grantOn(t, tg.qp, 800, 100, 2)
	wantAck(t, "chunk 1", exchange(t, c, header{op: opWriteImm, flags: flagLast, total: 50, imm: 12, token: 80, raddr: base + 800, rkey: k.RKey()}, bytes.Repeat([]byte{0x88}, 50)))
	wantAck(t, "chunk 2", exchange(t, c, header{op: opWriteImm, flags: flagLast, total: 50, imm: 12, token: 81, raddr: base + 850, rkey: k.RKey()}, bytes.Repeat([]byte{0x89}, 50)))
	wantNak(t, "a third chunk", exchange(t, c, header{op: opWrite, token: 82, raddr: base + 800, rkey: k.RKey()}, []byte{0x8A}))
	if !bytes.Equal(tg.mem[tg.page+800:tg.page+900], append(bytes.Repeat([]byte{0x88}, 50), bytes.Repeat([]byte{0x89}, 50)...)) {
		t.Fatal("chunks did not land exactly")
	}
	tg.intact(t, false)

	// Used grants leave the table.
	tg.qp.pd.mu.RLock()
	live := len(tg.qp.pd.grants)
	tg.qp.pd.mu.RUnlock()
	if live != 2 { // o and p
		t.Errorf("%d live grants in the table, want 2", live)
	}
}

func TestGrantErrors(t *testing.T) {
	tg := newTarget(t, verbsio.AccessLocalWrite)
	gr := tg.mr.(verbsio.Granter)
	base := tg.mr.Addr()
	if _, err := gr.Grant(base+uintptr(tg.page)-10, 11, tg.qp, 1); !errors.Is(err, verbsio.ErrBadAddress) {
		t.Errorf("grant past the region's end: %v, want ErrBadAddress", err)
	}
	if _, err := gr.Grant(base, 0, tg.qp, 1); !errors.Is(err, verbsio.ErrBadAddress) {
		t.Errorf("empty grant: %v, want ErrBadAddress", err)
	}
	if _, err := gr.Grant(base, 10, tg.qp, -1); !errors.Is(err, verbsio.ErrBadConfig) {
		t.Errorf("grant for -1 writes with immediate: %v, want ErrBadConfig", err)
	}
	other := newTarget(t, verbsio.AccessLocalWrite)
	if _, err := gr.Grant(base, 10, other.qp, 1); !errors.Is(err, verbsio.ErrBadConfig) {
		t.Errorf("grant to a queue pair of another domain: %v, want ErrBadConfig", err)
	}
	ro, err := tg.pd.RegisterMemory(base, 64, verbsio.AccessRemoteRead)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ro.(verbsio.Granter).Grant(base, 10, tg.qp, 1); !errors.Is(err, verbsio.ErrLocalProtection) {
		t.Errorf("grant on a region without local write: %v, want ErrLocalProtection", err)
	}
	ro.Close()
	gone, err := tg.pd.RegisterMemory(base, 64, verbsio.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	gone.Close()
	if _, err := gone.(verbsio.Granter).Grant(base, 10, tg.qp, 1); !errors.Is(err, verbsio.ErrClosed) {
		t.Errorf("grant on a closed region: %v, want ErrClosed", err)
	}
	// Keys: random, with the grant bit, distinct among live grants.
	seen := map[uint32]bool{}
	var prev uint32
	steps := 0
	for i := 0; i < 256; i++ {
		g, err := gr.Grant(base, 10, tg.qp, 1)
		if err != nil {
			t.Fatal(err)
		}
		defer g.Revoke()
		k := g.RKey()
		if seen[k] || k&grantKeyBit == 0 {
			t.Fatalf("grant rkey %#x repeats or lacks the grant bit", k)
		}
		seen[k] = true
		if k == prev+1 {
			steps++
		}
		prev = k
	}
	if steps > 2 {
		t.Errorf("%d of 256 grant rkeys follow the previous one: sequential, not random", steps)
	}
	// A queue pair's Close drops its grants; a region's Close drops the
	// rest.
	q2, err := tg.pd.CreateQP(verbsio.QPConfig{SendCQ: tg.cq, RecvCQ: tg.cq})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := gr.Grant(base, 10, q2, 1); err != nil {
		t.Fatal(err)
	}
	q2.Close()
	if _, err := gr.Grant(base, 10, q2, 1); !errors.Is(err, verbsio.ErrQPState) {
		t.Errorf("grant to a closed queue pair: %v, want ErrQPState", err)
	}
	tg.qp.pd.mu.RLock()
	n := len(tg.qp.pd.grants)
	tg.qp.pd.mu.RUnlock()
	if n != 256 {
		t.Errorf("%d grants live after the queue pair closed, want 256", n)
	}
	tg.mr.Close()
	tg.qp.pd.mu.RLock()
	n = len(tg.qp.pd.grants)
	tg.qp.pd.mu.RUnlock()
	if n != 0 {
		t.Errorf("%d grants live after the region closed", n)
	}
}

// stalledWrite opens a lane to the target and sends the header of a write
// of n bytes and the first k of them, then nothing; it returns once those
// k bytes have landed.
func stalledWrite(t *testing.T, tg *target, h header, n, k int) net.Conn {
	t.Helper()
	c := tg.dial(t)
	h.length = uint32(n)
	if _, err := c.Write(append(h.Append(nil), bytes.Repeat([]byte{0x5C}, k)...)); err != nil {
		t.Fatal(err)
	}
	off := int(h.raddr - uint64(tg.mr.Addr()))
	deadline := time.Now().Add(10 * time.Second)
	for tg.mem[tg.page+off+k-1] != 0x5C {
		if time.Now().After(deadline) {
			t.Fatal("the first bytes of the stalled write never landed")
		}
		time.Sleep(time.Millisecond)
	}
	return c
}

// within runs f and fails the test if it takes longer than d.
func within(t *testing.T, d time.Duration, what string, f func() error) {
	t.Helper()
	done := make(chan error, 1)
	start := time.Now()
	go func() { done <- f() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		t.Logf("%s returned in %v", what, time.Since(start).Round(time.Microsecond))
	case <-time.After(d):
		t.Fatalf("%s still blocked after %v by a peer stalled in the middle of a write", what, d)
	}
}

// TestCloseWithStalledWriter: a peer that sends a write header and part of
// the payload, then stays silent (alive), does not hold up the region's
// Close; the rest of its payload, when it comes, lands nowhere and the
// write is refused.
func TestCloseWithStalledWriter(t *testing.T) {
	tg := newTarget(t, verbsio.AccessLocalWrite|verbsio.AccessRemoteWrite)
	c := stalledWrite(t, tg, header{op: opWrite, token: 5, raddr: tg.base() + 100, rkey: tg.mr.RKey()}, 1000, 10)
	within(t, time.Second, "MemoryRegion.Close", tg.mr.Close)
	if _, err := c.Write(bytes.Repeat([]byte{0x5D}, 990)); err != nil {
		t.Fatal(err)
	}
	if r := readResponse(t, c); r.op != opNak || r.status != verbsio.StatusRemoteAccess || r.token != 5 {
		t.Fatalf("response %+v, want a remote access nak for token 5", r)
	}
	for i := tg.page + 110; i < 2*tg.page; i++ {
		if tg.mem[i] != guardByte {
			t.Fatalf("byte %d of the region changed after Close", i-tg.page)
		}
	}
	tg.intact(t, false)
	// The lane is still in step.
	if r := exchange(t, c, header{op: opWrite, token: 6, raddr: tg.base(), rkey: tg.mr.RKey()}, []byte{1}); r.op != opNak {
		t.Fatalf("write to the closed region: %+v", r)
	}
}

// TestRevokeWithStalledWriter: the same through a grant, cut short by
// Revoke.
func TestRevokeWithStalledWriter(t *testing.T) {
	tg := newTarget(t, verbsio.AccessLocalWrite)
	if err := tg.qp.PostRecv([]verbsio.RecvWR{{WRID: 1}}); err != nil {
		t.Fatal(err)
	}
	g := tg.grantOn(t, tg.qp, 0, 2000, 1)
	c := stalledWrite(t, tg, header{op: opWriteImm, flags: flagLast, total: 2000, imm: 3, token: 7, raddr: tg.base(), rkey: g.RKey()}, 2000, 10)
	within(t, time.Second, "Grant.Revoke", g.Revoke)
	c.Write(bytes.Repeat([]byte{0x5D}, 1990))
	if r := readResponse(t, c); r.op != opNak || r.status != verbsio.StatusRemoteAccess {
		t.Fatalf("response %+v, want a remote access nak", r)
	}
	for i := tg.page + 10; i < 2*tg.page; i++ {
		if tg.mem[i] != guardByte {
			t.Fatalf("byte %d of the region changed after Revoke", i-tg.page)
		}
	}
	// The receive the write took is back, for the next one.
	var wc [2]verbsio.Completion
	if n, _ := tg.cq.Poll(wc[:]); n != 0 {
		t.Fatalf("completions %+v after a refused write with immediate", wc[:n])
	}
	tg.qp.mu.Lock()
	posted := len(tg.qp.rq)
	tg.qp.mu.Unlock()
	if posted != 1 {
		t.Fatalf("%d receives posted after the refused write, want 1", posted)
	}
}

// TestCloseWithStalledReader: a peer that asks to read a region and then
// reads nothing of the answer (its socket buffers fill) does not hold up
// Close either; its lane is closed.
func TestCloseWithStalledReader(t *testing.T) {
	tg := newTarget(t, verbsio.AccessLocalWrite)
	const size = 64 << 20
	mem := mmapT(t, size)
	reg, err := tg.pd.RegisterMemory(offheap.Addr(mem), size, verbsio.AccessLocalWrite|verbsio.AccessRemoteRead)
	if err != nil {
		t.Fatal(err)
	}
	c := tg.dial(t)
	if _, err := c.Write(header{op: opReadReq, token: 1, length: size, raddr: uint64(reg.Addr()), rkey: reg.RKey()}.appendTo()); err != nil {
		t.Fatal(err)
	}
	// Wait until the answer is under way: the region's transfer is listed.
	m := reg.(*mr)
	deadline := time.Now().Add(10 * time.Second)
	for {
		m.mu.Lock()
		n := len(m.moving)
		m.mu.Unlock()
		if n > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the read never started")
		}
		time.Sleep(time.Millisecond)
	}
	time.Sleep(50 * time.Millisecond) // let the socket buffers fill
	within(t, time.Second, "MemoryRegion.Close", reg.Close)
}

// BenchmarkGrantRevoke is what a grant adds to a request on the
// receiving side: Grant when the request goes out, Revoke when it ends.
func BenchmarkGrantRevoke(b *testing.B) {
	tg := newTarget(b, verbsio.AccessLocalWrite)
	gr := tg.mr.(verbsio.Granter)
	for i := 0; i < b.N; i++ {
		g, err := gr.Grant(tg.mr.Addr(), 4096, tg.qp, 1)
		if err != nil {
			b.Fatal(err)
		}
		g.Revoke()
	}
}

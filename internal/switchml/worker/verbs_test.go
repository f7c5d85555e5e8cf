package worker

import (
	"errors"
	"os"
	"testing"

	"github.com/gdrlink/gdrlink/internal/ibv"
)

// TestPoolRKey: the rkey's low 16 bits are the pool index of the first
// slot, 2*(base+slot)+set, as the aggregator reads it.
func TestPoolRKey(t *testing.T) {
	for _, c := range []struct {
		base, slot, set int
		want            uint32
	}{{0, 0, 0, 0}, {0, 0, 1, 1}, {5, 3, 0, 16}, {5, 3, 1, 17}, {100, 39, 1, 279}} {
		if got := poolRKey(c.base, c.slot, c.set); got != c.want || int(got&0xffff)>>1 != c.base+c.slot || int(got&1) != c.set {
			t.Errorf("poolRKey(%d, %d, %d) = %d, want %d", c.base, c.slot, c.set, got, c.want)
		}
	}
}

// TestLayout: every queue pair's result places (one per generation) and
// send buffers (one per set) are disjoint, inside the region, and the
// reply address of a message names its generation's place.
func TestLayout(t *testing.T) {
	for _, l := range []layout{{1, 256}, {8, 4096}, {255, 1024}, {3, 3072}} {
		owner := map[int]string{}
		claim := func(off int, what string) {
			if off < 0 || off+l.msgB > l.size() {
				t.Fatalf("%+v: %s at %d..%d outside the %d-byte region", l, what, off, off+l.msgB, l.size())
			}
			for b := off; b < off+l.msgB; b += 64 {
				if o, ok := owner[b]; ok {
					t.Fatalf("%+v: %s overlaps %s", l, what, o)
				}
				owner[b] = what
			}
		}
		for q := range l.window {
			for g := range generations {
				claim(l.resultOff(g, q), "result")
			}
			claim(l.sendOff(q, 0), "send 0")
			claim(l.sendOff(q, 1), "send 1")
		}
		if l.size()%4096 != 0 {
			t.Errorf("%+v: region of %d bytes is not whole pages", l, l.size())
		}
		v := &verbsLink{lay: l}
		q := &qp{idx: l.window - 1}
		seen := map[uint64]uint64{}
		for m := uint64(1); m <= 2*generations; m++ {
			va := v.replyVA(q, m, 0)
			if int(va-RegionVA) != l.resultOff(int(m%generations), q.idx) {
				t.Fatalf("%+v: message %d replies to %#x", l, m, va)
			}
			if p, ok := seen[va]; ok && p != m-generations {
				t.Fatalf("%+v: messages %d and %d share %#x", l, p, m, va)
			}
			seen[va] = m
		}
	}
}

// TestCanary: a place holds the canary until anything in it changes.
func TestCanary(t *testing.T) {
	b := make([]byte, 1024)
	const c = 0x9e3779b97f4a7c15
	fillCanary(b, c)
	if !isCanary(b, c) {
		t.Fatal("filled place does not hold the canary")
	}
	for _, i := range []int{0, 7, 8, 511, 1023} {
		x := append([]byte(nil), b...)
		x[i] ^= 1
		if isCanary(x, c) {
			t.Errorf("a change at byte %d went unseen", i)
		}
	}
	if !isCanary(nil, c) {
		t.Error("an empty place is its own canary")
	}
}

// TestWRID: work request IDs carry the queue pair and the direction.
func TestWRID(t *testing.T) {
	for _, q := range []int{0, 1, 254} {
		for _, r := range []bool{false, true} {
			if gq, gr := wrQP(wrID(q, r)); gq != q || gr != r {
				t.Errorf("wrID(%d, %v) reads back as %d, %v", q, r, gq, gr)
			}
		}
	}
}

// TestRoCEv2GID: only a RoCE v2 entry whose GID is the IPv4-mapped address
// is picked.
func TestRoCEv2GID(t *testing.T) {
	ip := [4]byte{10, 234, 0, 10}
	other := mappedGID([4]byte{10, 234, 0, 11})
	gids := []ibv.GIDEntry{
		{Index: 0, Type: ibv.GIDTypeRoCEv1, GID: mappedGID(ip)},
		{Index: 1, Type: ibv.GIDTypeRoCEv2, GID: other},
		{Index: 2, Type: ibv.GIDTypeIB, GID: mappedGID(ip)},
	}
	if _, ok := roceV2GID(gids, ip); ok {
		t.Fatal("picked a GID that is not RoCE v2 for the address")
	}
	gids = append(gids, ibv.GIDEntry{Index: 5, Type: ibv.GIDTypeRoCEv2, GID: mappedGID(ip)})
	if i, ok := roceV2GID(gids, ip); !ok || i != 5 {
		t.Fatalf("roceV2GID = %d, %v; want 5", i, ok)
	}
	if g := mappedGID(ip); g.String() != "10.234.0.10" || !g.IsIPv4Mapped() {
		t.Errorf("mappedGID = %v", g)
	}
}

// TestVerbsCurrent: a completion is the current message's result only if
// it is a write with immediate of the awaited length that changed the
// awaited place; a second reply to an earlier message (which wrote its own
// place) is not.
func TestVerbsCurrent(t *testing.T) {
	w := &Worker{cfg: Config{Window: 2, MsgSlots: 1, SlotBytes: 256}, msgB: 256}
	l := &verbsLink{w: w, lay: layout{window: 2, msgB: 256}, canary: 0x5555aaaa12345678, mem: make([]byte, layout{2, 256}.size())}
	q := &qp{idx: 1}
	// mem stands in for the region: addresses are offsets from RegionVA.
	arm := func(count uint64, size int) {
		m := message{va: l.replyVA(q, count, 0), payload: make([]byte, size)}
		q.want, q.wantSize = m.va, size
		l.expect(q, &m)
	}
	wc := func(n int) ibv.WC { return ibv.WC{Flags: ibv.WCWithImm, ByteLen: uint32(n)} }
	arm(2, 256)
	if l.current(q, wc(256)) {
		t.Fatal("took a completion while the place still holds the canary (a stale reply wrote elsewhere)")
	}
	if l.current(q, wc(0)) {
		t.Fatal("took an empty completion for a data message")
	}
	off := l.lay.resultOff(2, 1)
	l.mem[off+100] = 7
	if !l.current(q, wc(256)) {
		t.Fatal("missed the current result")
	}
	if l.current(q, ibv.WC{ByteLen: 256}) {
		t.Fatal("took a completion without immediate")
	}
	arm(3, 0)
	if !l.current(q, wc(0)) || l.current(q, wc(256)) {
		t.Fatal("exponent-only message: wrong completion taken or missed")
	}
	q.want = 0
	if l.current(q, wc(0)) {
		t.Fatal("took a completion with no message awaited")
	}
}

// TestFindVerbs: on a host without a device the probe says what is
// missing (ErrNoDevice); with one, the guest test (TestRXEFrontDoor in the
// module root) uses it.
func TestFindVerbs(t *testing.T) {
	v, err := FindVerbs([4]byte{192, 0, 2, 1}) // TEST-NET-1: no GID has it
	if err == nil {
		t.Fatalf("found %+v for 192.0.2.1", v)
	}
	if !errors.Is(err, ErrNoDevice) {
		if os.Getenv("GDRLINK_REQUIRE_RDMA") == "1" {
			t.Fatalf("could not tell: %v", err)
		}
		t.Skipf("could not tell whether a device has the address: %v", err)
	}
	t.Logf("as expected: %v", err)
}

// TestVerbsConfig: a verbs worker refuses ports other than RoCEv2's before
// it touches a device.
func TestVerbsConfig(t *testing.T) {
	w := &Worker{cfg: Config{Port: 5000, DataPort: 4791, Window: 1}, msgB: 256}
	if _, err := newVerbsLink(w, Verbs{Device: "none"}); !errors.Is(err, ErrConfig) {
		t.Fatalf("port 5000: %v, want ErrConfig", err)
	}
	var _ transport = (*verbsLink)(nil)
	var _ transport = (*udpLink)(nil)
}

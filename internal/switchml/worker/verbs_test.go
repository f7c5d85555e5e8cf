package worker

import (
	"errors"
	"os"
	"slices"
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
			for g := range generations + resendPlaces {
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

// attributeRig is a verbs link without a device: mem stands in for the
// region (addresses are offsets from RegionVA), and sends are recorded as
// the transport records them, without posting anything.
type attributeRig struct {
	t *testing.T
	l *verbsLink
	q *qp
}

func newAttributeRig(t *testing.T, msgSlots int) *attributeRig {
	w := &Worker{cfg: Config{Window: 2, MsgSlots: msgSlots, SlotBytes: 256}, msgB: 256 * msgSlots}
	w.qps = []*qp{{idx: 0}, {idx: 1, result: make(chan reply, 1)}}
	lay := layout{window: 2, msgB: w.msgB}
	l := &verbsLink{w: w, lay: lay, canary: 0x5555aaaa12345678, mem: make([]byte, lay.size()), sent: make([]sentPlaces, 2)}
	fillCanary(l.mem, l.canary)
	return &attributeRig{t: t, l: l, q: w.qps[1]}
}

// next starts the queue pair's next message, as exchange does, and sends
// it once; size 0 is an exponent-only message.
func (r *attributeRig) next(size int) *message {
	q := r.q
	q.count++
	m := &message{va: r.l.replyVA(q, q.count, 0), payload: make([]byte, size)}
	if size == 0 {
		m.payload = nil
	}
	q.want, q.wantSize = m.va, size
	r.l.expect(q, m)
	r.send(m)
	return m
}

// send sends m (again) and returns the offset its reply is written to,
// or -1 if the transport refused to resend it (no free place).
func (r *attributeRig) send(m *message) int {
	if len(m.payload) == 0 {
		return int(m.va - RegionVA)
	}
	va, ok := r.l.place(r.q, m)
	if !ok {
		return -1
	}
	return int(va - RegionVA)
}

// write writes n bytes of a reply of fill bytes at off, as the device
// would, without a completion.
func (r *attributeRig) write(off, n int, fill byte) {
	for i := range n {
		r.l.mem[off+i] = fill
	}
}

// complete hands a completion of length n to attribute and returns what
// it took: the result's bytes, or nil.
func (r *attributeRig) complete(n int) []byte {
	off, ok := r.l.attribute(r.q, ibv.WC{Flags: ibv.WCWithImm, ByteLen: uint32(n)})
	if !ok {
		return nil
	}
	r.q.want = 0
	return append([]byte{}, r.l.mem[off:off+r.q.wantSize]...)
}

// resendUntilTaken sends m's reply (fill bytes) to the place its latest
// send named, as the aggregator would, and resends it until the reply is
// taken, at most tries times: each completion taken must be m's whole
// result, never another write's.
func (r *attributeRig) resendUntilTaken(m *message, n int, fill byte, tries int) {
	r.t.Helper()
	off := int(m.va - RegionVA)
	for range tries {
		r.write(off, n, fill)
		if got := r.complete(n); got != nil {
			for i, b := range got {
				if b != fill {
					r.t.Fatalf("result byte %d is %#x, want %#x", i, b, fill)
				}
			}
			return
		}
		if off = r.send(m); off < 0 {
			r.t.Fatal("a resend was refused")
		}
	}
	r.t.Fatalf("message of %#x not taken after %d sends", fill, tries)
}

// TestVerbsAttribute: a completion is taken as the current message's
// result only once that result is whole in its place; second replies to
// resends of earlier messages, which write places of their own, are
// accounted for and dropped, even when one's completion is handled while
// the current reply is still being written.
func TestVerbsAttribute(t *testing.T) {
	const n = 256
	whole := func(t *testing.T, got []byte, fill byte) {
		t.Helper()
		if got == nil {
			t.Fatal("the result was not taken")
		}
		for i, b := range got {
			if b != fill {
				t.Fatalf("result byte %d is %#x, want %#x: part of the result is another write's or the canary", i, b, fill)
			}
		}
	}
	t.Run("plain", func(t *testing.T) {
		r := newAttributeRig(t, 1)
		m := r.next(n)
		if r.complete(n) != nil {
			t.Fatal("took a completion while the place still holds the canary")
		}
		r.write(int(m.va-RegionVA), n, 1)
		whole(t, r.complete(n), 1)
		if r.complete(n) != nil {
			t.Fatal("took a completion with no message awaited")
		}
	})
	// The failure seen on Soft-RoCE: message 1 is resent and its first
	// reply taken; message 2 goes out; the second reply to message 1 is
	// handled while message 2's reply is half written.
	t.Run("second reply while the current one is written", func(t *testing.T) {
		r := newAttributeRig(t, 1)
		m1 := r.next(n)
		again := r.send(m1)
		r.write(int(m1.va-RegionVA), n, 1)
		whole(t, r.complete(n), 1)
		m2 := r.next(n)
		r.write(again, n, 1)                  // the second reply to message 1
		r.write(int(m2.va-RegionVA), n/2, 2)  // message 2's, half of it
		if got := r.complete(n); got != nil { // message 1's second completion
			t.Fatalf("took %x... as message 2's result: the second reply to message 1 was taken for it", got[n/2-1:n/2+1])
		}
		r.write(int(m2.va-RegionVA), n, 2)
		whole(t, r.complete(n), 2)
	})
	t.Run("second reply lost", func(t *testing.T) {
		r := newAttributeRig(t, 1)
		m1 := r.next(n)
		r.send(m1)
		r.write(int(m1.va-RegionVA), n, 1)
		whole(t, r.complete(n), 1)
		m2 := r.next(n)
		r.write(int(m2.va-RegionVA), n, 2)
		whole(t, r.complete(n), 2)
	})
	t.Run("first reply lost, the resend's taken", func(t *testing.T) {
		r := newAttributeRig(t, 1)
		m1 := r.next(n)
		again := r.send(m1)
		r.write(again, n, 3)
		whole(t, r.complete(n), 3)
	})
	t.Run("places come round", func(t *testing.T) {
		r := newAttributeRig(t, 1)
		for k := range 3 * (generations + resendPlaces) {
			m := r.next(n)
			off := int(m.va - RegionVA)
			for range k % 3 { // resends without replies
				off = r.send(m)
			}
			r.write(off, n, byte(k+1))
			whole(t, r.complete(n), byte(k+1))
		}
	})
	// Under load the aggregator answers resends of the previous message
	// long after the queue pair moved on and resent the current one many
	// times: no place awaited by the previous message is named, a resend
	// with no free place names one of its own message's places again,
	// and the messages after take a reply (the first, or, where a place
	// named twice kept an entry that took a completion as stale, the
	// next resend's).
	t.Run("second replies late, more resends than places", func(t *testing.T) {
		r := newAttributeRig(t, 1)
		m1 := r.next(n)
		var late []int
		for range 3 {
			late = append(late, r.send(m1))
		}
		r.write(int(m1.va-RegionVA), n, 1)
		whole(t, r.complete(n), 1)
		m2 := r.next(n)
		own := []int{int(m2.va - RegionVA)}
		last := own[0]
		for k := range resendPlaces + 2 {
			off := r.send(m2)
			if off < 0 {
				t.Fatalf("resend %d of message 2 refused: it has places of its own", k)
			}
			if slices.Contains(late, off) {
				t.Fatalf("a resend of message 2 names %d, where a reply to message 1 may still land", off)
			}
			if k >= resendPlaces-len(late) && !slices.Contains(own, off) {
				t.Fatalf("resend %d of message 2 names %d with no free place: not one of its own (%v)", k, off, own)
			}
			own = append(own, off)
			last = off
		}
		for _, off := range late {
			r.write(off, n, 1)
			if got := r.complete(n); got != nil {
				t.Fatal("took a late reply to message 1 as message 2's result")
			}
		}
		r.write(last, n, 2)
		whole(t, r.complete(n), 2)
		for k := byte(3); k < 6; k++ {
			r.resendUntilTaken(r.next(n), n, k, 2)
		}
	})
	// Every resend place awaits a reply for a long time (an aggregator
	// far behind, or the reply that completed the message lost): the
	// resends name the message's own places again, in turn, never a
	// place of another message, and the reply to any naming is taken.
	// (Giving places up instead, and filling them again, let a late
	// reply to the first naming land after the next message named the
	// place, and be taken for that message's result: see the next case.)
	t.Run("every place awaited for long", func(t *testing.T) {
		for _, lost := range []bool{false, true} {
			r := newAttributeRig(t, 1)
			m := r.next(n)
			offs := []int{int(m.va - RegionVA)}
			for range resendPlaces {
				offs = append(offs, r.send(m))
			}
			var renamed []int
			for k := range 3 * len(offs) {
				off := r.send(m)
				if !slices.Contains(offs, off) {
					t.Fatalf("resend %d named %d, not one of the message's places %v", len(offs)+k, off, offs)
				}
				renamed = append(renamed, off)
			}
			if want := append(slices.Clone(offs), offs...); !slices.Equal(renamed[:len(want)], want) {
				t.Fatalf("renamed %v, want the places in the order they were named, %v", renamed[:len(want)], want)
			}
			// The reply to the latest send lands (lost: every reply
			// before it was lost); else a late one to the first.
			at := offs[0]
			if lost {
				at = renamed[len(renamed)-1]
			}
			r.write(at, n, 7)
			whole(t, r.complete(n), 7)
			// The message after takes a reply, perhaps after
			// resends: the entries left of message 1 take
			// completions as stale, never as its result.
			r.resendUntilTaken(r.next(n), n, 8, 3*len(offs)+2)
		}
	})
	// A place awaited by the previous message's resend is never named by
	// the current message, however many of its own it names again; the
	// late reply there is dropped.
	t.Run("renaming never takes another message's place", func(t *testing.T) {
		r := newAttributeRig(t, 1)
		m1 := r.next(n)
		r.send(m1)
		tail := r.send(m1) // resends after the completing reply
		r.write(int(m1.va-RegionVA), n, 1)
		whole(t, r.complete(n), 1)
		m2 := r.next(n)
		for k := range 4 * resendPlaces {
			if off := r.send(m2); off == tail || off < 0 {
				t.Fatalf("resend %d of message 2: %d (message 1's late reply may land at %d)", k, off, tail)
			}
		}
		r.write(tail, n, 1)
		if r.complete(n) != nil {
			t.Fatal("took message 1's late reply as message 2's result")
		}
		r.write(int(m2.va-RegionVA), n, 2)
		whole(t, r.complete(n), 2)
	})
	t.Run("a multi-packet reply cut short", func(t *testing.T) {
		r := newAttributeRig(t, 4)
		m := r.next(4 * n)
		r.write(int(m.va-RegionVA), 3*n, 4) // last packet lost: no completion
		again := r.send(m)
		r.write(again, 4*n, 5)
		whole(t, r.complete(4*n), 5)
	})
	t.Run("exponent-only", func(t *testing.T) {
		r := newAttributeRig(t, 1)
		r.next(0)
		if r.complete(n) != nil {
			t.Fatal("took a data completion for an exponent-only message")
		}
		if got := r.complete(0); got == nil || len(got) != 0 {
			t.Fatalf("exponent-only message: took %v", got)
		}
		m := r.next(n)
		if r.complete(0) != nil {
			t.Fatal("took an empty completion for a data message")
		}
		r.write(int(m.va-RegionVA), n, 6)
		whole(t, r.complete(n), 6)
	})
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

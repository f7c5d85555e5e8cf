package agg

import (
	"encoding/binary"
	"errors"
	"testing"

	"github.com/gdrlink/gdrlink/internal/switchml/rocev2"
)

// rig is one job of workers with one queue pair each, and helpers to send
// messages packet by packet.
type rig struct {
	t    testing.TB
	a    *Aggregator
	job  int
	spec Job
	eps  [][]Endpoint
	psn  []uint32 // next PSN of each worker's queue pair
}

func newRig(t testing.TB, workers, slotBytes int) *rig {
	t.Helper()
	r := &rig{t: t, a: New(1)}
	r.spec = Job{Base: 4, Slots: 8, SlotBytes: slotBytes}
	for w := range workers {
		r.spec.Workers = append(r.spec.Workers, Worker{QPNs: []uint32{uint32(0x1000 + w)}, PSNs: []uint32{uint32(100 * w)}, RKey: uint32(0x5000 + w)})
		r.psn = append(r.psn, uint32(100*w))
	}
	var err error
	r.job, r.eps, err = r.a.AddJob(r.spec)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// packets builds worker w's message: n packets from slot first (absolute),
// set s, every significand = val, immediate imm.
func (r *rig) packets(w, first, s, n int, val int32, imm uint32) []rocev2.Packet {
	sb := r.spec.SlotBytes
	var ps []rocev2.Packet
	for k := range n {
		pl := make([]byte, sb)
		for i := 0; i < sb; i += 4 {
			binary.LittleEndian.PutUint32(pl[i:], uint32(val))
		}
		p := rocev2.Packet{DestQP: r.eps[w][0].QPN, PSN: r.psn[w], Payload: pl}
		r.psn[w] = (r.psn[w] + 1) & psnMask
		switch {
		case n == 1:
			p.Opcode = rocev2.WriteOnlyWithImm
		case k == 0:
			p.Opcode = rocev2.WriteFirst
		case k == n-1:
			p.Opcode = rocev2.WriteLastWithImm
		default:
			p.Opcode = rocev2.WriteMiddle
		}
		if k == 0 {
			p.VA, p.RKey, p.DMALen = 0xabc000, uint32(2*first+s), uint32(n*sb)
		}
		if p.Opcode.HasImm() {
			p.Imm = imm
		}
		ps = append(ps, p)
	}
	return ps
}

// send hands packets to the aggregator and returns the replies; want is the
// error every packet must give (nil for none).
func (r *rig) send(ps []rocev2.Packet, want error) []Reply {
	r.t.Helper()
	var out []Reply
	for i := range ps {
		var err error
		out, err = r.a.Handle(&ps[i], out)
		if !errors.Is(err, want) || (want == nil && err != nil) {
			r.t.Fatalf("packet %d (%v PSN %#x): %v, want %v", i, ps[i].Opcode, ps[i].PSN, err, want)
		}
	}
	// Copy the payloads: they alias the slots.
	for i := range out {
		out[i].Packet.Payload = append([]byte(nil), out[i].Packet.Payload...)
	}
	return out
}

// checkReply checks that out is the n-packet result for worker w: every
// significand sum, immediate imm.
func (r *rig) checkReply(out []Reply, w, n int, sum int32, imm uint32) {
	r.t.Helper()
	var mine []Reply
	for _, rp := range out {
		if rp.Worker == w {
			mine = append(mine, rp)
		}
	}
	if len(mine) != n {
		r.t.Fatalf("worker %d: %d reply packets, want %d", w, len(mine), n)
	}
	psn := r.eps[w][0].PSN
	for k, rp := range mine {
		p := rp.Packet
		if p.DestQP != r.spec.Workers[w].QPNs[0] || p.PSN != psn {
			r.t.Fatalf("worker %d reply %d: QPN %#x PSN %#x, want %#x %#x", w, k, p.DestQP, p.PSN, r.spec.Workers[w].QPNs[0], psn)
		}
		psn++
		if k == 0 && (p.VA != 0xabc000 || p.RKey != r.spec.Workers[w].RKey || p.DMALen != uint32(n*r.spec.SlotBytes)) {
			r.t.Fatalf("worker %d reply RETH: %#x %#x %d", w, p.VA, p.RKey, p.DMALen)
		}
		if k == n-1 && (!p.Opcode.HasImm() || p.Imm != imm) {
			r.t.Fatalf("worker %d reply %v immediate %#x, want %#x", w, p.Opcode, p.Imm, imm)
		}
		for i := 0; i < len(p.Payload); i += 4 {
			if v := int32(binary.LittleEndian.Uint32(p.Payload[i:])); v != sum {
				r.t.Fatalf("worker %d reply %d element %d: %d, want %d", w, k, i/4, v, sum)
			}
		}
	}
	r.eps[w][0].PSN = psn
}

func TestAggregate(t *testing.T) {
	r := newRig(t, 3, SlotSmall)
	if out := r.send(r.packets(0, 4, 0, 3, 1, 0x01020304), nil); len(out) != 0 {
		t.Fatalf("replies after 1 of 3 workers")
	}
	r.send(r.packets(1, 4, 0, 3, 10, 0x05000000), nil)
	out := r.send(r.packets(2, 4, 0, 3, -100, 0x00000a01), nil)
	for w := range 3 {
		r.checkReply(out, w, 3, -89, 0x05020a04)
	}
	if s := r.a.Stats(); s.Applied != 9 || s.Completed != 1 || s.ReplyPackets != 9 {
		t.Fatalf("stats %+v", s)
	}
}

// TestRetransmitNotAddedTwice: a whole message sent twice by one worker is
// added once; sent again after completion, the result goes back to that
// worker alone.
func TestRetransmitNotAddedTwice(t *testing.T) {
	r := newRig(t, 2, SlotLarge)
	r.send(r.packets(0, 5, 1, 2, 7, 0), nil)
	r.send(r.packets(0, 5, 1, 2, 7, 0), nil)
	out := r.send(r.packets(1, 5, 1, 2, 1, 0), nil)
	r.checkReply(out, 0, 2, 8, 0)
	r.checkReply(out, 1, 2, 8, 0)
	out = r.send(r.packets(1, 5, 1, 2, 1, 0), nil)
	if len(out) != 2 || out[0].Worker != 1 {
		t.Fatalf("resent result: %d packets", len(out))
	}
	r.checkReply(out, 1, 2, 8, 0)
	if s := r.a.Stats(); s.Duplicates != 4 || s.Resent != 1 || s.Applied != 4 {
		t.Fatalf("stats %+v", s)
	}
}

// TestPSNGap: a lost middle packet drops the rest of the message as UC
// does; the whole message resent completes it, with the packets that did
// land added once.
func TestPSNGap(t *testing.T) {
	r := newRig(t, 2, SlotSmall)
	r.send(r.packets(1, 4, 0, 4, 2, 0), nil)
	ps := r.packets(0, 4, 0, 4, 3, 0)
	r.send(ps[:1], nil)
	r.send(ps[2:], ErrPSN) // packet 1 lost
	if s := r.a.Stats(); s.Completed != 0 || s.Dropped != 2 {
		t.Fatalf("stats %+v", s)
	}
	out := r.send(r.packets(0, 4, 0, 4, 3, 0), nil)
	r.checkReply(out, 0, 4, 5, 0)
	r.checkReply(out, 1, 4, 5, 0)
}

// TestLostLast: a message cut short by a new start is abandoned; the
// retransmission completes it.
func TestLostLast(t *testing.T) {
	r := newRig(t, 2, SlotSmall)
	ps := r.packets(0, 4, 0, 2, 1, 0x10)
	r.send(ps[:1], nil) // the last packet is lost
	r.send(r.packets(1, 4, 0, 2, 1, 0x20), nil)
	out := r.send(r.packets(0, 4, 0, 2, 1, 0x10), nil)
	r.checkReply(out, 0, 2, 2, 0x20)
	if s := r.a.Stats(); s.Abandoned != 1 {
		t.Fatalf("stats %+v", s)
	}
}

func TestStale(t *testing.T) {
	r := newRig(t, 2, SlotSmall)
	old := r.packets(0, 4, 0, 1, 1, 0)
	r.send(r.packets(0, 4, 0, 1, 1, 0), nil)
	r.send(old, ErrStale)
}

// TestSetReuse: the next round of a set needs the other set complete.
func TestSetReuse(t *testing.T) {
	r := newRig(t, 2, SlotSmall)
	out := r.send(append(r.packets(0, 6, 0, 1, 1, 0), r.packets(1, 6, 0, 1, 2, 0)...), nil)
	r.checkReply(out, 0, 1, 3, 0)
	r.checkReply(out, 1, 1, 3, 0)
	r.send(r.packets(0, 6, 1, 1, 5, 0), nil) // set 1, worker 1 not yet
	// Worker 0 goes back to set 0 too early: set 1 is incomplete.
	r.send(r.packets(0, 6, 0, 1, 9, 0), ErrReuse)
	out = r.send(r.packets(1, 6, 1, 1, 6, 0), nil)
	r.checkReply(out, 0, 1, 11, 0)
	r.checkReply(out, 1, 1, 11, 0)
	// Now set 0 starts its next round, its old sum gone.
	r.send(r.packets(0, 6, 0, 1, 9, 0), nil)
	out = r.send(r.packets(1, 6, 0, 1, 1, 0), nil)
	r.checkReply(out, 0, 1, 10, 0)
	r.checkReply(out, 1, 1, 10, 0)
}

func TestBadMessages(t *testing.T) {
	r := newRig(t, 2, SlotSmall)
	cases := []struct {
		name string
		mod  func(ps []rocev2.Packet) []rocev2.Packet
		want error
	}{
		{"below the job", func(ps []rocev2.Packet) []rocev2.Packet { ps[0].RKey = 2 * 3; return ps }, ErrPoolIndex},
		{"beyond the job", func(ps []rocev2.Packet) []rocev2.Packet { ps[0].RKey = 2*12 + 1; return ps }, ErrPoolIndex},
		{"not whole slots", func(ps []rocev2.Packet) []rocev2.Packet { ps[0].DMALen = 300; return ps[:1] }, ErrSize},
		{"short payload", func(ps []rocev2.Packet) []rocev2.Packet { ps[0].Payload = ps[0].Payload[:100]; return ps[:1] }, ErrSize},
		{"ONLY naming 2 slots", func(ps []rocev2.Packet) []rocev2.Packet {
			ps[0].Opcode = rocev2.WriteOnlyWithImm
			ps[0].DMALen = 512
			return ps[:1]
		}, ErrSize},
		{"unknown QP", func(ps []rocev2.Packet) []rocev2.Packet { ps[0].DestQP = 7; return ps[:1] }, ErrUnknownQP},
	}
	for _, c := range cases {
		ps := c.mod(r.packets(0, 4, 0, 1, 1, 0))
		var err error
		_, err = r.a.Handle(&ps[0], nil)
		if !errors.Is(err, c.want) {
			t.Errorf("%s: %v, want %v", c.name, err, c.want)
		}
	}
	// A LAST where a MIDDLE is due, and a message of another size than
	// the other workers' for the same pool index.
	ps := r.packets(0, 4, 0, 3, 1, 0)
	ps[1].Opcode = rocev2.WriteLastWithImm
	r.send(ps[:1], nil)
	r.send(ps[1:2], ErrSize)
	r.send(r.packets(0, 4, 0, 3, 1, 0), nil)
	r.send(r.packets(1, 4, 0, 2, 1, 0)[:1], ErrSize)
}

// TestJobs: jobs with their own ranges are independent; overlapping ranges
// and bad specifications are refused.
func TestJobs(t *testing.T) {
	a := New(2)
	mk := func(base, slots, workers, sb int, qpn uint32) Job {
		j := Job{Base: base, Slots: slots, SlotBytes: sb}
		for w := range workers {
			j.Workers = append(j.Workers, Worker{QPNs: []uint32{qpn + uint32(w)}, PSNs: []uint32{0}})
		}
		return j
	}
	if _, _, err := a.AddJob(mk(0, 10, 2, SlotSmall, 1)); err != nil {
		t.Fatal(err)
	}
	if _, _, err := a.AddJob(mk(10, 10, 32, SlotLarge, 100)); err != nil {
		t.Fatal(err)
	}
	for _, bad := range []Job{mk(5, 10, 2, SlotSmall, 1), mk(30, 1, 33, SlotSmall, 1), mk(30, 1, 0, SlotSmall, 1), mk(30, 1, 2, 512, 1), mk(-1, 1, 2, SlotSmall, 1), mk(30, 1<<15, 2, SlotSmall, 1)} {
		if _, _, err := a.AddJob(bad); !errors.Is(err, ErrJob) {
			t.Errorf("AddJob(%d workers, slots [%d,+%d), %d B): %v, want ErrJob", len(bad.Workers), bad.Base, bad.Slots, bad.SlotBytes, err)
		}
	}
	a.RemoveJob(0)
	if _, _, err := a.AddJob(mk(5, 5, 2, SlotSmall, 1)); err != nil {
		t.Fatalf("range of a removed job: %v", err)
	}
}

// TestThirtyTwoWorkers fills the whole bitmap.
func TestThirtyTwoWorkers(t *testing.T) {
	r := newRig(t, MaxWorkers, SlotSmall)
	var out []Reply
	for w := range MaxWorkers {
		if len(out) != 0 {
			t.Fatalf("replies after %d workers", w)
		}
		out = r.send(r.packets(w, 8, 1, 2, int32(w), uint32(w)<<24|uint32(31-w)), nil)
	}
	for w := range MaxWorkers {
		r.checkReply(out, w, 2, 31*32/2, 31<<24|31)
	}
}

// BenchmarkHandle aggregates 1 KiB packets of 32 workers (one message of 4
// slots each per round); Memcpy copies the same bytes, the baseline.
func BenchmarkHandle(b *testing.B) {
	r := newRig(b, MaxWorkers, SlotLarge)
	msgs := make([][]rocev2.Packet, MaxWorkers)
	for w := range msgs {
		msgs[w] = r.packets(w, 4, 0, 4, int32(w), 0)
	}
	var out []Reply
	b.SetBytes(MaxWorkers * 4 * SlotLarge)
	set := 0
	for b.Loop() {
		for w := range msgs {
			for k := range msgs[w] {
				p := &msgs[w][k]
				p.PSN = r.psn[w]
				r.psn[w] = (r.psn[w] + 1) & psnMask
				if k == 0 {
					p.RKey = uint32(2*4 + set)
				}
				out, _ = r.a.Handle(p, out[:0])
			}
		}
		set ^= 1
	}
	if r.a.Stats().Dropped != 0 {
		b.Fatalf("dropped: %+v", r.a.Stats())
	}
}

func BenchmarkMemcpy(b *testing.B) {
	src := make([]byte, MaxWorkers*4*SlotLarge)
	dst := make([]byte, len(src))
	b.SetBytes(int64(len(src)))
	for b.Loop() {
		copy(dst, src)
	}
}

// TestTwoJobsInterleaved: two jobs in one aggregator, their packets
// interleaved, each gets its own sums.
func TestTwoJobsInterleaved(t *testing.T) {
	r1 := newRig(t, 2, SlotSmall)
	r2 := &rig{t: t, a: r1.a, spec: Job{Base: 20, Slots: 4, SlotBytes: SlotLarge}}
	for w := range 3 {
		r2.spec.Workers = append(r2.spec.Workers, Worker{QPNs: []uint32{uint32(0x2000 + w)}, PSNs: []uint32{5}, RKey: uint32(0x6000 + w)})
		r2.psn = append(r2.psn, 5)
	}
	var err error
	if r2.job, r2.eps, err = r1.a.AddJob(r2.spec); err != nil {
		t.Fatal(err)
	}
	a := r1.packets(0, 4, 0, 2, 1, 0)
	b := r2.packets(0, 20, 1, 2, 100, 0)
	r1.send(append(a[:1:1], b[0]), nil)
	r1.send(append(r2.packets(1, 20, 1, 2, 200, 0), a[1]), nil)
	out := r1.send(append(r1.packets(1, 4, 0, 2, 2, 0), append(b[1:], r2.packets(2, 20, 1, 2, 300, 0)...)...), nil)
	var o1, o2 []Reply
	for _, rp := range out {
		if rp.Job == r1.job {
			o1 = append(o1, rp)
		} else {
			o2 = append(o2, rp)
		}
	}
	for w := range 2 {
		r1.checkReply(o1, w, 2, 3, 0)
	}
	for w := range 3 {
		r2.checkReply(o2, w, 2, 600, 0)
	}
}

// TestExponentOnly: a zero-length WRITE ONLY WITH IMMEDIATE holds its
// slot's set, adds nothing, and is answered by a zero-length write with the
// maximum exponents, to a retransmission too; the slot then goes on with
// its other set as usual. A zero-length write without immediate is refused.
func TestExponentOnly(t *testing.T) {
	r := newRig(t, 3, SlotSmall)
	empty := func(w, s int, imm uint32) []rocev2.Packet {
		ps := r.packets(w, 5, s, 1, 0, imm)
		ps[0].Payload, ps[0].DMALen = nil, 0
		return ps
	}
	imms := []uint32{0x01020304, 0x10000001, 0x00300002}
	var out []Reply
	for w := range 3 {
		out = append(out, r.send(empty(w, 0, imms[w]), nil)...)
	}
	if len(out) != 3 {
		t.Fatalf("%d replies, want 3", len(out))
	}
	for _, rp := range out {
		p := rp.Packet
		if p.Opcode != rocev2.WriteOnlyWithImm || len(p.Payload) != 0 || p.DMALen != 0 || p.Imm != 0x10300304 {
			t.Fatalf("reply %v, %d bytes, DMA length %d, immediate %#x; want an empty write with %#x", p.Opcode, len(p.Payload), p.DMALen, p.Imm, 0x10300304)
		}
	}
	// A retransmission gets the result again, to its sender alone.
	if again := r.send(empty(1, 0, imms[1]), nil); len(again) != 1 || again[0].Worker != 1 || again[0].Packet.Imm != 0x10300304 {
		t.Fatalf("retransmission answered with %+v", again)
	}
	// The slot's other set takes a data message; its sums hold no trace of
	// the exponent-only round.
	out = nil
	for w := range 3 {
		out = append(out, r.send(r.packets(w, 5, 1, 1, int32(w+1), 0), nil)...)
	}
	if len(out) != 3 || binary.LittleEndian.Uint32(out[0].Packet.Payload) != 6 {
		t.Fatalf("data round after the exponent-only one: %d replies", len(out))
	}
	// A zero-length write without immediate is refused.
	ps := r.packets(0, 5, 0, 1, 0, 0)
	ps[0].Opcode, ps[0].Payload, ps[0].DMALen = rocev2.WriteOnly, nil, 0
	r.send(ps, ErrSize)
}

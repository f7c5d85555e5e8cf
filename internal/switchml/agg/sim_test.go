package agg

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math/bits"
	"math/rand/v2"
	"testing"

	"github.com/gdrlink/gdrlink/internal/switchml/rocev2"
)

// The simulation: workers all-reduce a schedule of messages through the
// aggregator over a network that loses (and may duplicate) packets in both
// directions. Workers follow the protocol: channel c owns a group of slots,
// a message goes on channel i%C with set (i/C)%2, a worker sends message i
// only once it has the result of message i-C, and resends a message whole
// when its result has not come after a timeout. Packets go through
// rocev2.AppendFrame and ParseFrame on the way, as on the wire.

type simMsg struct {
	first, n, set int      // job-relative first slot, packets, set
	data          [][]byte // per worker, n*SlotBytes
	imm           []uint32 // per worker
}

type simWorker struct {
	id      int
	qpn     []uint32 // the worker's queue pairs
	spsn    []uint32 // next PSN each sends
	eps     []Endpoint
	rpsn    []uint32 // next PSN each expects from the aggregator
	ractive []bool
	rbuf    []*bytes.Buffer
	rimm    []uint32
	results map[int][]byte // message index -> result (+ imm in 4 bytes)
	sentAt  map[int]int    // message index -> tick of the last send
	next    int            // next message to send
}

type simNet struct {
	t      *testing.T
	r      *rand.Rand
	loss   float64
	dup    float64
	frames [][]byte
}

func (n *simNet) send(ip *rocev2.IPv4, p *rocev2.Packet) {
	f, err := rocev2.AppendFrame(nil, ip, p)
	if err != nil {
		n.t.Fatal(err)
	}
	if n.r.Float64() < n.loss {
		return
	}
	n.frames = append(n.frames, f)
	if n.r.Float64() < n.dup {
		n.frames = append(n.frames, f)
	}
}

func parse(t *testing.T, f []byte) rocev2.Packet {
	_, p, err := rocev2.ParseFrame(f)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

type simResult struct {
	results [][][]byte // per worker, per message
	stats   Stats
	errs    map[error]int
}

// simulate runs a schedule and returns every worker's results.
func simulate(t *testing.T, workers, channels, slotBytes int, msgs []simMsg, loss, dup float64, seed uint64) simResult {
	t.Helper()
	a := New(seed)
	spec := Job{Base: 10, Slots: 64, SlotBytes: slotBytes}
	r := rand.New(rand.NewPCG(seed, 99))
	for range workers {
		var wk Worker
		for range channels {
			wk.QPNs = append(wk.QPNs, r.Uint32()&psnMask)
			wk.PSNs = append(wk.PSNs, r.Uint32()&psnMask)
		}
		wk.RKey = r.Uint32()
		spec.Workers = append(spec.Workers, wk)
	}
	id, eps, err := a.AddJob(spec)
	if err != nil {
		t.Fatal(err)
	}
	ws := make([]*simWorker, workers)
	for w := range ws {
		ws[w] = &simWorker{id: w, qpn: spec.Workers[w].QPNs, spsn: append([]uint32(nil), spec.Workers[w].PSNs...), eps: eps[w],
			ractive: make([]bool, channels), rimm: make([]uint32, channels), results: map[int][]byte{}, sentAt: map[int]int{}}
		for c := range channels {
			ws[w].rpsn = append(ws[w].rpsn, eps[w][c].PSN)
			ws[w].rbuf = append(ws[w].rbuf, new(bytes.Buffer))
		}
	}
	up := &simNet{t: t, r: rand.New(rand.NewPCG(seed, 1)), loss: loss, dup: dup}
	down := &simNet{t: t, r: rand.New(rand.NewPCG(seed, 2)), loss: loss, dup: dup}
	ip := &rocev2.IPv4{TTL: 64, DontFragment: true, SrcPort: 0xc000}
	const timeout = 3
	errs := map[error]int{}
	sendMsg := func(wk *simWorker, i, tick int) {
		m := msgs[i]
		c := i % channels
		wk.sentAt[i] = tick
		for k := range m.n {
			p := rocev2.Packet{PKey: rocev2.DefaultPKey, DestQP: wk.eps[c].QPN, PSN: wk.spsn[c],
				Payload: m.data[wk.id][k*slotBytes : (k+1)*slotBytes]}
			wk.spsn[c] = (wk.spsn[c] + 1) & psnMask
			p.Opcode = rocev2.WriteWithImmOpcode(k, m.n)
			if k == 0 {
				p.VA = 0x7f0000000000 + uint64(c)<<20
				p.RKey = 0xab<<16 | uint32(2*(spec.Base+m.first)+m.set)
				p.DMALen = uint32(m.n * slotBytes)
			}
			if p.Opcode.HasImm() {
				p.Imm = m.imm[wk.id]
			}
			up.send(ip, &p)
		}
	}
	// receive is the worker's UC responder for the aggregator's replies.
	receive := func(wk *simWorker, p rocev2.Packet) {
		c := -1
		for i, q := range wk.qpn {
			if q == p.DestQP {
				c = i
			}
		}
		if c < 0 {
			t.Fatalf("reply to unknown QPN %#x", p.DestQP)
		}
		if p.Opcode.Starts() {
			wk.ractive[c] = true
			wk.rbuf[c].Reset()
			if p.RKey != spec.Workers[wk.id].RKey {
				t.Fatalf("reply rkey %#x, want %#x", p.RKey, spec.Workers[wk.id].RKey)
			}
		} else if !wk.ractive[c] || p.PSN != wk.rpsn[c] {
			wk.ractive[c] = false
			wk.rpsn[c] = (p.PSN + 1) & psnMask
			return
		}
		wk.rpsn[c] = (p.PSN + 1) & psnMask
		wk.rbuf[c].Write(p.Payload)
		if p.Opcode.Ends() {
			wk.ractive[c] = false
			// The reply is for the message outstanding on channel c;
			// with none outstanding, it is a second reply to a message
			// done (a retransmission crossed the result).
			i := -1
			for k := c; k < wk.next; k += channels {
				if _, ok := wk.results[k]; !ok {
					i = k
					break
				}
			}
			if i < 0 {
				return
			}
			res := binary.BigEndian.AppendUint32(bytes.Clone(wk.rbuf[c].Bytes()), p.Imm)
			if len(res) != msgs[i].n*slotBytes+4 {
				t.Fatalf("worker %d message %d: %d result bytes, want %d", wk.id, i, len(res)-4, msgs[i].n*slotBytes)
			}
			wk.results[i] = res
		}
	}
	var out []Reply
	for tick := 0; ; tick++ {
		if tick > 100000 {
			for _, wk := range ws {
				t.Logf("worker %d: next %d, %d results", wk.id, wk.next, len(wk.results))
			}
			for i, s := range a.jobs[id].sets {
				if s.used {
					t.Logf("set %d (slot %d set %d): %+v", i, i/2, i%2, s)
				}
			}
			t.Fatalf("no progress after %d ticks", tick)
		}
		done := true
		for _, wk := range ws {
			if len(wk.results) < len(msgs) {
				done = false
			}
			// Send what the window allows; resend what timed out.
			for i := range wk.next {
				if _, ok := wk.results[i]; !ok && tick-wk.sentAt[i] >= timeout {
					sendMsg(wk, i, tick)
				}
			}
			for wk.next < len(msgs) {
				if prev := wk.next - channels; prev >= 0 {
					if _, ok := wk.results[prev]; !ok {
						break
					}
				}
				sendMsg(wk, wk.next, tick)
				wk.next++
			}
		}
		if done {
			break
		}
		// Deliver: shuffle the workers' packets between queue pairs, as
		// a switch's ingress ports interleave them, keeping each queue
		// pair's order.
		frames := up.frames
		up.frames = nil
		for _, f := range interleave(r, frames) {
			p := parse(t, f)
			out = out[:0]
			out, err = a.Handle(&p, out)
			if err != nil {
				var key error
				for _, e := range []error{ErrPSN, ErrStale, ErrReuse, ErrSize, ErrPoolIndex, ErrUnknownQP} {
					if errors.Is(err, e) {
						key = e
					}
				}
				if key == nil || key == ErrReuse || key == ErrSize || key == ErrPoolIndex || key == ErrUnknownQP {
					t.Fatalf("packet dropped for a reason loss cannot explain: %v", err)
				}
				errs[key]++
			}
			for _, rp := range out {
				if rp.Job != id {
					t.Fatalf("reply for job %d", rp.Job)
				}
				down.send(ip, &rp.Packet)
				// Frame now: the payload aliases the slots.
			}
		}
		frames = down.frames
		down.frames = nil
		for _, f := range frames {
			p := parse(t, f)
			for _, wk := range ws {
				for _, q := range wk.qpn {
					if q == p.DestQP {
						receive(wk, p)
					}
				}
			}
		}
	}
	res := simResult{stats: a.Stats(), errs: errs}
	for _, wk := range ws {
		var rs [][]byte
		for i := range msgs {
			rs = append(rs, wk.results[i])
		}
		res.results = append(res.results, rs)
	}
	checkInvariants(t, a)
	return res
}

// interleave mixes frames of different destination queue pairs, keeping the
// order of each queue pair's frames.
func interleave(r *rand.Rand, frames [][]byte) [][]byte {
	byQP := map[uint32][][]byte{}
	var qps []uint32
	for _, f := range frames {
		q := binary.BigEndian.Uint32(f[rocev2.IPv4Len+rocev2.UDPLen+4:]) & psnMask
		if _, ok := byQP[q]; !ok {
			qps = append(qps, q)
		}
		byQP[q] = append(byQP[q], f)
	}
	var out [][]byte
	for len(out) < len(frames) {
		q := qps[r.IntN(len(qps))]
		if len(byQP[q]) > 0 {
			out = append(out, byQP[q][0])
			byQP[q] = byQP[q][1:]
		}
	}
	return out
}

// checkInvariants walks every set: the count is the bitmap's population, and
// a done set has every worker or had workers move on.
func checkInvariants(t *testing.T, a *Aggregator) {
	t.Helper()
	for _, j := range a.jobs {
		for i, s := range j.sets {
			if s.seen&^j.all != 0 {
				t.Fatalf("set %d: bitmap %#x beyond the workers %#x", i, s.seen, j.all)
			}
			if bits.OnesCount32(s.seen) > s.count {
				t.Fatalf("set %d: bitmap %#x with count %d", i, s.seen, s.count)
			}
			if !s.done && bits.OnesCount32(s.seen) != s.count {
				t.Fatalf("set %d not done: bitmap %#x with count %d", i, s.seen, s.count)
			}
		}
	}
}

// schedule makes count messages of the given sizes (cycling, two rounds each), on channels
// that each own maxN slots, with random significands and exponents.
func schedule(r *rand.Rand, workers, channels, slotBytes, count int, sizes []int) []simMsg {
	maxN := 0
	for _, n := range sizes {
		maxN = max(maxN, n)
	}
	msgs := make([]simMsg, count)
	for i := range msgs {
		c := i % channels
		// Every slot must alternate its sets: a size holds for two rounds
		// of a channel, set 0 then set 1.
		round := i / channels
		m := simMsg{first: c * maxN, n: sizes[(round/2)%len(sizes)], set: round % 2}
		for range workers {
			d := make([]byte, m.n*slotBytes)
			for k := 0; k < len(d); k += 4 {
				binary.LittleEndian.PutUint32(d[k:], uint32(int32(r.Uint32())>>6))
			}
			m.data = append(m.data, d)
			m.imm = append(m.imm, r.Uint32())
		}
		msgs[i] = m
	}
	return msgs
}

// expected is the exact int32 sum and the exponent maxima of a message.
func expected(m simMsg) []byte {
	out := make([]byte, len(m.data[0]))
	for _, d := range m.data {
		for k := 0; k < len(out); k += 4 {
			binary.LittleEndian.PutUint32(out[k:], binary.LittleEndian.Uint32(out[k:])+binary.LittleEndian.Uint32(d[k:]))
		}
	}
	var e [4]uint8
	for _, imm := range m.imm {
		e = maxExp(e, imm)
	}
	return append(out, e[:]...)
}

func TestSimulation(t *testing.T) {
	for _, c := range []struct {
		workers, channels, slotBytes, count int
		sizes                               []int
		loss, dup                           float64
	}{
		{2, 1, SlotSmall, 20, []int{1}, 0, 0},
		{3, 2, SlotLarge, 30, []int{3}, 0, 0},
		{4, 4, SlotSmall, 60, []int{1, 4, 2}, 0, 0},
		{32, 3, SlotSmall, 24, []int{2, 5}, 0, 0},
		{3, 2, SlotLarge, 40, []int{3}, 0.05, 0},
		{4, 4, SlotSmall, 80, []int{1, 4, 2}, 0.1, 0.02},
		{8, 2, SlotSmall, 40, []int{6}, 0.2, 0.05},
		{32, 3, SlotSmall, 24, []int{2, 5}, 0.02, 0.01},
	} {
		name := fmt.Sprintf("w%d-c%d-s%d-sizes%v-loss%g-dup%g", c.workers, c.channels, c.slotBytes, c.sizes, c.loss, c.dup)
		t.Run(name, func(t *testing.T) {
			r := rand.New(rand.NewPCG(uint64(c.workers), uint64(c.count)))
			msgs := schedule(r, c.workers, c.channels, c.slotBytes, c.count, c.sizes)
			lossless := simulate(t, c.workers, c.channels, c.slotBytes, msgs, 0, 0, 1)
			for seed := uint64(1); seed <= 3; seed++ {
				got := simulate(t, c.workers, c.channels, c.slotBytes, msgs, c.loss, c.dup, seed)
				for i, m := range msgs {
					want := expected(m)
					for w := range c.workers {
						if !bytes.Equal(got.results[w][i], want) || !bytes.Equal(lossless.results[w][i], want) {
							t.Fatalf("seed %d worker %d message %d: result differs from the exact sum", seed, w, i)
						}
					}
				}
				if c.loss > 0 && got.stats.Duplicates == 0 && got.stats.Resent == 0 {
					t.Errorf("seed %d: %v loss and no retransmission seen: %+v", seed, c.loss, got.stats)
				}
				if got.stats.Completed != uint64(len(msgs)) {
					t.Errorf("seed %d: %d messages completed, want %d", seed, got.stats.Completed, len(msgs))
				}
				t.Logf("seed %d: %+v drops %v", seed, got.stats, got.errs)
			}
		})
	}
}

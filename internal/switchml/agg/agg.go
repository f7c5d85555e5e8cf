// Package agg is the protocol core of a SwitchML aggregator over RoCEv2, as a
// pure state machine: RDMA WRITE packets of workers' unreliable-connected
// (UC) queue pairs go in, the packets of the replies come out. It owns no
// socket and no clock; a worker that gets no reply resends its whole message,
// and the core never applies a packet twice.
//
// # Requests
//
// A job is a set of up to 32 workers and a range of slots in the pool. A slot
// holds one packet: 256 or 1024 bytes (64 or 256 little-endian int32
// significands, the byte order of the workers' memory), chosen when the job
// is added; a queue pair's path MTU is the slot size, so every packet fills
// one slot. Each slot has two sets, so that one can be filled while the
// result of the other is still kept for workers that lost it.
//
// A worker sends a message as one RDMA WRITE (WITH IMMEDIATE, for blocks in
// floating point) on one of its queue pairs; each queue pair carries one
// outstanding message. The first packet's RETH names the message:
//
//   - the rkey's low 16 bits are the pool index p of the first slot (the
//     high 16 bits are not looked at): slot p>>1, set p&1; packet j of the
//     message goes to slot (p>>1)+j, same set;
//   - the virtual address is where the reply must be written (the same on
//     every worker);
//   - the DMA length is the message size, a whole number of slots; it may
//     change during a job but is the same on all workers for a pool index.
//
// A message of length zero (one WRITE ONLY WITH IMMEDIATE packet without
// payload) carries only exponents: it holds the set of its slot as a
// one-slot message would (bitmap, retransmissions, alternation), adds
// nothing, and is answered by a zero-length write whose immediate is the
// maximum of the exponents. Workers use it to agree on the exponents of
// their first blocks without sending a payload ahead of them.
//
// The immediate of the last packet holds up to 4 exponent bytes, one per
// block of the message (see package bfp); a write without immediate counts
// as exponents 0.
//
// # Aggregation
//
// Each set of each slot keeps the sum of the significands, a bitmap of the
// workers whose packet it holds and their count. A packet from a worker
// already in the bitmap is a retransmission and is not added again. A
// worker's first packet in a set clears the worker's bit in the slot's other
// set (the worker has its result, since it moved on). A set that is complete
// starts its next round when a worker whose bit was cleared writes to it,
// and only if the other set of the slot is complete too: a worker reuses a
// set only after it has the result of the other, which needs every worker's
// contribution to it, so every worker has the result of the round being
// overwritten.
//
// When every slot of a message has every worker, the core writes the sums
// back to every worker, on the queue pair each used, as an RDMA WRITE WITH
// IMMEDIATE to the address of the request and the rkey of the worker's
// result region; the immediate holds the maximum of each exponent byte over
// the workers. A retransmitted message that finds its result complete gets
// the result again, to that worker only, when its last packet arrives.
//
// # What workers must do
//
// The aggregator can tell a retransmission from a new round of a set only by
// the worker's bit, so workers keep these rules (SwitchML's):
//
//   - each slot alternates its sets: a worker writes set s of a slot again
//     only after it has written set 1-s of that slot since (a message covers
//     several slots with one set, so all of them must be due the same set;
//     with message sizes that change, a size that holds for two uses of its
//     slots, set 0 then set 1, keeps that true);
//   - a worker writes a slot's set only once it has the result of the
//     slot's previous use, so at most one message per queue pair is in
//     flight, and a message goes on the queue pair its retransmissions use;
//   - a worker resends a message whole, on the same queue pair, and takes
//     a completion on a queue pair as the result of the message in flight
//     on it.
//
// One hazard is left by the last rule, and the protocol as specified cannot
// remove it: if a worker's timeout fires just before the result arrives, its
// retransmission reaches the aggregator after completion and is answered
// with the result again; that second reply can arrive after the worker has
// sent its next message on the queue pair, and look like that message's
// result (the completion carries only the immediate and the length). The
// uplink cannot go wrong this way (a queue pair's packets stay in order, so
// the retransmission is handled before the next message), only this second
// reply. It is not rare: with a few per cent of packets lost, TestTwoProcesses
// in package aggsrv sees such second replies in every run, and took one for
// the next message's result before its workers drained them. A worker avoids
// it by waiting, after taking the result of a message it retransmitted, until
// the reply path has been quiet for a while, discarding what comes, before
// it takes another completion on that queue pair; receiving each set's
// replies on a queue pair of its own would make the reply name its set.
// Package worker's verbs transport instead names a result place of its
// own in every send (a resend included, whose second reply goes to the
// resend's address) and attributes each completion to the oldest place
// written since.
//
// # Queue pairs
//
// Each worker queue pair is paired with one of the aggregator's, which
// checks packet sequence numbers as a UC responder does: a packet that
// starts a message (FIRST, ONLY) begins it whatever its PSN, abandoning any
// message in progress; any other packet must carry the next PSN of the
// message in progress, or it and the rest of its message are dropped. One
// rule is stricter than a plain UC responder: a starting packet whose PSN is
// behind the next expected one (within half the 24-bit space) is a stale
// duplicate and is dropped, since a worker's resent message gets new PSNs.
// Dropped packets are returned as errors naming why, and counted.
package agg

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"

	"github.com/gdrlink/gdrlink/internal/switchml/rocev2"
)

// MaxWorkers is the largest number of workers in a job (the width of a
// slot's bitmap).
const MaxWorkers = 32

// Slot sizes in bytes.
const (
	SlotSmall = 256
	SlotLarge = 1024
)

// MaxPoolIndex is the largest pool index an rkey can name (16 bits).
const MaxPoolIndex = 1<<16 - 1

// Errors of the package: the reasons a packet is dropped or a job refused.
var (
	// ErrUnknownQP means a packet for a queue pair no job owns.
	ErrUnknownQP = errors.New("agg: unknown queue pair")
	// ErrPSN means a packet that does not carry the next PSN of a message
	// in progress (or came with none in progress): it and the rest of its
	// message are dropped.
	ErrPSN = errors.New("agg: PSN out of sequence")
	// ErrStale means a starting packet whose PSN is behind the expected one.
	ErrStale = errors.New("agg: stale starting packet")
	// ErrPoolIndex means a message outside its job's slots.
	ErrPoolIndex = errors.New("agg: pool index outside the job")
	// ErrSize means a message or packet size the job does not allow, or one
	// that differs from the other workers' for the same pool index.
	ErrSize = errors.New("agg: wrong size")
	// ErrReuse means a write to a set whose other set is not complete, or
	// to slots another message of the same set still fills.
	ErrReuse = errors.New("agg: set reused too early")
	// ErrJob means a job specification the aggregator cannot take.
	ErrJob = errors.New("agg: bad job")
)

// Worker describes one worker of a job.
type Worker struct {
	// QPNs are the worker's queue pair numbers, one per message it may
	// have outstanding.
	QPNs []uint32
	// PSNs are the PSNs each of those queue pairs sends its first packet
	// with.
	PSNs []uint32
	// RKey is the rkey of the worker's result region.
	RKey uint32
}

// Job describes a job: its slots and its workers.
type Job struct {
	// Base and Slots are the job's range of slots, [Base, Base+Slots): pool
	// indexes 2*Base to 2*(Base+Slots)-1.
	Base, Slots int
	// SlotBytes is SlotSmall or SlotLarge.
	SlotBytes int
	// Workers are the job's workers, in rank order.
	Workers []Worker
}

// Endpoint is what the aggregator answers for each worker queue pair: the
// queue pair paired with it and the PSN its replies start at.
type Endpoint struct {
	QPN uint32
	PSN uint32
}

// Reply is one packet the aggregator sends: to which job's which worker, and
// the packet (DestQP is the worker's queue pair). Its payload aliases the
// aggregator's slots: write it out before the next call to Handle.
type Reply struct {
	Job    int
	Worker int
	Packet rocev2.Packet
}

// Stats counts what the aggregator did with packets.
type Stats struct {
	Applied      uint64 // packets added into a slot
	Duplicates   uint64 // retransmitted packets not added again
	Resent       uint64 // results sent again to a worker that retransmitted
	Completed    uint64 // messages whose result went to every worker
	Dropped      uint64 // packets dropped (each returned an error)
	Abandoned    uint64 // messages a new start cut short
	ReplyPackets uint64 // packets in Handle's replies
}

// Aggregator holds the jobs and their state.
type Aggregator struct {
	jobs    map[int]*job
	qps     map[uint32]*qp
	nextJob int
	nextQPN uint32
	rng     *rand.Rand
	stats   Stats
}

// New returns an aggregator with no job. Its queue pairs' starting PSNs come
// from a generator seeded with seed.
func New(seed uint64) *Aggregator {
	return &Aggregator{
		jobs:    map[int]*job{},
		qps:     map[uint32]*qp{},
		nextQPN: 0x100,
		rng:     rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15)),
	}
}

// Stats returns the counters.
func (a *Aggregator) Stats() Stats { return a.stats }

type job struct {
	id   int
	spec Job
	all  uint32 // bitmap of every worker
	sets []set  // 2 per slot: slot i of the job, set s at 2*i+s
	sums []byte // SlotBytes per set, in the same order
	msgs []msg  // message state, kept at a message's first slot's set
	qps  []*qp  // every queue pair of the job
}

// set is one set of one slot.
type set struct {
	seen  uint32 // workers added this round
	count int
	done  bool  // every worker added; the sum is the result
	used  bool  // has had a round
	first int32 // slot (job-relative) of the message this round belongs to
}

// msg is the state of a message round, at its first slot's set.
type msg struct {
	n     int  // packets
	empty bool // an exponent-only message: one packet without payload
	done  int  // complete slots
	exp   [4]uint8
	va    [MaxWorkers]uint64
	reply [MaxWorkers]*qp
}

// qp is one aggregator queue pair, paired with one worker queue pair.
type qp struct {
	job    *job
	worker int
	peer   uint32 // the worker's QPN
	epsn   uint32 // next PSN expected from the worker
	spsn   uint32 // next PSN this queue pair sends
	active bool   // a message is in progress
	first  int    // its first slot (job-relative), set and size
	set    int
	n      int
	empty  bool // its message is exponent-only
	next   int  // index of its next packet
}

// AddJob adds a job and returns its id and, per worker and queue pair, the
// aggregator's queue pair and starting PSN.
func (a *Aggregator) AddJob(spec Job) (int, [][]Endpoint, error) {
	if err := a.checkJob(spec); err != nil {
		return 0, nil, err
	}
	j := &job{
		id:   a.nextJob,
		spec: spec,
		all:  uint32(1<<len(spec.Workers) - 1),
		sets: make([]set, 2*spec.Slots),
		sums: make([]byte, 2*spec.Slots*spec.SlotBytes),
		msgs: make([]msg, 2*spec.Slots),
	}
	if len(spec.Workers) == MaxWorkers {
		j.all = ^uint32(0)
	}
	a.nextJob++
	eps := make([][]Endpoint, len(spec.Workers))
	for w, wk := range spec.Workers {
		for i, peer := range wk.QPNs {
			q := &qp{job: j, worker: w, peer: peer, epsn: wk.PSNs[i] & psnMask, spsn: a.rng.Uint32() & psnMask}
			n := a.nextQPN
			a.nextQPN = (a.nextQPN + 1) & psnMask
			a.qps[n] = q
			j.qps = append(j.qps, q)
			eps[w] = append(eps[w], Endpoint{QPN: n, PSN: q.spsn})
		}
	}
	a.jobs[j.id] = j
	return j.id, eps, nil
}

const psnMask = 1<<24 - 1

func (a *Aggregator) checkJob(spec Job) error {
	switch {
	case len(spec.Workers) < 1 || len(spec.Workers) > MaxWorkers:
		return fmt.Errorf("%w: %d workers, want 1..%d", ErrJob, len(spec.Workers), MaxWorkers)
	case spec.SlotBytes != SlotSmall && spec.SlotBytes != SlotLarge:
		return fmt.Errorf("%w: slot of %d bytes, want %d or %d", ErrJob, spec.SlotBytes, SlotSmall, SlotLarge)
	case spec.Base < 0 || spec.Slots < 1 || 2*(spec.Base+spec.Slots)-1 > MaxPoolIndex:
		return fmt.Errorf("%w: slots [%d, %d) beyond pool indexes 0..%d", ErrJob, spec.Base, spec.Base+spec.Slots, MaxPoolIndex)
	}
	for _, o := range a.jobs {
		if spec.Base < o.spec.Base+o.spec.Slots && o.spec.Base < spec.Base+spec.Slots {
			return fmt.Errorf("%w: slots [%d, %d) overlap job %d's [%d, %d)", ErrJob, spec.Base, spec.Base+spec.Slots, o.id, o.spec.Base, o.spec.Base+o.spec.Slots)
		}
	}
	nqp := 0
	for w, wk := range spec.Workers {
		if len(wk.QPNs) == 0 || len(wk.QPNs) != len(wk.PSNs) {
			return fmt.Errorf("%w: worker %d has %d queue pairs and %d PSNs", ErrJob, w, len(wk.QPNs), len(wk.PSNs))
		}
		nqp += len(wk.QPNs)
	}
	if len(a.qps)+nqp > 1<<23 {
		return fmt.Errorf("%w: %d queue pairs more than the aggregator can number", ErrJob, nqp)
	}
	return nil
}

// RemoveJob forgets a job and its queue pairs.
func (a *Aggregator) RemoveJob(id int) {
	j, ok := a.jobs[id]
	if !ok {
		return
	}
	for n, q := range a.qps {
		if q.job == j {
			delete(a.qps, n)
		}
	}
	delete(a.jobs, id)
}

// Handle takes one packet received from a worker and appends the reply
// packets it causes to out. A dropped packet gives an error wrapping one of
// the package's errors (and no reply); a duplicate is not an error.
func (a *Aggregator) Handle(p *rocev2.Packet, out []Reply) ([]Reply, error) {
	q := a.qps[p.DestQP]
	if q == nil {
		a.stats.Dropped++
		return out, fmt.Errorf("%w: %#x", ErrUnknownQP, p.DestQP)
	}
	out, err := a.handle(q, p, out)
	if err != nil {
		a.stats.Dropped++
	}
	return out, err
}

func (a *Aggregator) handle(q *qp, p *rocev2.Packet, out []Reply) ([]Reply, error) {
	j := q.job
	sb := j.spec.SlotBytes
	if p.Opcode.Starts() {
		if d := (q.epsn - p.PSN) & psnMask; d != 0 && d < 1<<23 {
			return out, fmt.Errorf("%w: PSN %#x, expected %#x", ErrStale, p.PSN, q.epsn)
		}
		if q.active {
			a.stats.Abandoned++
		}
		q.active = false
		q.epsn = (p.PSN + 1) & psnMask
		idx := int(p.RKey & MaxPoolIndex)
		first, s := idx>>1-j.spec.Base, idx&1
		n := int(p.DMALen) / sb
		empty := p.DMALen == 0 && p.Opcode == rocev2.WriteOnlyWithImm
		if empty {
			n = 1
		}
		switch {
		case !empty && (int(p.DMALen)%sb != 0 || n < 1 || (p.Opcode == rocev2.WriteFirst) != (n > 1)):
			return out, fmt.Errorf("%w: %v of %d bytes with %d-byte slots", ErrSize, p.Opcode, p.DMALen, sb)
		case first < 0 || first+n > j.spec.Slots:
			return out, fmt.Errorf("%w: pool index %d, %d slots, job has slots [%d, %d)", ErrPoolIndex, idx, n, j.spec.Base, j.spec.Base+j.spec.Slots)
		}
		q.active, q.first, q.set, q.n, q.empty, q.next = true, first, s, n, empty, 0
	} else {
		if !q.active || p.PSN != q.epsn {
			was := q.active
			q.active = false
			return out, fmt.Errorf("%w: PSN %#x, expected %#x (message in progress: %v)", ErrPSN, p.PSN, q.epsn, was)
		}
		q.epsn = (q.epsn + 1) & psnMask
	}
	k := q.next
	q.next++
	last := k == q.n-1
	want := sb
	if q.empty {
		want = 0
	}
	if p.Opcode.Ends() != last || len(p.Payload) != want {
		q.active = false
		return out, fmt.Errorf("%w: %v with %d bytes as packet %d of %d (%d-byte slots)", ErrSize, p.Opcode, len(p.Payload), k, q.n, sb)
	}
	if last {
		q.active = false
	}
	return a.apply(q, p, k, last, out)
}

// apply adds packet k of q's message, once.
func (a *Aggregator) apply(q *qp, p *rocev2.Packet, k int, last bool, out []Reply) ([]Reply, error) {
	j := q.job
	sb := j.spec.SlotBytes
	slot := q.first + k
	si := 2*slot + q.set
	st := &j.sets[si]
	other := &j.sets[si^1]
	mi := 2*q.first + q.set
	m := &j.msgs[mi]
	bit := uint32(1) << q.worker

	if st.seen&bit != 0 {
		// A retransmission.
		if st.first != int32(q.first) || m.n != q.n || m.empty != q.empty {
			return out, fmt.Errorf("%w: pool index %d holds a message of %d slots, this one has %d", ErrSize, 2*(j.spec.Base+q.first)+q.set, m.n, q.n)
		}
		a.stats.Duplicates++
		if k == 0 {
			m.reply[q.worker] = q
			m.va[q.worker] = p.VA
		}
		if last {
			m.exp = maxExp(m.exp, p.Imm)
			if m.done == m.n {
				a.stats.Resent++
				return a.reply(j, q.first, q.set, q.worker, out), nil
			}
		}
		return out, nil
	}
	if st.done || !st.used {
		// The first packet of a new round of this set.
		if other.used && !other.done {
			return out, fmt.Errorf("%w: slot %d set %d while set %d has %d of %d workers", ErrReuse, j.spec.Base+slot, q.set, q.set^1, other.count, len(j.spec.Workers))
		}
		if k == 0 {
			*m = msg{n: q.n, empty: q.empty}
		}
		if m.n != q.n || m.empty != q.empty {
			return out, fmt.Errorf("%w: pool index %d holds a message of %d slots, this one has %d", ErrSize, 2*(j.spec.Base+q.first)+q.set, m.n, q.n)
		}
		*st = set{used: true, first: int32(q.first)}
		clear(j.sums[si*sb : (si+1)*sb])
	} else if st.first != int32(q.first) || m.n != q.n || m.empty != q.empty {
		if st.first != int32(q.first) {
			return out, fmt.Errorf("%w: slot %d set %d is filled by the message at slot %d", ErrReuse, j.spec.Base+slot, q.set, j.spec.Base+int(st.first))
		}
		return out, fmt.Errorf("%w: pool index %d holds a message of %d slots, this one has %d", ErrSize, 2*(j.spec.Base+q.first)+q.set, m.n, q.n)
	}

	if !q.empty {
		sum := j.sums[si*sb : (si+1)*sb]
		for i := 0; i < sb; i += 4 {
			binary.LittleEndian.PutUint32(sum[i:], binary.LittleEndian.Uint32(sum[i:])+binary.LittleEndian.Uint32(p.Payload[i:]))
		}
	}
	st.seen |= bit
	st.count++
	other.seen &^= bit
	a.stats.Applied++
	if k == 0 {
		m.reply[q.worker] = q
		m.va[q.worker] = p.VA
	}
	if last {
		m.exp = maxExp(m.exp, p.Imm)
	}
	if st.seen != j.all {
		return out, nil
	}
	st.done = true
	m.done++
	if m.done < m.n {
		return out, nil
	}
	a.stats.Completed++
	for w := range j.spec.Workers {
		out = a.reply(j, q.first, q.set, w, out)
	}
	return out, nil
}

// reply appends the result of the message at (first, s) for worker w.
func (a *Aggregator) reply(j *job, first, s, w int, out []Reply) []Reply {
	m := &j.msgs[2*first+s]
	q := m.reply[w]
	sb := j.spec.SlotBytes
	imm := uint32(m.exp[0])<<24 | uint32(m.exp[1])<<16 | uint32(m.exp[2])<<8 | uint32(m.exp[3])
	for k := range m.n {
		si := 2*(first+k) + s
		p := rocev2.Packet{
			PKey:    rocev2.DefaultPKey,
			DestQP:  q.peer,
			PSN:     q.spsn,
			Payload: j.sums[si*sb : (si+1)*sb],
		}
		q.spsn = (q.spsn + 1) & psnMask
		p.Opcode = rocev2.WriteWithImmOpcode(k, m.n)
		if k == 0 {
			p.VA, p.RKey, p.DMALen = m.va[w], j.spec.Workers[w].RKey, uint32(m.n*sb)
		}
		if m.empty {
			p.Payload, p.DMALen = nil, 0
		}
		if p.Opcode.HasImm() {
			p.Imm = imm
		}
		out = append(out, Reply{Job: j.id, Worker: w, Packet: p})
		a.stats.ReplyPackets++
	}
	return out
}

// maxExp takes the maximum of each exponent byte; byte 0 of the array is
// the immediate's most significant byte.
func maxExp(e [4]uint8, imm uint32) [4]uint8 {
	for i := range e {
		e[i] = max(e[i], uint8(imm>>(24-8*i)))
	}
	return e
}

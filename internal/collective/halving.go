package collective

import (
	"context"
	"math/bits"
)

// The halving AllReduce: on a power-of-two number of ranks (4 or more),
// a tensor that the ring would not cut into segments (one lane) is
// reduced by recursive halving and gathered by recursive doubling, in
// 2·log2(Size) steps where the ring takes 2(Size-1), with the same bytes
// on the wire per rank, 2(Size-1)/Size of the tensor. Each step is an
// exchange with one partner, rank ^ d for a distance d: the
// reduce-scatter's distances go Size/2, Size/4, …, 1, each step sending
// the partner the half of this rank's block of chunks that holds the
// partner's chunk and adding the partner's copy of the other half in;
// after it rank r holds chunk r summed over every rank. The all-gather
// retraces the distances, 1, 2, …, Size/2, each step sending the block
// this rank holds final and receiving the partner's into place.
//
// Where a step costs more than its bytes (a host with more ranks than
// cores, where every step waits for the partner to get a core), fewer
// steps is what counts: 6 instead of 14 on 8 ranks.
//
// The order of additions is fixed per element, so every rank gets the
// same bits and a call gives the same bits every time: chunk c's sum is
// the tree the steps make (at distance d, the partial sums over two
// blocks of ranks that differ in bit d are added), whatever the timing;
// the all-gather copies rank c's bits, unchanged, to every other rank.

// setHalving decides whether the call's AllReduce goes by halving
// (x.lanes set already) and, if so, sets its steps and partners.
func (x *run) setHalving() {
	if x.n < 4 || x.n&(x.n-1) != 0 || x.lanes != 1 {
		return
	}
	m := bits.Len(uint(x.n)) - 1
	x.halving = true
	x.steps = 2 * m
	x.peers = make([]int, x.steps)
	for s := range m {
		x.peers[s] = x.rank ^ (x.n >> (s + 1))
		x.peers[2*m-1-s] = x.peers[s]
	}
}

// distance is step s's distance: n/2, …, 1 for the reduce-scatter, then
// 1, …, n/2 for the all-gather.
func (x *run) distance(s int) int {
	m := x.steps / 2
	if s < m {
		return x.n >> (s + 1)
	}
	return x.n >> (2*m - s)
}

// chunkRange is the span of chunks [lo, lo+d).
func (x *run) chunkRange(lo, d int) span {
	a, b := x.chunks[lo], x.chunks[lo+d-1]
	return span{a.off, b.off + b.n - a.off}
}

// firstStepWith is the first step whose partner is step s's (halving's
// all-gather retraces its reduce-scatter's partners).
func (x *run) firstStepWith(s int) int {
	for t := range s {
		if x.peers[t] == x.peers[s] {
			return t
		}
	}
	return s
}

// connectPartners gets the link to every step's partner, once per
// partner.
func (x *run) connectPartners(ctx context.Context) error {
	x.links = make([]Link, x.steps)
	for s := range x.steps {
		if t := x.firstStepWith(s); t < s {
			x.links[s] = x.links[t]
			continue
		}
		l, err := x.r.tr.Link(ctx, x.peers[s])
		if err != nil {
			return x.linkFailed(ctx, x.peers[s], err)
		}
		x.links[s] = l
	}
	return nil
}

// tellPartners tells every step's partner, each of which may wait for
// this rank's piece, that this rank's call failed with err before it
// began (those whose link is there within ctx).
func (x *run) tellPartners(ctx context.Context, err error) {
	for s := range x.steps {
		if x.firstStepWith(s) < s {
			continue
		}
		l, lerr := x.r.tr.Link(ctx, x.peers[s])
		if lerr != nil {
			continue
		}
		for t := s; t < x.steps; t++ {
			if x.peers[t] == x.peers[s] {
				_ = l.SendError(x.key(0), x.step(t), abortText(x.rank, err))
			}
		}
	}
}

// partnerLinks are the links to the partners, one per partner.
func (x *run) partnerLinks() []Link {
	var ls []Link
	for s, l := range x.links {
		if x.firstStepWith(s) == s {
			ls = append(ls, l)
		}
	}
	return ls
}

// abortPartners closes the links to the partners, dropping the sends
// that none of them asked for.
func (x *run) abortPartners() {
	for _, l := range x.partnerLinks() {
		_ = l.Abort()
	}
}

// halvingLane runs the halving AllReduce (it has one lane, k).
func (x *run) halvingLane(k int) error {
	n, r, m := x.n, x.rank, x.steps/2
	rsSent := make([]<-chan error, m)
	// lo is the first chunk of the block this rank holds: 2d chunks
	// before a reduce-scatter step of distance d, d before an all-gather
	// step's.
	lo := 0
	cur := x.recvFrom(x.links[0], x.peers[0], k, 0, span{})
	for s := range x.steps {
		d := x.distance(s)
		var give, want span
		// wantLo is the first chunk of want; nextLo the first of the
		// block this rank holds after the step.
		var wantLo, nextLo int
		if s < m {
			// Keep the half of the block [lo, lo+2d) that holds chunk
			// r; give the partner the other.
			keepLo, giveLo := lo, lo+d
			if r&d != 0 {
				keepLo, giveLo = lo+d, lo
			}
			for c := giveLo; c < giveLo+d; c++ {
				if err := x.ready(c, k); err != nil {
					x.drain(k, cur)
					return err
				}
			}
			give, want, wantLo = x.chunkRange(giveLo, d), x.chunkRange(keepLo, d), keepLo
			nextLo = keepLo
		} else {
			if s == m {
				// This rank's own chunk is final (divided by its last
				// addition, for Average).
				if err := x.store(r, k); err != nil {
					x.drain(k, cur)
					return err
				}
			}
			give, want, wantLo = x.chunkRange(lo, d), x.chunkRange(lo^d, d), lo^d
			nextLo = min(lo, wantLo)
		}
		done, err := x.sendTo(x.links[s], x.peers[s], k, s, give)
		if err != nil {
			x.drain(k, cur)
			return err
		}
		if s < m {
			rsSent[s] = done
		}
		var nxt chan result
		switch {
		case s+1 >= x.steps:
		case s+1 < m:
			nxt = x.recvFrom(x.links[s+1], x.peers[s+1], k, s+1, span{})
		default:
			// An all-gather step: the partner's block lands in place.
			nd := x.distance(s + 1)
			nxt = x.recvFrom(x.links[s+1], x.peers[s+1], k, s+1, x.chunkRange(nextLo^nd, nd))
		}
		got, err := x.takeFrom(x.peers[s], k, cur, want)
		if err != nil {
			x.drain(k, nxt)
			return err
		}
		in, _ := got.Bytes()
		if s < m {
			for c := wantLo; c < wantLo+d; c++ {
				if err := x.ready(c, k); err != nil {
					_ = got.Release()
					x.drain(k, nxt)
					return err
				}
			}
			if x.avg && s == m-1 {
				// The last addition into this rank's own chunk: divide
				// the sums as they are made.
				x.kern.addDiv(x.bytes(want), in, n)
			} else {
				x.kern.add(x.bytes(want), in)
			}
		} else {
			// The bytes overwritten went to the partner in the
			// reduce-scatter step of the same distance; its completion
			// says they have left.
			x.links[s].ConfirmNow()
			if err := x.awaitSent(k, rsSent[2*m-1-s]); err != nil {
				_ = got.Release()
				x.drain(k, nxt)
				return x.linkErr(x.peers[s], err)
			}
			x.place(want, got)
			for c := wantLo; c < wantLo+d; c++ {
				if err := x.store(c, k); err != nil {
					_ = got.Release()
					x.drain(k, nxt)
					return err
				}
			}
		}
		_ = got.Release()
		lo, cur = nextLo, nxt
	}
	return nil
}

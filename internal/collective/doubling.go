package collective

import "math/bits"

// The doubling AllReduce: on a power-of-two number of ranks, a tensor of
// at most the Ring's doubling bound (WithDoublingMax) in one lane is
// reduced in log2(Size) steps where halving takes twice as many and the
// ring 2(Size-1): each step an exchange of the whole tensor with one
// partner, rank ^ d, at distances Size/2, Size/4, …, 1, adding the
// partner's copy in. A step's cost is mostly its hand-offs while the
// tensor is small (every step waits for the partner, and on a host with
// more ranks than cores for the partner to get a core), so half the
// steps is what counts there; it puts log2(Size) times the tensor on the
// wire per rank, against 2(Size-1)/Size, and adds the whole tensor each
// step, which is why it stops at a bound.
//
// Every rank gets the same bits, and the same bits as halving and the
// ring would: at distance d both partners add the same two partial sums
// (in either order, which is the same float), so element i's sum is the
// tree halving makes, over blocks of ranks that differ in bit d, in the
// same order of distances; with two ranks that is the ring's one
// addition.

// defaultDoublingMax is the largest tensor the doubling AllReduce takes
// by default.
const defaultDoublingMax = 128 << 10

// WithDoublingMax sets the largest tensor, in bytes, that an AllReduce
// on a power-of-two number of ranks reduces by recursive doubling
// (default 128 KiB); 0 or less turns it off.
func WithDoublingMax(n int64) RingOption {
	return func(r *Ring) { r.doublingMax = n }
}

// setDoubling decides whether the call's AllReduce goes by doubling
// (x.lanes set already) and, if so, sets its steps and partners.
func (x *run) setDoubling() {
	size := int64(len(x.data))
	if x.n < 2 || x.n&(x.n-1) != 0 || x.lanes != 1 || size == 0 || size > x.r.doublingMax {
		return
	}
	x.halving, x.doubling = true, true
	x.steps = bits.Len(uint(x.n)) - 1
	x.peers = make([]int, x.steps)
	for s := range x.steps {
		x.peers[s] = x.rank ^ (x.n >> (s + 1))
	}
}

// doublingLane runs the doubling AllReduce (it has one lane, k).
func (x *run) doublingLane(k int) error {
	whole := span{0, x.elems()}
	for c := range x.n {
		if err := x.ready(c, k); err != nil {
			return err
		}
	}
	cur := x.recvFrom(x.links[0], x.peers[0], k, 0, span{})
	for s := range x.steps {
		done, err := x.sendTo(x.links[s], x.peers[s], k, s, whole)
		if err != nil {
			x.drain(k, cur)
			return err
		}
		var nxt chan result
		if s+1 < x.steps {
			nxt = x.recvFrom(x.links[s+1], x.peers[s+1], k, s+1, span{})
		}
		got, err := x.takeFrom(x.peers[s], k, cur, whole)
		if err != nil {
			x.drain(k, nxt)
			return err
		}
		// The sum goes where the piece sent came from: it must have left,
		// which the partner confirms as this rank does for its piece.
		x.links[s].ConfirmNow()
		if err := x.awaitSent(k, done); err != nil {
			_ = got.Release()
			x.drain(k, nxt)
			return x.linkErr(x.peers[s], err)
		}
		in, _ := got.Bytes()
		if x.avg && s == x.steps-1 {
			x.kern.addDiv(x.data, in, x.n)
		} else {
			x.kern.add(x.data, in)
		}
		_ = got.Release()
		cur = nxt
	}
	for c := range x.n {
		if err := x.store(c, k); err != nil {
			return err
		}
	}
	return nil
}

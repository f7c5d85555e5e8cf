package rendezvous

import (
	"fmt"

	"github.com/gdrlink/gdrlink/internal/wire"
	"github.com/gdrlink/gdrlink/verbsio"
)

// railConfig is an extra device of a channel, as WithRail gives it.
type railConfig struct {
	Device verbsio.Device
	PD     verbsio.ProtectionDomain
	Memory Memory
}

// WithRail adds an extra rail to the channel: a device dev, a protection
// domain pd on it, and mem, which finds the regions registered with pd of
// the same pools as the channel's Memory (a second memory-registration
// visitor on each pool). Large writes are striped over the channel's own
// queue pair and one queue pair per rail, so hosts with several NICs (or
// several paths between two hosts) use them all; writes of 4 MiB or more
// are striped, as below that one queue pair is faster than coordinating
// several. Give it once per rail, at most wire.MaxRailKeys times; the peers
// use as many rails as both have.
func WithRail(dev verbsio.Device, pd verbsio.ProtectionDomain, mem Memory) Option {
	return func(o *options) error {
		if len(o.rails)+1 > wire.MaxRailKeys {
			return fmt.Errorf("%w: %d rails, at most %d", ErrBadOption, len(o.rails)+1, wire.MaxRailKeys)
		}
		if dev == nil || pd == nil || mem == nil {
			return fmt.Errorf("%w: rail %d lacks a device, protection domain or memory", ErrBadOption, len(o.rails)+1)
		}
		o.rails = append(o.rails, railConfig{Device: dev, PD: pd, Memory: mem})
		return nil
	}
}

// rail is an extra rail's queue pair and completion queue.
type rail struct {
	railConfig
	name  string
	cq    verbsio.CompletionQueue
	qp    verbsio.QueuePair
	sqOut int
	done  chan struct{}
}

func (c *Channel) setupRails() error {
	for i, r := range c.opts.rails {
		rl := &rail{railConfig: r, name: r.Device.Info().Name, done: make(chan struct{})}
		c.rails = append(c.rails, rl)
		var err error
		if rl.cq, err = r.Device.CreateCQ(c.sqMax); err != nil {
			return fmt.Errorf("rendezvous: rail %d completion queue: %w", i+1, err)
		}
		if rl.qp, err = r.PD.CreateQP(verbsio.QPConfig{SendCQ: rl.cq, RecvCQ: rl.cq, MaxSendWR: c.sqMax, MaxRecvWR: 1, MaxSGE: 1}); err != nil {
			return fmt.Errorf("rendezvous: rail %d queue pair: %w", i+1, err)
		}
	}
	return nil
}

// railKeys fills m's rail keys for a result buffer at addr, n bytes, when
// the channel has rails and the buffer is large enough to stripe.
func (c *Channel) railKeys(m *wire.Message, addr uintptr, n int) {
	m.NumRailKeys = 0
	if c.active == 0 || int64(n) < c.opts.stripeMin {
		return
	}
	for i := 0; i < c.active; i++ {
		mr, ok := c.rails[i].Memory.Region(addr, n)
		if !ok {
			m.NumRailKeys = 0
			return
		}
		m.RailKeys[i] = mr.RKey()
	}
	m.NumRailKeys = uint8(c.active)
}

// stripeLocked posts the part of e's write that goes over the rails and
// reports whether it did. The rest (chunk 0, with the immediate) is posted
// on the channel's queue pair once every rail's part has completed, so the
// immediate still means "all bytes landed".
func (s *sender) stripeLocked(e *sendEntry) bool {
	c := s.c
	k := min(len(e.railKeys), c.active)
	if k == 0 || e.n < c.opts.stripeMin {
		return false
	}
	parts := int64(k + 1)
	chunk := (e.n + parts - 1) / parts
	chunk = (chunk + 4095) &^ 4095
	if chunk >= e.n {
		return false
	}
	type post struct {
		rl  *rail
		wrs []verbsio.SendWR
	}
	var posts []post
	seq := s.nextWrite
	s.nextWrite++
	for i := 0; i < k; i++ {
		lo := chunk * int64(i+1)
		if lo >= e.n {
			break
		}
		hi := min(e.n, lo+chunk)
		rl := c.rails[i]
		mr, ok := rl.Memory.Region(e.addr, int(e.n))
		if !ok {
			return false
		}
		maxMsg := int64(1 << 30)
		if mm := rl.Device.Caps().MaxMessage; mm > 0 && mm < maxMsg {
			maxMsg = mm
		}
		var wrs []verbsio.SendWR
		for off := lo; off < hi; off += maxMsg {
			l := min(maxMsg, hi-off)
			wrs = append(wrs, verbsio.SendWR{
				WRID: wridWrite | seq<<8, Op: verbsio.OpWrite, Signaled: true,
				SG:         []verbsio.SGE{{Addr: e.addr + uintptr(off), Length: uint32(l), LKey: mr.LKey()}},
				RemoteAddr: e.raddr + uint64(off), RKey: e.railKeys[i],
			})
		}
		if rl.sqOut+len(wrs) > c.sqMax {
			return false
		}
		posts = append(posts, post{rl, wrs})
	}
	e.railPending = 0
	s.striping[seq] = e
	for _, p := range posts {
		if err := p.rl.qp.PostSend(p.wrs); err != nil {
			var ds deliveries
			c.failLocked(c.peerLost(fmt.Errorf("rail %s: %w", p.rl.name, err)), &ds, stateFailed)
			c.runAsync(ds)
			return true
		}
		p.rl.sqOut += len(p.wrs)
		e.railPending += len(p.wrs)
	}
	e.firstChunk = chunk
	s.stats.striped.Add(1)
	return true
}

// pollRail collects the completions of one rail's writes.
func (c *Channel) pollRail(rl *rail) {
	defer close(rl.done)
	comps := make([]verbsio.Completion, 32)
	for {
		n, err := rl.cq.Wait(c.ctx, comps)
		if err != nil {
			if c.ctx.Err() != nil {
				return
			}
			var ds deliveries
			c.mu.Lock()
			c.failLocked(c.peerLost(fmt.Errorf("rail %s: %w", rl.name, err)), &ds, stateFailed)
			c.mu.Unlock()
			ds.run()
			return
		}
		var ds deliveries
		c.mu.Lock()
		for _, wc := range comps[:n] {
			rl.sqOut--
			if wc.Status != verbsio.StatusSuccess {
				c.failLocked(c.peerLost(fmt.Errorf("rail %s: %s %s: %w", rl.name, wc.Op, wc.Status, wc.Status.Err())), &ds, stateFailed)
				continue
			}
			c.snd.railPartDoneLocked((wc.WRID &^ wridKind) >> 8)
		}
		c.flushLocked()
		c.mu.Unlock()
		ds.run()
	}
}

// railPartDoneLocked counts one completed rail work request of write seq;
// once all of them are in, the rest of the write (with the immediate) is
// queued for the channel's own queue pair.
func (s *sender) railPartDoneLocked(seq uint64) {
	e, ok := s.striping[seq]
	if !ok {
		return
	}
	if e.railPending--; e.railPending == 0 {
		delete(s.striping, seq)
		if s.c.state == stateConnected {
			s.c.pushLocked(outItem{write: e})
		}
	}
}

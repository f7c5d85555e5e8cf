package main

import (
	"context"
	"fmt"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

// The copy-through-buffer baseline is TensorFlow's original verbs transport:
// each side has one fixed registered buffer; the sender copies the tensor
// into its buffer and RDMA-writes it into the receiver's, and the receiver
// copies it out into the result tensor. The same raw queue pair, without the
// copies, measures the provider's raw write latency: a small SEND asks, a
// write with immediate answers.
//
// Both are the fastest honest way to do this on a bare queue pair, so that
// they are baselines worth beating: neither side waits for the completion
// of its own SEND or write before going on (the tensor protocol does not
// either: its REQUEST's completion and its write's come to the channel's
// completion goroutine while the Recv is already answered). Every
// rawSignalEvery-th work request asks for a completion, and the side waits
// for one only when rawMaxSignaled are outstanding, so the send queue never
// fills. The one exception is the copy-through-buffer sender, which must not
// overwrite its buffer while the write before still reads it: it signals
// every write and waits for the previous one's completion before its copy
// (on a provider that completes writes as it posts them, that completion
// is already there).

// rawPair is a bare queue pair with one fixed registered buffer per side.
type rawPair struct {
	cq    verbsio.CompletionQueue
	qp    verbsio.QueuePair
	buf   alloc.Block // the fixed buffer: written into by the peer, written from here
	ctl   alloc.Block // SEND source and receive slots
	bufMR verbsio.MemoryRegion
	ctlMR verbsio.MemoryRegion
	// bufKey is the rkey the peer writes buf with: the region's, or a
	// grant's where the provider grants.
	bufKey uint32
	comps  []verbsio.Completion
	recvs  int // receive completions not yet consumed
	sends  int // send completions not yet consumed
	// posted counts the work requests posted on the send queue; signaled
	// those that asked for a completion not yet consumed.
	posted, signaled int

	remoteAddr uint64
	remoteKey  uint32
}

const (
	rawSlots    = 32
	rawSlotSize = 64
	// rawSignalEvery: one work request in so many asks for a completion;
	// rawMaxSignaled: at most so many of those are outstanding (so at most
	// rawSignalEvery*rawMaxSignaled work requests are, within rawSlots).
	rawSignalEvery = 8
	rawMaxSignaled = 2
)

// rawInfo is what a side tells the other about its raw pair.
type rawInfo struct {
	Provider, Host string
	Data           []byte
	Addr           uint64
	RKey           uint32
}

func newRawPair(dev verbsio.Device, pd verbsio.ProtectionDomain, pool *alloc.Pool, regionOf func(*alloc.Arena) (verbsio.MemoryRegion, bool), size int) (*rawPair, error) {
	r := &rawPair{comps: make([]verbsio.Completion, 16)}
	var err error
	if r.cq, err = dev.CreateCQ(4 * rawSlots); err != nil {
		return r, err
	}
	if r.qp, err = pd.CreateQP(verbsio.QPConfig{SendCQ: r.cq, RecvCQ: r.cq, MaxSendWR: rawSlots, MaxRecvWR: rawSlots, MaxSGE: 1}); err != nil {
		return r, err
	}
	if r.buf, err = pool.Alloc(size); err != nil {
		return r, err
	}
	if r.ctl, err = pool.Alloc(rawSlots * rawSlotSize); err != nil {
		return r, err
	}
	for _, b := range []struct {
		blk alloc.Block
		mr  *verbsio.MemoryRegion
	}{{r.buf, &r.bufMR}, {r.ctl, &r.ctlMR}} {
		a, ok := pool.ArenaOf(b.blk.Addr())
		if !ok {
			return r, fmt.Errorf("raw pair: block at %#x has no arena", b.blk.Addr())
		}
		if *b.mr, ok = regionOf(a); !ok {
			return r, fmt.Errorf("raw pair: %v is not registered", a)
		}
	}
	// Where the provider grants, a region whose buffers went to the tensor
	// path as grants no longer admits its own rkey: the raw pair then
	// writes through a grant of its buffer too, open for as many writes
	// with immediate as it will ever make (closing the queue pair revokes
	// it).
	r.bufKey = r.bufMR.RKey()
	if g, ok := r.bufMR.(verbsio.Granter); ok {
		gr, err := g.Grant(r.buf.Addr(), size, r.qp, 1<<30)
		if err != nil {
			return r, fmt.Errorf("raw pair: granting its buffer: %w", err)
		}
		r.bufKey = gr.RKey()
	}
	wrs := make([]verbsio.RecvWR, rawSlots)
	for i := range wrs {
		wrs[i] = r.recvWR(i)
	}
	if err := r.qp.PostRecv(wrs); err != nil {
		return r, err
	}
	return r, nil
}

func (r *rawPair) recvWR(i int) verbsio.RecvWR {
	return verbsio.RecvWR{WRID: uint64(i), SG: []verbsio.SGE{{Addr: r.ctl.Addr() + uintptr(i*rawSlotSize), Length: rawSlotSize, LKey: r.ctlMR.LKey()}}}
}

func (r *rawPair) info() rawInfo {
	ep := r.qp.Endpoint()
	return rawInfo{Provider: ep.Provider, Host: ep.Host, Data: ep.Data, Addr: uint64(r.buf.Addr()), RKey: r.bufKey}
}

func (r *rawPair) connect(ctx context.Context, peer rawInfo) error {
	r.remoteAddr, r.remoteKey = peer.Addr, peer.RKey
	return r.qp.Connect(ctx, verbsio.Endpoint{Provider: peer.Provider, Host: peer.Host, Data: peer.Data})
}

// wait consumes wantRecv receive and wantSend send completions, re-posting
// receive slots as they complete.
func (r *rawPair) wait(ctx context.Context, wantRecv, wantSend int) error {
	for r.recvs < wantRecv || r.sends < wantSend {
		n, err := r.cq.Wait(ctx, r.comps)
		if err != nil {
			return err
		}
		for _, c := range r.comps[:n] {
			if c.Status != verbsio.StatusSuccess {
				return fmt.Errorf("raw pair: %s completion: %w", c.Op, c.Status.Err())
			}
			switch c.Op {
			case verbsio.OpRecv, verbsio.OpRecvImm:
				r.recvs++
				if err := r.qp.PostRecv([]verbsio.RecvWR{r.recvWR(int(c.WRID))}); err != nil {
					return err
				}
			default:
				r.sends++
			}
		}
	}
	r.recvs -= wantRecv
	r.sends -= wantSend
	return nil
}

// post posts wr, asking for its completion when always is set or it is
// the rawSignalEvery-th; before a signaled one it waits until fewer than
// rawMaxSignaled are outstanding (send completions that came meanwhile
// count, whoever waited for them).
func (r *rawPair) post(ctx context.Context, wr verbsio.SendWR, always bool) error {
	r.posted++
	wr.Signaled = always || r.posted%rawSignalEvery == 0
	if wr.Signaled {
		if err := r.reap(ctx, rawMaxSignaled-1); err != nil {
			return err
		}
		r.signaled++
	}
	return r.qp.PostSend([]verbsio.SendWR{wr})
}

// reap waits until at most keep signaled work requests are outstanding.
func (r *rawPair) reap(ctx context.Context, keep int) error {
	took := min(r.sends, r.signaled)
	r.sends -= took
	r.signaled -= took
	if r.signaled > keep {
		k := r.signaled - keep
		if err := r.wait(ctx, 0, k); err != nil {
			return err
		}
		r.signaled -= k
	}
	return nil
}

// ask sends a small request and waits for the peer's write with immediate
// (not for its own SEND's completion).
func (r *rawPair) ask(ctx context.Context) error {
	wr := verbsio.SendWR{WRID: 1 << 32, Op: verbsio.OpSend,
		SG: []verbsio.SGE{{Addr: r.ctl.Addr() + uintptr((rawSlots-1)*rawSlotSize), Length: 8, LKey: r.ctlMR.LKey()}}}
	if err := r.post(ctx, wr, false); err != nil {
		return err
	}
	return r.wait(ctx, 1, 0)
}

// answer serves n requests: each is answered by a write with immediate of
// size bytes from the fixed buffer into the peer's, after copying src into
// the buffer when src is not nil (the copy-through-buffer sender, which
// first waits until the write before no longer reads the buffer).
func (r *rawPair) answer(ctx context.Context, n, size int, src []byte) error {
	for i := 0; i < n; i++ {
		if err := r.wait(ctx, 1, 0); err != nil {
			return err
		}
		if src != nil {
			if err := r.reap(ctx, 0); err != nil {
				return err
			}
			copy(r.buf.Bytes()[:size], src[:size])
		}
		wr := verbsio.SendWR{WRID: 2 << 32, Op: verbsio.OpWriteImm, Imm: uint32(i),
			SG:         []verbsio.SGE{{Addr: r.buf.Addr(), Length: uint32(size), LKey: r.bufMR.LKey()}},
			RemoteAddr: r.remoteAddr, RKey: r.remoteKey}
		if err := r.post(ctx, wr, src != nil); err != nil {
			return err
		}
	}
	return nil
}

// copyOut copies a received tensor out of the fixed buffer into dst (the
// result tensor's memory).
func (r *rawPair) copyOut(dst []byte) { copy(dst, r.buf.Bytes()[:len(dst)]) }

func (r *rawPair) close() {
	if r.qp != nil {
		_ = r.qp.Close()
	}
	if r.cq != nil {
		_ = r.cq.Close()
	}
	for _, b := range []alloc.Block{r.buf, r.ctl} {
		if b != (alloc.Block{}) {
			_ = b.Free()
		}
	}
}

var _ tensor.Buffer = alloc.Block{}

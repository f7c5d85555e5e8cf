package rendezvous

import (
	"bytes"
	"fmt"

	"github.com/gdrlink/gdrlink/internal/wire"
	"github.com/gdrlink/gdrlink/tensor"
)

// PullRef says where a receiver pulls a tensor from: Size bytes at Offset
// of the sender's exported arena Arena, which Handle describes (opaque to
// the channel: a legacy CUDA IPC handle, or what tells the receiver how to
// get a descriptor of the arena).
type PullRef struct {
	Arena  uint64
	Offset uint64
	Size   int64
	Handle []byte
}

// Puller is the on-node path of device tensors between two processes
// (WithPull), as Open MPI's smcuda has it: instead of the sender writing a
// device tensor through host memory, the receiver maps the sender's device
// memory (once per arena) and copies the tensor itself, device to device.
//
// A Recv onto a device asks for a pull (wire.ReqPull) when Ready says the
// pair's path is set up; a sender whose source lies in memory it exported
// (Export) answers with where the tensor is (wire.RespPull) and keeps the
// source until the receiver's CONFIRM says the copy is done; any other
// sender answers as without it, and the tensor is written as usual. A copy
// that fails, or a Recv given up meanwhile, sends CONFIRM with
// wire.ConfirmBad: the sender then keeps the tensor for the next request
// of its key and step (which, with the pair set to BAD by the Puller,
// will ask for a write), so nothing is lost.
//
// Ready, Export and Alloc are called under the channel's lock and must
// not block; Pull is called after it.
type Puller interface {
	// Ready reports whether a result on dev can be pulled from the peer
	// now. It may start setting the path up (and say false).
	Ready(dev tensor.Device) bool
	// Export says where the peer can pull the first n bytes of src from;
	// ok is false when src is not in memory this side exported.
	Export(src tensor.Buffer, n int) (ref PullRef, ok bool)
	// Alloc allocates a result of n bytes on dev to pull into.
	Alloc(n int, dev tensor.Device) (tensor.Buffer, error)
	// Pull copies ref's bytes into the start of dst and calls done once,
	// from any goroutine, when the copy is complete (nil) or failed. It
	// must not wait for the copy.
	Pull(ref PullRef, dst tensor.Buffer, done func(error))
}

// WithPull gives the channel the on-node device path of p: Recvs onto a
// device pull from a sender that exported the tensor's memory, and Sends
// of exported memory offer themselves to be pulled. Both peers must have
// one (wire.HelloPull); otherwise device tensors go as without it.
func WithPull(p Puller) Option {
	return func(o *options) error {
		o.puller = p
		return nil
	}
}

// pullLocked answers e's request with where the receiver can pull the
// tensor from, when the request asked for a pull and e's source lies in
// memory the Puller exported; it reports whether it did. The source stays
// with the channel until the receiver's CONFIRM.
func (s *sender) pullLocked(e *sendEntry) bool {
	c := s.c
	if !e.reqPull || !c.pull || e.serr != nil {
		return false
	}
	meta := e.t.Meta()
	buf := e.t.Buffer()
	if meta.IsDead || meta.ByteSize == 0 || meta.DType == tensor.String || buf == nil {
		return false
	}
	ref, ok := c.opts.puller.Export(buf, int(meta.ByteSize))
	if !ok {
		return false
	}
	m := wire.Message{Type: wire.TypeMetaResponse, Flags: wire.RespPull, Req: e.req,
		PullArena: ref.Arena, PullOffset: ref.Offset, PullHandle: ref.Handle}
	m.Meta.SetMeta(meta)
	if err := m.Check(); err != nil {
		c.log.Warn("rendezvous: cannot offer a pull, writing instead", "peer", c.peer, "key", e.key.name, "step", e.key.step, "err", err)
		return false
	}
	e.meta, e.n = meta, meta.ByteSize
	c.enqueueLocked(&m)
	s.pulls[e.req] = e
	s.stats.pullsOut.Add(1)
	return true
}

// onPullConfirmLocked ends a pulled send on the receiver's CONFIRM: the
// copy is done and the source goes back; or, with wire.ConfirmBad, the
// receiver did not take it (its copy failed, or its Recv was given up),
// and the tensor waits for the next request of its key and step, as after
// a CANCEL.
func (s *sender) onPullConfirmLocked(e *sendEntry, m *wire.Message, ds *deliveries) {
	delete(s.pulls, m.Req)
	if m.Flags&wire.ConfirmBad == 0 {
		s.stats.writesOut.Add(1)
		s.stats.bytesOut.Add(uint64(e.n))
		s.dropLocked(e, nil, ds)
		return
	}
	e.hasReq, e.reqHasMeta, e.reqPull = false, false, false
	other, taken := s.sends[e.key]
	switch {
	case s.c.state != stateConnected || taken && other.has:
		// A new Send of the key and step took its place.
		s.dropLocked(e, fmt.Errorf("%w: %s did not pull %q step %d", ErrCancelled, s.c.peer, e.key.name, e.key.step), ds)
	case taken:
		// The receiver asked again before this CONFIRM came (it gave
		// up its Recv and made another while the copy ran): that
		// request is parked, waiting for a Send; it gets this one.
		delete(s.sends, e.key)
		s.parked--
		e.peerRequest = other.peerRequest
		s.serveLocked(e, ds)
	default:
		s.sends[e.key] = e
	}
}

// onPullLocked takes a META_DATA_RESPONSE with wire.RespPull: it allocates
// the result on the request's device (the landing offered for a write is
// given up) and has the Puller copy the tensor; pulled completes it.
func (rv *receiver) onPullLocked(r *request, m *wire.Message, ds *deliveries) {
	c := rv.c
	meta := m.Meta.Tensor()
	if !r.pull || meta.DType == tensor.String {
		c.protocolLocked(ds, "%s offers request %d a pull it did not ask for", m.Type, m.Req)
		return
	}
	if r.cancelled {
		rv.pullConfirmLocked(r.idx, wire.ConfirmBad)
		rv.forgetLocked(r, ds)
		return
	}
	rv.revokeLocked(r, 0)
	if r.buf != nil {
		_ = r.buf.Free()
		r.buf = nil
	}
	var buf tensor.Buffer
	var err error
	if meta.ByteSize > c.opts.maxTensor {
		err = fmt.Errorf("%w: %v exceeds the limit of %d bytes", ErrTooLarge, meta, c.opts.maxTensor)
	} else {
		buf, err = c.opts.puller.Alloc(int(meta.ByteSize), r.dev)
	}
	if err != nil {
		rv.pullConfirmLocked(r.idx, wire.ConfirmBad)
		rv.finishLocked(r, nil, c.resultErrLocked(r.key, meta, err), ds)
		return
	}
	rv.cache[r.key.name] = meta
	r.meta, r.buf, r.path, r.pulling = meta, buf, PathPull, true
	ref := PullRef{Arena: m.PullArena, Offset: m.PullOffset, Size: meta.ByteSize, Handle: bytes.Clone(m.PullHandle)}
	rv.stats.pullsIn.Add(1)
	c.pulls.Add(1)
	p := c.opts.puller
	ds.add(func() { p.Pull(ref, buf, func(err error) { rv.pulled(r, err) }) })
}

// pulled completes a pull: CONFIRM to the sender (wire.ConfirmBad unless
// the tensor was taken), then the Recv, unless it was given up meanwhile.
// The result buffer is freed only now when the request ended during the
// copy (the copy was writing it).
func (rv *receiver) pulled(r *request, err error) {
	c := rv.c
	defer c.pulls.Done()
	var ds deliveries
	c.mu.Lock()
	r.pulling = false
	var flags uint8
	if err != nil || r.cancelled || r.done {
		flags = wire.ConfirmBad
	}
	if c.state == stateConnected {
		rv.pullConfirmLocked(r.idx, flags)
		c.flushLocked()
	}
	switch {
	case r.done:
		// Ended while the copy ran (the channel failed): its buffer was
		// left for now.
		if r.buf != nil {
			_ = r.buf.Free()
			r.buf = nil
		}
	case r.cancelled:
		rv.forgetLocked(r, &ds)
	case err != nil:
		rv.finishLocked(r, nil, fmt.Errorf("%w: %q step %d from %s: %w", ErrPullFailed, r.key.name, r.key.step, c.peer, err), &ds)
	default:
		rv.stats.bytesIn.Add(uint64(r.meta.ByteSize))
		t, terr := tensor.New(r.meta, r.buf)
		if terr == nil {
			r.buf = nil // owned by t now
		}
		rv.finishLocked(r, t, terr, &ds)
	}
	c.mu.Unlock()
	ds.run()
}

// pullConfirmLocked queues the CONFIRM that ends a pull, at once: the
// sender keeps the source until it comes.
func (rv *receiver) pullConfirmLocked(req uint32, flags uint8) {
	m := wire.Message{Type: wire.TypeConfirm, Flags: flags, Req: req}
	rv.c.enqueueLocked(&m)
	rv.stats.confirmsOut.Add(1)
}

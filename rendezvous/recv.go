package rendezvous

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gdrlink/gdrlink/internal/crc32c"
	"github.com/gdrlink/gdrlink/internal/wire"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

// receiver is the receiving half of a channel: the Recvs waiting for the
// peer's tensors, the names it defined for the peer, and the meta-data cache
// its requests are sized from. Its state is guarded by the channel's lock
// (see Channel.mu); it queues its requests on the channel, which posts them
// in order as credits allow.
type receiver struct {
	c *Channel

	nextReq  uint32
	reqs     map[uint32]*request // by request index
	byKey    map[skey]*request   // pending, by key and step
	names    map[string]uint32   // name indexes defined for the peer
	nextName uint32
	cache    map[string]tensor.Meta // the meta-data cache

	// confirms are the CONFIRMs not queued yet (and, in checksum mode,
	// the TAKEN owed: takenLocked): they wait, at most confirmDelay
	// (confirmTimer), for another control frame to ride with
	// (takeConfirmsLocked).
	confirms     []wire.Message
	confirmTimer *time.Timer
	confirmArmed bool

	// eager is what came eagerly (eager.go).
	eager eagerReceiver

	stats recvCounters
}

type recvCounters struct {
	requests, metaResponses, metaInPlace, reRequests, finals, writesIn atomic.Uint64
	bytesIn, errors, nameDefs, checksumFailures, chunksIn              atomic.Uint64
	// grants counts the grants given for result buffers (verbsio.Granter).
	grants atomic.Uint64
	// checksumRetries counts the corrupted arrivals asked for again;
	// confirmsOut the CONFIRMs sent.
	checksumRetries, confirmsOut atomic.Uint64
	// pullsIn counts the tensors pulled (WithPull).
	pullsIn atomic.Uint64
	// eagerIn counts the EAGER frames taken in.
	eagerIn atomic.Uint64
}

func newReceiver(c *Channel) receiver {
	return receiver{
		c: c, reqs: map[uint32]*request{}, byKey: map[skey]*request{}, names: map[string]uint32{},
		cache: map[string]tensor.Meta{}, nextReq: 1, nextName: 1, eager: eagerReceiver{held: map[skey]*eagerHeld{}},
	}
}

// pendingLocked reports whether a Recv waits for the peer's answer.
func (rv *receiver) pendingLocked() bool { return len(rv.reqs) > 0 }

// failLocked fails every pending Recv with err.
func (rv *receiver) failLocked(err error, ds *deliveries) {
	for k, h := range rv.eager.held {
		delete(rv.eager.held, k)
		rv.releaseHeld(h)
	}
	for idx, r := range rv.reqs {
		delete(rv.reqs, idx)
		rv.finishLocked(r, nil, fmt.Errorf("rendezvous: %q step %d from %s: %w", r.key.name, r.key.step, rv.c.peer, err), ds)
	}
}

// request is the receiver's side of one Recv.
type request struct {
	idx       uint32
	key       skey
	dev       tensor.Device
	meta      tensor.Meta // what buf was sized for
	buf       tensor.Buffer
	path      Path
	crc       uint32
	hasCRC    bool
	roundTrip bool
	// metaChanged: the cached meta-data was stale or missing.
	metaChanged bool
	cancelled   bool
	done        bool
	start       time.Time
	cb          func(*tensor.Tensor, Transfer, error)
	stop        func() bool
	landing     bool     // completed by a proxy Landing
	tr          Transfer // the transfer a Landing reports
	// chunk is the chunk size asked of the sender (0: one write), chunks
	// the chunk writes arrived so far.
	chunk  int64
	chunks int
	// grants are the peer's rights to write buf, on the channel's queue
	// pair (first) and its rails, where the provider gives grants; they
	// are revoked before buf is freed or handed on.
	grants []verbsio.Grant
	grant0 [1]verbsio.Grant // grants' room for the usual one
	// tries counts the writes of the tensor that arrived corrupted.
	tries int
	// into is the caller's tensor the result is asked into (Into), and
	// held the error of such a request cancelled while the peer may
	// still write it: its callback waits for the request's end.
	into *tensor.Tensor
	held error
	// pull: the request offered to pull the tensor (wire.ReqPull);
	// pulling: the Puller is copying it into buf, which is freed only
	// once the copy is over.
	pull, pulling bool
	// eager: its tensor came eagerly, copied into buf here: nobody
	// writes buf, so it is granted to nobody.
	eager bool
}

// RecvOption changes one Recv.
type RecvOption func(*request)

// OnDevice asks for the result on dev (default: host memory). With a
// channel Proxy (WithProxy), GPU results always land through it: written by
// the NIC into the GPU itself where the proxy's policy says Direct
// (PathDirectGPU, flushed as the proxy decides), or landed in a host proxy
// tensor and copied over (PathProxy). Without one, a GPU the channel's
// memory can allocate and the NIC can write is written directly
// (PathDirectGPU, with no flush: nothing here can make one); otherwise Recv
// fails with ErrNoPath.
func OnDevice(dev tensor.Device) RecvOption { return func(r *request) { r.dev = dev } }

// Into asks for the result to be written straight into t, a host tensor in
// the channel's registered memory: the callback's tensor then shares t's
// memory (its Release gives nothing back) and has the sender's meta-data,
// which fits t's bytes. Where the peer cannot be granted t's bytes alone
// (the provider gives no grants, or t is not registered memory) or the
// tensor sent does not fit t, the result lands in a tensor of its own as
// without Into; compare the result's Addr with t's to tell.
//
// The peer writes t only while the receive is pending: a receive that
// ctx cancels reports so only once the peer can no longer write t (it
// answered the cancel, its write arrived, or the channel ended), and a
// failed one only after its grant was revoked.
func Into(t *tensor.Tensor) RecvOption { return func(r *request) { r.into = t } }

// lent is a caller's memory lent to one request (Into): freeing it gives
// nothing back.
type lent struct {
	b    []byte
	addr uintptr
}

func (l *lent) Bytes() []byte         { return l.b }
func (l *lent) Addr() uintptr         { return l.addr }
func (l *lent) Len() int              { return len(l.b) }
func (l *lent) Device() tensor.Device { return tensor.Host }
func (l *lent) Free() error           { return nil }

// Recv asks the peer for the tensor sent under key and step and waits for
// it, or for ctx to end (the request is then withdrawn and the error wraps
// ErrCancelled and ctx's cause). The caller owns the result and releases it.
func (c *Channel) Recv(ctx context.Context, key string, step int64, opts ...RecvOption) (*tensor.Tensor, Transfer, error) {
	w := waiters.Get().(*recvWaiter)
	c.RecvFunc(ctx, key, step, w.cb, opts...)
	<-w.ch
	t, tr, err := w.t, w.tr, w.err
	w.t, w.tr, w.err = nil, Transfer{}, nil
	waiters.Put(w)
	return t, tr, err
}

// recvWaiter is where a Recv's callback leaves the result for the waiting
// caller. Waiters are reused (the callback runs exactly once, and the
// caller takes the result before it puts the waiter back), so that a Recv
// makes no channel and no closure of its own.
type recvWaiter struct {
	ch  chan struct{}
	cb  func(*tensor.Tensor, Transfer, error) // w.deliver, bound once
	t   *tensor.Tensor
	tr  Transfer
	err error
}

var waiters = sync.Pool{New: func() any {
	w := &recvWaiter{ch: make(chan struct{}, 1)}
	w.cb = w.deliver
	return w
}}

func (w *recvWaiter) deliver(t *tensor.Tensor, tr Transfer, err error) {
	w.t, w.tr, w.err = t, tr, err
	w.ch <- struct{}{}
}

// RecvFunc is Recv in callback form: it returns at once, and cb runs exactly
// once with the result or the error. cb runs on the channel's completion
// goroutine (or the one that ended ctx) and must not block.
func (c *Channel) RecvFunc(ctx context.Context, key string, step int64, cb func(*tensor.Tensor, Transfer, error), opts ...RecvOption) {
	c.rcv.recv(ctx, key, step, cb, opts)
}

func (rv *receiver) recv(ctx context.Context, key string, step int64, cb func(*tensor.Tensor, Transfer, error), opts []RecvOption) {
	c := rv.c
	if cb == nil {
		// Nobody will take the result: give its memory back.
		cb = func(t *tensor.Tensor, _ Transfer, _ error) {
			if t != nil {
				_ = t.Release()
			}
		}
	}
	tr := Transfer{Key: key, Step: step, Provider: c.provider, Device: c.devName}
	if err := checkKey(key); err != nil {
		cb(nil, tr, err)
		return
	}
	if err := ctx.Err(); err != nil {
		cb(nil, tr, fmt.Errorf("%w: %q step %d: %w", ErrCancelled, key, step, context.Cause(ctx)))
		return
	}
	r := &request{key: skey{key, step}, dev: tensor.Host, start: time.Now(), cb: cb}
	for _, o := range opts {
		o(r)
	}
	c.mu.Lock()
	tr.Peer = c.peer
	if c.state != stateConnected {
		err := c.stateErrLocked()
		c.mu.Unlock()
		cb(nil, tr, fmt.Errorf("rendezvous: %q step %d: %w", key, step, err))
		return
	}
	if _, dup := rv.byKey[r.key]; dup {
		c.mu.Unlock()
		cb(nil, tr, fmt.Errorf("%w: Recv of %q step %d is already pending", ErrDuplicate, key, step))
		return
	}
	if h, ok := rv.eager.held[r.key]; ok {
		// It came eagerly: no request.
		r.cb = cb
		var ds deliveries
		if rv.eagerIntoLocked(r, h, &ds) {
			delete(rv.eager.held, r.key)
			rv.releaseHeld(h)
		}
		c.mu.Unlock()
		ds.run()
		return
	}
	m := wire.Message{Type: wire.TypeRequest, Step: step}
	meta, cached := rv.cache[key]
	if r.into != nil && r.dev == tensor.Host {
		meta, cached = r.into.Meta(), true
	}
	if cached {
		if err := rv.allocResultLocked(r, meta); err != nil && refusalCode(err) == 0 {
			err = c.resultErrLocked(r.key, meta, err)
			c.mu.Unlock()
			cb(nil, tr, err)
			return
		} else if err != nil {
			// No room for the cached size: ask without meta-data. The
			// sender's answer says what the tensor is now, and a result
			// that still cannot be had is refused to the sender (CANCEL
			// with the reason) rather than left waiting there.
			c.log.Debug("rendezvous: no result for the cached meta-data, asking without it", "peer", c.peer, "key", key, "step", step, "err", err)
			cached = false
			r.meta, r.path = tensor.Meta{}, PathNone
		}
	}
	if cached {
		m.Flags |= wire.ReqMeta
		m.Meta.SetMeta(meta)
		m.Addr, m.RKey, m.Capacity = rv.bufTarget(r)
		if r.buf != nil {
			if m.ChunkShift = rv.chunkShiftLocked(r); m.ChunkShift != 0 {
				m.Flags |= wire.ReqChunks // and no rails: chunks keep to one queue pair
			} else {
				c.railKeys(&m, r.buf.Addr(), r.buf.Len())
				rv.railGrantsLocked(r, &m)
			}
			if m.NumRailKeys > 0 {
				m.Flags |= wire.ReqRails
			}
			if _, ok := r.buf.(Landing); ok {
				m.Flags |= wire.ReqExact // a landing is made for one meta-data
			}
		}
	}
	if c.pull && r.dev.IsGPU() && c.opts.puller.Ready(r.dev) {
		m.Flags |= wire.ReqPull
		r.pull = true
	}
	r.idx = rv.allocReqLocked()
	m.Req = r.idx
	ni, ok := rv.names[key]
	if !ok {
		ni = rv.nextName
		rv.nextName++
		rv.names[key] = ni
		m.Flags |= wire.ReqName
		m.Name = []byte(key)
		rv.stats.nameDefs.Add(1)
	}
	m.NameIndex = ni
	rv.reqs[r.idx] = r
	rv.byKey[r.key] = r
	c.enqueueLocked(&m)
	rv.stats.requests.Add(1)
	if ctx.Done() != nil {
		r.stop = context.AfterFunc(ctx, func() { rv.cancel(r, context.Cause(ctx)) })
	}
	c.flushLocked()
	c.armKeepaliveLocked()
	c.mu.Unlock()
}

func (rv *receiver) allocReqLocked() uint32 {
	for {
		idx := rv.nextReq
		rv.nextReq++
		if rv.nextReq == 0 {
			rv.nextReq = 1
		}
		if _, used := rv.reqs[idx]; !used {
			return idx
		}
	}
}

func (rv *receiver) bufTarget(r *request) (addr uint64, rkey uint32, capacity uint64) {
	c := rv.c
	if r.buf == nil {
		return 0, 0, 0
	}
	if len(r.grants) > 0 {
		return uint64(r.buf.Addr()), r.grants[0].RKey(), uint64(r.buf.Len())
	}
	mr, ok := c.mem.Region(r.buf.Addr(), r.buf.Len())
	if !ok {
		return 0, 0, 0
	}
	return uint64(r.buf.Addr()), mr.RKey(), uint64(r.buf.Len())
}

// grantLocked gives the peer a grant of exactly r's result buffer, on the
// channel's queue pair, when its region offers grants (verbsio.Granter):
// the request then carries the grant's rkey, not the region's, and the
// peer can write that buffer and no other, for as many writes with
// immediate as the request's chunks, until the request ends.
func (rv *receiver) grantLocked(r *request, mr verbsio.MemoryRegion) error {
	gr, ok := mr.(verbsio.Granter)
	if !ok || r.eager {
		return nil
	}
	imms := 1
	if rv.chunkShiftLocked(r) != 0 {
		imms = int((r.meta.ByteSize + r.chunk - 1) / r.chunk)
	}
	g, err := gr.Grant(r.buf.Addr(), r.buf.Len(), rv.c.qp, imms)
	if errors.Is(err, verbsio.ErrQPState) {
		// The queue pair failed and the channel has not seen it yet: the
		// connection is lost (a failover makes the next one), which is
		// not the request's fault.
		return fmt.Errorf("%w: %w", verbsio.ErrPeerLost, err)
	}
	if err != nil {
		return err
	}
	if r.grants == nil {
		r.grants = r.grant0[:0]
	}
	r.grants = append(r.grants[:0], g)
	rv.stats.grants.Add(1)
	return nil
}

// railGrantsLocked puts in m, in place of the region rkeys c.railKeys
// filled in, grants of r's buffer to each rail's queue pair (plain writes
// only: the immediate comes on the channel's queue pair) where the rail's
// region offers them. A rail that cannot have one takes the rails out of
// the request: the whole write then comes on the channel's queue pair.
func (rv *receiver) railGrantsLocked(r *request, m *wire.Message) {
	c := rv.c
	for i := 0; i < int(m.NumRailKeys); i++ {
		mr, ok := c.rails[i].Memory.Region(r.buf.Addr(), r.buf.Len())
		gr, granter := mr.(verbsio.Granter)
		if !ok || !granter {
			continue
		}
		g, err := gr.Grant(r.buf.Addr(), r.buf.Len(), c.rails[i].qp, 0)
		if err != nil {
			c.log.Debug("rendezvous: no grant on a rail, the write takes one queue pair", "rail", i+1, "err", err)
			m.NumRailKeys = 0
			rv.revokeLocked(r, 1)
			return
		}
		r.grants = append(r.grants, g)
		rv.stats.grants.Add(1)
		m.RailKeys[i] = g.RKey()
	}
}

// revokeLocked revokes r's grants from the keep-th on (0: all). Once it
// returns, no write of the peer lands in r's buffer through them.
func (rv *receiver) revokeLocked(r *request, keep int) {
	if len(r.grants) <= keep {
		return
	}
	for _, g := range r.grants[keep:] {
		if err := g.Revoke(); err != nil {
			rv.c.log.Warn("rendezvous: revoking a grant", "key", r.key.name, "step", r.key.step, "err", err)
		}
	}
	clear(r.grants[keep:])
	r.grants = r.grants[:keep]
}

// chunkShiftLocked decides whether r's result is asked for in chunks: a
// Landing with a ChunkLanded method (not writing the device directly) for a tensor larger than
// the channel's proxy chunk. It sets r.chunk and returns the chunk size as
// carried on the wire, 0 for one write.
func (rv *receiver) chunkShiftLocked(r *request) uint8 {
	c := rv.c
	r.chunk, r.chunks = 0, 0
	shift := c.opts.chunkShift
	if shift == 0 || r.meta.ByteSize <= int64(1)<<shift {
		return 0
	}
	if _, ok := r.buf.(chunkedLanding); !ok {
		return 0
	}
	if d, ok := r.buf.(interface{ Direct() bool }); ok && d.Direct() {
		return 0 // nothing to overlap: the NIC writes the device itself
	}
	r.chunk = int64(1) << shift
	return shift
}

// allocResultLocked sizes r's result buffer for meta, choosing the path.
func (rv *receiver) allocResultLocked(r *request, meta tensor.Meta) error {
	c := rv.c
	r.meta = meta
	r.chunk, r.chunks = 0, 0
	rv.revokeLocked(r, 0)
	if r.buf != nil {
		_ = r.buf.Free()
		r.buf = nil
	}
	dev := r.dev
	switch {
	case meta.DType == tensor.String:
		dev, r.path = tensor.Host, PathSerialized
	case dev.IsGPU():
		r.path = PathDirectGPU
	default:
		r.path = PathDirect
	}
	if meta.IsDead || meta.ByteSize == 0 {
		return nil
	}
	if meta.ByteSize > c.opts.maxTensor {
		return fmt.Errorf("%w: %v exceeds the limit of %d bytes", ErrTooLarge, meta, c.opts.maxTensor)
	}
	size := int(meta.ByteSize)
	if meta.DType == tensor.String {
		// Encodings change size from step to step: room for some growth
		// lets the next one be written with no re-request.
		size += size/4 + 64
	}
	if r.into != nil && r.path == PathDirect && rv.lendLocked(r, meta) {
		return nil
	}
	var buf tensor.Buffer
	var err error
	if r.path == PathDirectGPU && c.opts.proxy != nil {
		// One landing path for GPU results: with a proxy, it lands them,
		// written by the NIC into the GPU itself where its policy says
		// Direct (and then flushed as its flush choice says, outside the
		// channel's lock, when the landing completes), staged otherwise.
		err = verbsio.ErrNotSupported
	} else {
		buf, err = c.mem.Alloc(size, dev)
	}
	if err != nil && r.path == PathDirectGPU && errors.Is(err, verbsio.ErrNotSupported) {
		if c.opts.proxy == nil {
			return fmt.Errorf("%w: %s: %w (and no proxy)", ErrNoPath, dev, err)
		}
		r.path = PathProxy
		var l Landing
		l, err = c.opts.proxy.Land(meta, dev)
		if err == nil {
			buf = l
			if d, ok := l.(interface{ Direct() bool }); ok && d.Direct() {
				r.path = PathDirectGPU // the proxy chose GPUDirect for this GPU
			}
		}
	}
	if err != nil {
		return err
	}
	mr, ok := c.mem.Region(buf.Addr(), buf.Len())
	if !ok {
		_ = buf.Free()
		return fmt.Errorf("%w: result memory at %#x is not registered", ErrNoPath, buf.Addr())
	}
	r.buf = buf
	if err := rv.grantLocked(r, mr); err != nil {
		r.buf = nil
		_ = buf.Free()
		return fmt.Errorf("rendezvous: granting the peer the result memory at %#x: %w", buf.Addr(), err)
	}
	return nil
}

// lendLocked makes the caller's tensor (Into) r's result buffer for meta,
// with a grant of its bytes alone to the peer; false where it cannot be
// (the result then gets a buffer of its own).
func (rv *receiver) lendLocked(r *request, meta tensor.Meta) bool {
	c := rv.c
	im := r.into.Meta()
	b, err := r.into.Bytes()
	if err != nil || r.into.Device() != tensor.Host || meta.DType == tensor.String || meta.DType != im.DType || meta.ByteSize > im.ByteSize || len(b) == 0 {
		return false
	}
	l := &lent{b: b[:im.ByteSize:im.ByteSize], addr: r.into.Addr()}
	mr, ok := c.mem.Region(l.addr, l.Len())
	if !ok {
		return false
	}
	if r.eager {
		r.buf = l // copied into here: no grant
		return true
	}
	if _, ok := mr.(verbsio.Granter); !ok {
		return false // the peer could write the whole region
	}
	r.buf = l
	if err := rv.grantLocked(r, mr); err != nil || len(r.grants) == 0 {
		c.log.Debug("rendezvous: no grant of the tensor given to receive into, the result gets its own", "key", r.key.name, "step", r.key.step, "err", err)
		rv.revokeLocked(r, 0)
		r.buf = nil
		return false
	}
	return true
}

// cancel withdraws r if it has not completed, and reports whether it did.
func (rv *receiver) cancel(r *request, cause error) bool {
	c := rv.c
	c.mu.Lock()
	if r.done || r.cancelled {
		c.mu.Unlock()
		return false
	}
	r.cancelled = true
	cb := r.cb
	r.cb = nil
	delete(rv.byKey, r.key)
	tr := rv.resultless(r)
	err := fmt.Errorf("%w: %q step %d from %s: %w", ErrCancelled, r.key.name, r.key.step, tr.Peer, cause)
	if c.state == stateConnected {
		m := wire.Message{Type: wire.TypeCancel, Req: r.idx}
		c.enqueueLocked(&m)
		c.flushLocked()
		if _, ok := r.buf.(*lent); ok {
			// The peer may be writing the caller's memory: tell the
			// caller when it no longer can (forgetLocked, or
			// finishLocked when the channel ends).
			r.cb, r.held = cb, err
			c.mu.Unlock()
			return true
		}
	}
	c.mu.Unlock()
	cb(nil, tr, err)
	return true
}

// forgetLocked removes a finished or withdrawn request and frees its
// buffer; a cancelled request whose callback waited for this (cancel)
// gets it now.
func (rv *receiver) forgetLocked(r *request, ds *deliveries) {
	delete(rv.reqs, r.idx)
	if rv.byKey[r.key] == r {
		delete(rv.byKey, r.key)
	}
	rv.revokeLocked(r, 0)
	if r.buf != nil {
		_ = r.buf.Free()
		r.buf = nil
	}
	if cb, err := r.cb, r.held; cb != nil && err != nil {
		r.cb = nil
		tr := rv.resultless(r)
		ds.add(func() { cb(nil, tr, err) })
	}
}

// resultless is the Transfer of r ended without a result.
func (rv *receiver) resultless(r *request) Transfer {
	c := rv.c
	return Transfer{Key: r.key.name, Step: r.key.step, Peer: c.peer, Provider: c.provider, Device: c.devName, Took: time.Since(r.start)}
}

// finishLocked completes r with t or err; the callback runs after the lock.
// A buffer still in r.buf (not handed to t) is freed.
func (rv *receiver) finishLocked(r *request, t *tensor.Tensor, err error, ds *deliveries) {
	c := rv.c
	if r.held != nil {
		t, err = nil, r.held // cancelled, and now ended (the channel failed)
	}
	r.done = true
	if r.stop != nil {
		r.stop()
	}
	delete(rv.reqs, r.idx)
	if rv.byKey[r.key] == r {
		delete(rv.byKey, r.key)
	}
	rv.revokeLocked(r, 0)
	if r.buf != nil && r.pulling {
		// The Puller's copy still writes it: pulled frees it.
	} else if r.buf != nil {
		if c.state != stateConnected {
			// A write may still be landing in it until the queue pair is
			// gone; release frees it then.
			c.orphans = append(c.orphans, r.buf)
		} else {
			_ = r.buf.Free()
		}
		r.buf = nil
	}
	cb := r.cb
	r.cb = nil
	if cb == nil {
		return
	}
	tr := Transfer{Key: r.key.name, Step: r.key.step, Peer: c.peer, Path: r.path, Provider: c.provider, Device: c.devName,
		MetaRoundTrip: r.roundTrip, MetaChanged: r.metaChanged, Checksummed: r.hasCRC && err == nil, Took: time.Since(r.start)}
	if r.chunk > 0 && err == nil {
		tr.Chunks = r.chunks
	}
	if t != nil {
		tr.Meta = t.Meta()
		if !tr.Meta.IsDead {
			tr.Bytes = tr.Meta.ByteSize
		}
		if r.into != nil && err == nil {
			tr.Placed = t.Addr() != 0 && t.Addr() == r.into.Addr()
		}
	} else if err == nil && r.landing {
		tr.Meta, tr.Bytes = r.meta, r.meta.ByteSize
	} else if err == nil {
		tr.Path = PathNone
	}
	if err == nil && c.log.Enabled(context.Background(), slog.LevelDebug) {
		// Formatted only when it is logged: a Recv allocates nothing
		// for a record the handler drops.
		c.log.Debug("rendezvous: transfer", "transfer", tr.logValue())
	}
	if t == nil && err == nil && r.landing {
		r.cb, r.tr = cb, tr // landedLocked delivers
		return
	}
	ds.add(func() { cb(t, tr, err) })
}

// landedLocked hands a proxied result to its landing; the callback runs when
// the proxy has the tensor on the device.
func (rv *receiver) landedLocked(r *request, l Landing, ds *deliveries) {
	cb, tr := r.cb, r.tr
	r.cb = nil
	if cb == nil {
		ds.add(func() {
			l.Landed(func(t *tensor.Tensor, err error) {
				if t != nil {
					_ = t.Release()
				}
			})
		})
		return
	}
	ds.add(func() {
		l.Landed(func(t *tensor.Tensor, err error) {
			if t != nil {
				tr.Meta = t.Meta()
			}
			cb(t, tr, err)
		})
	})
}

func (rv *receiver) onMetaLocked(m *wire.Message, ds *deliveries) {
	c := rv.c
	r, ok := rv.reqs[m.Req]
	if !ok {
		c.protocolLocked(ds, "%s for unknown request %d", m.Type, m.Req)
		return
	}
	if m.Flags&wire.RespPull != 0 {
		rv.onPullLocked(r, m, ds)
		return
	}
	final := m.Flags&wire.RespFinal != 0
	meta := m.Meta.Tensor()
	if final != (meta.IsDead || meta.ByteSize == 0) {
		c.protocolLocked(ds, "%s for request %d: final=%v with meta-data %v", m.Type, m.Req, final, meta)
		return
	}
	if r.cancelled {
		if final {
			rv.forgetLocked(r, ds)
		}
		return
	}
	if final {
		rv.stats.finals.Add(1)
		r.path = PathNone
		rv.revokeLocked(r, 0)
		if r.buf != nil {
			_ = r.buf.Free()
			r.buf = nil
		}
		if meta.IsDead {
			rv.finishLocked(r, tensor.Dead(meta.DType, meta.Shape), nil, ds)
			return
		}
		rv.cache[r.key.name] = meta
		t, err := tensor.New(meta, nil)
		if meta.DType == tensor.String {
			t, err = tensor.NewStrings(meta.Shape, nil)
		}
		rv.finishLocked(r, t, err, ds)
		return
	}
	if m.Flags&wire.RespWriteFollows != 0 {
		if _, landing := r.buf.(Landing); r.buf == nil || landing || int64(r.buf.Len()) < meta.ByteSize || meta.DType != r.meta.DType {
			c.protocolLocked(ds, "%s for request %d: %v does not fit its buffer", m.Type, m.Req, meta)
			return
		}
		rv.stats.metaInPlace.Add(1)
		rv.cache[r.key.name] = meta
		r.meta, r.metaChanged = meta, true
		if m.Flags&wire.RespChecksum != 0 {
			r.crc, r.hasCRC = m.Checksum, true
		}
		return
	}
	rv.stats.metaResponses.Add(1)
	rv.cache[r.key.name] = meta
	r.roundTrip, r.metaChanged = true, true
	if m.Flags&wire.RespChecksum != 0 {
		r.crc, r.hasCRC = m.Checksum, true
	}
	if err := rv.allocResultLocked(r, meta); err != nil {
		// Withdraw the request with the reason: the sender fails its Send
		// (RefusedError) and gives the tensor back.
		cb := r.cb
		r.cb = nil
		r.cancelled = true
		delete(rv.byKey, r.key)
		cm := wire.Message{Type: wire.TypeCancel, Req: r.idx, Code: refusalCode(err)}
		c.enqueueLocked(&cm)
		tr := Transfer{Key: r.key.name, Step: r.key.step, Peer: c.peer, Provider: c.provider, Device: c.devName}
		e := c.resultErrLocked(r.key, meta, err)
		ds.add(func() { cb(nil, tr, e) })
		return
	}
	rr := wire.Message{Type: wire.TypeReRequest, Req: r.idx}
	rr.Addr, rr.RKey, rr.Capacity = rv.bufTarget(r)
	if r.buf != nil {
		if rr.ChunkShift = rv.chunkShiftLocked(r); rr.ChunkShift == 0 {
			c.railKeys(&rr, r.buf.Addr(), r.buf.Len())
			rv.railGrantsLocked(r, &rr)
		}
	}
	c.enqueueLocked(&rr)
	rv.stats.reRequests.Add(1)
}

func (rv *receiver) onChecksumLocked(m *wire.Message, ds *deliveries) {
	c := rv.c
	r, ok := rv.reqs[m.Req]
	if !ok {
		c.protocolLocked(ds, "%s for unknown request %d", m.Type, m.Req)
		return
	}
	r.crc, r.hasCRC = m.Checksum, true
}

func (rv *receiver) onErrorLocked(m *wire.Message, ds *deliveries) {
	c := rv.c
	r, ok := rv.reqs[m.Req]
	if !ok {
		c.protocolLocked(ds, "%s for unknown request %d", m.Type, m.Req)
		return
	}
	rv.stats.errors.Add(1)
	if r.cancelled {
		rv.forgetLocked(r, ds)
		return
	}
	err := fmt.Errorf("%w: %s for %q step %d: %s: %s", remoteErr(m.Code), c.peer, r.key.name, r.key.step, m.Code, m.Text)
	rv.finishLocked(r, nil, err, ds)
}

func (rv *receiver) onWriteLocked(imm uint32, wc *verbsio.Completion, ds *deliveries) {
	c := rv.c
	r, ok := rv.reqs[imm]
	if !ok {
		c.protocolLocked(ds, "write with immediate %d names no request", imm)
		return
	}
	if r.buf == nil {
		c.protocolLocked(ds, "write for request %d, which has no result buffer", imm)
		return
	}
	if r.chunk > 0 {
		// Chunks of one request come in order over one queue pair: the
		// count says which chunk this is. All but the last go to the
		// landing now (its copy to the device starts while the rest is on
		// the wire); the last completes the request below.
		rv.stats.chunksIn.Add(1)
		total := int((r.meta.ByteSize + r.chunk - 1) / r.chunk)
		r.chunks++
		if r.chunks < total {
			if l, ok := r.buf.(chunkedLanding); ok && !r.cancelled {
				off := int64(r.chunks-1) * r.chunk
				n := r.chunk
				ds.add(func() { l.ChunkLanded(int(off), int(n)) })
			}
			return
		}
	}
	// The last write is in: the peer may write the buffer no more.
	rv.revokeLocked(r, 0)
	if r.cancelled {
		rv.confirmLocked(r, 0)
		rv.forgetLocked(r, ds)
		return
	}
	rv.stats.writesIn.Add(1)
	rv.stats.bytesIn.Add(uint64(r.meta.ByteSize))
	meta := r.meta
	var host []byte
	if b := r.buf.Bytes(); b != nil {
		host = b[:meta.ByteSize]
	}
	if c.checksum {
		switch {
		case !r.hasCRC && !c.confirm:
			c.protocolLocked(ds, "write for request %d without a checksum in checksum mode", imm)
			return
		case !r.hasCRC:
			// A peer that confirms sends none for a source it cannot
			// read (device memory, in the provider's default mode): the
			// tensor is taken unverified.
		case host != nil:
			var got uint32
			if wc != nil && wc.HasChecksum && int64(wc.ByteLen) == meta.ByteSize {
				// The provider took it as the bytes landed: the
				// write was the whole tensor, in one piece.
				got = wc.Checksum
			} else {
				got = crc32c.Checksum(host)
			}
			if got != r.crc {
				rv.stats.checksumFailures.Add(1)
				r.tries++
				if rv.retryLocked(r) {
					return
				}
				rv.confirmLocked(r, wire.ConfirmBad)
				err := &ChecksumError{Peer: c.peer, Key: r.key.name, Step: r.key.step, Tries: r.tries, Got: got, Want: r.crc}
				r.hasCRC = false
				rv.finishLocked(r, nil, err, ds)
				return
			}
		default:
			r.hasCRC = false // GPU memory: not verifiable here
		}
	}
	rv.confirmLocked(r, 0)
	if r.path == PathSerialized {
		t, err := tensor.DecodeStringTensor(meta, host, c.opts.maxStrings)
		// The strings were copied out: the buffer is free again.
		_ = r.buf.Free()
		r.buf = nil
		rv.finishLocked(r, t, err, ds)
		return
	}
	if l, ok := r.buf.(Landing); ok {
		r.buf = nil // the landing completes itself
		r.landing = true
		rv.finishLocked(r, nil, nil, ds)
		rv.landedLocked(r, l, ds)
		return
	}
	t, err := tensor.New(meta, r.buf)
	if err == nil {
		r.buf = nil // owned by t now
	}
	rv.finishLocked(r, t, err, ds)
}

// confirmDelay is how long a CONFIRM waits for another control frame
// to ride with (a request of the next Recv, most often) before it goes
// alone: the sender keeps the source that much longer, and a stream of
// Recvs sends no more SENDs than without confirmations.
const confirmDelay = 200 * time.Microsecond

// confirmLocked sends CONFIRM for r's write, with flags (wire.ConfirmBad:
// it arrived corrupted on every try), when the channel confirms
// (Channel.confirm): with the next control frame, or alone after
// confirmDelay.
func (rv *receiver) confirmLocked(r *request, flags uint8) {
	c := rv.c
	if !c.confirm {
		return
	}
	rv.confirms = append(rv.confirms, wire.Message{Type: wire.TypeConfirm, Flags: flags, Req: r.idx})
	rv.stats.confirmsOut.Add(1)
	rv.armConfirmsLocked()
}

// armConfirmsLocked starts the wait of the frames held in rv.confirms
// (CONFIRMs, and in checksum mode a TAKEN) for another frame to ride with.
func (rv *receiver) armConfirmsLocked() {
	if rv.confirmArmed {
		return
	}
	rv.confirmArmed = true
	if rv.confirmTimer == nil {
		rv.confirmTimer = time.AfterFunc(confirmDelay, rv.confirmsDue)
	} else {
		rv.confirmTimer.Reset(confirmDelay)
	}
}

// confirmsDue sends the CONFIRMs that found nothing to ride with.
func (rv *receiver) confirmsDue() {
	c := rv.c
	c.mu.Lock()
	defer c.mu.Unlock()
	rv.confirmArmed = false
	if c.state != stateConnected || len(rv.confirms) == 0 {
		return
	}
	rv.takeConfirmsLocked(true)
	c.flushLocked()
}

// ConfirmNow sends at once the CONFIRMs held for the peer's writes (a
// channel that confirms holds them up to confirmDelay for a frame to ride
// with, and a Go program that sleeps sees a timer that short fire after a
// millisecond): for a caller that will post nothing more to the peer soon
// while the peer waits for them, as a collective's rank about to wait for
// its own sends, whose peer does the same. Without held confirmations it
// does nothing.
func (c *Channel) ConfirmNow() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.state != stateConnected || len(c.rcv.confirms) == 0 {
		return
	}
	c.rcv.takeConfirmsLocked(true)
	c.flushLocked()
}

// takeConfirmsLocked queues the waiting CONFIRMs on the channel, when
// something else is about to go out (a frame queued, or credits to
// return), or always when now.
func (rv *receiver) takeConfirmsLocked(now bool) {
	c := rv.c
	if len(rv.confirms) == 0 || !now && len(c.outq) == 0 && c.owed < c.threshold {
		return
	}
	for i := range rv.confirms {
		m := &rv.confirms[i]
		if m.Type == wire.TypeTaken {
			rv.eager.reported = m.Count
		}
		c.enqueueLocked(m)
	}
	rv.confirms = rv.confirms[:0]
}

// retryLocked asks the sender to write r's tensor again into the same
// buffer, its write having arrived corrupted: a TENSOR_RE_REQUEST for a
// request the sender answered, which a peer that confirms takes as that.
// It reports false when r may not be retried: no confirmations with this
// peer, MaxChecksumRetries reached, a result taken in chunks (parts of it
// went on to the proxy already), or no grant to be had for the buffer.
func (rv *receiver) retryLocked(r *request) bool {
	c := rv.c
	if !c.confirm || r.tries > MaxChecksumRetries || r.chunk > 0 || r.cancelled {
		return false
	}
	mr, ok := c.mem.Region(r.buf.Addr(), r.buf.Len())
	if !ok {
		return false
	}
	if err := rv.grantLocked(r, mr); err != nil {
		c.log.Debug("rendezvous: no grant to ask again for a corrupted write", "peer", c.peer, "key", r.key.name, "step", r.key.step, "err", err)
		return false
	}
	m := wire.Message{Type: wire.TypeReRequest, Req: r.idx}
	m.Addr, m.RKey, m.Capacity = rv.bufTarget(r)
	c.railKeys(&m, r.buf.Addr(), r.buf.Len())
	rv.railGrantsLocked(r, &m)
	c.enqueueLocked(&m)
	rv.stats.checksumRetries.Add(1)
	c.log.Debug("rendezvous: checksum mismatch, asking again", "peer", c.peer, "key", r.key.name, "step", r.key.step, "try", r.tries)
	return true
}

// confirmsAheadLocked copies into b the CONFIRMs queued on the channel, as
// many as fit with room kept for a frame of reserve bytes after them, and
// returns their length. A closing side posts them ahead of its BYE (the
// rest of its queue is dropped), so that the peer knows which of its
// writes arrived intact before the BYE says the channel is done.
func (rv *receiver) confirmsAheadLocked(b []byte, reserve int) int {
	rv.takeConfirmsLocked(true)
	n := 0
	for _, it := range rv.c.outq {
		if it.write != nil || len(it.frame) < wire.HeaderLen || wire.Type(it.frame[1]) != wire.TypeConfirm {
			continue
		}
		if n+len(it.frame)+reserve > len(b) {
			break
		}
		n += copy(b[n:], it.frame)
	}
	return n
}

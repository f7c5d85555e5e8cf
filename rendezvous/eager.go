package rendezvous

import (
	"fmt"
	"unsafe"

	"github.com/gdrlink/gdrlink/internal/crc32c"
	"github.com/gdrlink/gdrlink/internal/wire"
	"github.com/gdrlink/gdrlink/tensor"
)

// Eager tensors (WithEager). A Send of a small host tensor for which no
// request has come goes at once as an EAGER frame, its bytes copied into
// the frame, to a peer that takes them (wire.HelloEager); the Send ends
// when the SEND carrying it completes, or the peer's BYE counts it (in
// checksum mode, with wire.HelloEagerChecksum from the peer, the frame
// carries the CRC-32C of the bytes and the Send ends at the TAKEN or BYE
// that counts it, once the receiver found them intact). The
// receiver hands the frame to the Recv of its key and step: to a Recv
// already waiting (its TENSOR_REQUEST crossed the EAGER: the sender drops
// that request), copying the bytes into its result, or, kept in a block
// of the channel's memory, to the Recv when it comes, which then sends no
// request and takes the block as its result.
//
// Flow: a sender has at most wire.EagerWindow EAGER frames the receiver's
// TAKEN has not counted; past that a Send waits, and goes eagerly when a
// TAKEN makes room unless its request came first. TAKEN counts the frames
// handed to Recvs, sent once takenEvery are owed. Frames arrive in the
// order sent, so a TAKEN of count n comes after frame n-1 arrived, and
// after every request the receiver sent before that frame arrived: a
// request crossing an EAGER of sequence s comes before any TAKEN above s.
// The sender forgets what it keeps of frame s for crossing requests at
// such a TAKEN.

// eagerSender is the sender's side: under the channel's lock.
type eagerSender struct {
	// seq is the number of EAGER frames sent, taken the peer's last
	// TAKEN count (both modulo 2^32).
	seq, taken uint32
	// sent: the key and step of each EAGER not yet counted by a TAKEN, with
	// its sequence number, for a request that crosses it.
	sent map[skey]uint32
	// dropped: the requests dropped for crossing an EAGER, with its
	// sequence number, for a CANCEL that follows them.
	dropped map[uint32]uint32
	// waiting are the keys of Sends that would have gone eagerly but for
	// the window, in the order made: a TAKEN sends those still not
	// requested when it makes room (onTakenLocked).
	waiting []skey
	// pending are the Sends of the EAGER frames whose delivery is not
	// known yet, in sequence order: a SEND's completion (or the peer's
	// BYE, which counts the frames it took in) ends them with nil, the
	// channel's end with its error.
	pending []eagerSend
}

// eagerSend is the Send of EAGER frame seq.
type eagerSend struct {
	seq  uint32
	done func(error)
}

// settle ends, delivered, the Sends of the frames before end.
func (e *eagerSender) settle(end uint32, ds *deliveries) {
	k := 0
	for k < len(e.pending) && int32(e.pending[k].seq-end) < 0 {
		if d := e.pending[k].done; d != nil {
			ds.add(func() { d(nil) })
		}
		k++
	}
	n := copy(e.pending, e.pending[k:])
	clear(e.pending[n:]) // no Send stays reachable from the array
	e.pending = e.pending[:n]
}

// failLocked ends the Sends of every frame not known delivered with err
// (a new connection may send them again) and forgets the rest.
func (e *eagerSender) failLocked(err error, ds *deliveries) {
	for _, p := range e.pending {
		if d := p.done; d != nil {
			ds.add(func() { d(err) })
		}
	}
	clear(e.pending)
	e.pending = e.pending[:0]
	clear(e.sent)
	clear(e.dropped)
	e.waiting = nil
}

// sendEagerLocked sends t eagerly when the peer takes it and the window
// has room, and reports whether it did. A tensor that would go but for
// the window waits for a TAKEN to make room (eagerSender.waiting).
func (s *sender) sendEagerLocked(k skey, t *tensor.Tensor, serr error, done func(error)) bool {
	c := s.c
	if !c.eager || serr != nil || t == nil || len(s.writes) > 0 || c.rcv.pendingLocked() {
		// Writes in flight: the peer's Recvs are asking ahead of the
		// Sends, and a stream goes faster by request (one copy, a
		// write into the result) than eagerly (a copy on each side).
		// A Recv of this side pending: an exchange (a collective's
		// step), whose peer's request is on its way; by request the
		// Send ends when its write is posted, eagerly only when the
		// peer has taken the SEND in, a round trip later.
		return false
	}
	meta := t.Meta()
	if meta.IsDead || meta.ByteSize <= 0 || meta.ByteSize > int64(c.opts.eagerMax) || !meta.DType.DMAable() || t.Device() != tensor.Host {
		return false
	}
	b, err := t.Bytes()
	if err != nil || int64(len(b)) < meta.ByteSize {
		return false
	}
	m := wire.Message{Type: wire.TypeEager, Step: k.step, Name: unsafe.Slice(unsafe.StringData(k.name), len(k.name)), Data: b[:meta.ByteSize]}
	m.Meta.SetMeta(meta)
	if c.checksum {
		m.Flags = wire.EagerChecksum
	}
	if n := m.Len(); n > c.peerSlot || n > c.slot {
		return false
	}
	if s.eager.seq-s.eager.taken >= wire.EagerWindow {
		s.eager.waiting = append(s.eager.waiting, k)
		return false
	}
	if c.checksum {
		m.Checksum = crc32c.Checksum(m.Data)
	}
	// The frame holds a copy of the bytes; the Send ends when its SEND
	// completes (the peer has the frame), in checksum mode when a TAKEN
	// counts it (the peer checked its bytes), or with the channel's error
	// (which a new connection may send it again for).
	c.enqueueEagerLocked(&m, s.eager.seq)
	s.eager.pending = append(s.eager.pending, eagerSend{seq: s.eager.seq, done: done})
	s.eager.sent[k] = s.eager.seq
	s.eager.seq++
	s.stats.eagerOut.Add(1)
	s.stats.bytesOut.Add(uint64(meta.ByteSize))
	c.flushLocked()
	return true
}

// crossedLocked drops the peer's request req for k when it crossed the
// EAGER that carried k, and reports whether it did.
func (s *sender) crossedLocked(k skey, req uint32) bool {
	seq, ok := s.eager.sent[k]
	if !ok {
		return false
	}
	delete(s.eager.sent, k)
	s.eager.dropped[req] = seq
	s.stats.eagerCrossed.Add(1)
	return true
}

// onTakenLocked takes the peer's TAKEN: the window moves, and what was
// kept of the frames it counts goes.
func (s *sender) onTakenLocked(m *wire.Message, ds *deliveries) {
	if m.Count-s.eager.taken > s.eager.seq-s.eager.taken {
		s.c.protocolLocked(ds, "TAKEN counts %d EAGER frames, %d were sent", m.Count, s.eager.seq)
		return
	}
	s.eager.taken = m.Count
	if s.c.checksum {
		// Frames arrive in order, and one whose bytes do not match its
		// checksum fails the channel: a TAKEN of n says frames 0..n-1
		// arrived good.
		s.eager.settle(m.Count, ds)
	}
	for k, seq := range s.eager.sent {
		if int32(seq-m.Count) < 0 {
			delete(s.eager.sent, k)
		}
	}
	for req, seq := range s.eager.dropped {
		if int32(seq-m.Count) < 0 {
			delete(s.eager.dropped, req)
		}
	}
	// Room again: the Sends that wait for it go, those not matched by a
	// request meanwhile.
	q := s.eager.waiting
	for len(q) > 0 && s.eager.seq-s.eager.taken < wire.EagerWindow {
		k := q[0]
		q = q[1:]
		e, ok := s.sends[k]
		if !ok || e.hasReq || !e.has {
			continue
		}
		if s.sendEagerLocked(k, e.t, e.serr, e.done) {
			delete(s.sends, k)
		}
	}
	n := copy(s.eager.waiting, q)
	clear(s.eager.waiting[n:])
	s.eager.waiting = s.eager.waiting[:n]
}

// eagerReceiver is the receiver's side: under the channel's lock.
type eagerReceiver struct {
	// in is the number of EAGER frames arrived, taken the number handed
	// to Recvs, reported the count of the last TAKEN sent.
	in, taken, reported uint32
	// held are the tensors that came before their Recv.
	held map[skey]*eagerHeld
	// spare are byte slices of held tensors taken, for the next ones (at
	// most a window of them, as held is).
	spare [][]byte
}

// eagerHeld is a tensor that came eagerly before its Recv: its bytes in
// a block of the channel's memory, which a Recv takes as its result as
// it is, or, without one (the memory refused), in data.
type eagerHeld struct {
	meta tensor.Meta
	buf  tensor.Buffer
	data []byte
	// checked: the bytes matched the frame's checksum (checksum mode).
	checked bool
}

// bytes is where h's bytes are.
func (h *eagerHeld) bytes() []byte {
	if h.buf != nil {
		return h.buf.Bytes()[:h.meta.ByteSize]
	}
	return h.data
}

// release gives h's memory back: its block to the pool, its slice to the
// spares.
func (rv *receiver) releaseHeld(h *eagerHeld) {
	if h.buf != nil {
		_ = h.buf.Free()
		h.buf = nil
	} else if h.data != nil && len(rv.eager.spare) < wire.EagerWindow {
		rv.eager.spare = append(rv.eager.spare, h.data)
	}
	h.data = nil
}

// onEagerLocked takes an EAGER frame: into the Recv that waits for it, or
// kept for the one to come.
func (rv *receiver) onEagerLocked(m *wire.Message, ds *deliveries) {
	c := rv.c
	if !c.takesEager {
		c.protocolLocked(ds, "EAGER for %q step %d, which this side did not offer to take", printName(m.Name), m.Step)
		return
	}
	if c.checksum && m.Flags&wire.EagerChecksum == 0 {
		c.protocolLocked(ds, "EAGER for %q step %d without a checksum, in checksum mode", printName(m.Name), m.Step)
		return
	}
	if m.Flags&wire.EagerChecksum != 0 {
		if got := crc32c.Checksum(m.Data); got != m.Checksum {
			// Corrupted on the way: nothing of it is delivered, and the
			// channel fails, ending the Send that sent it (not yet
			// counted by a TAKEN) with its error.
			err := &ChecksumError{Peer: c.peer, Key: string(m.Name), Step: m.Step, Tries: 1, Got: got, Want: m.Checksum}
			c.failLocked(fmt.Errorf("%w: from %s: an EAGER frame: %w", ErrProtocol, c.peer, err), ds, stateFailed)
			return
		}
	}
	if int(rv.eager.in-rv.eager.taken) >= wire.EagerWindow {
		c.protocolLocked(ds, "EAGER for %q step %d beyond the window of %d not taken", printName(m.Name), m.Step, wire.EagerWindow)
		return
	}
	k := skey{string(m.Name), m.Step}
	if _, dup := rv.eager.held[k]; dup {
		c.protocolLocked(ds, "a second EAGER for %q step %d", printName(m.Name), m.Step)
		return
	}
	rv.eager.in++
	rv.stats.eagerIn.Add(1)
	h := &eagerHeld{meta: m.Meta.Tensor(), data: m.Data, checked: m.Flags&wire.EagerChecksum != 0}
	if r := rv.byKey[k]; r != nil {
		if rv.eagerIntoLocked(r, h, ds) {
			return
		}
	}
	// The receive buffer is posted again: the bytes wait in a block the
	// Recv will take as its result, or else in a slice of their own.
	if buf, err := c.mem.Alloc(len(m.Data), tensor.Host); err == nil && len(buf.Bytes()) >= len(m.Data) {
		copy(buf.Bytes(), m.Data)
		h.buf, h.data = buf, nil
	} else {
		if err == nil {
			_ = buf.Free()
		}
		var b []byte
		if n := len(rv.eager.spare); n > 0 {
			b, rv.eager.spare = rv.eager.spare[n-1], rv.eager.spare[:n-1]
		}
		h.data = append(b[:0], m.Data...)
	}
	rv.eager.held[k] = h
}

// eagerIntoLocked completes r with h, and reports whether h was taken:
// not when r's result cannot be had (no memory, or none with a host view:
// r then fails, and h waits for the next Recv of its key and step).
func (rv *receiver) eagerIntoLocked(r *request, h *eagerHeld, ds *deliveries) bool {
	c := rv.c
	r.eager, r.hasCRC = true, h.checked
	if h.buf != nil && r.into == nil && r.dev == tensor.Host && h.meta.DType != tensor.String {
		// The block is the result as it is: no copy.
		rv.revokeLocked(r, 0)
		if r.buf != nil {
			_ = r.buf.Free()
		}
		r.buf, r.meta, h.buf = h.buf, h.meta, nil
		rv.eagerDoneLocked(r, h.meta, ds)
		return true
	}
	// A result asked into the caller's tensor takes it here even where its
	// request could not lend it (no grants): nobody writes it remotely.
	_, lending := r.buf.(*lent)
	if r.buf == nil || !r.meta.Equal(h.meta) || r.into != nil && !lending {
		if err := rv.allocResultLocked(r, h.meta); err != nil {
			rv.finishLocked(r, nil, c.resultErrLocked(r.key, h.meta, err), ds)
			return false
		}
	}
	rv.revokeLocked(r, 0) // no write comes
	var b []byte
	if r.buf != nil {
		b = r.buf.Bytes()
	}
	if int64(len(b)) < h.meta.ByteSize {
		rv.finishLocked(r, nil, fmt.Errorf("%w: %q step %d came eagerly, and its result (on %s) has no host memory to copy it into", ErrNoPath, r.key.name, r.key.step, r.dev), ds)
		return false
	}
	copy(b, h.bytes())
	rv.eagerDoneLocked(r, h.meta, ds)
	return true
}

// eagerDoneLocked completes r, whose buf holds the tensor that came
// eagerly, and counts it taken.
func (rv *receiver) eagerDoneLocked(r *request, meta tensor.Meta, ds *deliveries) {
	rv.stats.bytesIn.Add(uint64(meta.ByteSize))
	rv.takenLocked()
	r.path = PathEager
	t, err := tensor.New(meta, r.buf)
	if err == nil {
		r.buf = nil // owned by t now
	}
	rv.finishLocked(r, t, err, ds)
}

// takenEvery is how many EAGER frames handed to Recvs a TAKEN counts: a
// quarter window, so that a sender pushing a stream has three quarters
// still in flight while a TAKEN travels and its sender wakes to it. In
// checksum mode, where the TAKEN ends the Send (eagerSender.settle), one
// also goes for fewer: with the next control frame, or alone after
// confirmDelay, as a CONFIRM does.
const takenEvery = wire.EagerWindow / 4

// takenLocked counts an EAGER frame handed to a Recv, and sends TAKEN once
// takenEvery are owed (in checksum mode also with the next control frame,
// or alone after confirmDelay).
func (rv *receiver) takenLocked() {
	c := rv.c
	rv.eager.taken++
	if c.checksum {
		if n := len(rv.confirms); n > 0 && rv.confirms[n-1].Type == wire.TypeTaken {
			rv.confirms[n-1].Count = rv.eager.taken // counts are cumulative
		} else {
			rv.confirms = append(rv.confirms, wire.Message{Type: wire.TypeTaken, Count: rv.eager.taken})
		}
		if rv.eager.taken-rv.eager.reported >= takenEvery {
			// A quarter window owed: now, so that a sender's window
			// does not wait on the hold.
			rv.takeConfirmsLocked(true)
			c.flushLocked()
			return
		}
		rv.armConfirmsLocked()
		return
	}
	if rv.eager.taken-rv.eager.reported >= takenEvery {
		m := wire.Message{Type: wire.TypeTaken, Count: rv.eager.taken}
		c.enqueueLocked(&m)
		rv.eager.reported = rv.eager.taken
		c.flushLocked()
	}
}

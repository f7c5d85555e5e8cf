package rendezvous

import (
	"errors"
	"fmt"
	"sync/atomic"
	"unicode/utf8"

	"github.com/gdrlink/gdrlink/internal/crc32c"
	"github.com/gdrlink/gdrlink/internal/wire"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

// sender is the sending half of a channel: the tensors handed to Send, the
// peer's requests for them, and the writes that answer those requests. Its
// state is guarded by the channel's lock (see Channel.mu); it queues its
// control messages and writes on the channel, which posts them in order as
// credits allow.
type sender struct {
	c *Channel

	peerNames map[uint32]string     // the peer's name indexes, at most options.namesLimit
	sends     map[skey]*sendEntry   // a Send or a request, not yet matched
	parked    int                   // requests in sends: at most options.pendingLimit
	kept      map[uint32]*sendEntry // answered with META_DATA_RESPONSE, awaiting the re-request
	writes    map[uint64]*sendEntry // writes posted on the channel's queue pair
	striping  map[uint64]*sendEntry // writes whose rail parts are in flight
	// wrs and sges are postWriteLocked's chain, reused under the lock.
	wrs  []verbsio.SendWR
	sges []verbsio.SGE
	// held are the sends that ended (the channel stopped) while a queue
	// pair may still read their bytes, by write sequence: their staging
	// block and their done (which gives the source tensor back) wait until
	// it cannot (holdLocked).
	held      map[uint64]*sendEntry
	nextWrite uint64
	// imms counts the writes with immediate posted on the channel's queue
	// pair; a write's last one is its sendEntry.immEnd. The peer's BYE
	// says how many of them it took in (settleLocked).
	imms uint64
	// errorsQueued counts the ERROR_STATUS in the channel's queue (see
	// Channel.withholdingLocked).
	errorsQueued int
	// awaiting are the writes that wait for the receiver's CONFIRM, by
	// request (checksum mode with confirmations, Channel.confirm): from
	// the time they are queued until the CONFIRM, or until the send ends
	// otherwise. Their sources are kept: a write that arrived corrupted is
	// written again when the receiver asks (TENSOR_RE_REQUEST).
	awaiting map[uint32]*sendEntry
	// pulls are the sends the receiver pulls itself (WithPull), by
	// request, from the answer that said where until its CONFIRM. Their
	// sources are kept until then.
	pulls map[uint32]*sendEntry
	// eager is what the sender keeps of its EAGER frames (eager.go).
	eager eagerSender

	stats sendCounters
}

type sendCounters struct {
	requestsIn, reRequestsIn                        atomic.Uint64
	writesOut, bytesOut, staged, striped, chunksOut atomic.Uint64
	pendingRefused, namesRefused                    atomic.Uint64
	// refused counts the Sends the peer refused (CANCEL with a reason).
	refused atomic.Uint64
	// rewrites counts the writes made again on the peer's request, their
	// first having arrived corrupted; confirmsIn the CONFIRMs received.
	rewrites, confirmsIn atomic.Uint64
	// pullsOut counts the sends offered to the receiver to pull.
	pullsOut atomic.Uint64
	// eagerOut counts the tensors sent eagerly, eagerCrossed the requests
	// dropped for crossing them.
	eagerOut, eagerCrossed atomic.Uint64
}

// statsLocked fills in what the sender holds now.
func (s *sender) statsLocked(st *Stats) {
	for _, e := range s.sends {
		if e.has && !e.hasReq {
			st.SendsPending++
		}
	}
	st.Kept = len(s.kept)
	st.WritesInFlight = len(s.writes) + len(s.striping)
	st.RequestsParked = s.parked
	st.Names = len(s.peerNames)
	for _, e := range s.awaiting {
		if e.written && !e.held {
			st.Unconfirmed++
		}
	}
}

func newSender(c *Channel) sender {
	return sender{
		c: c, peerNames: map[uint32]string{}, sends: map[skey]*sendEntry{}, kept: map[uint32]*sendEntry{},
		writes: map[uint64]*sendEntry{}, striping: map[uint64]*sendEntry{}, held: map[uint64]*sendEntry{}, nextWrite: 1,
		awaiting: map[uint32]*sendEntry{}, pulls: map[uint32]*sendEntry{},
		eager: eagerSender{sent: map[skey]uint32{}, dropped: map[uint32]uint32{}},
	}
}

// peerRequest is what the peer's request for a send asked (its
// TENSOR_REQUEST, or the TENSOR_RE_REQUEST that followed): the request,
// the result buffer to write and how.
type peerRequest struct {
	hasReq     bool
	req        uint32
	reqHasMeta bool
	reqExact   bool
	reqPull    bool // the receiver can pull (wire.ReqPull)
	reqMeta    wire.Meta
	raddr      uint64
	rkey       uint32
	rcap       uint64
	railKeys   []uint32
	// chunkShift: the receiver asked for the write in chunks of
	// 1<<chunkShift bytes (0: one write).
	chunkShift uint8
}

// sendEntry is the sender's side of one key and step: a Send, a request, or
// both once matched.
type sendEntry struct {
	key  skey
	t    *tensor.Tensor
	done func(error)
	serr error
	has  bool // Send or SendError arrived

	peerRequest

	prepared bool
	meta     tensor.Meta
	addr     uintptr
	n        int64
	lkey     uint32
	src      []byte // host view of the bytes written, nil for GPU memory
	stage    tensor.Buffer
	crc      uint32
	crcSent  bool
	crcTaken bool // crc was taken when the tensor was offered (sourceCRC)
	noCRC    bool // checksum mode, but no host view to take one from

	railPending int
	firstChunk  int64 // when striped: the bytes left for the channel's own queue pair

	// posted is how much of a write in chunks (peerRequest.chunkShift) is
	// posted, wseq its write sequence once the first chunk went out.
	posted int64
	wseq   uint64

	// wrsOut counts the work requests of the write posted on the
	// channel's queue pair whose completions have not come back. untilQP:
	// a queue pair may hold work requests of the write that will never be
	// counted here (rail parts, whose completions the rails' pollers see,
	// or the part of a post that failed), so only the queue pairs'
	// destruction ends its reads. held: the send ended while its bytes may
	// still be read, and heldErr is what its done gets once they cannot.
	wrsOut  int
	untilQP bool
	held    bool
	heldErr error
	// immEnd is the number (sender.imms) of the write's last write with
	// immediate, once posted: the peer has the tensor when it took in
	// that many. awaitBye: a held write, fully posted, whose fate a BYE of
	// the peer's may still tell: it does not end on its completions but
	// when a BYE settles it (settleLocked) or, if none comes, once the
	// completions already queued are handled (finishAwaitingLocked, as the
	// completion goroutine stops) or the queue pair is gone (releaseHeld).
	// byeFollowed: it was held because this side closed, so this side's
	// BYE followed it and the peer took it in before hearing of the close
	// if it arrived at all: with no BYE of the peer's it ends delivered if
	// its work requests all completed successfully. localFailed: one of
	// them completed in error.
	immEnd      uint64
	awaitBye    bool
	byeFollowed bool
	localFailed bool
	// seq is the write's sequence in writes (and held), once posted.
	seq uint64

	// With confirmations (Channel.confirm): needConfirm, the write waits
	// in sender.awaiting for the receiver's CONFIRM and the source is kept
	// until then; written, its last work request completed; confirmed,
	// the CONFIRM came (confirmErr: it said the write arrived corrupted
	// every time); rewrite, a TENSOR_RE_REQUEST came for it before its
	// completion did, so it is written again once that comes; retries,
	// how many times it was asked for again. pristine is the source as it
	// was before the test hook (options.corrupt) changed it, put back
	// once the write has read it, as a corruption in flight would leave
	// it.
	needConfirm bool
	written     bool
	confirmed   bool
	confirmErr  error
	rewrite     bool
	retries     int
	pristine    []byte
}

// Send hands t to the peer under key and step. It never waits for the
// network: the tensor is written when the peer's request arrives (or at once
// if it already has). The channel owns t from now on and releases it once
// written or dropped. t should live in registered memory (a pool of the
// channel's Memory); other host tensors are copied into a registered block
// first (counted in Stats.Staged and logged). If Send returns an error, the
// caller keeps t.
func (c *Channel) Send(key string, step int64, t *tensor.Tensor) error {
	if t == nil {
		return fmt.Errorf("%w: nil tensor for %q step %d", ErrBadTensor, key, step)
	}
	return c.SendFunc(key, step, t, func(error) { _ = t.Release() })
}

// SendFunc is Send that gives t back: done runs once with nil when t has been
// written (or needed no write; or, sent eagerly, see WithEager, when the
// peer has the control message that carries a copy of it), or with the
// error that dropped it. t must not
// change until then. In checksum mode with a peer that confirms (see
// WithChecksum), written means confirmed: the receiver checked the bytes,
// and t is kept until it did, so that a write that arrived corrupted can
// be made again; if every try arrived corrupted, done gets a
// *ChecksumError naming the receiver. A write in flight when the channel fails or closes keeps
// t until the queue pair can read it no more: until its work requests
// complete (or are flushed), at the latest until Close has destroyed the
// queue pairs, so done may come only from Close. done runs on the channel's
// completion goroutine (or Close's) and must not block. If SendFunc returns
// an error, done is not called.
func (c *Channel) SendFunc(key string, step int64, t *tensor.Tensor, done func(error)) error {
	if err := checkKey(key); err != nil {
		return err
	}
	if t == nil {
		return fmt.Errorf("%w: nil tensor for %q step %d", ErrBadTensor, key, step)
	}
	return c.snd.put(skey{key, step}, t, nil, done)
}

// SendError answers the peer's Recv of key and step with an error: the peer
// gets ERROR_STATUS with err's text, and its Recv fails with ErrRemote.
func (c *Channel) SendError(key string, step int64, err error) error {
	if e := checkKey(key); e != nil {
		return e
	}
	if err == nil {
		return fmt.Errorf("%w: SendError with a nil error", ErrBadTensor)
	}
	return c.snd.put(skey{key, step}, nil, err, nil)
}

func (s *sender) put(k skey, t *tensor.Tensor, serr error, done func(error)) error {
	c := s.c
	crc, crcTaken := s.sourceCRC(t)
	var ds deliveries
	c.mu.Lock()
	if c.state != stateConnected {
		err := c.stateErrLocked()
		c.mu.Unlock()
		return fmt.Errorf("rendezvous: Send of %q step %d: %w", k.name, k.step, err)
	}
	e, ok := s.sends[k]
	_, eager := s.eager.sent[k]
	if ok && e.has || eager {
		c.mu.Unlock()
		return fmt.Errorf("%w: Send of %q step %d", ErrDuplicate, k.name, k.step)
	}
	if !ok && s.sendEagerLocked(k, t, serr, done) {
		c.mu.Unlock()
		return nil
	}
	if !ok {
		e = &sendEntry{key: k}
	}
	e.t, e.serr, e.done, e.has = t, serr, done, true
	e.crc, e.crcTaken = crc, crcTaken
	if e.hasReq {
		delete(s.sends, k)
		s.parked--
		s.serveLocked(e, &ds)
		c.flushLocked()
	} else {
		s.sends[k] = e
	}
	c.armKeepaliveLocked()
	c.mu.Unlock()
	ds.run()
	return nil
}

// eagerCRCMin is the smallest tensor whose checksum a Send takes as it is
// offered (sourceCRC); a smaller one's takes less time than the lock it
// would add, and is taken when the tensor is written.
const eagerCRCMin = 64 << 10

// sourceCRC takes, in checksum mode, the CRC-32C of a host tensor of at
// least eagerCRCMin bytes as it is offered, on the caller's goroutine and
// without the channel's lock: a Send made ahead of the peer's Recv (as
// producers do) then has its checksum ready when the request comes,
// instead of taking it between the request and the write, and the
// completion goroutine is not held up by it. The checksum is of the bytes
// as they were offered, so a source changed before it is written
// (against Send's contract) arrives as corrupted instead of passing.
// ok is false where it is taken later, when the tensor is written: no
// checksum mode, a small, dead or string tensor (whose bytes are an
// encoding made then), or one without a host view.
func (s *sender) sourceCRC(t *tensor.Tensor) (crc uint32, ok bool) {
	if t == nil {
		return 0, false
	}
	m := t.Meta()
	if m.IsDead || m.DType == tensor.String || m.ByteSize < eagerCRCMin {
		return 0, false
	}
	c := s.c
	c.mu.Lock()
	on := c.checksum && c.state == stateConnected
	c.mu.Unlock()
	if !on {
		return 0, false
	}
	b, err := t.Bytes()
	if err != nil || int64(len(b)) < m.ByteSize {
		return 0, false
	}
	return crc32c.Checksum(b[:m.ByteSize]), true
}

// inFlightLocked reports whether writes are posted whose arrival is not
// known yet, or not confirmed yet.
func (s *sender) inFlightLocked() bool {
	return len(s.writes) > 0 || len(s.striping) > 0 || len(s.awaiting) > 0 || len(s.pulls) > 0
}

// pendingLocked reports whether the sender waits on the peer: a Send or a
// request not matched, a tensor kept for a re-request, or a write in flight.
func (s *sender) pendingLocked() bool {
	return len(s.sends) > 0 || len(s.kept) > 0 || len(s.writes) > 0 || len(s.striping) > 0 || len(s.awaiting) > 0 || len(s.pulls) > 0
}

// failLocked drops everything the sender holds with err. A write posted
// (or being striped) is not given back yet: its source stays with the
// channel until no queue pair can read it (holdLocked).
func (s *sender) failLocked(err error, ds *deliveries) {
	s.eager.failLocked(err, ds)
	for k, e := range s.sends {
		delete(s.sends, k)
		s.dropLocked(e, err, ds)
	}
	s.parked = 0
	for k, e := range s.kept {
		delete(s.kept, k)
		s.dropLocked(e, err, ds)
	}
	for k, e := range s.pulls {
		// The receiver may still be copying, but from memory that
		// stays mapped: at worst it reads the source's next owner's
		// bytes, for a Recv that fails with the channel anyway.
		delete(s.pulls, k)
		s.dropLocked(e, err, ds)
	}
	for k, e := range s.writes {
		delete(s.writes, k)
		s.holdLocked(k, e, err, ds)
	}
	for k, e := range s.striping {
		delete(s.striping, k)
		e.untilQP = true // the rails' parts: released with the queue pairs
		s.holdLocked(k, e, err, ds)
	}
	for _, e := range s.awaiting {
		if e.written && !e.held {
			// Written, not confirmed yet: the CONFIRM may come still,
			// ahead of the peer's BYE (Channel.postByeLocked), and says
			// what arrived; without one the send ends with err.
			e.held, e.heldErr, e.awaitBye = true, err, true
			e.byeFollowed = s.c.state == stateClosed
			s.held[e.seq] = e
		}
	}
}

// holdLocked ends send e, whose write of sequence seq was posted, with err.
// A source tensor (and the staging block it may use) is given back only
// once no queue pair can read it any more, as the result buffers of
// requests are freed only once no peer can write them: a staging block
// or a user's tensor released while a work request still reads it would
// send whatever its next owner puts there. So a write with work requests
// out is held: it ends when the last of them completes, successfully or
// flushed (writeCompletedLocked), or, where the channel cannot count them
// (untilQP), when the queue pairs are destroyed (releaseHeld, from Close).
func (s *sender) holdLocked(seq uint64, e *sendEntry, err error, ds *deliveries) {
	if e.held {
		return
	}
	if e.wrsOut == 0 && !e.untilQP {
		s.dropLocked(e, err, ds)
		return
	}
	e.held, e.heldErr = true, err
	// The write's fate is what the peer's BYE says, which may be among
	// the completions still queued (a write's completion may come before
	// the BYE that counts it, and the channel may have failed before
	// either was handled). With confirmations, what its CONFIRM says,
	// which comes ahead of the BYE.
	e.awaitBye = e.immEnd != 0 && !e.untilQP
	if e.needConfirm {
		e.awaitBye = !e.confirmed && !e.untilQP
		if e.confirmed {
			e.heldErr = e.confirmErr
		}
	}
	e.byeFollowed = s.c.state == stateClosed
	s.held[seq] = e
	e.seq = seq
}

// settledLocked says the peer's BYE came: no held write awaits one any
// more, and those whose work requests all completed end.
func (s *sender) settledLocked(ds *deliveries) {
	for seq, e := range s.held {
		e.awaitBye = false
		if e.wrsOut <= 0 && !e.untilQP {
			delete(s.held, seq)
			s.endHeldLocked(e, ds)
		}
	}
}

// finishAwaitingLocked ends the held writes that waited for a BYE of the
// peer's that did not come, the completion goroutine having handled every
// completion queued: with the error the channel failed with (but see
// unconfirmedLocked).
func (s *sender) finishAwaitingLocked(ds *deliveries) {
	for seq, e := range s.held {
		if e.awaitBye && e.wrsOut <= 0 && !e.untilQP {
			delete(s.held, seq)
			s.unconfirmedLocked(e, false)
			s.endHeldLocked(e, ds)
		}
	}
}

// unconfirmedLocked decides a held write that awaited its CONFIRM when
// neither it nor the peer's BYE will come (the channel failed, or the
// peer's BYE did not come in time), as without confirmations: delivered
// if its write completed while the channel was up (written), which then
// reported it delivered at once, or if completed says so (Close's rule,
// releaseHeld). Reporting it failed would make a tensor the peer may well
// have taken look lost, and a Send that failed must be safe to make
// again. A write the receiver found corrupted and asked for again is not
// written (its rewrite is queued or dropped), so it is never taken for
// delivered here.
func (s *sender) unconfirmedLocked(e *sendEntry, completed bool) {
	if e.needConfirm && !e.confirmed && (e.written || completed) {
		e.heldErr = nil
		s.stats.writesOut.Add(1)
		s.stats.bytesOut.Add(uint64(e.n))
	}
}

// settleLocked takes the count of writes with immediate that the peer's
// BYE says it took in (wire.ByeImms): every write whose last write with
// immediate is among them arrived, and its send ends delivered (its source
// given back once no work request reads it); the others did not, and end
// with the error the channel stops with. RC delivers a queue pair's writes
// in the order they were posted, so the count names them. A count beyond
// what this side posted is the peer's mistake, and settles nothing.
func (s *sender) settleLocked(count uint32, ds *deliveries) {
	behind := uint32(s.imms) - count
	if uint64(behind) > s.imms {
		s.c.log.Warn("rendezvous: BYE counts more writes than were sent", "peer", s.c.peer, "count", count, "sent", s.imms)
		return
	}
	in := s.imms - uint64(behind)
	// With confirmations, a write that arrived is delivered only if its
	// CONFIRM said so (onConfirmLocked): the count does not say whether
	// its checksum matched.
	arrived := func(e *sendEntry) bool { return e.immEnd != 0 && e.immEnd <= in && !e.needConfirm }
	for seq, e := range s.writes {
		if !arrived(e) {
			continue // failed with the channel
		}
		delete(s.writes, seq)
		s.stats.writesOut.Add(1)
		s.stats.bytesOut.Add(uint64(e.n))
		s.holdLocked(seq, e, nil, ds)
		e.awaitBye = false
	}
	for _, e := range s.held {
		if arrived(e) {
			e.heldErr = nil
		}
	}
	// The caller ends them (settledLocked).
}

// awaitingLocked reports whether a held write waits for completions of the
// channel's queue pair (the completion goroutine keeps polling for them).
func (s *sender) awaitingLocked() bool {
	for _, e := range s.held {
		if e.wrsOut > 0 && !e.untilQP {
			return true
		}
	}
	return false
}

// releaseHeld ends every held send: the queue pairs are destroyed, so
// nothing reads their bytes any more.
func (s *sender) releaseHeld() {
	var ds deliveries
	s.c.mu.Lock()
	for k, e := range s.held {
		delete(s.held, k)
		completed := e.awaitBye && e.byeFollowed && e.wrsOut <= 0 && !e.localFailed
		switch {
		case e.needConfirm && e.awaitBye:
			s.unconfirmedLocked(e, completed)
		case completed && !e.needConfirm:
			e.heldErr = nil // completed, and no BYE said otherwise
		}
		s.endHeldLocked(e, &ds)
	}
	s.c.mu.Unlock()
	ds.run()
}

// endHeldLocked gives a held send back: its staging block is freed and its
// done runs with the error it was dropped with.
func (s *sender) endHeldLocked(e *sendEntry, ds *deliveries) {
	e.held = false
	s.unawaitLocked(e)
	s.restoreLocked(e)
	if e.stage != nil {
		_ = e.stage.Free()
		e.stage = nil
	}
	if done := e.done; done != nil {
		e.done = nil
		err := e.heldErr
		ds.add(func() { done(err) })
	}
}

// onRequestLocked takes the peer's TENSOR_REQUEST: it resolves the name
// (defining it if the request carries it), then serves the request if its
// Send is here, or parks it until the Send comes. Both the names and the
// parked requests are bounded (WithMaxNames, WithMaxPendingRequests): a
// request beyond either is refused with ERROR_STATUS (wire.CodeLimit), and
// nothing of it is kept. A name is kept even when its request is then
// refused for the other bound, so that the peer's later requests may use
// its index. The refusals take no memory beyond their queued ERROR_STATUS,
// each about the size of a request, and a long queue of those makes the
// channel hold back the peer's credits (Channel.withholdingLocked).
func (s *sender) onRequestLocked(m *wire.Message, ds *deliveries) {
	c := s.c
	s.stats.requestsIn.Add(1)
	name, known := s.peerNames[m.NameIndex]
	switch {
	case m.Flags&wire.ReqName != 0 && known:
		if name != string(m.Name) {
			c.protocolLocked(ds, "name index %d redefined from %q to %q", m.NameIndex, name, m.Name)
			return
		}
	case m.Flags&wire.ReqName != 0:
		if n := c.opts.namesLimit(); len(s.peerNames) >= n {
			s.refuseLocked(m, boundNames, "WithMaxNames", n, printName(m.Name), fmt.Sprintf("it has defined the %d names it may; name index %d refused", n, m.NameIndex))
			return
		}
		name = string(m.Name)
		s.peerNames[m.NameIndex] = name
	case !known:
		if n := c.opts.namesLimit(); len(s.peerNames) >= n {
			// The index of a name refused above: the table is full, and
			// stays full, so refuse again rather than fail the channel.
			s.refuseLocked(m, boundNames, "WithMaxNames", n, fmt.Sprintf("name index %d", m.NameIndex), fmt.Sprintf("it has defined the %d names it may; the index is one refused", n))
			return
		}
		c.protocolLocked(ds, "request %d uses undefined name index %d", m.Req, m.NameIndex)
		return
	}
	k := skey{name, m.Step}
	if s.crossedLocked(k, m.Req) {
		return
	}
	e, ok := s.sends[k]
	if ok && e.hasReq {
		s.sendErrorLocked(m.Req, wire.CodeBadRequest, fmt.Sprintf("%s step %d is already requested", printName([]byte(name)), m.Step))
		return
	}
	if !ok {
		if n := c.opts.pendingLimit(); s.parked >= n {
			s.refuseLocked(m, boundPending, "WithMaxPendingRequests", n, printName([]byte(name)), fmt.Sprintf("%d of its requests for tensors not sent yet wait here", s.parked))
			return
		}
		e = &sendEntry{key: k}
	}
	e.hasReq, e.req = true, m.Req
	e.reqHasMeta = m.Flags&wire.ReqMeta != 0
	e.reqExact = m.Flags&wire.ReqExact != 0
	e.reqPull = m.Flags&wire.ReqPull != 0
	if e.reqHasMeta {
		e.reqMeta = m.Meta
	}
	e.raddr, e.rkey, e.rcap = m.Addr, m.RKey, m.Capacity
	e.railKeys = append(e.railKeys[:0], m.RailKeys[:m.NumRailKeys]...)
	e.chunkShift = m.ChunkShift // 0 unless wire.ReqChunks
	if e.has {
		delete(s.sends, k)
		s.serveLocked(e, ds)
		return
	}
	s.sends[k] = e
	s.parked++
}

// refuseLocked refuses the peer's request m for bound b, the option opt
// at value n (what is the tensor's name as printed, why the state of the
// bound): ERROR_STATUS with wire.CodeLimit to the peer, whose text is just
// the bound and its value ("WithMaxPendingRequests=4096"), so that the
// answer to a flood takes about the room of the flood (a frame of 43 bytes
// against a request's 45 at least); a count in Stats and a log line here,
// with the details. Nothing of the request is kept.
func (s *sender) refuseLocked(m *wire.Message, b bound, opt string, n int, what, why string) {
	c := s.c
	if b == boundNames {
		s.stats.namesRefused.Add(1)
	} else {
		s.stats.pendingRefused.Add(1)
	}
	text := fmt.Sprintf("%s=%d", opt, n)
	err := fmt.Errorf("%w: %s: request %d of peer %s for %s step %d refused: %s", ErrLimit, text, m.Req, c.peer, what, m.Step, why)
	c.logRefusalLocked(b, err, "peer", c.peer, "req", m.Req, "key", what, "step", m.Step)
	s.sendErrorLocked(m.Req, wire.CodeLimit, text)
}

// printName quotes a peer's name for errors and logs, cut to 64 bytes.
func printName(b []byte) string {
	const most = 64
	if len(b) <= most {
		return fmt.Sprintf("%q", b)
	}
	return fmt.Sprintf("%q... (%d bytes)", b[:most], len(b))
}

// serveLocked answers a matched request: a write when the receiver's
// meta-data matches, META_DATA_RESPONSE otherwise (keeping the tensor for the
// re-request), a final META_DATA_RESPONSE for dead and empty tensors.
func (s *sender) serveLocked(e *sendEntry, ds *deliveries) {
	c := s.c
	if e.serr != nil {
		s.sendErrorLocked(e.req, wire.CodeSender, e.serr.Error())
		return
	}
	if s.pullLocked(e) {
		return
	}
	if err := s.prepareLocked(e, ds); err != nil {
		if err == errStaging {
			return // served again once staged
		}
		s.sendErrorLocked(e.req, wire.CodeInternal, err.Error())
		s.dropLocked(e, err, ds)
		return
	}
	meta := e.meta
	if meta.IsDead || meta.ByteSize == 0 {
		m := wire.Message{Type: wire.TypeMetaResponse, Flags: wire.RespFinal, Req: e.req}
		m.Meta.SetMeta(meta)
		c.enqueueLocked(&m)
		s.dropLocked(e, nil, ds)
		return
	}
	if e.reqHasMeta && e.reqMeta.Equal(meta) && e.raddr != 0 && e.rcap >= uint64(meta.ByteSize) {
		s.queueWriteLocked(e)
		return
	}
	if e.reqHasMeta && !e.reqExact && e.raddr != 0 && e.rcap >= uint64(meta.ByteSize) && e.reqMeta.DType == meta.DType && !e.reqMeta.Dead {
		// Changed, but it fits the buffer: say so and write at once.
		m := wire.Message{Type: wire.TypeMetaResponse, Flags: wire.RespWriteFollows, Req: e.req}
		m.Meta.SetMeta(meta)
		if c.checksum && !e.noCRC {
			m.Flags |= wire.RespChecksum
			m.Checksum = e.crc
			e.crcSent = true
		}
		c.enqueueLocked(&m)
		s.queueWriteLocked(e)
		return
	}
	m := wire.Message{Type: wire.TypeMetaResponse, Req: e.req}
	m.Meta.SetMeta(meta)
	if c.checksum && !e.noCRC {
		m.Flags |= wire.RespChecksum
		m.Checksum = e.crc
		e.crcSent = true
	}
	c.enqueueLocked(&m)
	s.kept[e.req] = e
}

// errStaging says a source is being staged by the proxy (WithProxy).
var errStaging = errors.New("rendezvous: staging")

// prepareLocked finds (or makes) registered bytes to write from. A device
// source the NIC cannot read goes to the proxy (after the lock, through
// ds) and errStaging is returned.
func (s *sender) prepareLocked(e *sendEntry, ds *deliveries) error {
	c := s.c
	if e.prepared {
		return nil
	}
	t := e.t
	meta := t.Meta()
	e.meta = meta
	if meta.IsDead || meta.ByteSize == 0 {
		e.prepared = true
		return nil
	}
	n := int(meta.ByteSize)
	if meta.DType == tensor.String {
		vals, err := t.Strings()
		if err != nil {
			return fmt.Errorf("%w: %q step %d: %w", ErrBadTensor, e.key.name, e.key.step, err)
		}
		blk, err := c.mem.Alloc(n, tensor.Host)
		if err != nil {
			return fmt.Errorf("rendezvous: staging %d bytes of strings: %w", n, err)
		}
		hb := blk.Bytes()
		enc := tensor.AppendStrings(hb[:0:n], vals)
		mr, ok := c.mem.Region(blk.Addr(), n)
		if len(enc) != n || !ok || &enc[0] != &hb[0] {
			_ = blk.Free()
			return fmt.Errorf("%w: %q step %d: encoding of %d bytes, meta-data says %d", ErrBadTensor, e.key.name, e.key.step, len(enc), n)
		}
		e.stage, e.addr, e.lkey, e.src = blk, blk.Addr(), mr.LKey(), enc
	} else {
		buf := t.Buffer()
		if buf == nil {
			return fmt.Errorf("%w: %q step %d has no buffer", ErrBadTensor, e.key.name, e.key.step)
		}
		host, herr := t.Bytes()
		if herr != nil && buf.Bytes() != nil {
			return fmt.Errorf("%w: %q step %d: %w", ErrBadTensor, e.key.name, e.key.step, herr)
		}
		if mr, ok := c.mem.Region(buf.Addr(), n); ok {
			e.addr, e.lkey, e.src = buf.Addr(), mr.LKey(), host
		} else {
			if host == nil && c.opts.stager != nil {
				st := c.opts.stager
				ds.add(func() { st.Stage(buf, n, func(sb tensor.Buffer, err error) { s.staged(e, n, sb, err) }) })
				return errStaging
			}
			if host == nil {
				return fmt.Errorf("%w: %q step %d: %s memory at %#x is not registered and has no host view (and no proxy stages it)", ErrBadTensor, e.key.name, e.key.step, buf.Device(), buf.Addr())
			}
			blk, err := c.mem.Alloc(n, tensor.Host)
			if err != nil {
				return fmt.Errorf("rendezvous: staging %d bytes: %w", n, err)
			}
			mr, ok := c.mem.Region(blk.Addr(), n)
			if !ok {
				_ = blk.Free()
				return fmt.Errorf("%w: staging block at %#x is not registered", ErrBadTensor, blk.Addr())
			}
			sb := blk.Bytes()[:n]
			copy(sb, host)
			e.stage, e.addr, e.lkey, e.src = blk, blk.Addr(), mr.LKey(), sb
			s.stats.staged.Add(1)
			c.log.Debug("rendezvous: staged source", "key", e.key.name, "step", e.key.step, "bytes", n, "reason", "source not in registered memory")
		}
	}
	e.n = int64(n)
	if c.checksum {
		switch {
		case e.src == nil && c.confirm && !c.opts.checksumSet:
			// Device memory the CPU cannot read, in the provider's
			// default mode: written without a checksum (the receiver
			// takes it unverified, Transfer.Checksummed false).
			e.noCRC = true
		case e.src == nil:
			return fmt.Errorf("%w: checksum mode needs a host view of %q step %d", ErrBadTensor, e.key.name, e.key.step)
		case !e.crcTaken:
			e.crc = crc32c.Checksum(e.src)
		}
	}
	e.prepared = true
	return nil
}

func (s *sender) queueWriteLocked(e *sendEntry) {
	c := s.c
	if c.checksum && !e.crcSent && !e.noCRC {
		m := wire.Message{Type: wire.TypeChecksum, Req: e.req, Checksum: e.crc}
		c.enqueueLocked(&m)
		e.crcSent = true
	}
	if c.confirm && !e.needConfirm {
		e.needConfirm = true
		s.awaiting[e.req] = e
	}
	if c.opts.corrupt != nil && e.src != nil {
		if e.pristine == nil {
			e.pristine = append([]byte(nil), e.src...)
		}
		c.opts.corrupt(e.key.name, e.key.step, e.src)
	}
	c.pushLocked(outItem{write: e})
}

// restoreLocked puts back a source the test hook changed (options.corrupt)
// once no work request reads it.
func (s *sender) restoreLocked(e *sendEntry) {
	if e.pristine != nil {
		copy(e.src, e.pristine)
		e.pristine = nil
	}
}

// unawaitLocked takes e out of the writes awaiting a CONFIRM.
func (s *sender) unawaitLocked(e *sendEntry) {
	if e.needConfirm && s.awaiting[e.req] == e {
		delete(s.awaiting, e.req)
	}
}

// onConfirmLocked takes the receiver's CONFIRM for a write: it arrived
// intact (the send ends delivered) or, with ConfirmBad, corrupted on every
// try (it ends with a *ChecksumError). It is taken on a stopped channel
// too: CONFIRMs come ahead of the peer's BYE and say which of the held
// writes arrived.
func (s *sender) onConfirmLocked(m *wire.Message, ds *deliveries) {
	c := s.c
	s.stats.confirmsIn.Add(1)
	if e, ok := s.pulls[m.Req]; ok {
		s.onPullConfirmLocked(e, m, ds)
		return
	}
	e, ok := s.awaiting[m.Req]
	if !ok || e.confirmed || e.rewrite || (!e.written && e.immEnd == 0) {
		if c.state == stateConnected {
			c.protocolLocked(ds, "%s for request %d, which awaits none", m.Type, m.Req)
		}
		return
	}
	e.confirmed = true
	if m.Flags&wire.ConfirmBad != 0 {
		e.confirmErr = &ChecksumError{Peer: c.peer, Key: e.key.name, Step: e.key.step, Tries: e.retries + 1, Sending: true}
	} else {
		s.stats.writesOut.Add(1)
		s.stats.bytesOut.Add(uint64(e.n))
	}
	if e.held {
		e.heldErr, e.awaitBye = e.confirmErr, false
		if e.wrsOut <= 0 && !e.untilQP {
			delete(s.held, e.seq)
			s.endHeldLocked(e, ds)
		}
		return
	}
	if e.written {
		s.unawaitLocked(e)
		s.dropLocked(e, e.confirmErr, ds)
	}
	// Otherwise its completion ends it (writeDoneLocked).
}

// rewriteLocked writes e again, to the buffer the peer's
// TENSOR_RE_REQUEST named: its first write arrived corrupted.
func (s *sender) rewriteLocked(e *sendEntry) {
	e.posted, e.wseq, e.firstChunk, e.railPending, e.immEnd = 0, 0, 0, 0, 0
	e.written, e.untilQP, e.localFailed = false, false, false
	// The checksum goes again ahead of the write: the frame that carried
	// it may be what was corrupted on the way.
	e.crcSent = false
	s.stats.rewrites.Add(1)
	s.c.log.Debug("rendezvous: writing again, the receiver found the write corrupted", "peer", s.c.peer, "key", e.key.name, "step", e.key.step, "retry", e.retries)
	s.queueWriteLocked(e)
}

// onRetryLocked takes a TENSOR_RE_REQUEST for a request whose write
// awaits its CONFIRM: the write arrived corrupted, and the receiver asks
// for it again (at most MaxChecksumRetries times).
func (s *sender) onRetryLocked(e *sendEntry, m *wire.Message, ds *deliveries) {
	c := s.c
	switch {
	case e.confirmed || e.rewrite || (!e.written && e.immEnd == 0):
		c.protocolLocked(ds, "%s for request %d, whose write is not complete", m.Type, m.Req)
		return
	case e.retries >= MaxChecksumRetries:
		c.protocolLocked(ds, "%s for request %d asks for its write a %d-th time, at most %d", m.Type, m.Req, e.retries+2, 1+MaxChecksumRetries)
		return
	case m.Addr == 0 || m.Capacity < uint64(e.n):
		c.protocolLocked(ds, "%s for request %d: buffer at %#x of %d bytes for %d", m.Type, m.Req, m.Addr, m.Capacity, e.n)
		return
	}
	e.retries++
	s.stats.reRequestsIn.Add(1)
	e.raddr, e.rkey, e.rcap = m.Addr, m.RKey, m.Capacity
	e.railKeys = append(e.railKeys[:0], m.RailKeys[:m.NumRailKeys]...)
	e.chunkShift = m.ChunkShift
	if !e.written {
		e.rewrite = true // written again once its completion comes
		return
	}
	s.rewriteLocked(e)
}

func (s *sender) onReRequestLocked(m *wire.Message, ds *deliveries) {
	e, ok := s.kept[m.Req]
	if !ok {
		if e, ok := s.awaiting[m.Req]; ok {
			s.onRetryLocked(e, m, ds)
			return
		}
		s.c.protocolLocked(ds, "%s for request %d, which awaits none", m.Type, m.Req)
		return
	}
	delete(s.kept, m.Req)
	s.stats.reRequestsIn.Add(1)
	e.raddr, e.rkey, e.rcap = m.Addr, m.RKey, m.Capacity
	e.railKeys = append(e.railKeys[:0], m.RailKeys[:m.NumRailKeys]...)
	e.chunkShift = m.ChunkShift
	if e.raddr == 0 || e.rcap < uint64(e.n) {
		s.sendErrorLocked(e.req, wire.CodeTooSmall, fmt.Sprintf("%q step %d needs %d bytes, buffer at %#x holds %d", e.key.name, e.key.step, e.n, e.raddr, e.rcap))
		s.dropLocked(e, fmt.Errorf("%w: receiver's buffer too small", ErrRemote), ds)
		return
	}
	s.queueWriteLocked(e)
}

func (s *sender) onCancelLocked(m *wire.Message, ds *deliveries) {
	if _, ok := s.eager.dropped[m.Req]; ok {
		// A request dropped for crossing an EAGER, withdrawn: its Recv
		// ends with this answer (the tensor waits there for the next).
		delete(s.eager.dropped, m.Req)
		s.sendErrorLocked(m.Req, wire.CodeCancelled, "cancelled by the receiver")
		return
	}
	if _, ok := s.pulls[m.Req]; ok {
		return // the receiver's CONFIRM follows: it may be copying still
	}
	if e, ok := s.kept[m.Req]; ok && m.Code != 0 {
		// Refused: the receiver cannot take the tensor. The Send fails
		// with the reason and its tensor goes back.
		delete(s.kept, m.Req)
		s.sendErrorLocked(m.Req, wire.CodeCancelled, "cancelled by the receiver")
		s.stats.refused.Add(1)
		err := &RefusedError{Peer: s.c.peer, Key: e.key.name, Step: e.key.step, Meta: e.meta, Reason: refusalReason(m.Code), code: m.Code}
		s.c.log.Debug("rendezvous: tensor refused by the receiver", "peer", s.c.peer, "key", e.key.name, "step", e.key.step, "err", err)
		s.dropLocked(e, err, ds)
		return
	}
	if e, ok := s.kept[m.Req]; ok {
		// Matched but not written: the tensor waits for the next request
		// of its key and step.
		delete(s.kept, m.Req)
		s.sendErrorLocked(m.Req, wire.CodeCancelled, "cancelled by the receiver")
		e.hasReq, e.reqHasMeta, e.crcSent = false, false, false
		if _, taken := s.sends[e.key]; taken {
			s.dropLocked(e, fmt.Errorf("%w: by %s for %q step %d", ErrCancelled, s.c.peer, e.key.name, e.key.step), ds)
			return
		}
		s.sends[e.key] = e
		return
	}
	for k, e := range s.sends {
		if e.hasReq && e.req == m.Req {
			e.hasReq = false
			if !e.has {
				delete(s.sends, k)
				s.parked--
			}
			s.sendErrorLocked(m.Req, wire.CodeCancelled, "cancelled by the receiver")
			return
		}
	}
	// The write is on its way or done; its completion ends the request.
}

func (s *sender) sendErrorLocked(req uint32, code wire.Code, text string) {
	if len(text) > wire.MaxText {
		text = text[:wire.MaxText]
		for !utf8.ValidString(text) && len(text) > 0 {
			text = text[:len(text)-1]
		}
	}
	m := wire.Message{Type: wire.TypeError, Req: req, Code: code, Text: []byte(text)}
	s.c.enqueueLocked(&m)
	s.errorsQueued++
}

// dropLocked ends a send: its staging block is freed and done runs after
// the lock with err. A held send (holdLocked) is left alone: it ends once
// no queue pair reads it.
func (s *sender) dropLocked(e *sendEntry, err error, ds *deliveries) {
	c := s.c
	if e.held {
		return
	}
	s.unawaitLocked(e)
	s.restoreLocked(e)
	if e.stage != nil {
		if c.state == stateConnected || err == nil {
			_ = e.stage.Free()
		} else {
			c.orphans = append(c.orphans, e.stage)
		}
		e.stage = nil
	}
	if done := e.done; done != nil {
		e.done = nil
		ds.add(func() { done(err) })
	}
}

// staged resumes a send whose source the proxy copied to host memory.
func (s *sender) staged(e *sendEntry, n int, sb tensor.Buffer, err error) {
	c := s.c
	var ds deliveries
	c.mu.Lock()
	defer func() {
		c.mu.Unlock()
		ds.run()
	}()
	if err == nil && c.state != stateConnected {
		err = c.stateErrLocked()
	}
	var mr verbsio.MemoryRegion
	if err == nil {
		var ok bool
		if mr, ok = c.mem.Region(sb.Addr(), n); !ok || sb.Bytes() == nil {
			err = fmt.Errorf("%w: staged copy at %#x is not registered host memory", ErrBadTensor, sb.Addr())
		}
	}
	if err != nil {
		if sb != nil {
			_ = sb.Free()
		}
		err = fmt.Errorf("rendezvous: staging %q step %d: %w", e.key.name, e.key.step, err)
		if c.state == stateConnected {
			s.sendErrorLocked(e.req, wire.CodeInternal, err.Error())
			c.flushLocked()
		}
		s.dropLocked(e, err, &ds)
		return
	}
	e.stage, e.addr, e.lkey, e.src, e.n = sb, sb.Addr(), mr.LKey(), sb.Bytes()[:n], int64(n)
	if c.checksum {
		e.crc = crc32c.Checksum(e.src)
	}
	e.prepared = true
	s.stats.staged.Add(1)
	c.log.Debug("rendezvous: staged source", "key", e.key.name, "step", e.key.step, "bytes", n, "reason", "device memory the NIC cannot read, copied by the proxy")
	s.serveLocked(e, &ds)
	c.flushLocked()
}

// writeCompletedLocked counts a completion, of status ok or not, of a
// work request of write seq on the channel's queue pair: once the last of a
// held write's is in, the queue pair reads its bytes no more and it ends
// (a write awaiting the peer's BYE, all of whose work requests succeeded,
// waits for it).
func (s *sender) writeCompletedLocked(seq uint64, ok bool, ds *deliveries) {
	if e, found := s.held[seq]; found {
		if !ok {
			e.localFailed, e.awaitBye = true, false
		}
		if e.wrsOut--; e.wrsOut <= 0 && !e.untilQP && !e.awaitBye {
			delete(s.held, seq)
			s.endHeldLocked(e, ds)
		}
		return
	}
	if e, ok := s.writes[seq]; ok {
		e.wrsOut--
	}
}

// writeDoneLocked ends write seq once its last work request completed.
func (s *sender) writeDoneLocked(seq uint64, ds *deliveries) {
	e, ok := s.writes[seq]
	if !ok {
		return
	}
	delete(s.writes, seq)
	if e.needConfirm {
		s.restoreLocked(e)
		e.written = true
		switch {
		case e.rewrite:
			e.rewrite = false
			s.rewriteLocked(e)
		case e.confirmed:
			s.unawaitLocked(e)
			s.dropLocked(e, e.confirmErr, ds)
		}
		// Otherwise the source is kept for the CONFIRM.
		return
	}
	s.stats.writesOut.Add(1)
	s.stats.bytesOut.Add(uint64(e.n))
	s.dropLocked(e, nil, ds)
}

// postWriteLocked posts the write of e: chunks of at most the device's
// largest message, the last with the request index as immediate. A write
// the receiver asked for in chunks goes to postChunksLocked. lead, when
// not nil, is a work request posted in the same chain ahead of the write
// (Channel.writeNextLocked says for which writes); it is posted when
// postWriteLocked returns true, not when it returns false with the channel
// up (no room in the send queue), and perhaps when the post failed (the
// channel is then lost: a provider may post part of a chain).
func (s *sender) postWriteLocked(e *sendEntry, lead *verbsio.SendWR) bool {
	c := s.c
	if e.chunkShift != 0 && e.n > int64(1)<<e.chunkShift {
		if lead != nil {
			return false
		}
		return s.postChunksLocked(e)
	}
	if lead == nil && e.firstChunk == 0 && s.stripeLocked(e) {
		return true // the rest is posted when the rails' parts complete
	}
	n := e.n
	if e.firstChunk > 0 {
		n = e.firstChunk
	}
	maxMsg := c.maxMsg()
	chunks := int((n + maxMsg - 1) / maxMsg)
	need := chunks
	if lead != nil {
		need++
	}
	if c.sqOut+need > c.sqMax {
		return false
	}
	seq := s.nextWrite
	s.nextWrite++
	// The chain and its SGEs are the sender's, reused under the lock: the
	// provider copies what it needs before PostSend returns.
	if cap(s.wrs) < need {
		s.wrs, s.sges = make([]verbsio.SendWR, 0, need), make([]verbsio.SGE, need)
	}
	wrs := s.wrs[:0]
	if lead != nil {
		wrs = append(wrs, *lead)
	}
	for off := int64(0); off < n; off += maxMsg {
		l := min(maxMsg, n-off)
		last := off+l == n
		k := len(wrs)
		s.sges[k] = verbsio.SGE{Addr: e.addr + uintptr(off), Length: uint32(l), LKey: e.lkey}
		wr := verbsio.SendWR{
			WRID: wridWrite | seq<<8, Op: verbsio.OpWrite, Signaled: true,
			SG:         s.sges[k : k+1 : k+1],
			RemoteAddr: e.raddr + uint64(off), RKey: e.rkey,
		}
		if last {
			wr.WRID |= 1
			wr.Op = verbsio.OpWriteImm
			wr.Imm = e.req
		}
		wrs = append(wrs, wr)
	}
	s.writes[seq] = e
	e.seq = seq
	if err := c.qp.PostSend(wrs); err != nil {
		// Part of the chain may be posted: the source stays until the
		// queue pair is gone.
		delete(s.writes, seq)
		e.untilQP = true
		var ds deliveries
		s.holdLocked(seq, e, err, &ds)
		c.lostLocked(err, &ds)
		c.runAsync(ds)
		return false
	}
	e.wrsOut += chunks
	c.sqOut += chunks
	c.credits--
	s.imms++
	e.immEnd = s.imms
	return true
}

// postChunksLocked posts what it can of a write the receiver asked for in
// chunks (wire.ReqChunks): each chunk ends with a write with immediate
// naming the request, so the receiver hears of every chunk as it lands.
// Every chunk consumes one of the receiver's posted receives, so each takes
// a credit, one staying in reserve as for any other item; a chunk also
// needs send-queue room for its work requests. It reports whether the whole
// write is posted; if not, the rest stays at the head of the queue and goes
// out as credits come back (a long tensor never overruns the receiver's
// ring, whatever its depth). All chunks go over the channel's own queue
// pair, whose order makes the receiver's count of chunks name their
// offsets.
func (s *sender) postChunksLocked(e *sendEntry) bool {
	c := s.c
	chunk := int64(1) << e.chunkShift
	maxMsg := c.maxMsg()
	per := int((chunk + maxMsg - 1) / maxMsg)
	if e.wseq == 0 {
		e.wseq = s.nextWrite
		s.nextWrite++
		s.writes[e.wseq] = e
		e.seq = e.wseq
	}
	var wrs []verbsio.SendWR
	credits, sq, chunks := c.credits, c.sqOut, 0
	for e.posted < e.n && credits > 1 && sq+per <= c.sqMax {
		end := min(e.posted+chunk, e.n)
		for off := e.posted; off < end; off += maxMsg {
			l := min(maxMsg, end-off)
			wr := verbsio.SendWR{
				WRID: wridWrite | e.wseq<<8, Op: verbsio.OpWrite, Signaled: true,
				SG:         []verbsio.SGE{{Addr: e.addr + uintptr(off), Length: uint32(l), LKey: e.lkey}},
				RemoteAddr: e.raddr + uint64(off), RKey: e.rkey,
			}
			if off+l == end {
				wr.Op, wr.Imm = verbsio.OpWriteImm, e.req
				if end == e.n {
					wr.WRID |= 1
				}
			}
			wrs = append(wrs, wr)
			sq++
		}
		e.posted = end
		credits--
		chunks++
	}
	if len(wrs) > 0 {
		if err := c.qp.PostSend(wrs); err != nil {
			// Earlier chunks, and part of this chain, may be posted:
			// the source stays until the queue pair is gone.
			delete(s.writes, e.wseq)
			e.untilQP = true
			var ds deliveries
			s.holdLocked(e.wseq, e, err, &ds)
			c.lostLocked(err, &ds)
			c.runAsync(ds)
			return false
		}
		e.wrsOut += len(wrs)
		c.sqOut, c.credits = sq, credits
		s.stats.chunksOut.Add(uint64(chunks))
		s.imms += uint64(chunks) // one write with immediate per chunk
		if e.posted == e.n {
			e.immEnd = s.imms
		}
	}
	return e.posted == e.n
}

package rendezvous

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/bits"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/internal/hostid"
	"github.com/gdrlink/gdrlink/internal/wire"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

// Work request IDs carry their kind in the top byte.
const (
	wridRecv  uint64 = 1 << 56
	wridCtrl  uint64 = 2 << 56
	wridWrite uint64 = 3 << 56
	wridKind  uint64 = 0xff << 56
)

// maxInline is the largest control SEND carried inline when the device can.
const maxInline = 256

type chanState uint8

const (
	stateNew chanState = iota
	stateConnected
	stateFailed
	stateClosed
)

// skey names a tensor on a channel: key and step.
type skey struct {
	name string
	step int64
}

// Channel is one side of the tensor protocol with one peer, over one queue
// pair. It is safe for concurrent use. Make one with New, trade Hello with
// the peer through a bootstrap, then Connect.
//
// A channel joins a sender (send.go: Send and the peer's requests) and a
// receiver (recv.go: Recv and the peer's answers) over what they share: the
// queue pair and its completion goroutine, the credits and the queue of
// control messages and writes, rails (rails.go) and keepalives
// (keepalive.go).
type Channel struct {
	opts     options
	log      *slog.Logger
	dev      verbsio.Device
	pd       verbsio.ProtectionDomain
	mem      Memory
	provider string
	devName  string
	host     string
	caps     verbsio.Caps

	cq     verbsio.CompletionQueue
	qp     verbsio.QueuePair
	rails  []*rail
	active int // rails both peers have

	slot     int
	inline   int
	recvBuf  tensor.Buffer
	recvMR   verbsio.MemoryRegion
	sendBuf  tensor.Buffer
	sendMR   verbsio.MemoryRegion
	recvWRs  []verbsio.RecvWR // reused for re-posting
	recvSGEs []verbsio.SGE
	// ctrlWR and ctrlSGE are the work request of a control SEND
	// (postCtrlLocked), reused under mu.
	ctrlWR  [1]verbsio.SendWR
	ctrlSGE [1]verbsio.SGE
	posted  bool // receives posted before Connect

	ctx      context.Context
	stop     context.CancelFunc
	pollDone chan struct{}
	// byeSent is closed once this side's BYE has left (its send
	// completed, successfully or not) or will not be sent; peerBye once the
	// peer's BYE has come or can come no more (byeSentLocked,
	// peerByeLocked).
	byeSent chan struct{}
	peerBye chan struct{}
	// lost is why a post failed, while the channel waits for its flushed
	// completions (lostLocked); lostTimer fails it if none comes.
	lost      error
	lostTimer *time.Timer
	// async counts deliveries run on goroutines of their own (runAsync):
	// Close waits for them, so that every source is back with its owner
	// when it returns.
	async sync.WaitGroup
	// pulls counts the Puller's copies in flight (pull.go): Close waits
	// for them, as they write result buffers of the channel's memory.
	pulls sync.WaitGroup

	// mu guards the fields below and the state of both halves. It is one
	// lock for both on purpose: the halves share the queue, the credits
	// and the send slots; one completion batch carries frames for both,
	// whose answers join the queue in the order the frames arrived; and a
	// failure ends both at once. A lock per half would still need this one
	// around all of that, and taking the two in turn would let a Send or a
	// Recv slip in between the failure of one half and of the other.
	mu        sync.Mutex
	state     chanState
	started   bool // completion goroutines running
	failErr   error
	peer      string
	checksum  bool
	credits   int
	owed      int
	threshold int
	sqOut     int
	sqMax     int
	freeSlots []int
	outq      []outItem
	// outqArr is the array outq's items live in, reused once the queue
	// empties; frames is the arena of the queued control frames, reused
	// likewise (a full one is left to the frames still queued in it and
	// a new one started), so that queuing a message allocates nothing on
	// the steady path.
	outqArr []outItem
	frames  []byte
	orphans []tensor.Buffer
	byeWRID uint64
	// byeDone, peerDone: byeSent and peerBye are closed.
	byeDone, peerDone bool
	// imms counts the writes with immediate taken in on the queue pair
	// (the count a BYE carries, see doc.go).
	imms uint64
	// creditBlocked: the last flush left work queued with no credit to
	// spare (flushLocked counts credit stalls from it).
	creditBlocked bool
	// warned: a refusal for the bound was logged at warning level already
	// (logRefusalLocked).
	warned [numBounds]bool

	// confirm: checksum mode with a peer that confirms (checksum.go):
	// sources are kept until CONFIRM, and corrupted writes are asked for
	// again.
	confirm bool
	// pull: both peers have a Puller (wire.HelloPull).
	pull bool
	// slotEager is, per send slot, whether the SEND posted from it
	// carries EAGER frames and the sequence number after the last: their
	// Sends end when it completes (eagerSender.settle).
	slotEager []slotEager
	// takesEager: this side offered wire.HelloEager (takesEager, in New);
	// eager: it sends EAGER to the peer, which offered it (and, in
	// checksum mode, wire.HelloEagerChecksum); peerSlot is the size of the
	// peer's receive buffers.
	takesEager, eager bool
	peerSlot          int
	// peerEager: the peer offered wire.HelloEager, and so reads a BYE
	// with wire.ByeEagers.
	peerEager bool

	// liveness (keepalive.go)
	arrivals uint64      // receive completions from the peer
	kaSeen   uint64      // arrivals when the keepalive timer was armed
	kaTimer  *time.Timer // nil until work is first pending
	kaArmed  bool
	live     liveness

	snd sender   // the sending half (send.go)
	rcv receiver // the receiving half (recv.go)

	stats chanCounters
	once  sync.Once
}

// chanCounters count what the halves share: control SENDs and the waits
// of the queue for credits; and the results the receiving half could not
// allocate for want of memory (resultErrLocked).
type chanCounters struct {
	controlOut, creditsOnly, keepalives, creditStalls atomic.Uint64
	resultsRefused                                    atomic.Uint64
}

// outItem is a queued control frame or write, posted in order. An EAGER
// frame's item says so, with the frame's sequence number.
type outItem struct {
	frame    []byte
	write    *sendEntry
	eager    bool
	eagerSeq uint32
}

// New makes a channel on dev: a completion queue, a queue pair in pd, and its
// control buffers from mem (which must be registered with pd). Receives are
// posted at once where the provider allows it.
func New(dev verbsio.Device, pd verbsio.ProtectionDomain, mem Memory, opts ...Option) (*Channel, error) {
	o := options{ring: defaultRing, sendSlots: defaultSendSlots, maxStrings: defaultMaxStringBytes, maxTensor: defaultMaxTensorBytes, stripeMin: defaultStripeMin, keepalive: defaultKeepalive, peerTimeout: defaultPeerTimeout, chunkShift: uint8(bits.TrailingZeros(defaultProxyChunk)), eagerMax: defaultEagerMax, log: slog.New(discard{})}
	for _, f := range opts {
		if f == nil {
			continue
		}
		if err := f(&o); err != nil {
			return nil, err
		}
	}
	if dev == nil || pd == nil || mem == nil {
		return nil, fmt.Errorf("%w: device, protection domain and memory are required", ErrBadOption)
	}
	host, _ := hostid.Get()
	c := &Channel{
		opts: o, log: o.log, dev: dev, pd: pd, mem: mem,
		provider: dev.Info().Provider, devName: dev.Info().Name, host: host, caps: dev.Caps(),
		slot: wire.MinSlot, peerSlot: wire.MinSlot, pollDone: make(chan struct{}), byeSent: make(chan struct{}), peerBye: make(chan struct{}),
	}
	if o.eagerMax > 0 && !o.firstRelease {
		// Room for an EAGER frame in every buffer, sent or received.
		c.slot = wire.MaxFrame
		c.takesEager = takesEager(&o, mem)
	}
	c.initHalves()
	if c.provider == "" {
		c.provider = c.caps.Provider
	}
	c.ctx, c.stop = context.WithCancel(context.Background())
	if err := c.setup(); err != nil {
		c.release()
		return nil, err
	}
	return c, nil
}

// initHalves makes the channel's sender and receiver.
func (c *Channel) initHalves() {
	c.snd = newSender(c)
	c.rcv = newReceiver(c)
}

func (c *Channel) setup() error {
	o := &c.opts
	c.sqMax = o.sendSlots + 2*o.ring
	if c.caps.MaxQPDepth > 0 && c.sqMax > c.caps.MaxQPDepth {
		c.sqMax = c.caps.MaxQPDepth
	}
	if c.sqMax < 4 {
		return fmt.Errorf("%w: send queue of %d", ErrBadOption, c.sqMax)
	}
	recvDepth := o.ring
	if c.caps.MaxQPDepth > 0 && recvDepth > c.caps.MaxQPDepth {
		return fmt.Errorf("%w: ring of %d exceeds the device's queue depth %d", ErrBadOption, recvDepth, c.caps.MaxQPDepth)
	}
	var err error
	if c.cq, err = c.dev.CreateCQ(c.sqMax + recvDepth); err != nil {
		return fmt.Errorf("rendezvous: completion queue: %w", err)
	}
	c.inline = min(c.caps.MaxInline, maxInline)
	if c.qp, err = c.pd.CreateQP(verbsio.QPConfig{SendCQ: c.cq, RecvCQ: c.cq, MaxSendWR: c.sqMax, MaxRecvWR: recvDepth, MaxSGE: 1, MaxInline: c.inline}); err != nil {
		return fmt.Errorf("rendezvous: queue pair: %w", err)
	}
	if err := c.setupRails(); err != nil {
		return err
	}
	if c.recvBuf, c.recvMR, err = c.allocRegistered(o.ring * c.slot); err != nil {
		return fmt.Errorf("rendezvous: receive buffers: %w", err)
	}
	if c.sendBuf, c.sendMR, err = c.allocRegistered(o.sendSlots * c.slot); err != nil {
		return fmt.Errorf("rendezvous: send buffers: %w", err)
	}
	c.freeSlots = make([]int, 0, o.sendSlots)
	for i := o.sendSlots - 1; i >= 0; i-- {
		c.freeSlots = append(c.freeSlots, i)
	}
	c.recvSGEs = make([]verbsio.SGE, o.ring)
	c.recvWRs = make([]verbsio.RecvWR, 0, o.ring)
	all := make([]verbsio.RecvWR, o.ring)
	for i := range all {
		all[i] = c.recvWR(i)
	}
	// Posting before Connect lets the peer send as soon as it is connected;
	// providers that only take receives once connected get them in Connect.
	if err := c.qp.PostRecv(all); err == nil {
		c.posted = true
	} else if !errors.Is(err, verbsio.ErrQPState) {
		return fmt.Errorf("rendezvous: posting receives: %w", err)
	}
	c.threshold = max(2, o.ring/4)
	return nil
}

func (c *Channel) allocRegistered(n int) (tensor.Buffer, verbsio.MemoryRegion, error) {
	b, err := c.mem.Alloc(n, tensor.Host)
	if err != nil {
		return nil, nil, err
	}
	mr, ok := c.mem.Region(b.Addr(), n)
	if !ok {
		_ = b.Free()
		return nil, nil, fmt.Errorf("%w: memory at %#x+%d is not registered", ErrBadOption, b.Addr(), n)
	}
	if b.Bytes() == nil {
		_ = b.Free()
		return nil, nil, fmt.Errorf("%w: control buffers need host memory", ErrBadOption)
	}
	return b, mr, nil
}

// sendSlot is send buffer i, cut to what the peer's receive buffers hold:
// the frames packed into one SEND fit one of them.
func (c *Channel) sendSlot(i int) []byte {
	n := c.slot
	if c.peerSlot > 0 {
		n = min(n, c.peerSlot)
	}
	return c.sendBuf.Bytes()[i*c.slot : i*c.slot+n]
}

func (c *Channel) recvWR(i int) verbsio.RecvWR {
	c.recvSGEs[i] = verbsio.SGE{Addr: c.recvBuf.Addr() + uintptr(i*c.slot), Length: uint32(c.slot), LKey: c.recvMR.LKey()}
	return verbsio.RecvWR{WRID: wridRecv | uint64(i), SG: c.recvSGEs[i : i+1 : i+1]}
}

// Hello is what the peer needs to connect to this channel, to be carried to
// it by a bootstrap (internal/bootstrap) and passed to its Connect.
func (c *Channel) Hello() []byte {
	m := wire.Message{Type: wire.TypeHello, Ring: uint16(c.opts.ring), Slot: uint32(c.slot), Text: []byte(c.opts.name), Host: []byte(c.host), NumEndpoints: 1}
	m.Flags |= c.opts.checksumHello(c.provider)
	if c.opts.puller != nil && !c.opts.firstRelease {
		m.Flags |= wire.HelloPull
	}
	if c.takesEager {
		m.Flags |= wire.HelloEager | wire.HelloEagerChecksum
	}
	ep := c.qp.Endpoint()
	m.Endpoints[0] = wire.Endpoint{Provider: []byte(ep.Provider), Host: []byte(ep.Host), Data: ep.Data}
	for i, rl := range c.rails {
		ep := rl.qp.Endpoint()
		m.Endpoints[i+1] = wire.Endpoint{Provider: []byte(ep.Provider), Host: []byte(ep.Host), Data: ep.Data}
		m.NumEndpoints++
	}
	return m.Append(nil)
}

// Connect connects to the peer whose Hello is given and starts the channel's
// completion goroutine. The peers must agree on provider, and on checksum
// mode where both chose one (WithChecksum; see DefaultChecksum).
func (c *Channel) Connect(ctx context.Context, peerHello []byte) error {
	var m wire.Message
	n, err := wire.Decode(peerHello, &m)
	if err != nil {
		return fmt.Errorf("rendezvous: peer hello: %w", err)
	}
	if m.Type != wire.TypeHello || n != len(peerHello) {
		return fmt.Errorf("%w: peer hello is a %s of %d bytes in %d", ErrProtocol, m.Type, n, len(peerHello))
	}
	peer := string(m.Text)
	if peer == "" {
		peer = "peer"
	}
	if m.NumEndpoints < 1 {
		return fmt.Errorf("%w: peer %s sent no endpoint", ErrMismatch, peer)
	}
	checksum, confirm, err := negotiateChecksum(c.opts.checksumHello(c.provider), m.Flags, peer)
	if err != nil {
		return err
	}
	if int(m.Slot) < wire.MinSlot {
		return fmt.Errorf("%w: peer %s receive buffers of %d bytes, need %d", ErrMismatch, peer, m.Slot, wire.MinSlot)
	}
	if m.Ring < minRing {
		return fmt.Errorf("%w: peer %s posts %d receive buffers", ErrMismatch, peer, m.Ring)
	}
	e := m.Endpoints[0]
	ep := verbsio.Endpoint{Provider: string(e.Provider), Host: string(e.Host), Data: append([]byte(nil), e.Data...)}
	if ep.Provider != c.qp.Endpoint().Provider {
		return fmt.Errorf("%w: peer %s uses provider %q, this side %q", ErrMismatch, peer, ep.Provider, c.qp.Endpoint().Provider)
	}
	c.mu.Lock()
	if c.state != stateNew {
		st := c.state
		c.mu.Unlock()
		return fmt.Errorf("%w: Connect on a channel in state %d", ErrClosed, st)
	}
	c.peer = peer
	c.credits = int(m.Ring)
	c.checksum, c.confirm = checksum, confirm
	if s, ok := c.qp.(verbsio.WriteChecksummer); ok {
		// The provider takes each tensor's checksum as it lands.
		s.ChecksumWrites(checksum)
	}
	c.pull = c.opts.puller != nil && !c.opts.firstRelease && m.Flags&wire.HelloPull != 0
	c.peerEager = m.Flags&wire.HelloEager != 0
	c.eager = c.opts.eagerMax > 0 && c.slot > wire.MinSlot && c.peerEager &&
		(!checksum || m.Flags&wire.HelloEagerChecksum != 0)
	c.peerSlot = int(min(m.Slot, uint32(wire.MaxFrame)))
	c.live.peerRing = int(m.Ring)
	c.mu.Unlock()
	if err := c.qp.Connect(ctx, ep); err != nil {
		return fmt.Errorf("rendezvous: connecting to %s: %w", peer, err)
	}
	active := min(len(c.rails), int(m.NumEndpoints)-1)
	for i := 0; i < active; i++ {
		e := m.Endpoints[i+1]
		rep := verbsio.Endpoint{Provider: string(e.Provider), Host: string(e.Host), Data: append([]byte(nil), e.Data...)}
		if err := c.rails[i].qp.Connect(ctx, rep); err != nil {
			return fmt.Errorf("rendezvous: connecting rail %d (%s) to %s: %w", i+1, c.rails[i].name, peer, err)
		}
	}
	if !c.posted {
		all := make([]verbsio.RecvWR, c.opts.ring)
		for i := range all {
			all[i] = c.recvWR(i)
		}
		if err := c.qp.PostRecv(all); err != nil {
			return fmt.Errorf("rendezvous: posting receives: %w", err)
		}
		c.posted = true
	}
	c.mu.Lock()
	if c.state != stateNew {
		err := c.stateErrLocked()
		c.mu.Unlock()
		return fmt.Errorf("rendezvous: connecting to %s: %w", peer, err)
	}
	c.state = stateConnected
	c.active = active
	c.started = true
	c.mu.Unlock()
	go c.poll()
	for _, rl := range c.rails[:active] {
		go c.pollRail(rl)
	}
	c.log.Debug("rendezvous: connected", "peer", peer, "provider", c.provider, "device", c.devName, "ring", c.opts.ring, "peer_ring", m.Ring, "checksum", checksum, "confirm", confirm, "rails", 1+active)
	return nil
}

// Peer is the peer's name from its Hello ("" before Connect).
func (c *Channel) Peer() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.peer
}

// Provider and Device name the verbs provider and device of the channel.
func (c *Channel) Provider() string { return c.provider }

// Device names the verbs device of the channel.
func (c *Channel) Device() string { return c.devName }

// Stats returns the channel's counters, and what its sending side holds at
// the time of the call: one snapshot, taken under the channel's lock, so a
// write that completed is never missing from both WritesInFlight and
// WritesOut.
func (c *Channel) Stats() Stats {
	r, s, ch := &c.rcv.stats, &c.snd.stats, &c.stats
	c.mu.Lock()
	defer c.mu.Unlock()
	st := Stats{
		Requests: r.requests.Load(), MetaResponses: r.metaResponses.Load(), MetaInPlace: r.metaInPlace.Load(), ReRequests: r.reRequests.Load(), Finals: r.finals.Load(),
		WritesIn: r.writesIn.Load(), WritesOut: s.writesOut.Load(), BytesIn: r.bytesIn.Load(), BytesOut: s.bytesOut.Load(),
		Errors: r.errors.Load(), ControlOut: ch.controlOut.Load(), CreditsOnly: ch.creditsOnly.Load(), NameDefs: r.nameDefs.Load(),
		ChecksumFailures: r.checksumFailures.Load(), Staged: s.staged.Load(), Striped: s.striped.Load(), Keepalives: ch.keepalives.Load(),
		ChunksIn: r.chunksIn.Load(), ChunksOut: s.chunksOut.Load(), CreditStalls: ch.creditStalls.Load(),
		RequestsIn: s.requestsIn.Load(), ReRequestsIn: s.reRequestsIn.Load(),
		PendingRefused: s.pendingRefused.Load(), NamesRefused: s.namesRefused.Load(), ResultsRefused: ch.resultsRefused.Load(),
		SendsRefused:    s.refused.Load(),
		ChecksumRetries: r.checksumRetries.Load(), Rewrites: s.rewrites.Load(), ConfirmsOut: r.confirmsOut.Load(), ConfirmsIn: s.confirmsIn.Load(), PullsIn: r.pullsIn.Load(), PullsOut: s.pullsOut.Load(),
		EagerOut: s.eagerOut.Load(), EagerIn: r.eagerIn.Load(), EagerCrossed: s.eagerCrossed.Load(),
	}
	c.snd.statsLocked(&st)
	return st
}

// Err is why the channel stopped working, nil while it works.
func (c *Channel) Err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.failErr
}

// closeWait bounds how long Close waits for its BYE to leave and, when
// writes were in flight, for the peer's BYE that says which arrived.
const closeWait = time.Second

// Close says BYE to the peer, fails everything pending with ErrClosed, and
// releases the queue pair, completion queue and buffers. It waits for its
// BYE to leave and, if writes were in flight, for the peer's BYE (the
// peer answers one with its own), which says which of them arrived (see
// "Closing" in the package documentation); at most a second, and not at
// all for a peer known gone or closing. The sources of writes still in
// flight go back to their owners (Send's release, SendFunc's done) only
// after the queue pairs are destroyed. It is idempotent.
func (c *Channel) Close() error {
	first := false
	c.once.Do(func() { first = true })
	if !first {
		return nil
	}
	c.mu.Lock()
	wasConnected := c.state == stateConnected
	// Writes in flight, or EAGER frames whose delivery is not known yet:
	// the peer's BYE tells which arrived.
	eagers := c.snd.eager.pending
	waitPeer := wasConnected && (c.snd.inFlightLocked() || len(eagers) > 0)
	if wasConnected {
		c.postByeLocked()
	}
	c.byeSentLocked() // unless posted: then its completion says it left
	var ds deliveries
	closed := fmt.Errorf("%w: closed by this side", ErrClosed)
	if waitPeer {
		// Their Sends end at the peer's BYE (onByeLocked), or below.
		c.snd.eager.pending = nil
	}
	c.failLocked(closed, &ds, stateClosed)
	if waitPeer {
		c.snd.eager.pending = eagers
	}
	started := c.started
	if !started {
		c.peerByeLocked()
	}
	c.mu.Unlock()
	ds.run()
	if wasConnected {
		timer := time.NewTimer(closeWait)
		select {
		case <-c.byeSent:
			if waitPeer {
				select {
				case <-c.peerBye:
				case <-c.pollDone:
				case <-timer.C:
				}
			}
		case <-c.pollDone:
		case <-timer.C:
		}
		timer.Stop()
	}
	c.stop()
	if started {
		// The completion goroutines use the buffers and queues released
		// below: wait until they are gone.
		<-c.pollDone
		for _, rl := range c.rails[:c.active] {
			<-rl.done
		}
	}
	// EAGER frames no BYE counted: not known delivered.
	var late deliveries
	c.mu.Lock()
	c.snd.eager.failLocked(closed, &late)
	c.mu.Unlock()
	late.run()
	return c.release()
}

func (c *Channel) release() error {
	var errs []error
	if c.qp != nil {
		errs = append(errs, c.qp.Close())
	}
	if c.cq != nil {
		errs = append(errs, c.cq.Close())
	}
	for _, rl := range c.rails {
		if rl.qp != nil {
			errs = append(errs, rl.qp.Close())
		}
		if rl.cq != nil {
			errs = append(errs, rl.cq.Close())
		}
	}
	// No queue pair reads or writes anything of the channel's now: the
	// sources of writes that were in flight go back to their owners, and
	// the buffers kept for the same reason are freed.
	c.snd.releaseHeld()
	c.mu.Lock()
	orphans := c.orphans
	c.orphans = nil
	c.mu.Unlock()
	for _, b := range orphans {
		errs = append(errs, b.Free())
	}
	if c.recvBuf != nil {
		errs = append(errs, c.recvBuf.Free())
	}
	if c.sendBuf != nil {
		errs = append(errs, c.sendBuf.Free())
	}
	// Sends ended by a failed post give their sources back on their own
	// goroutines: they are back before Close returns; so are the result
	// buffers pulls were copying into.
	c.async.Wait()
	c.pulls.Wait()
	return errors.Join(errs...)
}

// postByeLocked posts BYE with the count of writes with immediate taken in
// (wire.ByeImms), straight to the queue pair and ahead of anything queued:
// the queue's items are dropped as the channel stops, and a write dropped
// unposted is one the peer will not get, as its error says. The BYE may
// take the credit kept in reserve: nothing follows it. If it cannot be
// posted, nobody waits for it. The CONFIRMs queued go in the same SEND,
// ahead of it (receiver.confirmsAheadLocked).
func (c *Channel) postByeLocked() {
	if c.credits < 1 || len(c.freeSlots) == 0 || c.sqOut >= c.sqMax {
		c.log.Debug("rendezvous: BYE not sent: no credit or send slot", "peer", c.peer)
		c.byeSentLocked()
		return
	}
	slot := c.freeSlots[len(c.freeSlots)-1]
	buf := c.sendSlot(slot)
	m := wire.Message{Type: wire.TypeBye, Flags: wire.ByeImms, Imms: uint32(c.imms)}
	if c.peerEager {
		m.Flags |= wire.ByeEagers
		m.Eagers = c.rcv.eager.in
	}
	n := c.rcv.confirmsAheadLocked(buf, m.Len())
	n += len(m.Append(buf[n:n]))
	c.putCredits(buf)
	if !c.postCtrlLocked(slot, n, true) {
		c.byeSentLocked()
	}
}

// byeSentLocked closes byeSent once: this side's BYE left, or will not.
func (c *Channel) byeSentLocked() {
	if c.byeWRID != 0 && !c.byeDone && c.state == stateConnected {
		return // posted: its completion closes it
	}
	c.closeByeSentLocked()
}

func (c *Channel) closeByeSentLocked() {
	if !c.byeDone && c.byeSent != nil {
		c.byeDone = true
		close(c.byeSent)
	}
}

// peerByeLocked closes peerBye once: the peer's BYE came, or no more
// frames of the peer's can come.
func (c *Channel) peerByeLocked() {
	if !c.peerDone && c.peerBye != nil {
		c.peerDone = true
		close(c.peerBye)
	}
}

// onByeLocked takes the peer's BYE: writes it says arrived are delivered,
// the others fail with ErrClosed; a channel still open answers with its
// own BYE (so that a peer closing with writes in flight learns which of
// them arrived here) and stops.
func (c *Channel) onByeLocked(m *wire.Message, ds *deliveries) {
	c.peerByeLocked()
	if m.Flags&wire.ByeImms != 0 {
		c.snd.settleLocked(m.Imms, ds)
	}
	if m.Flags&wire.ByeEagers != 0 {
		// The EAGER frames it took in are delivered, whatever became of
		// the SENDs' completions (or the TAKENs); the others never will be.
		c.snd.eager.settle(m.Eagers, ds)
		c.snd.eager.failLocked(fmt.Errorf("%w: by peer %s, which did not take the tensor in", ErrClosed, c.peer), ds)
	}
	if c.state == stateConnected {
		c.postByeLocked()
		c.failLocked(fmt.Errorf("%w: by peer %s", ErrClosed, c.peer), ds, stateFailed)
	}
	// Nothing more will tell what arrived: held writes end on their
	// completions (a BYE without a count, of a first-release peer, says
	// nothing of them).
	c.snd.settledLocked(ds)
}

// deliveries are callbacks collected under the lock and run after it.
type deliveries []func()

func (d *deliveries) add(f func()) { *d = append(*d, f) }
func (d deliveries) run() {
	for _, f := range d {
		f()
	}
}

// runAsync runs ds on a goroutine of its own, for callers that hold the
// lock and cannot hand ds to their own callers; Close waits for it.
func (c *Channel) runAsync(ds deliveries) {
	if len(ds) == 0 {
		return
	}
	c.async.Add(1)
	go func() {
		defer c.async.Done()
		ds.run()
	}()
}

// failLocked stops the channel: every pending request and send fails with
// err. Buffers of requests whose writes may still land are freed only once
// the queue pair is gone (in release, via the poller's exit); sources of
// writes the queue pair may still read are given back only once their
// work requests completed or the queue pair is gone (sender.holdLocked).
func (c *Channel) failLocked(err error, ds *deliveries, st chanState) {
	if c.state == stateFailed || c.state == stateClosed {
		if st == stateClosed {
			c.state = stateClosed
		}
		return
	}
	c.state = st
	c.failErr = err
	if c.lostTimer != nil {
		c.lostTimer.Stop()
	}
	c.disarmKeepaliveLocked()
	c.rcv.failLocked(err, ds)
	c.snd.failLocked(err, ds)
	for _, it := range c.outq {
		if it.write != nil {
			c.snd.dropLocked(it.write, err, ds)
		}
	}
	clear(c.slotEager)
	c.outq, c.outqArr, c.frames = nil, nil, nil
	c.snd.errorsQueued = 0
	if st == stateFailed {
		c.log.Debug("rendezvous: channel failed", "peer", c.peer, "err", err)
	}
}

func (c *Channel) protocolLocked(ds *deliveries, format string, args ...any) {
	c.failLocked(fmt.Errorf("%w: from %s: %s", ErrProtocol, c.peer, fmt.Sprintf(format, args...)), ds, stateFailed)
}

func (c *Channel) stateErrLocked() error {
	switch c.state {
	case stateNew:
		return ErrNotConnected
	case stateClosed:
		if c.failErr != nil {
			return c.failErr
		}
		return ErrClosed
	}
	return c.failErr
}

// bound is one of the bounds on what a peer may make a channel hold.
type bound uint8

const (
	boundPending bound = iota // WithMaxPendingRequests
	boundNames                // WithMaxNames
	boundResults              // the pool's limit, WithMaxTensorBytes
	numBounds
)

// logRefusalLocked logs a refusal for bound b, err saying which: the first
// of each bound on the channel at warning level, the others at debug level,
// so that a flood makes one warning and a counter in Stats rather than a
// flood of log lines.
func (c *Channel) logRefusalLocked(b bound, err error, args ...any) {
	level := slog.LevelDebug
	if !c.warned[b] {
		c.warned[b] = true
		level = slog.LevelWarn
	}
	c.log.Log(context.Background(), level, "rendezvous: refused", append(args, "err", err)...)
}

// resultErrLocked is the error of this side's Recv of key whose result,
// sized for meta, could not be allocated: it names the peer and the
// tensor's size. A refusal for want of memory (the pool's limit,
// alloc.ErrPoolExhausted; WithMaxTensorBytes, ErrTooLarge) is logged and
// counted in Stats.ResultsRefused; the receiver withdraws the request
// with the reason (CANCEL with a code), which fails the peer's Send with a
// RefusedError and gives its tensor back.
func (c *Channel) resultErrLocked(key skey, meta tensor.Meta, err error) error {
	e := fmt.Errorf("rendezvous: result of %q step %d from %s (%v): %w", key.name, key.step, c.peer, meta, err)
	if errors.Is(err, alloc.ErrPoolExhausted) || errors.Is(err, ErrTooLarge) {
		c.stats.resultsRefused.Add(1)
		c.logRefusalLocked(boundResults, e, "peer", c.peer, "key", key.name, "step", key.step, "bytes", meta.ByteSize)
	}
	return e
}

func checkKey(key string) error {
	if key == "" || len(key) > wire.MaxName {
		return fmt.Errorf("%w: %d bytes, want 1..%d", ErrBadKey, len(key), wire.MaxName)
	}
	return nil
}

// lostGrace bounds how long a channel whose post failed waits for its
// completion queue to end in flushed work requests (lostLocked).
const lostGrace = 500 * time.Millisecond

// lostLocked takes a failed post: the queue pair is in error. Its
// completion queue holds, in order, what completed before (writes the peer
// delivered here among them) and then the flushed work requests; the
// completion goroutine fails the channel when it reaches the first of
// those, having delivered everything before it. Failing at once would fail
// Recvs whose tensor had arrived and been acknowledged to the sender, who
// then has nothing left to send again. Until then nothing more is posted;
// if no flushed completion comes within lostGrace, the channel fails
// anyway.
func (c *Channel) lostLocked(err error, ds *deliveries) {
	if c.state != stateConnected {
		return
	}
	if !c.started {
		c.failLocked(c.peerLost(err), ds, stateFailed)
		return
	}
	if c.lost == nil {
		c.lost = c.peerLost(err)
		c.lostTimer = time.AfterFunc(lostGrace, c.lostTimeout)
	}
}

// lostTimeout fails a channel whose failed post was not followed by a
// flushed completion within lostGrace.
func (c *Channel) lostTimeout() {
	var ds deliveries
	c.mu.Lock()
	if c.state == stateConnected && c.lost != nil {
		c.failLocked(c.lost, &ds, stateFailed)
	}
	c.mu.Unlock()
	ds.run()
}

func (c *Channel) peerLost(cause error) error {
	return fmt.Errorf("%w: %s (%s on %s): %w", verbsio.ErrPeerLost, c.peer, c.provider, c.devName, cause)
}

// poll is the channel's completion goroutine.
func (c *Channel) poll() {
	defer close(c.pollDone)
	defer func() {
		c.mu.Lock()
		c.peerByeLocked()
		c.mu.Unlock()
	}()
	comps := make([]verbsio.Completion, 64)
	var ds deliveries // reused: a steady stream allocates no list
	for {
		clear(ds)
		ds = ds[:0]
		n, err := c.cq.Wait(c.ctx, comps)
		if err != nil {
			if c.ctx.Err() != nil {
				return
			}
			var ds deliveries
			c.mu.Lock()
			c.failLocked(c.peerLost(err), &ds, stateFailed)
			c.mu.Unlock()
			ds.run()
			return
		}
		c.mu.Lock()
		c.recvWRs = c.recvWRs[:0]
		for i := 0; i < n; i++ {
			c.handleLocked(&comps[i], &ds)
		}
		if len(c.recvWRs) > 0 && c.state == stateConnected && c.lost == nil {
			if err := c.qp.PostRecv(c.recvWRs); err != nil {
				c.lostLocked(err, &ds)
			} else {
				c.owed += len(c.recvWRs)
			}
		}
		c.flushLocked()
		c.armKeepaliveLocked() // the peer's requests may be pending now
		stopped := c.state == stateFailed && !c.snd.awaitingLocked()
		c.mu.Unlock()
		ds.run()
		if len(ds) > 0 {
			runtime.Gosched()
		}
		if stopped {
			// Nothing here waits for a completion any more (a write
			// still out keeps the goroutine polling, so that its source
			// is given back when the write completes or is flushed).
			// Handle what is queued still, the peer's BYE perhaps, then
			// leave the rest to Close.
			c.drain(comps)
			return
		}
	}
}

// drain handles the completions queued on a channel that failed, without
// waiting for more, then ends the held writes that waited for a BYE of the
// peer's (sender.finishAwaitingLocked). A BYE already queued behind
// completions handled after the failure (a write's, or a frame whose
// answer could not be posted because the peer had closed its queue pair)
// thus still settles the writes it counts.
func (c *Channel) drain(comps []verbsio.Completion) {
	for {
		n, err := c.cq.Poll(comps)
		if err != nil || n == 0 {
			break
		}
		var ds deliveries
		c.mu.Lock()
		for i := 0; i < n; i++ {
			c.handleLocked(&comps[i], &ds)
		}
		c.mu.Unlock()
		ds.run()
	}
	var ds deliveries
	c.mu.Lock()
	c.snd.finishAwaitingLocked(&ds)
	c.mu.Unlock()
	ds.run()
}

func (c *Channel) handleLocked(wc *verbsio.Completion, ds *deliveries) {
	kind := wc.WRID & wridKind
	id := wc.WRID &^ wridKind
	if kind == wridWrite {
		// Whatever its status, the work request reads its source no more.
		c.snd.writeCompletedLocked(id>>8, wc.Status == verbsio.StatusSuccess, ds)
	}
	if wc.Status != verbsio.StatusSuccess {
		if c.state == stateConnected {
			cause := c.lost // a failed post saw it first
			if cause == nil {
				cause = c.peerLost(fmt.Errorf("%s %s: %w", wc.Op, wc.Status, wc.Status.Err()))
			}
			c.failLocked(cause, ds, stateFailed)
		}
		if kind == wridCtrl {
			c.freeSlots = append(c.freeSlots, int(id))
			if wc.WRID == c.byeWRID {
				c.closeByeSentLocked()
			}
		}
		// The queue pair is in error: nothing more of the peer's comes.
		c.peerByeLocked()
		return
	}
	switch kind {
	case wridRecv:
		c.arrivals++
		slot := int(id)
		if slot >= c.opts.ring {
			c.failLocked(fmt.Errorf("%w: receive completion for slot %d", ErrProtocol, slot), ds, stateFailed)
			return
		}
		if wc.Op == verbsio.OpRecvImm || wc.HasImm {
			c.imms++
			c.rcv.onWriteLocked(wc.Imm, wc, ds)
		} else {
			b := c.recvBuf.Bytes()[slot*c.slot:]
			if int(wc.ByteLen) > c.slot {
				c.failLocked(fmt.Errorf("%w: %d bytes in a %d-byte buffer", ErrProtocol, wc.ByteLen, c.slot), ds, stateFailed)
				return
			}
			c.onFramesLocked(b[:wc.ByteLen], ds)
		}
		if c.state == stateConnected {
			c.recvWRs = append(c.recvWRs, c.recvWR(slot))
		}
	case wridCtrl:
		c.sqOut--
		c.freeSlots = append(c.freeSlots, int(id))
		if int(id) < len(c.slotEager) && c.slotEager[id].has {
			// The EAGER frames it carried are the peer's (in checksum
			// mode their Sends end at the TAKEN that counts them, once
			// the peer has checked their bytes).
			if !c.checksum {
				c.snd.eager.settle(c.slotEager[id].end, ds)
			}
			c.slotEager[id] = slotEager{}
		}
		if wc.WRID == c.byeWRID {
			c.closeByeSentLocked()
		}
	case wridWrite:
		c.sqOut--
		if last := id&0xff == 1; last {
			c.snd.writeDoneLocked(id>>8, ds)
		}
	}
}

func (c *Channel) onFramesLocked(b []byte, ds *deliveries) {
	var m wire.Message
	for len(b) > 0 {
		n, err := wire.Decode(b, &m)
		if err != nil {
			c.failLocked(fmt.Errorf("%w: from %s: %w", ErrProtocol, c.peer, err), ds, stateFailed)
			return
		}
		b = b[n:]
		if c.state != stateConnected {
			// Stopped: only the peer's BYE matters still, for what it
			// says of this side's writes in flight.
			switch m.Type {
			case wire.TypeBye:
				c.onByeLocked(&m, ds)
			case wire.TypeConfirm:
				c.snd.onConfirmLocked(&m, ds)
			}
			continue
		}
		c.credits += int(m.Credits)
		switch m.Type {
		case wire.TypeCredit:
		case wire.TypeRequest:
			c.snd.onRequestLocked(&m, ds)
		case wire.TypeReRequest:
			c.snd.onReRequestLocked(&m, ds)
		case wire.TypeCancel:
			c.snd.onCancelLocked(&m, ds)
		case wire.TypeMetaResponse:
			c.rcv.onMetaLocked(&m, ds)
		case wire.TypeChecksum:
			c.rcv.onChecksumLocked(&m, ds)
		case wire.TypeError:
			c.rcv.onErrorLocked(&m, ds)
		case wire.TypeBye:
			c.onByeLocked(&m, ds)
		case wire.TypeConfirm:
			c.snd.onConfirmLocked(&m, ds)
		case wire.TypeEager:
			c.rcv.onEagerLocked(&m, ds)
		case wire.TypeTaken:
			c.snd.onTakenLocked(&m, ds)
		default:
			c.failLocked(fmt.Errorf("%w: %s from %s on an open channel", ErrProtocol, m.Type, c.peer), ds, stateFailed)
		}
	}
}

// frameArena is the size of an arena of queued control frames.
const frameArena = 64 << 10

// enqueueLocked queues a control message.
func (c *Channel) enqueueLocked(m *wire.Message) {
	if len(c.outq) == 0 {
		// No frame is in use: the arena starts over.
		c.frames = c.frames[:0]
	}
	start := len(c.frames)
	if n := m.Len(); start+n > cap(c.frames) {
		c.frames, start = make([]byte, 0, max(frameArena, n)), 0
	}
	c.frames = m.Append(c.frames)
	c.pushLocked(outItem{frame: c.frames[start:len(c.frames):len(c.frames)]})
}

// enqueueEagerLocked queues EAGER frame seq.
func (c *Channel) enqueueEagerLocked(m *wire.Message, seq uint32) {
	c.enqueueLocked(m)
	it := &c.outq[len(c.outq)-1]
	it.eager, it.eagerSeq = true, seq
	if c.opts.corrupt != nil {
		// The test hook: the bytes on their way, after their checksum.
		c.opts.corrupt(string(m.Name), m.Step, it.frame[len(it.frame)-len(m.Data):])
	}
}

// slotEager: a SEND carries EAGER frames, the last of sequence end-1.
type slotEager struct {
	has bool
	end uint32
}

// pushLocked appends it to the queue (an empty queue starts over at the
// beginning of its array).
func (c *Channel) pushLocked(it outItem) {
	if len(c.outq) == 0 {
		c.outq = c.outqArr[:0]
	}
	c.outq = append(c.outq, it)
	if cap(c.outq) > cap(c.outqArr) {
		c.outqArr = c.outq // grown into a new array, which it begins
	}
}

// flushLocked posts queued items in order while credits, send slots and
// send-queue room allow, packing consecutive control frames into one SEND,
// then returns credits alone if many are owed and nothing else carried them.
// It counts a credit stall (Stats.CreditStalls) when it leaves work queued
// for want of credits.
func (c *Channel) flushLocked() {
	if c.state != stateConnected || c.lost != nil {
		return
	}
	c.rcv.takeConfirmsLocked(false) // CONFIRMs ride with what goes out
	queued, credits := len(c.outq), c.credits
	for len(c.outq) > 0 {
		// One credit stays in reserve for a CREDIT message.
		if c.credits <= 1 {
			break
		}
		it := &c.outq[0]
		if it.write != nil {
			if !c.snd.postWriteLocked(it.write, nil) {
				break
			}
			c.outq[0] = outItem{} // the queue's array keeps nothing posted
			c.outq = c.outq[1:]
			continue
		}
		if len(c.freeSlots) == 0 || c.sqOut >= c.sqMax {
			break
		}
		slot := c.freeSlots[len(c.freeSlots)-1]
		buf := c.sendSlot(slot)
		n := 0
		for len(c.outq) > 0 && c.outq[0].write == nil && n+len(c.outq[0].frame) <= len(buf) {
			f := c.outq[0].frame
			if c.outq[0].eager {
				if c.slotEager == nil {
					c.slotEager = make([]slotEager, c.opts.sendSlots)
				}
				c.slotEager[slot] = slotEager{has: true, end: c.outq[0].eagerSeq + 1}
			}
			copy(buf[n:], f)
			if wire.Type(f[1]) == wire.TypeError {
				c.snd.errorsQueued--
			}
			n += len(f)
			c.outq[0] = outItem{}
			c.outq = c.outq[1:]
		}
		c.putCredits(buf)
		if e := c.writeNextLocked(); e != nil {
			// The frames go in one post with the write that follows
			// them (a CHECKSUM and its write, most often): one system
			// call on tcp instead of two, one doorbell on a NIC.
			lead := c.ctrlWRLocked(slot, n)
			c.freeSlots = c.freeSlots[:len(c.freeSlots)-1]
			if c.snd.postWriteLocked(e, &lead) {
				c.sqOut++
				c.credits--
				c.stats.controlOut.Add(1)
				c.outq[0] = outItem{}
				c.outq = c.outq[1:]
				continue
			}
			if c.lost != nil {
				// The post failed: the channel is lost. The slot is
				// not taken back: a provider that posts part of a
				// chain may have posted the frames, whose flushed
				// completion gives it back.
				return
			}
			c.freeSlots = append(c.freeSlots, slot)
		}
		if !c.postCtrlLocked(slot, n, false) { // BYE never queues (postByeLocked)
			return
		}
	}
	// Every item takes a credit and one stays in reserve, so work left
	// queued with at most one credit waits for credits (whatever else it
	// may lack). A wait counts when it begins: when this flush found the
	// queue free of credit trouble, or moved it (posting takes credits,
	// striping takes the item) before running out again.
	blocked := len(c.outq) > 0 && c.credits <= 1
	moved := len(c.outq) != queued || c.credits != credits
	if blocked && (!c.creditBlocked || moved) {
		c.stats.creditStalls.Add(1)
	}
	c.creditBlocked = blocked
	if c.owed >= c.threshold && c.credits >= 1 && !c.withholdingLocked() && len(c.freeSlots) > 0 && c.sqOut < c.sqMax {
		slot := c.freeSlots[len(c.freeSlots)-1]
		buf := c.sendSlot(slot)
		m := wire.Message{Type: wire.TypeCredit}
		n := len(m.Append(buf[:0]))
		c.putCredits(buf)
		if c.postCtrlLocked(slot, n, false) {
			c.stats.creditsOnly.Add(1)
		}
	}
}

// maxQueuedErrors is the most ERROR_STATUS the channel queues before it
// withholds credits (withholdingLocked).
const maxQueuedErrors = 1024

// withholdingLocked reports whether the channel keeps the credits it owes
// the peer for now: while more than maxQueuedErrors ERROR_STATUS wait in
// its queue and it has credits to spare. A peer that asks faster than it
// takes the answers (a flood of refused requests, each answered, or one
// that does not return credits) would otherwise grow the queue without
// bound: each credit returned lets it send a frame of many requests. So
// credits go back only once the queue is short again, or when this side is
// down to the one credit kept for a CREDIT, as before: the peer then sends
// no faster than this side answers, and two channels that both withhold
// still return credits when both are short, so neither waits for ever.
func (c *Channel) withholdingLocked() bool {
	return c.snd.errorsQueued > maxQueuedErrors && c.credits > 1
}

// putCredits writes the credits owed into the header of the frame at b
// (none while the channel withholds them).
func (c *Channel) putCredits(b []byte) {
	if c.withholdingLocked() {
		b[2], b[3] = 0, 0
		return
	}
	k := min(c.owed, 0xffff)
	b[2], b[3] = byte(k), byte(k>>8)
	c.owed -= k
}

func (c *Channel) postCtrlLocked(slot, n int, bye bool) bool {
	c.ctrlWR[0] = c.ctrlWRLocked(slot, n)
	wr := &c.ctrlWR[0]
	c.freeSlots = c.freeSlots[:len(c.freeSlots)-1]
	if err := c.qp.PostSend(c.ctrlWR[:]); err != nil {
		c.freeSlots = append(c.freeSlots, slot)
		var ds deliveries
		c.lostLocked(err, &ds)
		c.runAsync(ds)
		return false
	}
	if bye {
		c.byeWRID = wr.WRID
	}
	c.sqOut++
	c.credits--
	c.stats.controlOut.Add(1)
	return true
}

// ctrlWRLocked is the SEND of the n bytes of control frames in send slot
// slot. Its SGE is the channel's (under mu): the provider copies what it
// needs before PostSend returns.
func (c *Channel) ctrlWRLocked(slot, n int) verbsio.SendWR {
	c.ctrlSGE[0] = verbsio.SGE{Addr: c.sendBuf.Addr() + uintptr(slot*c.slot), Length: uint32(n), LKey: c.sendMR.LKey()}
	return verbsio.SendWR{
		WRID: wridCtrl | uint64(slot), Op: verbsio.OpSend, Signaled: true,
		SG: c.ctrlSGE[:], Inline: c.inline >= n,
	}
}

// writeNextLocked returns the write at the head of the queue when control
// frames just taken from it may go in one post with it: a write of one
// chain on the channel's own queue pair (not in chunks, not striped over
// rails), with a credit for each and one in reserve. Nil otherwise.
func (c *Channel) writeNextLocked() *sendEntry {
	if len(c.outq) == 0 || c.outq[0].write == nil || c.credits <= 2 {
		return nil
	}
	e := c.outq[0].write
	if (e.chunkShift != 0 && e.n > int64(1)<<e.chunkShift) || e.firstChunk != 0 || (len(e.railKeys) > 0 && c.active > 0) {
		return nil
	}
	return e
}

// maxMsg is the largest write the channel posts as one work request.
func (c *Channel) maxMsg() int64 {
	maxMsg := int64(1 << 30)
	if c.caps.MaxMessage > 0 && c.caps.MaxMessage < maxMsg {
		maxMsg = c.caps.MaxMessage
	}
	return maxMsg
}

type discard struct{}

func (discard) Enabled(context.Context, slog.Level) bool  { return false }
func (discard) Handle(context.Context, slog.Record) error { return nil }
func (d discard) WithAttrs([]slog.Attr) slog.Handler      { return d }
func (d discard) WithGroup(string) slog.Handler           { return d }

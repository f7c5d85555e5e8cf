// Package worker is a SwitchML worker: it all-reduces tensors through an
// aggregator (package aggsrv, or a switch) with the RDMA WRITE WITH
// IMMEDIATE messages of unreliable-connected (UC) queue pairs, and takes
// the aggregator's writes as its results. Two transports carry them:
//
//   - UDP (the default): the worker builds the RoCEv2 packets a verbs NIC's
//     UC queue pairs would send (RDMA WRITE FIRST/MIDDLE/LAST/ONLY, with
//     immediate) itself, sends them over a plain UDP socket and reassembles
//     the aggregator's replies. It needs no RDMA device.
//   - Verbs (Config.Verbs): real UC queue pairs on an ibverbs device with a
//     RoCE v2 GID for the worker's address (a NIC, or Soft-RoCE), through
//     package ibv; the aggregator's writes land in a registered result
//     region mapped at the same virtual address (RegionVA) in every
//     worker.
//
// The message schedule, the exponents, timeouts and resends below are the
// same for both; the aggregator cannot tell them apart.
//
// # Messages
//
// A job has Window queue pairs; queue pair q owns the slots
// [q*MsgSlots, (q+1)*MsgSlots) of the job's range and carries one message at
// a time, of MsgSlots packets (one slot each). A tensor is cut into chunks of
// MsgSlots*SlotBytes bytes (the last one padded with zeros); chunk c goes on
// queue pair c mod Window, whose messages alternate the two sets of its
// slots. Every worker cuts and schedules the same way, so a pool index holds
// the same chunk on every worker.
//
// # Exponents
//
// A block is one slot (64 or 256 elements). Every worker must quantise a
// block with the same exponent, the maximum of the workers' own (package
// bfp). As in SwitchML, a message carries in its immediate the exponents of
// the next chunk its queue pair will carry, and the aggregator's reply
// brings their maximum back. The first chunk of each queue pair is preceded
// by an exponent-only message: a WRITE WITH IMMEDIATE of length zero, to a
// slot of the queue pair's own beyond its data slots (package agg), which
// the aggregator answers with an empty write carrying the maxima. So a
// float AllReduce of S bytes sends and receives S bytes of payload per
// worker (rounded up to whole messages, as for int32), at the cost of one
// round trip more per call.
//
// # Loss
//
// A message that gets no result within Timeout is resent whole, with new
// PSNs, on the same queue pair. The aggregator answers a retransmission of a
// completed message with its result again; such a second reply may arrive
// after the queue pair has moved on, so each message writes its result to a
// virtual address of its own (the queue pair's message count picks it), and
// a reply whose address is not the current message's is dropped. The UDP
// transport reads the address in the reply. A verbs completion does not
// carry it, so the verbs transport gives every send, resends included, a
// place of its own, filled with a canary before the send and not named
// again by another message while a reply may still come to it;
// completions come in the order of the writes, and a completion is the
// write of the oldest-sent place that no longer holds the canary and has
// not been accounted for. A resend with no free place names again one of
// its own message's places, whose replies all carry the same result. It
// is the current message's
// result only if that place is one of the current message's sends (not
// merely because the current place changed: it may be half written while
// a second reply to an earlier message completes).
package worker

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"sync"
	"time"

	"github.com/gdrlink/gdrlink/internal/jobauth"
	"github.com/gdrlink/gdrlink/internal/switchml/aggsrv"
	"github.com/gdrlink/gdrlink/internal/switchml/rocev2"
)

// Errors of the package.
var (
	// ErrAggregator means the aggregator failed: it refused the job,
	// closed the control connection, or did not answer in time.
	ErrAggregator = errors.New("switchml: aggregator failed")
	// ErrWorker means another worker of the job left it (closed, or its
	// process died); the error names its rank.
	ErrWorker = errors.New("switchml: a worker left the job")
	// ErrClosed means the worker was closed.
	ErrClosed = errors.New("switchml: worker closed")
	// ErrConfig means a configuration that cannot work.
	ErrConfig = errors.New("switchml: bad configuration")
)

// LeftError says which worker left the job: the aggregator, seeing its
// control connection end (Close, or its process died) or its Abandon,
// ended the job and named it to the others. It matches ErrWorker.
type LeftError struct {
	Rank       int    // the worker that left
	Job        string // the job's name
	Aggregator string // the aggregator's control endpoint
	Why        string // how its connection ended as the aggregator saw it, or why it abandoned
	// Abandoned: the worker gave the job up with Abandon, because it
	// could not take part in a call; it is alive, and a new job of the
	// same name may be set up with it.
	Abandoned bool
}

// Error names the rank.
func (e *LeftError) Error() string {
	if e.Abandoned {
		return fmt.Sprintf("%v: rank %d abandoned job %q, ended by the aggregator %s: %s", ErrWorker, e.Rank, e.Job, e.Aggregator, e.Why)
	}
	return fmt.Sprintf("%v: rank %d left job %q (the aggregator %s saw its connection end: %s)", ErrWorker, e.Rank, e.Job, e.Aggregator, e.Why)
}

// Is makes a LeftError match ErrWorker.
func (e *LeftError) Is(target error) bool { return target == ErrWorker }

// Defaults of Config.
const (
	DefaultSlotBytes = 1024
	DefaultMsgSlots  = 4
	DefaultWindow    = 8
	DefaultTimeout   = 50 * time.Millisecond
	DefaultRetries   = 200
	// DefaultMinTimeout is the floor of the learned resend timeout (its
	// ceiling is Config.Timeout unless MaxTimeout says otherwise);
	// DefaultGiveUp bounds a message's wait for its result.
	DefaultMinTimeout = time.Millisecond
	DefaultGiveUp     = 10 * time.Second
	// DefaultCloseTimeout bounds Close's wait for the other workers.
	DefaultCloseTimeout = time.Second
	// DefaultVerbsBackoff is MaxTimeout, in timeouts, for a verbs worker
	// whose MaxTimeout is zero.
	DefaultVerbsBackoff = 8
)

// Config configures a worker.
type Config struct {
	// Control is the aggregator's control endpoint (host:port).
	Control string
	// Key is the job key the aggregator checks (zero on loopback without
	// one).
	Key jobauth.Key
	// Job names the job, the same on every worker.
	Job string
	// Workers and Rank: the job's size and this worker's rank.
	Workers, Rank int
	// Local is this worker's IPv4 address for RoCE traffic. The UDP
	// transport binds it at Port, so workers on one host need one address
	// each (127.0.0.2, 127.0.0.3, ... on loopback), as the aggregator
	// writes to every worker at the same port; with Verbs, it is the
	// address of the device's GID, and workers on one host may share it
	// (the device tells their queue pairs apart).
	Local [4]byte
	// Port is the UDP port the worker receives on and the aggregator
	// writes to; rocev2.Port when zero. A verbs device always uses
	// rocev2.Port.
	Port uint16
	// DataPort is the aggregator's UDP port; rocev2.Port when zero.
	DataPort uint16
	// Verbs, when set, carries the messages on UC queue pairs of that
	// ibverbs device (FindVerbs finds one for Local) instead of the UDP
	// socket.
	Verbs *Verbs
	// SlotBytes is 256 or 1024 (DefaultSlotBytes when zero).
	SlotBytes int
	// MsgSlots is the packets per message, 1..4 (DefaultMsgSlots).
	MsgSlots int
	// Window is the number of queue pairs (DefaultWindow).
	Window int
	// Timeout is how long a message waits for its result before it is
	// resent until the worker has measured a round trip (DefaultTimeout).
	// From then on the timeout is learned as TCP's is, from the messages
	// answered on their first send (the smoothed round trip plus four
	// mean deviations, doubled after timeouts until the next such
	// answer), within [MinTimeout, MaxTimeout] (DefaultMinTimeout, and
	// Timeout when zero, so that it only ever shortens the wait; with
	// Verbs, MinTimeout is Timeout and MaxTimeout DefaultVerbsBackoff
	// timeouts when zero: the verbs transport keeps the configured
	// timeout and backs off from it, see New); each
	// resend of a message doubles its next wait, up to MaxTimeout. A
	// message fails after Retries resends (DefaultRetries) or GiveUp
	// without a result (DefaultGiveUp), whichever comes first.
	Timeout, MinTimeout, MaxTimeout, GiveUp time.Duration
	Retries                                 int
	// CloseTimeout bounds how long Close waits for the other workers to
	// leave too (DefaultCloseTimeout when zero).
	CloseTimeout time.Duration
	// DropSend and DropRecv, between 0 and 1, drop that share of the
	// packets sent and received, at random, to test loss (with Verbs,
	// whole messages and completions); Seed seeds it.
	DropSend, DropRecv float64
	Seed               uint64
}

// Stats counts a worker's traffic.
type Stats struct {
	Messages   uint64 // messages completed
	Resent     uint64 // messages resent after a timeout
	RoundTrips uint64 // round trips measured (messages answered on their first send)
	// Timeout is the resend timeout learned so far (Config.Timeout before
	// the first round trip).
	Timeout       time.Duration
	PacketsSent   uint64
	BytesSent     uint64 // payload bytes sent (RDMA payload, no headers)
	BytesReceived uint64 // payload bytes of results taken
	StaleReplies  uint64 // replies dropped (old message, gap, bad ICRC): packets over UDP, completions over verbs
	Dropped       uint64 // packets dropped on purpose (DropSend, DropRecv)
}

// Worker is one member of a SwitchML job.
type Worker struct {
	cfg     Config
	ctl     net.Conn
	tr      transport
	base    int
	slotEl  int // elements (int32) per slot
	msgB    int // bytes per message
	qps     []*qp
	opMu    sync.Mutex // one AllReduce at a time
	mu      sync.Mutex
	stats   Stats
	resend  resendTimer // under mu
	rng     *rand.Rand
	dead    chan struct{} // closed when the control connection ends
	deadErr error
	broken  error
	closed  bool
	quit    chan struct{} // closed when Close starts: pending calls end
	wg      sync.WaitGroup
}

// qp is one of the worker's queue pairs.
type qp struct {
	idx    int    // its index in the window
	qpn    uint32 // its number (the transport's)
	aqpn   uint32 // the aggregator's
	psn    uint32 // next PSN sent (UDP) or the first (verbs)
	set    int    // set of the next message
	count  uint64 // messages sent (picks the reply address)
	first  int    // first slot, job-relative
	eslot  int    // slot of its exponent-only messages, job-relative
	eset   int    // set of its next exponent-only message
	result chan reply
	// receive side, owned by the transport's receive loop under w.mu
	rpsn     uint32
	active   bool
	va       uint64
	buf      []byte
	size     int    // DMA length of the reply being received
	want     uint64 // address of the message awaited (0: none)
	wantSize int    // its result's length
	// sbuf is the UDP transport's packet buffer, owned by the goroutine
	// that runs the queue pair's messages.
	sbuf []byte
}

type reply struct {
	va  uint64
	imm uint32
	buf []byte
}

const psnMask = 1<<24 - 1

// withDefaults fills in the zero fields of c with their defaults.
func (c Config) withDefaults() Config {
	cfg := c
	if cfg.SlotBytes == 0 {
		cfg.SlotBytes = DefaultSlotBytes
	}
	if cfg.MsgSlots == 0 {
		cfg.MsgSlots = DefaultMsgSlots
	}
	if cfg.Window == 0 {
		cfg.Window = DefaultWindow
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = DefaultTimeout
	}
	if cfg.Retries == 0 {
		cfg.Retries = DefaultRetries
	}
	if cfg.MinTimeout == 0 {
		cfg.MinTimeout = min(DefaultMinTimeout, cfg.Timeout)
		if cfg.Verbs != nil {
			// The verbs transport keeps the configured timeout. A
			// shorter one resends more into an aggregator that is
			// behind, each resend holding one of a queue pair's
			// places until a later reply comes, and it showed no
			// clear gain in the Soft-RoCE guest. (The 8-rank job
			// that took another message's result with it did so
			// through places given up and named again, which verbs.go
			// no longer does.)
			cfg.MinTimeout = cfg.Timeout
		}
	}
	if cfg.MaxTimeout == 0 {
		cfg.MaxTimeout = cfg.Timeout
		if cfg.Verbs != nil {
			// The verbs transport's timeout is not learned down, so
			// its resends back off instead: a message's waits double
			// up to eight timeouts, and an aggregator that is behind
			// (eight workers in an emulated guest) gets a few resends
			// of each message, not one every timeout.
			cfg.MaxTimeout = DefaultVerbsBackoff * cfg.Timeout
		}
	}
	if cfg.GiveUp == 0 {
		cfg.GiveUp = DefaultGiveUp
	}
	if cfg.CloseTimeout <= 0 {
		cfg.CloseTimeout = DefaultCloseTimeout
	}
	if cfg.Port == 0 {
		cfg.Port = rocev2.Port
	}
	if cfg.DataPort == 0 {
		cfg.DataPort = rocev2.Port
	}
	return cfg
}

// New sets a worker up with the aggregator: it binds the data socket,
// announces the queue pairs and waits for the aggregator's. It returns when
// every worker of the job has announced, or fails.
func New(ctx context.Context, cfg Config) (*Worker, error) {
	cfg = cfg.withDefaults()
	switch {
	case cfg.SlotBytes != 256 && cfg.SlotBytes != 1024:
		return nil, fmt.Errorf("%w: %d-byte slots, want 256 or 1024", ErrConfig, cfg.SlotBytes)
	case cfg.MsgSlots < 1 || cfg.MsgSlots > 4:
		return nil, fmt.Errorf("%w: %d slots per message, want 1..4", ErrConfig, cfg.MsgSlots)
	case cfg.Window < 1 || cfg.Window > 255:
		return nil, fmt.Errorf("%w: window of %d, want 1..255", ErrConfig, cfg.Window)
	case cfg.Timeout < 0 || cfg.MinTimeout < 0 || cfg.MinTimeout > cfg.MaxTimeout || cfg.GiveUp < 0:
		return nil, fmt.Errorf("%w: timeouts %v, min %v, max %v, give up after %v", ErrConfig, cfg.Timeout, cfg.MinTimeout, cfg.MaxTimeout, cfg.GiveUp)
	case cfg.Workers < 1 || cfg.Rank < 0 || cfg.Rank >= cfg.Workers:
		return nil, fmt.Errorf("%w: rank %d of %d", ErrConfig, cfg.Rank, cfg.Workers)
	}
	w := &Worker{cfg: cfg, slotEl: cfg.SlotBytes / 4,
		resend: resendTimer{initial: cfg.Timeout, min: cfg.MinTimeout, max: cfg.MaxTimeout},
		msgB:   cfg.SlotBytes * cfg.MsgSlots, dead: make(chan struct{}), quit: make(chan struct{}),
		rng: rand.New(rand.NewPCG(cfg.Seed, uint64(cfg.Rank)))}
	var err error
	if cfg.Verbs != nil {
		w.tr, err = newVerbsLink(w, *cfg.Verbs)
	} else {
		w.tr, err = newUDPLink(w)
	}
	if err != nil {
		return nil, err
	}
	if err := w.setup(ctx); err != nil {
		w.tr.close()
		if w.ctl != nil {
			w.ctl.Close()
		}
		return nil, err
	}
	w.wg.Add(1)
	go w.watch()
	return w, nil
}

// Transport names the transport that carries the worker's messages:
// "udp" or "verbs".
func (w *Worker) Transport() string { return w.tr.name() }

// setup is the control handshake.
func (w *Worker) setup(ctx context.Context) error {
	cfg := w.cfg
	var d net.Dialer
	c, err := d.DialContext(ctx, "tcp", cfg.Control)
	if err != nil {
		return fmt.Errorf("%w: aggregator %s: %w", ErrAggregator, cfg.Control, err)
	}
	w.ctl = c
	if dl, ok := ctx.Deadline(); ok {
		c.SetDeadline(dl)
	}
	stop := context.AfterFunc(ctx, func() { c.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	if !cfg.Key.IsZero() {
		if err := jobauth.Initiate(c, cfg.Key, aggsrv.Purpose, uint32(cfg.Rank), jobauth.EndsOf(c, true)); err != nil {
			return fmt.Errorf("%w: aggregator %s: %w", ErrAggregator, cfg.Control, err)
		}
	}
	a := aggsrv.Announce{Job: cfg.Job, Workers: cfg.Workers, Rank: cfg.Rank, SlotBytes: cfg.SlotBytes,
		Slots: cfg.Window * (cfg.MsgSlots + 1), Addr: cfg.Local}
	seed := rand.New(rand.NewPCG(cfg.Seed^0x51, uint64(cfg.Rank)))
	for i := range cfg.Window {
		q := &qp{idx: i, psn: seed.Uint32() & psnMask, first: i * cfg.MsgSlots, eslot: cfg.Window*cfg.MsgSlots + i, result: make(chan reply, 1)}
		w.qps = append(w.qps, q)
	}
	if err := w.tr.announce(&a, w.qps); err != nil {
		return err
	}
	body := a.Append(nil)
	if _, err := c.Write(append(binary.BigEndian.AppendUint16(nil, uint16(len(body))), body...)); err != nil {
		return fmt.Errorf("%w: aggregator %s: %w", ErrAggregator, cfg.Control, err)
	}
	var h [2]byte
	if _, err := io.ReadFull(c, h[:]); err != nil {
		return fmt.Errorf("%w: aggregator %s: no assignment: %w", ErrAggregator, cfg.Control, err)
	}
	n := int(binary.BigEndian.Uint16(h[:]))
	if n > aggsrv.MaxMessage {
		return fmt.Errorf("%w: aggregator %s: %d-byte assignment", ErrAggregator, cfg.Control, n)
	}
	b := make([]byte, n)
	if _, err := io.ReadFull(c, b); err != nil {
		return fmt.Errorf("%w: aggregator %s: %w", ErrAggregator, cfg.Control, err)
	}
	as, err := aggsrv.ParseAssignment(b)
	if err != nil {
		return fmt.Errorf("%w: aggregator %s: %w", ErrAggregator, cfg.Control, err)
	}
	if as.Err != "" {
		return fmt.Errorf("%w: aggregator %s refused the job: %s", ErrAggregator, cfg.Control, as.Err)
	}
	if len(as.QPNs) != cfg.Window {
		return fmt.Errorf("%w: aggregator %s: %d queue pairs for %d", ErrAggregator, cfg.Control, len(as.QPNs), cfg.Window)
	}
	c.SetDeadline(time.Time{})
	w.base = as.Base
	for i, q := range w.qps {
		q.aqpn, q.rpsn = as.QPNs[i], as.PSNs[i]
	}
	return w.tr.connect(as)
}

// watch notices the end of the control connection: the aggregator died,
// or it ended the job because a worker left, which it names first.
func (w *Worker) watch() {
	defer w.wg.Done()
	var err error
	b, rerr := aggsrv.ReadMessage(w.ctl)
	if rerr == nil {
		var e aggsrv.Ended
		if e, err = aggsrv.ParseEnded(b); err == nil {
			err = &LeftError{Rank: e.Rank, Job: w.cfg.Job, Aggregator: w.cfg.Control, Why: e.Why, Abandoned: e.Abandoned}
		} else {
			err = fmt.Errorf("%w: aggregator %s: %w", ErrAggregator, w.cfg.Control, err)
		}
		io.Copy(io.Discard, w.ctl)
	} else {
		err = fmt.Errorf("%w: aggregator %s closed the job: %w", ErrAggregator, w.cfg.Control, rerr)
	}
	w.mu.Lock()
	w.deadErr = err
	if w.closed {
		w.deadErr = ErrClosed
	}
	w.mu.Unlock()
	close(w.dead)
}

// Close leaves the job, which ends it for every worker. Since a worker
// that lost a result needs the aggregator's job to get it again, Close first
// sends one more message (exponent-only: no payload) and waits for its
// result, or for another worker to end the job: either shows every worker
// sent it, so every worker has the results of everything before it. It
// waits at most CloseTimeout for that; a call pending when Close starts
// fails with ErrClosed at once.
func (w *Worker) Close() error {
	if !w.markClosed() {
		return nil
	}
	w.opMu.Lock()
	w.mu.Lock()
	broken := w.broken
	w.mu.Unlock()
	if broken == nil {
		ctx, cancel := context.WithTimeout(context.Background(), w.cfg.CloseTimeout)
		w.exchange(ctx, w.qps[0], nil, 0)
		cancel()
	}
	w.opMu.Unlock()
	err := errors.Join(w.ctl.Close(), w.tr.close())
	w.wg.Wait()
	return err
}

// Abandon gives the job up because this worker cannot take part in a
// call (its tensor could not be staged, say): it tells the aggregator why
// (aggsrv.Leave) and leaves. The aggregator ends the job, and every other
// worker's pending and next AllReduce fail at once with a *LeftError
// naming this rank, Abandoned set and why given, instead of waiting at the
// aggregator for messages that will not come. Unlike Close it does not
// first wait for the others: the job is over for all, and a new one of
// the same name may be set up. A call pending on this worker fails with
// ErrClosed.
func (w *Worker) Abandon(why string) error {
	if !w.markClosed() {
		return ErrClosed
	}
	w.opMu.Lock()
	w.ctl.SetWriteDeadline(time.Now().Add(w.cfg.CloseTimeout))
	werr := aggsrv.WriteMessage(w.ctl, (&aggsrv.Leave{Why: why}).Append(nil))
	w.opMu.Unlock()
	if werr != nil {
		werr = fmt.Errorf("%w: aggregator %s: telling it this worker abandons: %w", ErrAggregator, w.cfg.Control, werr)
	}
	err := errors.Join(werr, w.ctl.Close(), w.tr.close())
	w.wg.Wait()
	return err
}

// markClosed marks the worker closed, so that a pending AllReduce fails
// with ErrClosed now; false if it was already.
func (w *Worker) markClosed() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return false
	}
	w.closed = true
	close(w.quit)
	return true
}

// Stats returns the counters.
func (w *Worker) Stats() Stats {
	w.mu.Lock()
	defer w.mu.Unlock()
	st := w.stats
	st.RoundTrips, st.Timeout = w.resend.samples, w.resend.timeout()
	return st
}

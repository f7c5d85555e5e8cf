package gdrlink

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"syscall"
	"time"

	"github.com/gdrlink/gdrlink/internal/bootstrap"
	"github.com/gdrlink/gdrlink/internal/hostcard"
	"github.com/gdrlink/gdrlink/rendezvous"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

// peer is this rank's connection to one other rank, made on first use.
//
// Only the lower rank of a pair makes the connection: for each provider
// both may use, best first, it opens a channel and Calls the higher rank
// with the provider and its hello (connectMsg); the higher rank opens a
// channel on that provider, answers with its hello and connects; a failure
// makes the lower rank try the next provider, and when none is left it
// says so (giveUpMsg). The higher rank, when it is the first to need the
// connection, asks the lower one to start (kickMsg). One side drives, so
// two ranks starting at once never race.
type peer struct {
	g     *Group
	rank  int
	lower bool // this rank is the lower of the pair: it connects
	// local: the peer runs on this node (one kernel, one network and
	// process namespace), which the on-node GPU path needs. A peer state
	// lives as long as the process it was made for (a rejoin makes a new
	// one), so its host card cannot change under it.
	local bool
	cands []string
	why   string // why the candidates are what they are

	mu      sync.Mutex
	started bool // lower: connecting; higher: kicked
	// lower: the attempt in progress, which the higher rank's failedMsg
	// cancels.
	attempt       string
	attemptCancel context.CancelFunc
	ch            *rendezvous.Channel
	provider      string
	gen           int // higher: the attempt the current channel belongs to
	// done closes once connected, or failed for good (err); a failover
	// replaces it with a fresh one. Read it under mu.
	done   chan struct{}
	err    error // the final error, once done closed without a channel
	queue  []queuedSend
	closed bool
	// Failover: how many times the connection failed and was made again,
	// the provider that failed last (tried last next time), and whether
	// the higher rank's next kick asks the lower one to reconnect.
	failovers    int
	failedProv   string
	kickFailover bool
	// peerHello is, at the higher rank, the lower rank's hello for the
	// current connection; kickFor that of the connection a reconnect kick
	// asks to replace.
	peerHello, kickFor []byte
	// retired are the last connections failover replaced (maxRetired).
	retired []*rendezvous.Channel
	// ipc is the on-node GPU path's state with this peer (ipclink.go),
	// made on first use.
	ipc *ipcPair
}

// queuedSend is a Send made before the connection was up.
type queuedSend struct {
	key  string
	step int64
	t    *tensor.Tensor
}

// peer returns the state of rank r, made on first use.
func (g *Group) peer(r int) (*peer, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed {
		return nil, fmt.Errorf("gdrlink: group of rank %d: %w", g.boot.Rank(), ErrClosed)
	}
	if r < 0 || r >= g.boot.Size() || r == g.boot.Rank() {
		return nil, fmt.Errorf("gdrlink: %w: peer rank %d (this is rank %d of %d)", verbsio.ErrBadConfig, r, g.boot.Rank(), g.boot.Size())
	}
	p := g.peers[r]
	if p == nil {
		cands, why := hostcard.Candidates(g.me, g.cards[r], g.cfg.provider)
		p = &peer{g: g, rank: r, lower: g.boot.Rank() < r, local: hostcard.SameNode(g.me, g.cards[r]), cands: cands, why: why, done: make(chan struct{})}
		g.peers[r] = p
	}
	return p, nil
}

// start begins connecting if nobody has: the lower rank connects, the
// higher one asks it to. It runs in the background.
func (p *peer) start() {
	p.mu.Lock()
	if p.started || p.closed || p.isDone() {
		p.mu.Unlock()
		return
	}
	p.started = true
	p.mu.Unlock()
	g := p.g
	g.mu.Lock()
	if g.closed {
		g.mu.Unlock()
		return
	}
	g.wg.Add(1)
	g.mu.Unlock()
	go func() {
		defer g.wg.Done()
		ctx, cancel := context.WithTimeout(g.ctx, g.cfg.connectTimeout)
		defer cancel()
		if p.lower {
			p.connect(ctx)
			return
		}
		p.mu.Lock()
		kick := connMsg{kind: kickMsg}
		if p.kickFailover {
			kick.payload = append([]byte(kickReconnect), p.kickFor...)
		}
		p.mu.Unlock()
		for round := 0; ; round++ {
			_, err := g.boot.Call(ctx, p.rank, kick.Append(nil))
			if err == nil {
				return
			}
			if errors.Is(err, bootstrap.ErrRefused) || !p.retryAfter(ctx, round, err) {
				p.fail(fmt.Errorf("gdrlink: rank %d asking rank %d to connect: %w", g.Rank(), p.rank, err))
				return
			}
		}
	}()
}

func (p *peer) isDone() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// connect is the lower rank's side: each candidate provider in turn (the
// one that failed last, after a failover, last).
func (p *peer) connect(ctx context.Context) {
	g := p.g
	p.mu.Lock()
	cands := slices.Clone(p.cands)
	if i := slices.Index(cands, p.failedProv); i >= 0 {
		cands = append(append(cands[:i:i], cands[i+1:]...), p.failedProv)
	}
	p.mu.Unlock()
	if len(cands) == 0 {
		err := fmt.Errorf("gdrlink: %w: rank %d to rank %d: %s", verbsio.ErrNoProvider, g.Rank(), p.rank, p.why)
		g.boot.Call(ctx, p.rank, connMsg{kind: giveUpMsg, payload: []byte(err.Error())}.Append(nil))
		p.fail(err)
		return
	}
	var errs []error
	for round := 0; ; round++ {
		if p.connectRound(ctx, cands, &errs) {
			return
		}
		if !p.retryAfter(ctx, round, errors.Join(errs...)) {
			break
		}
	}
	err := fmt.Errorf("gdrlink: rank %d could not connect to rank %d: %w", g.Rank(), p.rank, errors.Join(errs...))
	g.boot.Call(ctx, p.rank, connMsg{kind: giveUpMsg, payload: []byte(err.Error())}.Append(nil))
	p.fail(err)
}

// maxReconnectRounds bounds the rounds over every candidate provider that
// making a connection again after a failover takes.
const maxReconnectRounds = 4

// retryAfter reports whether to try making the connection again after
// round failed with err, having waited for it: a connection being made
// again after a failover may be cut as well (what cut the old one may
// still be at work), so it is tried a few times with a growing pause,
// unless the peer's process is gone (its ports refuse) or ctx ended.
func (p *peer) retryAfter(ctx context.Context, round int, err error) bool {
	if !p.reconnecting() || round >= maxReconnectRounds || ctx.Err() != nil || refused(err) {
		return false
	}
	select {
	case <-time.After(time.Duration(50<<round) * time.Millisecond):
		return true
	case <-ctx.Done():
		return false
	}
}

// reconnecting reports whether the peer's connection is being made again
// after a failover.
func (p *peer) reconnecting() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.failovers > 0
}

// refused reports whether err says a port of the peer refused a
// connection: its process is gone.
func refused(err error) bool { return errors.Is(err, syscall.ECONNREFUSED) }

// connectRound tries each candidate provider once and reports whether one
// connected; the failures are added to errs.
func (p *peer) connectRound(ctx context.Context, cands []string, errs *[]error) bool {
	g := p.g
	for _, prov := range cands {
		actx, cancel := context.WithCancel(ctx)
		p.mu.Lock()
		p.attempt, p.attemptCancel = prov, cancel
		p.mu.Unlock()
		ch, err := g.newChannel(prov, p)
		if err == nil {
			var reply []byte
			reply, err = g.boot.Call(actx, p.rank, connMsg{kind: connectMsg, provider: prov, payload: ch.Hello()}.Append(nil))
			if err == nil {
				err = ch.Connect(actx, reply)
			}
			if err == nil {
				cancel()
				p.markConnected(ch, prov)
				return true
			}
			ch.Close()
		}
		// The higher rank's failedMsg cancels actx: its side failed.
		if ctx.Err() == nil && actx.Err() != nil {
			err = fmt.Errorf("rank %d's side failed: %w", p.rank, err)
		}
		cancel()
		g.log.Warn("gdrlink: provider failed, trying the next", "rank", g.Rank(), "peer", p.rank, "provider", prov, "err", err)
		*errs = append(*errs, fmt.Errorf("%s: %w", prov, err))
		if ctx.Err() != nil {
			break
		}
	}
	return false
}

// newChannel opens a protocol channel to peer p on provider's device.
func (g *Group) newChannel(provider string, p *peer) (*rendezvous.Channel, error) {
	rank := p.rank
	d := g.devs[provider]
	if d == nil {
		return nil, fmt.Errorf("%w: provider %s is not open on rank %d", verbsio.ErrNotSupported, provider, g.Rank())
	}
	opts := []rendezvous.Option{
		rendezvous.WithName(fmt.Sprintf("rank %d", g.Rank())),
		rendezvous.WithLogger(g.log),
		rendezvous.WithPeerTimeout(g.cfg.peerTimeout),
	}
	if g.cfg.checksumSet {
		opts = append(opts, rendezvous.WithChecksum(g.cfg.checksum))
	}
	if g.cfg.eagerSet {
		opts = append(opts, rendezvous.WithEager(g.cfg.eagerMax))
	}
	mem, err := g.peerMemory(d, rank)
	if err != nil {
		return nil, err
	}
	return rendezvous.New(d.dev, d.pd, mem, append(opts, g.gpuOptions(p)...)...)
}

// onCall answers the connection messages of other ranks.
func (g *Group) onCall(ctx context.Context, from int, req []byte) ([]byte, error) {
	select {
	case <-g.ready:
	case <-ctx.Done():
		return nil, fmt.Errorf("rank %d is still joining: %w", g.Rank(), ctx.Err())
	}
	m, err := decodeConnMsg(req)
	if err != nil {
		return nil, err
	}
	if m.kind == ipcMsg {
		return g.onIPC(from, m.payload)
	}
	p, err := g.peer(from)
	if err != nil {
		return nil, err
	}
	switch m.kind {
	case kickMsg:
		if !p.lower {
			return nil, fmt.Errorf("%w: rank %d asked rank %d to connect, but the lower rank connects", verbsio.ErrBadFrame, from, g.Rank())
		}
		if id, ok := bytes.CutPrefix(m.payload, []byte(kickReconnect)); ok {
			// The higher rank lost the connection named by this rank's
			// hello for it: so has this side, whether or not it noticed
			// yet. A kick for a connection replaced since is stale.
			if ch, _ := p.connected(); ch != nil && (len(id) == 0 || bytes.Equal(ch.Hello(), id)) {
				p.failover(ch, fmt.Errorf("%w: rank %d lost its side of the connection", verbsio.ErrPeerLost, from))
			}
		}
		p.start()
		return nil, nil
	case giveUpMsg:
		p.fail(fmt.Errorf("gdrlink: rank %d gave up connecting to rank %d: %s", from, g.Rank(), m.payload))
		return nil, nil
	case failedMsg:
		if !p.lower {
			return nil, fmt.Errorf("%w: rank %d reported a failed attempt to rank %d, but the lower rank connects", verbsio.ErrBadFrame, from, g.Rank())
		}
		p.mu.Lock()
		if p.attempt == m.provider && p.attemptCancel != nil {
			p.attemptCancel()
		}
		p.mu.Unlock()
		return nil, nil
	}
	if p.lower {
		return nil, fmt.Errorf("%w: rank %d tried to connect to rank %d, but the lower rank connects", verbsio.ErrBadFrame, from, g.Rank())
	}
	return p.accept(m.provider, m.payload)
}

// accept is the higher rank's side of one attempt: a channel on the
// provider the lower rank chose, connected in the background.
func (p *peer) accept(provider string, hello []byte) ([]byte, error) {
	g := p.g
	if !slices.Contains(p.cands, provider) {
		return nil, fmt.Errorf("%w: rank %d does not use provider %s with rank %d (%v)", verbsio.ErrNotSupported, g.Rank(), provider, p.rank, p.cands)
	}
	ch, err := g.newChannel(provider, p)
	if err != nil {
		return nil, err
	}
	if cur, _ := p.connected(); cur != nil {
		// The lower rank connects again only when it lost the
		// connection: so has this side, whether or not it noticed yet.
		p.replace(cur, fmt.Errorf("%w: rank %d reconnects", verbsio.ErrPeerLost, p.rank), false)
	}
	p.mu.Lock()
	if p.closed || p.isDone() {
		p.mu.Unlock()
		ch.Close()
		return nil, fmt.Errorf("%w: rank %d already has its connection to rank %d", verbsio.ErrBadConfig, g.Rank(), p.rank)
	}
	old := p.ch
	p.gen++
	gen := p.gen
	p.ch, p.provider, p.started = ch, provider, true
	p.peerHello = hello
	p.mu.Unlock()
	if old != nil {
		old.Close() // an earlier attempt the lower rank gave up on
	}
	g.mu.Lock()
	if g.closed {
		g.mu.Unlock()
		return nil, fmt.Errorf("gdrlink: %w", ErrClosed)
	}
	g.wg.Add(1)
	g.mu.Unlock()
	go func() {
		defer g.wg.Done()
		ctx, cancel := context.WithTimeout(g.ctx, g.cfg.connectTimeout)
		defer cancel()
		err := ch.Connect(ctx, hello)
		p.mu.Lock()
		current := p.gen == gen && p.ch == ch
		if current && err != nil {
			p.ch = nil
		}
		p.mu.Unlock()
		if !current {
			return // replaced: the replacer closed ch
		}
		if err != nil {
			// Tell the lower rank at once, so it moves on to the next
			// provider (or gives up) instead of waiting out its timeout.
			ch.Close()
			g.log.Warn("gdrlink: connection attempt failed", "rank", g.Rank(), "peer", p.rank, "provider", provider, "err", err)
			if _, cerr := g.boot.Call(ctx, p.rank, connMsg{kind: failedMsg, provider: provider, payload: []byte(err.Error())}.Append(nil)); cerr != nil {
				g.log.Warn("gdrlink: telling the lower rank of a failed attempt", "rank", g.Rank(), "peer", p.rank, "err", cerr)
			}
			return
		}
		p.markConnected(ch, provider)
	}()
	return ch.Hello(), nil
}

// markConnected publishes a connected channel and hands it the queued Sends.
func (p *peer) markConnected(ch *rendezvous.Channel, provider string) {
	p.mu.Lock()
	if p.closed || p.isDone() {
		p.mu.Unlock()
		ch.Close()
		return
	}
	p.ch, p.provider = ch, provider
	q := p.queue
	p.queue = nil
	close(p.done)
	failedProv, failovers := p.failedProv, p.failovers
	p.mu.Unlock()
	if failovers > 0 {
		p.g.log.Warn("gdrlink: failed over", "rank", p.g.Rank(), "peer", p.rank, "from", failedProv, "to", provider, "device", ch.Device(), "failovers", failovers, "resending", len(q))
	} else {
		p.g.log.Info("gdrlink: connected", "rank", p.g.Rank(), "peer", p.rank, "provider", provider, "device", ch.Device())
	}
	for _, s := range q {
		if err := p.sendOn(ch, s.key, s.step, s.t); err != nil {
			p.g.log.Warn("gdrlink: queued send dropped", "rank", p.g.Rank(), "peer", p.rank, "key", s.key, "step", s.step, "err", err)
			_ = s.t.Release()
		}
	}
}

// fail ends the connection attempts with err: waiting Recvs get it, and
// the queued Sends are released.
func (p *peer) fail(err error) {
	p.mu.Lock()
	if p.isDone() {
		p.mu.Unlock()
		return
	}
	p.err = err
	ch := p.ch
	p.ch = nil
	q := p.queue
	p.queue = nil
	close(p.done)
	p.mu.Unlock()
	if ch != nil {
		ch.Close()
	}
	p.g.dropIPCPeer(p.rank)
	for _, s := range q {
		_ = s.t.Release()
	}
	p.g.log.Warn("gdrlink: no connection", "rank", p.g.Rank(), "peer", p.rank, "err", err)
}

// send hands t to the connection, or queues it until the connection is up.
func (p *peer) send(key string, step int64, t *tensor.Tensor) error {
	p.mu.Lock()
	switch {
	case p.closed:
		p.mu.Unlock()
		return fmt.Errorf("gdrlink: Send to rank %d: %w", p.rank, ErrClosed)
	case p.isDone() && p.ch == nil:
		err := p.err
		p.mu.Unlock()
		return err
	case p.isDone():
		ch := p.ch
		p.mu.Unlock()
		return p.sendOn(ch, key, step, t)
	}
	for _, s := range p.queue {
		if s.key == key && s.step == step {
			p.mu.Unlock()
			return fmt.Errorf("gdrlink: %w: Send of %q step %d to rank %d twice", rendezvous.ErrDuplicate, key, step, p.rank)
		}
	}
	p.queue = append(p.queue, queuedSend{key, step, t})
	p.mu.Unlock()
	p.start()
	return nil
}

// wait starts the connection if needed and waits until it is up.
func (p *peer) wait(ctx context.Context) (*rendezvous.Channel, error) {
	p.start()
	p.mu.Lock()
	done := p.done
	p.mu.Unlock()
	select {
	case <-done:
	case <-ctx.Done():
		return nil, fmt.Errorf("gdrlink: %w: rank %d waiting for its connection to rank %d: %w", verbsio.ErrTimeout, p.g.Rank(), p.rank, ctx.Err())
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	switch {
	case p.closed && p.err == nil:
		return nil, fmt.Errorf("gdrlink: Recv from rank %d: %w", p.rank, ErrClosed)
	case p.ch == nil && p.isDone():
		return nil, p.err
	case p.ch == nil:
		// Failed over since: wait for the next connection.
		return nil, errFailingOver
	}
	return p.ch, nil
}

// connected returns the channel and provider once connected.
func (p *peer) connected() (*rendezvous.Channel, string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.isDone() || p.ch == nil {
		return nil, ""
	}
	return p.ch, p.provider
}

// close closes the connection or the attempt and releases queued Sends.
func (p *peer) close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	ch := p.ch
	q := p.queue
	p.queue = nil
	if !p.isDone() {
		p.err = fmt.Errorf("gdrlink: connection to rank %d: %w", p.rank, ErrClosed)
		close(p.done)
	}
	p.mu.Unlock()
	for _, s := range q {
		_ = s.t.Release()
	}
	if ch == nil {
		return nil
	}
	if err := ch.Close(); err != nil && !errors.Is(err, ErrClosed) {
		return err
	}
	return nil
}

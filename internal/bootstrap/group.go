package bootstrap

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/gdrlink/gdrlink/internal/adaptspin"
	"github.com/gdrlink/gdrlink/internal/ctxerr"
	"github.com/gdrlink/gdrlink/internal/jobauth"
	"github.com/gdrlink/gdrlink/internal/refuselog"
	"github.com/gdrlink/gdrlink/verbsio"
)

// Group is a joined job: every rank's contact address, a control
// connection to the root (or, at the root, to every rank) and pairwise
// connections made on first use. An operation that fails (a timeout, a
// peer gone) may leave its connection in the middle of a message: close
// the group after an error rather than retrying on it.
type Group struct {
	rank, size int
	max        int
	ln         net.Listener
	key        jobauth.Key
	insecure   bool
	dialFn     func(ctx context.Context, addr string) (net.Conn, error)
	logger     *slog.Logger
	// refusals logs the connections the listener turns away (set before
	// the accept loop starts).
	refusals *refuselog.Log

	gatherMu sync.Mutex
	// gatherSpin says how long an all-gather polls its socket before it
	// sleeps (spinReader).
	gatherSpin *adaptspin.Policy
	root       net.Conn   // ranks > 0: the connection to the root
	ranks      []net.Conn // rank 0: the connection of every rank

	onCall Handler
	ctx    context.Context // ends at Close; bounds the Handlers
	cancel context.CancelFunc

	// Rejoining (see Rejoined): this process's data for its peers, and the
	// handler of a peer's notice.
	rejoinData []byte
	onRejoin   RejoinHandler

	mu sync.Mutex
	// addrs and incs are every rank's contact address and incarnation;
	// they change when a rank rejoins.
	addrs []string
	incs  []uint64
	// inc is this process's incarnation (0 until joined); rejoined says it
	// joined in place of a dead process, and peerData holds what each
	// peer answered its notice with.
	inc       uint64
	rejoined  bool
	peerData  [][]byte
	rejoining map[int]bool // root: ranks whose rejoin is being decided
	rejoins   int
	closed    bool
	joined    bool // rank 0: every rank joined, the join queue is shut
	pairs     map[int]*pair
	joinCh    chan joinReq
	pending   map[net.Conn]*greeting // accepted connections in greet
	evicted   int                    // of them, closed to make room for newer ones
	// unprovenBy counts the pending connections that proved nothing yet,
	// by the other end's IP (see maxPerHost).
	unprovenBy map[string]int
	wg         sync.WaitGroup
}

type pair struct {
	mu    sync.Mutex // one Exchange at a time
	ready chan struct{}
	c     net.Conn
}

type joinReq struct {
	c net.Conn
	h helloBody
}

// Join joins the job: rank 0 listens at the root address and waits for
// every other rank, the others dial it until ctx ends. The error of a rank
// that never shows up names it and wraps verbsio.ErrTimeout. A rank that
// cannot prove cfg.Key to the root fails at once, with an error wrapping
// jobauth.ErrRefused; without a key, listening beyond loopback fails with
// an error wrapping jobauth.ErrInsecure unless cfg.Insecure is set.
func Join(ctx context.Context, cfg Config) (*Group, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	g := &Group{rank: cfg.Rank, size: cfg.Size, max: cfg.MaxMessage, pairs: map[int]*pair{},
		gatherSpin: adaptspin.New(adaptspin.Bounds{Max: adaptspin.DefaultMax, Min: adaptspin.DefaultMin}),
		joinCh:     make(chan joinReq, cfg.Size), pending: map[net.Conn]*greeting{}, onCall: cfg.OnCall,
		key: cfg.Key, insecure: cfg.Insecure, dialFn: cfg.dial, logger: cfg.Logger, unprovenBy: map[string]int{},
		rejoinData: cfg.RejoinData, onRejoin: cfg.OnRejoin, rejoining: map[int]bool{}}
	g.ctx, g.cancel = context.WithCancel(context.Background())
	if g.max == 0 {
		g.max = DefaultMaxMessage
	}
	var err error
	if cfg.Rank == 0 {
		err = g.joinRoot(ctx, cfg)
	} else {
		err = g.joinRank(ctx, cfg)
	}
	if err != nil {
		g.Close()
		return nil, err
	}
	return g, nil
}

func (g *Group) listen(addr string) error {
	if err := g.checkListen(addr); err != nil {
		return err
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("%w: bootstrap rank %d: listening on %s: %w", verbsio.ErrBadConfig, g.rank, addr, err)
	}
	g.serve(ln)
	return nil
}

// serve starts accepting on ln.
func (g *Group) serve(ln net.Listener) {
	g.ln = ln
	g.refusals = refuselog.New(g.logger, "bootstrap", ln.Addr().String())
	g.wg.Add(1)
	go g.acceptLoop()
}

func (g *Group) joinRoot(ctx context.Context, cfg Config) error {
	if cfg.Listener != nil {
		if err := g.checkListen(cfg.Listener.Addr().String()); err != nil {
			return err
		}
		g.serve(cfg.Listener)
	} else {
		addr := cfg.root()
		if addr == "" { // a job of one: nobody dials it
			addr = "127.0.0.1:0"
		}
		if err := g.listen(addr); err != nil {
			return err
		}
	}
	g.mu.Lock()
	g.addrs = make([]string, g.size)
	g.addrs[0] = contactOf(g.ln.Addr().String(), cfg.root())
	g.incs = make([]uint64, g.size)
	for r := range g.incs {
		g.incs[r] = 1 // the first process of each rank
	}
	g.ranks = make([]net.Conn, g.size)
	g.mu.Unlock()
	for joined := 1; joined < g.size; {
		select {
		case j := <-g.joinCh:
			why := ""
			switch {
			case j.h.size != g.size:
				why = fmt.Sprintf("job size %d, root has %d", j.h.size, g.size)
			case j.h.rank == 0 || g.ranks[j.h.rank] != nil:
				why = fmt.Sprintf("rank %d already joined", j.h.rank)
			}
			if why != "" {
				g.turnAway(j.c, why)
				continue
			}
			g.mu.Lock()
			g.ranks[j.h.rank] = j.c
			g.addrs[j.h.rank] = j.h.contact
			g.mu.Unlock()
			joined++
		case <-ctx.Done():
			var missing []string
			for r := 1; r < g.size; r++ {
				if g.ranks[r] == nil {
					missing = append(missing, fmt.Sprint(r))
				}
			}
			return fmt.Errorf("%w: bootstrap root %s: rank(s) %s of %d never joined: %w", verbsio.ErrTimeout, g.addrs[0], strings.Join(missing, ", "), g.size, ctx.Err())
		}
	}
	g.mu.Lock()
	g.joined = true
	g.inc = 1
	m := appendMsg(nil, tAddrs, appendAddrs(nil, g.addrs, g.incs))
	g.mu.Unlock()
	// Hellos that queued after the last rank joined (a second process
	// claiming a rank) are turned away now, not parked until Close.
	for drained := false; !drained; {
		select {
		case j := <-g.joinCh:
			g.turnAway(j.c, fmt.Sprintf("rank %d: the job of %d ranks has already joined", j.h.rank, g.size))
		default:
			drained = true
		}
	}
	for r := 1; r < g.size; r++ {
		if err := g.io(ctx, g.ranks[r], func(c net.Conn) error { _, err := c.Write(m); return err }); err != nil {
			return fmt.Errorf("bootstrap root: sending addresses to rank %d at %s: %w", r, g.addrs[r], err)
		}
	}
	return nil
}

// contactOf replaces an unspecified listening IP with the host of the
// address the ranks were told (the root address or a peer list entry).
func contactOf(listening, told string) string {
	h, p, err := net.SplitHostPort(listening)
	if err != nil {
		return listening
	}
	if ip := net.ParseIP(h); ip == nil || !ip.IsUnspecified() {
		return listening
	}
	if th, _, err := net.SplitHostPort(told); err == nil && th != "" {
		return net.JoinHostPort(th, p)
	}
	return listening
}

// checkListen refuses, without a job key, an address beyond loopback
// unless the configuration says the job may run unauthenticated.
func (g *Group) checkListen(addr string) error {
	if err := jobauth.CheckListen(g.key, addr, g.insecure); err != nil {
		return fmt.Errorf("%w: bootstrap rank %d: %w", verbsio.ErrBadConfig, g.rank, err)
	}
	return nil
}

// dial opens a connection to a rank (Config.dial in tests).
func (g *Group) dial(ctx context.Context, addr string) (net.Conn, error) {
	if g.dialFn != nil {
		return g.dialFn(ctx, addr)
	}
	var d net.Dialer
	return d.DialContext(ctx, "tcp", addr)
}

// authPurpose is the purpose of the bootstrap's handshakes (see
// jobauth.Initiate).
const authPurpose = "bootstrap"

// initiate proves the job key on a connection this rank dialled, claiming
// its rank, before any bootstrap message travels; without a key it does
// nothing. It is bounded by ctx only: the acceptor may not have reached
// Join yet. A refusal wraps ErrRefused and jobauth.ErrRefused.
func (g *Group) initiate(ctx context.Context, c net.Conn) error {
	if g.key.IsZero() {
		return nil
	}
	return g.io(ctx, c, func(c net.Conn) error {
		return jobauth.Initiate(c, g.key, authPurpose, uint32(g.rank), jobauth.EndsOf(c, true))
	})
}

func (g *Group) joinRank(ctx context.Context, cfg Config) error {
	root := cfg.root()
	var c net.Conn
	var last error
	for wait := 20 * time.Millisecond; ; wait = min(2*wait, time.Second) {
		c, last = g.dial(ctx, root)
		if last == nil {
			break
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w: bootstrap rank %d: root (rank 0) at %s unreachable: %v (%w)", verbsio.ErrTimeout, g.rank, root, last, ctx.Err())
		case <-time.After(wait):
		}
	}
	g.root = c
	// Only the dial is retried: a root that refuses the key refuses it
	// again, and the rank says so now rather than when ctx ends.
	if err := g.initiate(ctx, c); err != nil {
		return fmt.Errorf("bootstrap rank %d: proving the job key to the root at %s: %w", g.rank, root, err)
	}
	contact := ""
	if cfg.Peers != nil {
		contact = cfg.Peers[g.rank]
	} else {
		h, _, _ := net.SplitHostPort(c.LocalAddr().String())
		contact = net.JoinHostPort(h, "0")
	}
	if err := g.listen(contact); err != nil {
		return err
	}
	contact = contactOf(g.ln.Addr().String(), contact)
	hm := appendMsg(nil, tHello, helloBody{rank: g.rank, size: g.size, contact: contact}.Append(nil))
	var m msg
	err := g.io(ctx, c, func(c net.Conn) error {
		if _, err := c.Write(hm); err != nil {
			return err
		}
		var err error
		m, err = readMsg(c, g.max)
		return err
	})
	if err != nil {
		return fmt.Errorf("bootstrap rank %d: waiting for the address list from the root at %s (are all %d ranks started?): %w", g.rank, root, g.size, err)
	}
	switch m.typ {
	case tAddrs, tRejoined:
	case tRefused:
		return fmt.Errorf("%w: %w: bootstrap rank %d: root %s refused: %s", verbsio.ErrBadConfig, ErrRefused, g.rank, root, m.body)
	default:
		return fmt.Errorf("%w: bootstrap: message type %d from the root, want the address list", verbsio.ErrBadFrame, m.typ)
	}
	addrs, incs, err := parseAddrs(m.body, g.size)
	if err != nil {
		return err
	}
	g.mu.Lock()
	g.addrs, g.incs, g.inc = addrs, incs, incs[g.rank]
	g.rejoined = m.typ == tRejoined
	g.mu.Unlock()
	if g.rejoined {
		g.notifyAll(ctx)
	}
	return nil
}

// io runs fn on c with c's deadline following ctx: cancelling ctx
// interrupts a blocked read or write. A failure because ctx ended wraps
// verbsio.ErrTimeout.
func (g *Group) io(ctx context.Context, c net.Conn, fn func(net.Conn) error) error {
	if dl, ok := ctx.Deadline(); ok {
		c.SetDeadline(dl)
	}
	stop := context.AfterFunc(ctx, func() { c.SetDeadline(time.Unix(1, 0)) })
	err := fn(c)
	stop()
	c.SetDeadline(time.Time{})
	switch {
	case err == nil:
		return nil
	case ctx.Err() != nil || errors.Is(err, os.ErrDeadlineExceeded):
		return fmt.Errorf("%w: %w", verbsio.ErrTimeout, err)
	case errors.Is(err, verbsio.ErrBadFrame):
		return err
	case errors.Is(err, jobauth.ErrRefused):
		return fmt.Errorf("%w: %w", ErrRefused, err)
	}
	return fmt.Errorf("%w: %w", verbsio.ErrPeerLost, err)
}

func (g *Group) acceptLoop() {
	defer g.wg.Done()
	for {
		c, err := g.ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			time.Sleep(10 * time.Millisecond)
			continue
		}
		host := hostOf(c.RemoteAddr())
		g.mu.Lock()
		if g.closed {
			g.mu.Unlock()
			c.Close()
			return
		}
		// A flood of connections that prove nothing must not hold the
		// job's own ranks out, nor grow goroutines without bound: beyond
		// an address's share the oldest of that address goes; on a full
		// listener, the oldest of the address holding the most, so that
		// one address's flood never evicts another's connections.
		var evicted net.Conn
		var why error
		switch {
		case g.unprovenBy[host] >= g.maxPerHost():
			evicted = g.oldestPendingLocked(host)
			why = fmt.Errorf("%w: bootstrap: closed before proving anything, to make room: %s opened %d newer connections that proved nothing either", jobauth.ErrRefused, host, g.maxPerHost())
		case len(g.pending) >= g.maxPending():
			evicted = g.oldestPendingLocked(g.busiestHostLocked())
			why = fmt.Errorf("%w: bootstrap: closed before proving anything, to make room: %d newer connections waited too", jobauth.ErrRefused, g.maxPending())
		}
		if evicted != nil {
			evicted.Close()
			g.forgetLocked(evicted)
			g.evicted++
		}
		g.pending[c] = &greeting{at: time.Now(), host: host}
		g.unprovenBy[host]++
		g.wg.Add(1)
		g.mu.Unlock()
		if evicted != nil {
			g.refusals.Refused(evicted.RemoteAddr().String(), why)
		}
		go g.greet(c)
	}
}

// greeting is an accepted connection in greet.
type greeting struct {
	at     time.Time
	host   string // the other end's IP
	proven bool   // it proved the job key, or sent its first message without one
}

// hostOf is the IP of addr, or all of it when it has no port.
func hostOf(addr net.Addr) string {
	s := addr.String()
	if h, _, err := net.SplitHostPort(s); err == nil {
		return h
	}
	return s
}

// maxPending is how many accepted connections may wait to prove the key and
// send their first message at once: room for every rank's hello and a Call
// from each, and 64 more.
func (g *Group) maxPending() int { return 2*g.size + 64 }

// maxPerHost is how many of them one address may hold unproven: room for
// every rank of the job on that host at once, and 16 more.
func (g *Group) maxPerHost() int { return g.size + 16 }

// oldestPendingLocked is host's oldest pending connection that proved
// nothing, or, when none did, the oldest of all (a listener full of
// proven connections). Callers hold g.mu.
func (g *Group) oldestPendingLocked(host string) net.Conn {
	var oldest, any net.Conn
	var at, anyAt time.Time
	for c, p := range g.pending {
		if any == nil || p.at.Before(anyAt) {
			any, anyAt = c, p.at
		}
		if !p.proven && p.host == host && (oldest == nil || p.at.Before(at)) {
			oldest, at = c, p.at
		}
	}
	if oldest == nil {
		return any
	}
	return oldest
}

// busiestHostLocked is the address holding the most unproven connections.
// Callers hold g.mu.
func (g *Group) busiestHostLocked() string {
	var busiest string
	n := 0
	for h, k := range g.unprovenBy {
		if k > n || k == n && h < busiest {
			busiest, n = h, k
		}
	}
	return busiest
}

// forgetLocked drops c from the pending connections. Callers hold g.mu.
func (g *Group) forgetLocked(c net.Conn) {
	p, ok := g.pending[c]
	if !ok {
		return
	}
	g.provenLocked(p)
	delete(g.pending, c)
}

// provenLocked takes p out of the unproven counts. Callers hold g.mu.
func (g *Group) provenLocked(p *greeting) {
	if p.proven {
		return
	}
	p.proven = true
	if g.unprovenBy[p.host]--; g.unprovenBy[p.host] <= 0 {
		delete(g.unprovenBy, p.host)
	}
}

// proven marks c as past what a stranger can reach, out of the per-address
// bound's way.
func (g *Group) proven(c net.Conn) {
	g.mu.Lock()
	if p, ok := g.pending[c]; ok {
		g.provenLocked(p)
	}
	g.mu.Unlock()
}

// refused logs a pending connection that greet turns away, unless the
// group is closing or it was evicted (and logged) already.
func (g *Group) refused(c net.Conn, why error) {
	g.mu.Lock()
	_, pending := g.pending[c]
	log := pending && !g.closed
	g.mu.Unlock()
	if log {
		g.refusals.Refused(c.RemoteAddr().String(), why)
	}
}

// turnAway tells the other end of c why it is turned away (refuse) and
// logs it, unless the group is closing.
func (g *Group) turnAway(c net.Conn, why string) {
	g.mu.Lock()
	closed := g.closed
	g.mu.Unlock()
	if !closed {
		g.refusals.Refused(c.RemoteAddr().String(), fmt.Errorf("%w: %s", ErrRefused, why))
	}
	refuse(c, why)
}

// Deadlines of an accepted connection, from its acceptance: for proving
// the job key, and for its first message.
const (
	handshakeTimeout = 10 * time.Second
	greetTimeout     = 30 * time.Second
)

// greet reads the first message of an accepted connection: a rank joining
// (root only), a peer opening a pairwise connection, or a Call. With a job
// key, the other end proves it first, and the message must claim the rank
// the proof is bound to.
func (g *Group) greet(c net.Conn) {
	defer g.wg.Done()
	keep := false
	defer func() {
		g.mu.Lock()
		g.forgetLocked(c)
		g.mu.Unlock()
		if !keep {
			c.Close()
		}
	}()
	start := time.Now()
	bound := -1 // the rank the handshake bound; -1 without a key
	if !g.key.IsZero() {
		c.SetDeadline(start.Add(handshakeTimeout))
		r, err := g.accept(c)
		if err != nil {
			g.refused(c, fmt.Errorf("bootstrap: proving the job key: %w", err))
			return
		}
		bound = r
		g.proven(c)
	}
	c.SetDeadline(start.Add(greetTimeout))
	m, err := readMsg(c, min(g.max, maxGreeting))
	c.SetDeadline(time.Time{})
	if err != nil {
		g.refused(c, fmt.Errorf("bootstrap: reading the first message: %w", err))
		return
	}
	g.proven(c)
	switch m.typ {
	case tCall:
		g.answer(c, m.body, bound)
		return
	case tNotice:
		g.onNotice(c, m.body, bound)
		return
	case tPing:
		g.mu.Lock()
		inc := g.inc
		g.mu.Unlock()
		c.SetWriteDeadline(time.Now().Add(time.Second))
		c.Write(appendMsg(nil, tPong, binary.BigEndian.AppendUint64(nil, inc)))
		return
	}
	h, err := parseHello(m.body)
	if err == nil && h.size != g.size {
		err = fmt.Errorf("%w: hello for a job of %d ranks, this one has %d", verbsio.ErrBadFrame, h.size, g.size)
	}
	if err != nil {
		g.refused(c, fmt.Errorf("bootstrap: first message of type %d: %w", m.typ, err))
		return
	}
	if bound >= 0 && h.rank != bound {
		g.turnAway(c, fmt.Sprintf("hello from rank %d on a connection whose job key was proven for rank %d", h.rank, bound))
		return
	}
	switch {
	case m.typ == tHello && g.rank == 0:
		// Checked and queued under g.mu, which joinRoot takes to mark the
		// job joined before it drains the queue: no hello is parked.
		g.mu.Lock()
		joined := g.joined
		if !joined {
			select {
			case g.joinCh <- joinReq{c: c, h: h}:
				keep = true
			default:
			}
		}
		g.mu.Unlock()
		switch {
		case joined:
			keep = g.rejoin(c, h)
		case !keep:
			g.turnAway(c, fmt.Sprintf("rank %d: too many hellos for a job of %d ranks", h.rank, g.size))
		}
	case m.typ == tPeerHello && h.rank < g.rank:
		p := g.pair(h.rank)
		g.mu.Lock()
		if p.c == nil && !g.closed {
			p.c = c
			close(p.ready)
			keep = true
		}
		g.mu.Unlock()
		if !keep {
			g.refused(c, fmt.Errorf("%w: bootstrap: pairwise hello from rank %d, which is connected already", jobauth.ErrRefused, h.rank))
		}
	default:
		g.refused(c, fmt.Errorf("%w: bootstrap: message of type %d from rank %d at rank %d", verbsio.ErrBadFrame, m.typ, h.rank, g.rank))
	}
}

// maxGreeting bounds the first message of an accepted connection (a hello
// or a Call), before the peer is known to be a rank of the job.
const maxGreeting = 64 << 10

// accept has the other end of an accepted connection prove the job key
// and returns the rank it claimed, now bound to the proof. A process
// without the key that opens with a bootstrap message is told why it is
// turned away; anything else that fails the handshake is closed unanswered.
func (g *Group) accept(c net.Conn) (int, error) {
	// A handshake's first bytes can never pass for a message header: read
	// as a length, its magic is far over maxGreeting.
	var head [msgHdrLen]byte
	if _, err := io.ReadFull(c, head[:]); err != nil {
		return 0, err
	}
	if checkHdr(head[:], maxGreeting) == nil {
		// Read the rest of the message first: closing with unread bytes
		// would reset the connection and could lose the refusal.
		if _, err := io.CopyN(io.Discard, c, int64(binary.BigEndian.Uint32(head[:]))-2); err != nil {
			return 0, err
		}
		refuse(c, fmt.Sprintf("rank %d proves a job key on every connection and this one did not start with its handshake: give every rank the same key (%s or %s)", g.rank, jobauth.KeyEnv, jobauth.KeyFileEnv))
		return 0, fmt.Errorf("%w: bootstrap message from %s without a handshake", jobauth.ErrRefused, c.RemoteAddr())
	}
	rw := struct {
		io.Reader
		io.Writer
	}{io.MultiReader(bytes.NewReader(head[:]), c), c}
	r, err := jobauth.Accept(rw, g.key, authPurpose, jobauth.EndsOf(c, false))
	if err != nil {
		return 0, err
	}
	if uint64(r) >= uint64(g.size) {
		return 0, fmt.Errorf("%w: rank %d claimed in a job of %d", jobauth.ErrRefused, r, g.size)
	}
	return int(r), nil
}

// refuse tells the other end of c why it is turned away, within a second,
// and closes c.
func refuse(c net.Conn, why string) {
	c.SetWriteDeadline(time.Now().Add(time.Second))
	c.Write(appendMsg(nil, tRefused, []byte(why)))
	c.Close()
}

// answer runs the Handler for a Call and writes its reply or refusal. bound
// is the rank the connection's handshake proved, -1 without a key.
func (g *Group) answer(c net.Conn, body []byte, bound int) {
	cb, err := parseCall(body)
	if err != nil {
		g.turnAway(c, err.Error())
		return
	}
	if bound >= 0 && cb.rank != bound {
		g.turnAway(c, fmt.Sprintf("call from rank %d on a connection whose job key was proven for rank %d", cb.rank, bound))
		return
	}
	if cb.size != g.size || cb.rank == g.rank {
		g.turnAway(c, fmt.Sprintf("call from rank %d of %d: this is rank %d of %d", cb.rank, cb.size, g.rank, g.size))
		return
	}
	if known := g.incOf(cb.rank); cb.inc < known {
		g.turnAway(c, fmt.Sprintf("call from incarnation %d of rank %d, which incarnation %d replaced", cb.inc, cb.rank, known))
		return
	}
	if g.onCall == nil {
		refuse(c, fmt.Sprintf("rank %d answers no calls", g.rank))
		return
	}
	ctx, cancel := context.WithTimeout(g.ctx, CallTimeout)
	defer cancel()
	reply, err := g.onCall(ctx, cb.rank, cb.req)
	if err == nil && len(reply) > g.max {
		err = fmt.Errorf("%w: reply of %d bytes over the message limit %d", verbsio.ErrBadConfig, len(reply), g.max)
	}
	if err != nil {
		refuse(c, err.Error())
		return
	}
	c.SetWriteDeadline(time.Now().Add(CallTimeout))
	c.Write(appendMsg(nil, tReply, reply))
}

// Call sends req to peer's Handler (Config.OnCall) over a connection of its
// own and returns the reply. Unlike Exchange it needs nothing of the peer
// but its Handler, so either side may start it at any time after Join. A
// refusal wraps ErrRefused with the peer's reason (and jobauth.ErrRefused
// when it was the job key).
func (g *Group) Call(ctx context.Context, peer int, req []byte) ([]byte, error) {
	if peer < 0 || peer >= g.size || peer == g.rank {
		return nil, fmt.Errorf("%w: call to rank %d from rank %d of %d", verbsio.ErrBadConfig, peer, g.rank, g.size)
	}
	if len(req)+64 > maxGreeting {
		return nil, fmt.Errorf("%w: call of %d bytes over the limit %d", verbsio.ErrBadConfig, len(req), maxGreeting-64)
	}
	c, err := g.dial(ctx, g.addr(peer))
	if err != nil {
		return nil, fmt.Errorf("%w: bootstrap rank %d: calling rank %d at %s: %w", ctxerr.Sentinel(ctx, verbsio.ErrPeerLost), g.rank, peer, g.addr(peer), err)
	}
	defer c.Close()
	if err := g.initiate(ctx, c); err != nil {
		return nil, fmt.Errorf("bootstrap rank %d: call to rank %d at %s: %w", g.rank, peer, g.addr(peer), err)
	}
	var m msg
	err = g.io(ctx, c, func(c net.Conn) error {
		if _, err := c.Write(appendMsg(nil, tCall, callBody{rank: g.rank, size: g.size, inc: g.incOf(g.rank), req: req}.Append(nil))); err != nil {
			return err
		}
		var err error
		m, err = readMsg(c, g.max)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("bootstrap rank %d: call to rank %d at %s: %w", g.rank, peer, g.addr(peer), err)
	}
	switch m.typ {
	case tReply:
		return m.body, nil
	case tRefused:
		return nil, fmt.Errorf("%w: rank %d at %s: %s", ErrRefused, peer, g.addr(peer), m.body)
	}
	return nil, fmt.Errorf("%w: message type %d from rank %d, want a reply", verbsio.ErrBadFrame, m.typ, peer)
}

// ErrRefused: a peer or the root turned a Call or a hello away, or a
// connection's job key was not proven (the error then also wraps
// jobauth.ErrRefused); the message quotes the reason.
var ErrRefused = errors.New("bootstrap: refused")

func (g *Group) pair(peer int) *pair {
	g.mu.Lock()
	defer g.mu.Unlock()
	p := g.pairs[peer]
	if p == nil {
		p = &pair{ready: make(chan struct{})}
		g.pairs[peer] = p
	}
	return p
}

// Rank is this process's rank.
func (g *Group) Rank() int { return g.rank }

// Size is the number of ranks.
func (g *Group) Size() int { return g.size }

// Addrs is every rank's contact address, by rank.
func (g *Group) Addrs() []string {
	g.mu.Lock()
	defer g.mu.Unlock()
	return slices.Clone(g.addrs)
}

// addr is rank r's contact address (it changes when r rejoins).
func (g *Group) addr(r int) string {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.addrs[r]
}

// rankConn is, at the root, rank r's control connection.
func (g *Group) rankConn(r int) net.Conn {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.ranks[r]
}

// SetYield makes the all-gathers (Barrier's) poll their socket for up to
// gatherYieldSpin, giving up the thread's CPU between looks
// (adaptspin.Bounds.Yield), or, off, go back to the default short poll
// that keeps the CPU. For hosts with more runnable threads than CPUs: there
// the completion queues of the process may keep every Go processor busy
// polling, and the runtime then looks at the network (a sleeping
// all-gather's socket) only every 10 ms; and a rank that reached the
// all-gather first held its CPU from ranks still on their way. The front
// door calls it once it knows how many ranks share the host.
func (g *Group) SetYield(on bool) {
	g.gatherMu.Lock()
	defer g.gatherMu.Unlock()
	if g.gatherSpin.Yields() == on {
		return
	}
	b := adaptspin.Bounds{Max: adaptspin.DefaultMax, Min: adaptspin.DefaultMin}
	if on {
		b = adaptspin.Bounds{Max: gatherYieldSpin, Min: gatherYieldSpin, Yield: true}
	}
	g.gatherSpin = adaptspin.New(b)
}

// gatherYieldSpin is how long an all-gather polls where polls yield
// (SetYield): well beyond the completion queues' long polls (5 ms by
// default, verbsio/onnode), during which nothing else may look at the
// network for it.
const gatherYieldSpin = 50 * time.Millisecond

// RootAddr is the root's address (useful when rank 0 listened on port 0).
func (g *Group) RootAddr() string { return g.addr(0) }

// AllGather gives every rank's data, by rank, to every rank.
func (g *Group) AllGather(ctx context.Context, data []byte) ([][]byte, error) {
	if len(data) > g.max {
		return nil, fmt.Errorf("%w: %d bytes over the message limit %d", verbsio.ErrBadConfig, len(data), g.max)
	}
	g.gatherMu.Lock()
	defer g.gatherMu.Unlock()
	if g.rank != 0 {
		var m msg
		err := g.io(ctx, g.root, func(c net.Conn) error {
			if _, err := c.Write(appendMsg(nil, tGather, data)); err != nil {
				return err
			}
			var err error
			m, err = readMsg(newSpinReader(c, g.gatherSpin), g.max*g.size+4*g.size+4)
			return err
		})
		if err != nil {
			return nil, fmt.Errorf("bootstrap rank %d: all-gather through the root at %s: %w", g.rank, g.addr(0), err)
		}
		if m.typ != tGathered {
			return nil, fmt.Errorf("%w: message type %d from the root, want the gathered data", verbsio.ErrBadFrame, m.typ)
		}
		return parseList(m.body, g.size)
	}
	out := make([][]byte, g.size)
	out[0] = slices.Clone(data)
	for r := 1; r < g.size; r++ {
		var m msg
		err := g.io(ctx, g.rankConn(r), func(c net.Conn) error {
			var err error
			m, err = readMsg(newSpinReader(c, g.gatherSpin), g.max)
			return err
		})
		if err != nil {
			return nil, fmt.Errorf("bootstrap root: rank %d at %s did not reach the all-gather: %w", r, g.addr(r), err)
		}
		if m.typ != tGather {
			return nil, fmt.Errorf("%w: message type %d from rank %d, want its all-gather data", verbsio.ErrBadFrame, m.typ, r)
		}
		out[r] = m.body
	}
	reply := appendMsg(nil, tGathered, appendList(nil, out))
	for r := 1; r < g.size; r++ {
		if err := g.io(ctx, g.rankConn(r), func(c net.Conn) error { _, err := c.Write(reply); return err }); err != nil {
			return nil, fmt.Errorf("bootstrap root: sending the all-gather to rank %d at %s: %w", r, g.addr(r), err)
		}
	}
	return out, nil
}

// Barrier returns once every rank has called it.
func (g *Group) Barrier(ctx context.Context) error {
	_, err := g.AllGather(ctx, nil)
	return err
}

// Exchange sends data to peer and returns what peer sent in its Exchange
// with this rank. The lower rank dials the higher one on first use.
func (g *Group) Exchange(ctx context.Context, peer int, data []byte) ([]byte, error) {
	if peer < 0 || peer >= g.size {
		return nil, fmt.Errorf("%w: exchange with rank %d of %d", verbsio.ErrBadConfig, peer, g.size)
	}
	if len(data) > g.max {
		return nil, fmt.Errorf("%w: %d bytes over the message limit %d", verbsio.ErrBadConfig, len(data), g.max)
	}
	if peer == g.rank {
		return slices.Clone(data), nil
	}
	p := g.pair(peer)
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := g.openPair(ctx, peer, p); err != nil {
		return nil, err
	}
	var m msg
	err := g.io(ctx, p.c, func(c net.Conn) error {
		if _, err := c.Write(appendMsg(nil, tExchange, data)); err != nil {
			return err
		}
		var err error
		m, err = readMsg(c, g.max)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("bootstrap rank %d: exchange with rank %d at %s: %w", g.rank, peer, g.addr(peer), err)
	}
	if m.typ != tExchange {
		return nil, fmt.Errorf("%w: message type %d from rank %d, want an exchange", verbsio.ErrBadFrame, m.typ, peer)
	}
	return m.body, nil
}

func (g *Group) openPair(ctx context.Context, peer int, p *pair) error {
	if peer < g.rank {
		select {
		case <-p.ready:
			return nil
		case <-ctx.Done():
			return fmt.Errorf("%w: bootstrap rank %d: rank %d at %s never opened its pairwise connection: %w", verbsio.ErrTimeout, g.rank, peer, g.addr(peer), ctx.Err())
		}
	}
	g.mu.Lock()
	have := p.c != nil
	g.mu.Unlock()
	if have {
		return nil
	}
	c, err := g.dial(ctx, g.addr(peer))
	if err != nil {
		return fmt.Errorf("%w: bootstrap rank %d: dialing rank %d at %s: %w", ctxerr.Sentinel(ctx, verbsio.ErrPeerLost), g.rank, peer, g.addr(peer), err)
	}
	if err := g.initiate(ctx, c); err != nil {
		c.Close()
		return fmt.Errorf("bootstrap rank %d: pairwise connection to rank %d at %s: %w", g.rank, peer, g.addr(peer), err)
	}
	hm := appendMsg(nil, tPeerHello, helloBody{rank: g.rank, size: g.size}.Append(nil))
	if err := g.io(ctx, c, func(c net.Conn) error { _, err := c.Write(hm); return err }); err != nil {
		c.Close()
		return err
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed {
		c.Close()
		return fmt.Errorf("%w: bootstrap group", verbsio.ErrClosed)
	}
	p.c = c
	close(p.ready)
	return nil
}

// Close closes the listener and every connection. Idempotent.
func (g *Group) Close() error {
	g.mu.Lock()
	if g.closed {
		g.mu.Unlock()
		return nil
	}
	g.closed = true
	g.cancel()
	for c := range g.pending {
		c.Close()
	}
	for _, p := range g.pairs {
		if p.c != nil {
			p.c.Close()
		}
	}
	g.mu.Unlock()
	if g.ln != nil {
		g.ln.Close()
	}
	if g.root != nil {
		g.root.Close()
	}
	for _, c := range g.ranks {
		if c != nil {
			c.Close()
		}
	}
	// Ranks that joined after the root gave up wait in joinCh.
	for {
		select {
		case j := <-g.joinCh:
			j.c.Close()
			continue
		default:
		}
		break
	}
	g.wg.Wait()
	return nil
}

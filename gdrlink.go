package gdrlink

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"reflect"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/alloc/visitor"
	"github.com/gdrlink/gdrlink/internal/bootstrap"
	"github.com/gdrlink/gdrlink/internal/closed"
	"github.com/gdrlink/gdrlink/internal/collective"
	"github.com/gdrlink/gdrlink/internal/hostcard"
	"github.com/gdrlink/gdrlink/internal/jobauth"
	"github.com/gdrlink/gdrlink/rendezvous"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"

	// The built-in providers register themselves with verbsio.
	_ "github.com/gdrlink/gdrlink/verbsio/ibverbs"
	_ "github.com/gdrlink/gdrlink/verbsio/onnode"
	_ "github.com/gdrlink/gdrlink/verbsio/tcp"
)

// ErrClosed is returned for use of a closed Group. It is the one closed
// error of every layer: errors.Is(err, ErrClosed) holds whether the group,
// its pool, a channel or a device noticed.
var ErrClosed = closed.Err

// ErrNotAuthenticated: a peer did not prove the job key (a stranger, a
// wrong key, a replayed handshake), or refused ours. Every layer that
// authenticates a connection (the bootstrap, the tcp and onnode providers)
// wraps this one value.
var ErrNotAuthenticated = jobauth.ErrRefused

// ErrInsecure: a job without a key was asked to listen beyond loopback; set
// a job key (GDRLINK_JOB_KEY, GDRLINK_JOB_KEY_FILE, WithJobKey), or
// GDRLINK_INSECURE=1 (WithInsecure) to run unauthenticated.
var ErrInsecure = jobauth.ErrInsecure

// Transfer is what one Recv did: the path the bytes took (direct,
// direct-gpu, proxy, serialized, none), the provider and device that
// carried them, the meta-data round trips and the time taken.
type Transfer = rendezvous.Transfer

// builtin are the providers Join considers, best first.
var builtin = []string{"onnode", "ibverbs", "tcp"}

// Group is this process's place in a job: its rank, the registered tensor
// pool, and a connection to each peer it has exchanged with (made on first
// use). It is safe for concurrent use.
type Group struct {
	cfg   config
	log   *slog.Logger
	boot  *bootstrap.Group
	cards []hostcard.Card
	me    hostcard.Card
	// unusable says why each built-in provider cannot be used here.
	unusable map[string]error

	// Fixed after Join: the devices opened and the pool registered with
	// each of them.
	devs map[string]*device
	pool *alloc.Pool
	// src is the group pool's source, which the peers' result pools use
	// too, and budget the limit they share (see peerMemory).
	src    alloc.Source
	budget *alloc.Budget
	gpu    *gpuSide // nil without WithGPU
	// cpus are the CPUs this process was bound to (WithCPUBinding), nil
	// when not; unbound says why a binding asked for was not made.
	cpus    []int
	unbound string
	// yield says whether the devices' completion queues yield their CPU
	// between polls (verbsio.Config.Yield).
	yield bool
	// procs is what shareProcs set GOMAXPROCS to (0: it did not), and
	// procsBefore what it was before.
	procs, procsBefore int

	metrics    *metrics
	metricsSrv *metricsServer // nil without WithMetricsAddr

	ready   chan struct{} // closed when Join has finished setting up
	ctx     context.Context
	cancel  context.CancelFunc
	joinDur time.Duration

	mu      sync.Mutex
	closed  bool
	peers   map[int]*peer
	rejoins int // peers that restarted and rejoined
	// failovers counts the connections lost and made again.
	failovers int
	// peerPools are the peers' result pools (see peerMemory).
	peerPools map[peerPoolKey]*alloc.Pool
	// peerInc is the incarnation of each peer that rejoined (1 when not
	// in it); rejoinSig closes at each rejoin, for WaitRejoin.
	peerInc   map[int]uint64
	rejoinSig chan struct{}
	wg        sync.WaitGroup

	// The collectives run one at a time: collMu holds the turn, collSeq
	// counts the calls made, collErr is the failure that ended them.
	// ring is the built-in backend (coll, or the one switchml hands
	// calls to), closed with the group.
	coll    collective.Backend
	ring    *collective.Ring
	collMu  sync.Mutex
	collSeq uint64
	collErr error
}

// device is one provider's open device, protection domain and the pool's
// registration with it.
type device struct {
	name string
	dev  verbsio.Device
	pd   verbsio.ProtectionDomain
	// reg registers the group's pool; writable, on a device that gives
	// each peer a result pool of its own (perPeer), the pools peers write.
	reg      *visitor.MemoryRegistration
	writable *visitor.MemoryRegistration
}

// Join joins the job this process belongs to: it reads the launcher's
// environment (or the options), meets every rank through the bootstrap,
// learns where each runs, opens the providers the job can use and a tensor
// pool registered with each of them once. No peer connection is made yet:
// the first Send or Recv between two ranks makes theirs, with the best
// provider both have. Join waits for every rank until ctx ends.
func Join(ctx context.Context, opts ...Option) (*Group, error) {
	start := time.Now()
	cfg, err := fromEnv(os.LookupEnv)
	if err != nil {
		return nil, fmt.Errorf("gdrlink: %w", err)
	}
	for _, o := range opts {
		if o == nil {
			continue
		}
		if err := o(&cfg); err != nil {
			return nil, fmt.Errorf("gdrlink: %w", err)
		}
	}
	if cfg.log == nil {
		cfg.log = slog.New(slog.DiscardHandler)
	}
	bc, err := bootstrapConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("gdrlink: %w", err)
	}
	cfg.bindJob(bc)
	bc.Key = cfg.jobKey
	g := &Group{cfg: cfg, log: cfg.log, devs: map[string]*device{}, peers: map[int]*peer{}, unusable: map[string]error{}, ready: make(chan struct{}),
		peerInc: map[int]uint64{}, rejoinSig: make(chan struct{}), peerPools: map[peerPoolKey]*alloc.Pool{}}
	g.ctx, g.cancel = context.WithCancel(context.Background())
	g.metrics = newMetrics(g)
	g.ring = collective.NewRing(ringTransport{g})
	g.coll = g.ring
	if cfg.aggregator != "" {
		g.coll = newSwitchML(g, g.coll)
	}
	bc.OnCall = g.onCall
	bc.OnRejoin = g.onRejoin
	var usable []string
	for _, name := range builtin {
		p, err := verbsio.Lookup(name)
		if err == nil {
			_, err = p.Devices()
		}
		if err != nil {
			g.unusable[name] = err
			continue
		}
		usable = append(usable, name)
	}
	if cfg.provider != "" {
		var errs []error
		for _, p := range strings.Split(cfg.provider, ",") {
			if slices.Contains(usable, p) {
				errs = nil
				break
			}
			errs = append(errs, fmt.Errorf("%s: %w", p, g.unusable[p]))
		}
		if errs != nil {
			return nil, fmt.Errorf("gdrlink: %w: provider %s chosen but not usable here: %w", verbsio.ErrBadConfig, cfg.provider, errors.Join(errs...))
		}
	}
	g.me = hostcard.Local("/", usable)
	bc.RejoinData = g.me.Append(nil)
	if g.boot, err = bootstrap.Join(ctx, bc); err != nil {
		g.cancel()
		if errors.Is(err, jobauth.ErrRefused) && !cfg.key.IsZero() {
			return nil, fmt.Errorf("gdrlink: joining the job %q (id from %s): %w (every rank needs the same job key and job id)", cfg.jobID, cfg.jobIDSource, err)
		}
		return nil, fmt.Errorf("gdrlink: joining the job: %w", err)
	}
	if err := g.setup(ctx); err != nil {
		return nil, errors.Join(fmt.Errorf("gdrlink: rank %d: %w", g.boot.Rank(), err), g.Close())
	}
	if cfg.metricsAddr != "" {
		if g.metricsSrv, err = g.serveMetrics(cfg.metricsAddr); err != nil {
			return nil, errors.Join(fmt.Errorf("gdrlink: rank %d: %w", g.boot.Rank(), err), g.Close())
		}
	}
	g.joinDur = time.Since(start)
	close(g.ready)
	g.log.Info("gdrlink: joined", "rank", g.Rank(), "size", g.Size(), "providers", g.providerNames(), "took", g.joinDur,
		"job_key", cfg.key.Fingerprint(), "job_key_from", cfg.keySource, "job_id", cfg.jobID, "job_id_from", cfg.jobIDSource, "insecure", cfg.insecure)
	return g, nil
}

func bootstrapConfig(cfg config) (bootstrap.Config, error) {
	bc, err := bootstrap.FromEnv()
	if cfg.haveRank {
		bc.Rank, bc.Size, err = cfg.rank, cfg.size, nil
	}
	if errors.Is(err, bootstrap.ErrNoRoot) && (cfg.root != "" || cfg.rootListener != nil) {
		// The rank came from the environment (mpirun), the root from
		// WithRoot or WithRootListener.
		err = nil
	}
	if err != nil {
		return bc, err
	}
	if cfg.root != "" {
		bc.Root = cfg.root
	}
	bc.Insecure = cfg.insecure
	bc.Logger = cfg.log
	if cfg.rootListener != nil && bc.Rank == 0 {
		bc.Listener = cfg.rootListener
		if bc.Root == "" {
			bc.Root = cfg.rootListener.Addr().String()
		}
	}
	return bc, bc.Validate()
}

// bindJob names the job, when the environment does not (jobID from
// jobauth.JobIDFromEnv), by the bootstrap root address as this rank was
// given it (GDRLINK_ROOT, MASTER_ADDR and MASTER_PORT, WithRoot, the first
// of GDRLINK_PEERS, or rank 0's WithRootListener), which is the same string
// on every rank when one launcher handed it out; and binds the job key to
// the job (jobKey), for every connection between ranks.
func (c *config) bindJob(bc bootstrap.Config) {
	if c.jobID == "" {
		c.jobID, c.jobIDSource = bc.Root, "the root address"
		if c.jobID == "" && len(bc.Peers) > 0 {
			c.jobID = bc.Peers[0]
		}
	}
	c.jobKey = c.key.ForJob(c.jobID)
}

// setup trades host cards, opens the devices of every provider some peer
// may use, and makes the pool registered with each of them.
func (g *Group) setup(ctx context.Context) error {
	var all [][]byte
	var err error
	if g.boot.Rejoined() {
		// The job runs: the peers answered this process's notice with
		// their cards.
		all = g.rejoinCards()
	} else if all, err = g.boot.AllGather(ctx, g.me.Append(nil)); err != nil {
		return fmt.Errorf("trading host cards: %w", err)
	}
	g.cards = make([]hostcard.Card, len(all))
	need := map[string]bool{}
	for r, b := range all {
		if b == nil {
			g.log.Warn("gdrlink: no host card of a peer that did not answer this rejoin", "rank", g.Rank(), "peer", r)
			continue
		}
		if g.cards[r], err = hostcard.Decode(b); err != nil {
			return fmt.Errorf("host card of rank %d: %w", r, err)
		}
		if r == g.Rank() {
			continue
		}
		cands, _ := hostcard.Candidates(g.me, g.cards[r], g.cfg.provider)
		for _, c := range cands {
			need[c] = true
		}
	}
	if g.cfg.bind {
		if err := g.bindCPUs(); err != nil {
			return err
		}
	}
	vc := verbsio.Config{}
	if g.cfg.verbs != nil {
		vc = *g.cfg.verbs
	} else if vc, err = verbsio.ConfigFromEnv(); err != nil {
		return err
	}
	vc.JobKey, vc.Insecure = g.cfg.jobKey.Bytes(), g.cfg.insecure
	var why string
	if vc.Yield, why, err = g.yieldCPUs(vc.Yield); err != nil {
		return err
	}
	if g.yield = vc.Yield; g.yield {
		g.log.Info("gdrlink: polls yield the CPU", "rank", g.Rank(), "why", why)
		if g.cfg.yield != "on" {
			if err := g.shareProcs(); err != nil {
				return err
			}
		}
	}
	g.boot.SetYield(g.yield)
	if vc.Logger == nil {
		vc.Logger = g.log // the providers' refusals
	}
	vc.PeerTimeout = g.cfg.peerTimeout // the providers' timers outlast the channels'
	if vc.ListenAddr == "" {
		// Listen where the bootstrap reaches this rank, so peers on
		// other hosts (or namespaces) can reach the tcp provider too.
		if h, _, err := net.SplitHostPort(g.boot.Addrs()[g.Rank()]); err == nil {
			vc.ListenAddr = net.JoinHostPort(h, "0")
		}
	}
	var visitors, pinnedVisitors []alloc.Visitor
	for _, name := range builtin {
		if !need[name] {
			continue
		}
		d := &device{name: name}
		if d.dev, err = verbsio.Open(name, vc); err != nil {
			return fmt.Errorf("opening %s: %w", name, err)
		}
		g.devs[name] = d
		if d.pd, err = d.dev.AllocPD(); err != nil {
			return fmt.Errorf("%s protection domain: %w", name, err)
		}
		newRegistrations(d, g.cfg.peerPools)
		visitors = append(visitors, d.reg)
		pinnedVisitors = append(pinnedVisitors, d.writableVisitor())
	}
	// The on-node provider writes file-backed arenas through a shared
	// mapping (one copy, the fastest); other providers want huge pages.
	var src alloc.Source
	if need["onnode"] {
		src = alloc.NewMemfdSource(fmt.Sprintf("gdrlink-rank%d", g.Rank()), alloc.MmapOptions{})
	} else {
		src = alloc.NewMmapSource(alloc.MmapOptions{HugePages: true})
	}
	// One budget, the pool limit, bounds the group's pool and the result
	// pools of its peers (peerMemory) together.
	if g.budget, err = alloc.NewBudget(fmt.Sprintf("gdrlink rank %d", g.Rank()), g.poolLimit()); err != nil {
		return err
	}
	g.src = src
	popts := []alloc.Option{alloc.WithVisitors(visitors...), alloc.WithName(fmt.Sprintf("gdrlink rank %d", g.Rank())), alloc.WithBudget(g.budget)}
	if g.pool, err = alloc.New(src, popts...); err != nil {
		return fmt.Errorf("tensor pool: %w", err)
	}
	if g.cfg.gpu >= 0 {
		psrc := alloc.NewMmapSource(alloc.MmapOptions{})
		if need["onnode"] {
			psrc = alloc.NewMemfdSource(fmt.Sprintf("gdrlink-rank%d-pinned", g.Rank()), alloc.MmapOptions{})
		}
		return g.setupGPU(psrc, pinnedVisitors)
	}
	return nil
}

// poolLimit is the byte limit of the tensor pool, and of a GPU group's
// pinned proxy pool: the configured one, else the default.
func (g *Group) poolLimit() int64 {
	if g.cfg.poolLimit != 0 {
		return g.cfg.poolLimit
	}
	return defaultPoolLimit()
}

func (g *Group) providerNames() []string {
	out := make([]string, 0, len(g.devs))
	for n := range g.devs {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

// Rank is this process's rank, 0..Size()-1.
func (g *Group) Rank() int { return g.boot.Rank() }

// Size is the number of ranks in the job.
func (g *Group) Size() int { return g.boot.Size() }

// NewTensor allocates a tensor of dtype and shape from the registered pool,
// in host memory: every byte of it can be written to a peer without a copy
// or a registration. Its contents are not zeroed. Give it to Send, or
// Release it.
func (g *Group) NewTensor(dtype tensor.DType, shape ...int64) (*tensor.Tensor, error) {
	return g.NewTensorOn(tensor.Host, dtype, shape...)
}

// NewTensorOn is NewTensor on a device: host memory (tensor.Host), or,
// in a group joined WithGPU, page-locked host memory (tensor.PinnedHost)
// or the GPU's memory (tensor.GPUDevice). Tensors of strings live in host
// memory only.
func (g *Group) NewTensorOn(dev tensor.Device, dtype tensor.DType, shape ...int64) (*tensor.Tensor, error) {
	if err := g.usable(); err != nil {
		return nil, err
	}
	if dev != tensor.Host && !dtype.DMAable() {
		return nil, fmt.Errorf("gdrlink: %w: %s tensors on %s: they live in host memory", verbsio.ErrNotSupported, dtype, dev)
	}
	m, err := tensor.MetaFor(dtype, tensor.Shape(shape))
	if err != nil {
		return nil, fmt.Errorf("gdrlink: %w", err)
	}
	var t *tensor.Tensor
	switch {
	case dev == tensor.Host:
		t, err = g.pool.NewTensor(m)
	case dev.Kind == tensor.PinnedHost && g.gpu != nil:
		t, err = g.gpu.pinned.NewTensor(m)
	default:
		var b tensor.Buffer
		if b, err = g.allocGPU(int(m.ByteSize), dev); err == nil {
			if t, err = tensor.New(m, b); err != nil {
				_ = b.Free()
			}
		}
	}
	if err != nil {
		return nil, fmt.Errorf("gdrlink: %w", err)
	}
	return t, nil
}

func (g *Group) usable() error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed {
		return fmt.Errorf("gdrlink: group of rank %d: %w", g.boot.Rank(), ErrClosed)
	}
	return nil
}

// Send offers t to peer under key and step; the peer's Recv of the same
// key and step receives it. Send never waits on the network: the first
// exchange with a peer connects in the background. t belongs to the group
// from then on and is released once written (or once the connection
// fails); do not change it. A second Send of one key and step to one peer
// before the first is received is an error.
func (g *Group) Send(peer int, key string, step int64, t *tensor.Tensor) error {
	p, err := g.peer(peer)
	if err != nil {
		return err
	}
	if t == nil {
		return fmt.Errorf("gdrlink: %w: nil tensor for %q step %d", verbsio.ErrBadConfig, key, step)
	}
	if t.Device().IsGPU() && g.gpu != nil && g.gpu.ipc != nil && p.local {
		p.ipcPair().ready() // the first GPU transfer with the peer sets the on-node path up
	}
	return p.send(key, step, t)
}

// Recv receives the tensor a peer sends under key and step, written by the
// peer straight into a tensor of this group's pool. The first exchange
// with a peer connects first. Release the tensor when done with it.
// Transfer says how it came. ctx bounds the wait.
func (g *Group) Recv(ctx context.Context, peer int, key string, step int64) (*tensor.Tensor, Transfer, error) {
	return g.RecvOn(ctx, tensor.Host, peer, key, step)
}

// RecvInto receives the tensor a peer sends under key and step into t, a
// host tensor of this group's pool, which holds it once RecvInto returns:
// the peer writes t itself where the connection can grant it t's bytes
// alone (Transfer.Placed; onnode and tcp can), else the tensor lands in
// the pool and is copied into t. The tensor sent must have t's element
// type and at most its byte size (a smaller one fills t's front;
// Transfer.Meta says what came). ctx bounds the wait; a RecvInto that
// fails or is cancelled returns only once the peer can no longer write t.
func (g *Group) RecvInto(ctx context.Context, t *tensor.Tensor, peer int, key string, step int64) (Transfer, error) {
	tr, err := g.recvInto(ctx, t, peer, key, step)
	g.metrics.recv(tr, err)
	return tr, err
}

func (g *Group) recvInto(ctx context.Context, t *tensor.Tensor, peer int, key string, step int64) (Transfer, error) {
	if t == nil || t.Device() != tensor.Host {
		return Transfer{}, fmt.Errorf("gdrlink: %w: RecvInto of %q step %d needs a host tensor", rendezvous.ErrBadTensor, key, step)
	}
	p, err := g.peer(peer)
	if err != nil {
		return Transfer{}, err
	}
	got, tr, err := p.recvFailover(ctx, key, step, rendezvous.Into(t))
	if err != nil {
		return tr, err
	}
	defer got.Release()
	if tr.Placed {
		return tr, nil
	}
	gm, tm := got.Meta(), t.Meta()
	src, serr := got.Bytes()
	dst, derr := t.Bytes()
	if serr != nil || derr != nil || gm.DType != tm.DType || gm.ByteSize > tm.ByteSize {
		return tr, fmt.Errorf("gdrlink: %w: %q step %d from rank %d is %s, which does not fit %s", rendezvous.ErrBadTensor, key, step, peer, gm, tm)
	}
	copy(dst, src)
	return tr, nil
}

// RecvOn is Recv with the result on dev: host memory, or in a group joined
// WithGPU its GPU, where the tensor lands in a pinned proxy and is copied
// to the GPU as its chunks arrive (Transfer.Path is proxy).
func (g *Group) RecvOn(ctx context.Context, dev tensor.Device, peer int, key string, step int64) (*tensor.Tensor, Transfer, error) {
	t, tr, err := g.recvOn(ctx, dev, peer, key, step)
	g.metrics.recv(tr, err)
	return t, tr, err
}

func (g *Group) recvOn(ctx context.Context, dev tensor.Device, peer int, key string, step int64) (*tensor.Tensor, Transfer, error) {
	p, err := g.peer(peer)
	if err != nil {
		return nil, Transfer{}, err
	}
	if dev == tensor.Host {
		return p.recvFailover(ctx, key, step)
	}
	t, tr, err := p.recvFailover(ctx, key, step, rendezvous.OnDevice(dev))
	if errors.Is(err, rendezvous.ErrPullFailed) {
		// The pair is BAD now and the sender kept the tensor: ask again,
		// through host memory.
		g.log.Warn("gdrlink: pull failed, receiving through host memory", "rank", g.Rank(), "peer", peer, "key", key, "step", step, "err", err)
		return p.recvFailover(ctx, key, step, rendezvous.OnDevice(dev))
	}
	return t, tr, err
}

// Barrier returns once every rank of the job has called it, or when ctx
// ends. A rank that sent tensors calls it before Close, so that it does
// not close while its peers still receive. It goes through rank 0 over
// the bootstrap's TCP connections, and each rank polls its socket a
// while (at most 200 µs, learned from the barriers before) before it
// sleeps, so that the ranks leave together, not a wake-up apart.
func (g *Group) Barrier(ctx context.Context) error {
	if err := g.usable(); err != nil {
		return err
	}
	if err := g.boot.Barrier(ctx); err != nil {
		return fmt.Errorf("gdrlink: rank %d: barrier: %w", g.Rank(), err)
	}
	return nil
}

// Stats is what a group did and holds.
type Stats struct {
	// Rank and Size are the group's.
	Rank, Size int
	// Join is how long Join took.
	Join time.Duration
	// Connections counts the peers connected, by provider. Connections are
	// made on first use, so only pairs that exchanged appear.
	Connections map[string]int
	// Unusable says why each built-in provider could not be used here
	// (ibverbs without an RDMA device, for example).
	Unusable map[string]string
	// Protocol sums the protocol counters of every connection.
	Protocol rendezvous.Stats
	// Pool is the registered tensor pool's, with the result pools of the
	// peers added in where a provider gives each peer its own (bytes,
	// arenas, blocks and counts summed; the name, limit and free-space
	// figures are the tensor pool's).
	Pool alloc.Stats
	// Registrations is the number of arena registrations the group holds
	// with its providers: each arena of the pool, and of the pinned proxy
	// pool of a group joined WithGPU, once per provider opened.
	Registrations int
	// Rejoins counts the peers that restarted as new processes and
	// rejoined the job while this rank ran (see Group.Rejoined).
	Rejoins int
	// Failovers counts the connections that failed with their peer alive
	// and were made again (see "Failover" in the package documentation).
	Failovers int
	// Retransmits counts the segments each provider's transport
	// retransmitted since Join, for the providers that can tell: tcp (the
	// kernel's TCP_INFO of its connections). onnode copies through memory
	// and has none; ibverbs' would come from the NIC's hardware counters,
	// which are not read. A provider whose count could not be read is left
	// out.
	Retransmits map[string]uint64
	// IPC counts the on-node GPU path (a group joined WithGPU whose GPU
	// has one): the handle cache, the pulls and the pairs' states.
	IPC IPCStats
	// CPUs are the CPUs every thread of this process was bound to at Join
	// (WithCPUBinding); nil when it was not bound.
	CPUs []int
	// Unbound says why a binding asked for was not made (more ranks on
	// this host than CPUs, say); empty otherwise.
	Unbound string
	// Yield says whether this process's completion queues yield their
	// CPU between polls (GDRLINK_YIELD; by default where this host runs
	// more ranks of the job than this process may use CPUs).
	Yield bool
	// Procs is what Join set GOMAXPROCS to, this process's share of the
	// CPUs where the host runs more ranks of the job than it may use
	// CPUs and reaches the others over onnode (GDRLINK_YIELD=auto; not
	// where the GOMAXPROCS variable is set); 0 where Join left it alone.
	Procs int
}

// Stats reports the group's connections, protocol counters, pool, the
// pool's registrations and the transport's retransmits.
func (g *Group) Stats() Stats {
	s := Stats{Rank: g.Rank(), Size: g.Size(), Join: g.joinDur, Connections: map[string]int{}, Unusable: map[string]string{},
		Retransmits: map[string]uint64{}, CPUs: slices.Clone(g.cpus), Unbound: g.unbound, Yield: g.yield, Procs: g.procs}
	for n, err := range g.unusable {
		s.Unusable[n] = err.Error()
	}
	g.mu.Lock()
	s.Rejoins = g.rejoins
	s.Failovers = g.failovers
	peers := make([]*peer, 0, len(g.peers))
	for _, p := range g.peers {
		peers = append(peers, p)
	}
	g.mu.Unlock()
	for _, p := range peers {
		ch, prov := p.connected()
		if ch == nil {
			continue
		}
		s.Connections[prov]++
		addStats(&s.Protocol, ch.Stats())
	}
	if g.pool != nil {
		s.Pool = g.pool.Stats()
	}
	if g.gpu != nil && g.gpu.ipc != nil {
		s.IPC = g.gpu.ipc.stats()
		for _, p := range g.peerList() {
			if pr := p.ipcPairIfAny(); pr != nil {
				s.IPC.Pairs[pr.state().String()]++
			}
		}
	}
	g.mu.Lock()
	for _, p := range g.peerPools {
		addPoolStats(&s.Pool, p.Stats())
	}
	g.mu.Unlock()
	for _, name := range builtin {
		d := g.devs[name]
		if d == nil {
			continue
		}
		s.Registrations += d.reg.Registered()
		if d.writable != nil {
			s.Registrations += d.writable.Registered()
		}
		if rc, ok := d.dev.(retransmitCounter); ok {
			if n, err := rc.Retransmits(); err == nil {
				s.Retransmits[name] = n
			} else {
				g.log.Debug("gdrlink: retransmits not read", "provider", name, "err", err)
			}
		}
	}
	return s
}

// retransmitCounter is a device that counts the segments its transport
// retransmitted (the tcp provider's, from TCP_INFO). It is not part of
// verbsio.Device: onnode has no retransmits, and ibverbs' would come from
// the NIC's hardware counters (not read).
type retransmitCounter interface {
	Retransmits() (uint64, error)
}

// addStats adds every counter of b into a.
func addStats(a *rendezvous.Stats, b rendezvous.Stats) {
	av, bv := reflect.ValueOf(a).Elem(), reflect.ValueOf(b)
	for i := range av.NumField() {
		if f := av.Field(i); f.CanSet() && f.Kind() >= reflect.Int && f.Kind() <= reflect.Uint64 {
			if f.CanUint() {
				f.SetUint(f.Uint() + bv.Field(i).Uint())
			} else {
				f.SetInt(f.Int() + bv.Field(i).Int())
			}
		}
	}
}

// Close closes every connection (telling each peer), the pool, the
// devices and the bootstrap, and joins their errors. Tensors from the
// group must be released first; Close reports those still held. It is
// idempotent.
func (g *Group) Close() error {
	g.mu.Lock()
	if g.closed {
		g.mu.Unlock()
		return nil
	}
	g.closed = true
	peers := g.peers
	close(g.rejoinSig) // WaitRejoin sees the group closed
	g.rejoinSig = make(chan struct{})
	g.mu.Unlock()
	var errs []error
	if s, ok := g.coll.(*switchML); ok {
		errs = append(errs, s.Close())
	}
	g.cancel()
	errs = append(errs, g.ring.Close())
	if g.metricsSrv != nil {
		errs = append(errs, g.metricsSrv.close())
	}
	for _, p := range peers {
		errs = append(errs, p.close())
	}
	if g.gpu != nil && g.gpu.ipc != nil {
		// While the bootstrap still runs: peers close their mappings of
		// this rank's GPU arenas (CUDA wants that before they are freed),
		// and this rank closes its mappings of theirs.
		errs = append(errs, g.gpu.ipc.shutdown())
	}
	g.wg.Wait()
	if g.boot != nil {
		errs = append(errs, g.boot.Close())
	}
	if g.gpu != nil {
		errs = append(errs, g.gpu.close()...)
	}
	for _, p := range g.peerPools {
		errs = append(errs, p.Close())
	}
	if g.pool != nil {
		errs = append(errs, g.pool.Close())
	}
	for _, name := range builtin {
		d := g.devs[name]
		if d == nil {
			continue
		}
		if d.pd != nil {
			errs = append(errs, d.pd.Close())
		}
		errs = append(errs, d.dev.Close())
	}
	g.restoreProcs()
	return errors.Join(errs...)
}

// addPoolStats adds pool b's bytes, arenas, blocks and counts into a.
func addPoolStats(a *alloc.Stats, b alloc.Stats) {
	a.InUse += b.InUse
	a.Requested += b.Requested
	a.PeakInUse += b.PeakInUse
	a.Reserved += b.Reserved
	a.Arenas += b.Arenas
	a.Blocks += b.Blocks
	a.Allocs += b.Allocs
	a.Frees += b.Frees
	a.ArenasCreated += b.ArenasCreated
	a.ArenasReleased += b.ArenasReleased
}

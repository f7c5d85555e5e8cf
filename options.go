package gdrlink

import (
	"fmt"
	"log/slog"
	"net"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/dustin/go-humanize"
	"golang.org/x/sys/unix"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/internal/cgroupmem"
	"github.com/gdrlink/gdrlink/internal/jobauth"
	"github.com/gdrlink/gdrlink/internal/wire"
	"github.com/gdrlink/gdrlink/proxy"
	"github.com/gdrlink/gdrlink/verbsio"
)

// Option configures Join. Every option has an environment variable too;
// an option given in Go wins over the variable.
type Option func(*config) error

// config is what Join works from: the environment first, then the options.
type config struct {
	rank, size   int
	haveRank     bool
	root         string
	rootListener net.Listener
	provider     string
	poolLimit    int64
	// eagerMax is GDRLINK_EAGER_MAX: the largest tensor sent eagerly
	// (rendezvous.WithEager); eagerSet says it was given.
	eagerMax       int
	eagerSet       bool
	checksum       bool
	checksumSet    bool // checksum was chosen, not the provider's default
	connectTimeout time.Duration
	peerTimeout    time.Duration
	log            *slog.Logger
	verbs          *verbsio.Config
	gpu            int // -1: none
	// cudaIPC is how GPU arenas are exported to peers on the node:
	// "auto" (the default: VMM where the GPU can, legacy handles
	// otherwise), "vmm", "legacy" or "off" (GDRLINK_CUDA_IPC).
	cudaIPC     string
	metricsAddr string
	// aggregator is the SwitchML aggregator's control endpoint (empty:
	// AllReduce on the ring), aggregatorPort the RoCEv2 UDP port.
	aggregator     string
	aggregatorPort uint16
	// switchmlTransport is GDRLINK_SWITCHML_TRANSPORT: auto (""), verbs
	// or udp.
	switchmlTransport string
	// switchmlPackets is GDRLINK_SWITCHML_MSG_PACKETS: packets per
	// SwitchML message, 1..4 (0: the worker's default, 1 on Soft-RoCE).
	switchmlPackets int
	// switchmlLocal picks the switchml worker's IPv4 address (nil:
	// localIPv4; a test gives another loopback network).
	switchmlLocal func(aggregator string, rank int) ([4]byte, error)
	// peerPools gives each peer a result pool of its own on every
	// provider but onnode, as on a device without grants (a test's: it
	// runs that fallback where the provider gives grants).
	peerPools bool
	// key is the job key (zero: none), keySource where it came from. It
	// is the secret's own key, which the SwitchML aggregator is given.
	key       jobauth.Key
	keySource string
	// jobID names the job (jobauth.JobIDFromEnv, else the root address as
	// given: see bindJob), jobIDSource where it came from; jobKey is key
	// bound to it, which every connection between ranks proves.
	jobID, jobIDSource string
	jobKey             jobauth.Key
	insecure           bool
	// bind binds each rank of a host to CPUs of its own (GDRLINK_BIND).
	bind bool
	// yield is GDRLINK_YIELD: "auto" (or ""), "on" or "off".
	yield string
	// openGPU opens the GPU (openCUDA unless a test gives a simulated one).
	openGPU func(ordinal int) (proxy.Device, alloc.Visitor, error)
	// bar1 reads the BAR1 aperture of the GPU at a PCI address (nvml.BAR1
	// unless a test gives a fake: there is no seam below NVML).
	bar1 func(busID string) (free, total int64, err error)
}

// WithRank sets this process's rank and the job's size
// (GDRLINK_RANK and GDRLINK_SIZE; without either, Join reads what torchrun,
// mpirun or srun set: RANK/WORLD_SIZE, OMPI_COMM_WORLD_RANK/_SIZE,
// SLURM_PROCID/SLURM_NTASKS).
func WithRank(rank, size int) Option {
	return func(c *config) error {
		if size < 1 || rank < 0 || rank >= size {
			return fmt.Errorf("%w: rank %d of %d", verbsio.ErrBadConfig, rank, size)
		}
		c.rank, c.size, c.haveRank = rank, size, true
		return nil
	}
}

// WithRoot sets where rank 0 listens and the others dial ("host:port";
// GDRLINK_ROOT, else MASTER_ADDR and MASTER_PORT as torchrun sets them).
func WithRoot(addr string) Option {
	return func(c *config) error {
		if _, _, err := net.SplitHostPort(addr); err != nil {
			return fmt.Errorf("%w: root address %q: %w", verbsio.ErrBadConfig, addr, err)
		}
		c.root = addr
		return nil
	}
}

// WithRootListener gives rank 0 a listener to use as the root address, so
// a program that starts its own peers can learn the port first. It has no
// variable: a listener is a Go value.
func WithRootListener(ln net.Listener) Option {
	return func(c *config) error {
		if ln == nil {
			return fmt.Errorf("%w: nil root listener", verbsio.ErrBadConfig)
		}
		c.rootListener = ln
		return nil
	}
}

// WithProvider makes every connection use the named provider (ibverbs,
// onnode or tcp; GDRLINK_PROVIDER), or the first of a comma-separated list
// that both sides can use, the next ones when it fails ("ibverbs,tcp": RDMA,
// and tcp when RDMA breaks). By default each peer gets the best one both
// sides have: onnode with a peer on this node (same kernel, network and PID
// namespace), else ibverbs, else tcp.
func WithProvider(name string) Option {
	return func(c *config) error {
		for _, n := range strings.Split(name, ",") {
			if _, err := verbsio.Lookup(n); err != nil {
				return fmt.Errorf("%w: provider %q: %w", verbsio.ErrBadConfig, n, err)
			}
		}
		c.provider = name
		return nil
	}
}

// WithEagerMax sets the largest tensor, in bytes, that a Send made before
// the peer's Recv asks sends at once, in the control message itself, so
// that the Recv makes no round trip (GDRLINK_EAGER_MAX, a size such as
// "2KiB"; default 4096, at most 4096; 0: none). In checksum mode (tcp's
// default) with the CRC-32C of the bytes, checked on arrival. Not to a
// rank whose results may land on a GPU (a group with WithGPU);
// Transfer.Path says "eager". See rendezvous.WithEager.
func WithEagerMax(bytes int) Option {
	return func(c *config) error {
		if bytes < 0 || bytes > wire.MaxEager {
			return fmt.Errorf("%w: eager tensors of up to %d bytes, want 0..%d", verbsio.ErrBadConfig, bytes, wire.MaxEager)
		}
		c.eagerMax, c.eagerSet = bytes, true
		return nil
	}
}

// WithPoolLimit caps the bytes the tensor pool may reserve (GDRLINK_POOL_LIMIT,
// bytes or a size such as "8GiB"). By default, and with 0, the cap is half
// of the machine's physical memory or of the process's memory cgroup limit
// (a container's), whichever is lower, at most 64 GiB: a peer that announces
// huge tensors makes its Recvs fail instead of exhausting the host. Tensors
// and received results that do not fit fail with alloc.ErrPoolExhausted (a
// Recv's error names the peer and the size). There is no "no cap": ask for
// a larger one.
func WithPoolLimit(bytes int64) Option {
	return func(c *config) error {
		if bytes < 0 {
			return fmt.Errorf("%w: pool limit %d", verbsio.ErrBadConfig, bytes)
		}
		c.poolLimit = bytes
		return nil
	}
}

// maxDefaultPoolLimit is the largest default pool limit.
const maxDefaultPoolLimit = 64 << 30

// defaultPoolLimit is the pool limit when none is given: half of the
// memory this process may use, the machine's physical memory as
// sysinfo(2) reports it or its memory cgroup's limit (a container's)
// when that is lower, at most 64 GiB; 64 GiB when neither can be read.
func defaultPoolLimit() int64 {
	var physical uint64
	var si unix.Sysinfo_t
	if err := unix.Sysinfo(&si); err == nil {
		physical = uint64(si.Totalram) * uint64(max(si.Unit, 1))
	}
	if l, ok, err := cgroupmem.Limit("/"); err == nil && ok && (physical == 0 || l < physical) {
		physical = l
	}
	return poolLimitFor(physical)
}

// poolLimitFor is the default pool limit on a machine of physical bytes of
// memory (0: unknown). It is never 0, which alloc takes for no limit.
func poolLimitFor(physical uint64) int64 {
	if physical < 2 {
		return maxDefaultPoolLimit
	}
	return int64(min(physical/2, maxDefaultPoolLimit))
}

// WithChecksum turns the protocol's checksum mode on or off for every
// connection (GDRLINK_CHECKSUM=1 or 0): each tensor's CRC-32C travels with
// it and is checked on arrival; a tensor that arrives corrupted is sent
// again (rendezvous.MaxChecksumRetries times at most), and both ends fail
// it with a *rendezvous.ChecksumError if it never arrives intact. Without
// it each connection takes its provider's default
// (rendezvous.DefaultChecksum: on for tcp, off for onnode and ibverbs),
// and follows a peer that chose; ranks that both chose must agree.
func WithChecksum(on bool) Option {
	return func(c *config) error { c.checksum, c.checksumSet = on, true; return nil }
}

// WithConnectTimeout bounds making one connection, every provider tried
// included, when the caller's context has no deadline
// (GDRLINK_CONNECT_TIMEOUT, a Go duration; default 30s).
func WithConnectTimeout(d time.Duration) Option {
	return func(c *config) error {
		if d <= 0 {
			return fmt.Errorf("%w: connect timeout %v", verbsio.ErrBadConfig, d)
		}
		c.connectTimeout = d
		return nil
	}
}

// WithPeerTimeout sets how long a peer may stay silent while this process
// waits on it (a Recv not answered, a Send not asked for or not written)
// before the connection fails (GDRLINK_PEER_TIMEOUT, a Go duration;
// default 30s, at most verbsio.MaxPeerTimeout). The failure matches
// verbsio.ErrPeerLost and rendezvous.ErrPeerTimeout and names the peer and
// how long it was silent. Heartbeats that the peer's process answers run
// while anything is pending on either side, so a peer counts as silent
// when its process is stopped (SIGSTOP, a debugger, a pause of that
// length) or its network is cut, never because it has nothing to send;
// a pause shorter than d is survived. The providers' own timers (tcp's
// TCP_USER_TIMEOUT and keepalive) are set never to give up first. Every
// rank should use the same value. See "Liveness" in the README.
func WithPeerTimeout(d time.Duration) Option {
	return func(c *config) error {
		if d <= 0 || d > verbsio.MaxPeerTimeout {
			return fmt.Errorf("%w: peer timeout %v, want a positive duration of at most %v", verbsio.ErrBadConfig, d, verbsio.MaxPeerTimeout)
		}
		c.peerTimeout = d
		return nil
	}
}

// WithLogger sets the structured logger (GDRLINK_LOG=debug, info, warn or
// error logs text to standard error at that level; default: nothing).
// Connections are logged at info, transfers at debug, and connections the
// bootstrap or a provider refuses (a stranger without the job key, a flood
// evicted) at warn, at most a line a second per listener.
func WithLogger(l *slog.Logger) Option {
	return func(c *config) error {
		if l == nil {
			return fmt.Errorf("%w: nil logger", verbsio.ErrBadConfig)
		}
		c.log = l
		return nil
	}
}

// WithVerbsConfig configures the verbs devices (the RDMA_* variables of
// TensorFlow's verbs transport, GDRLINK_LISTEN_ADDR and the rest that
// verbsio.ConfigFromEnv reads).
func WithVerbsConfig(vc verbsio.Config) Option {
	return func(c *config) error { c.verbs = &vc; return nil }
}

// WithMetricsAddr makes Join serve Prometheus metrics at /metrics on addr
// ("host:port", port 0 for any; GDRLINK_METRICS_ADDR; default: not
// served), from a registry of the group's own that Close shuts down. The
// metrics are those of Group.Collector.
func WithMetricsAddr(addr string) Option {
	return func(c *config) error {
		if _, _, err := net.SplitHostPort(addr); err != nil {
			return fmt.Errorf("%w: metrics address %q: %w", verbsio.ErrBadConfig, addr, err)
		}
		c.metricsAddr = addr
		return nil
	}
}

// WithJobKey sets the job's key from its secret (GDRLINK_JOB_KEY, or a file
// of this user's that nobody else can read named by GDRLINK_JOB_KEY_FILE;
// at least 16 bytes; the same on every rank). Every connection of the job,
// bootstrap and providers alike, then starts with a mutual proof of the key,
// and nothing of the job crosses before it. Without a key, the job listens
// on loopback only, unless WithInsecure.
//
// The connections prove a key bound to the job's id, so that jobs sharing
// a key file cannot join each other: GDRLINK_JOB_ID, else the launcher's
// (TORCHELASTIC_RUN_ID, OMPI_MCA_ess_base_jobid, PMIX_NAMESPACE,
// SLURM_JOB_ID), else the bootstrap root address as this rank was given it.
// Every rank must see the same id; set GDRLINK_JOB_ID where they would
// not. The SwitchML aggregator is given the key itself.
func WithJobKey(secret string) Option {
	return func(c *config) error {
		k, err := jobauth.Parse(secret)
		if err != nil {
			return fmt.Errorf("%w: %w", verbsio.ErrBadConfig, err)
		}
		c.key, c.keySource = k, "WithJobKey"
		return nil
	}
}

// WithInsecure lets a job without a key listen beyond loopback
// (GDRLINK_INSECURE=1): any host that reaches its ports may then join it.
func WithInsecure(on bool) Option {
	return func(c *config) error { c.insecure = on; return nil }
}

// WithCPUBinding binds the ranks of a host to CPUs of their own
// (GDRLINK_BIND=cores, or none; default none), as mpirun binds each rank
// to a core when there are enough: the CPUs this process may run on (its
// affinity mask, as the launcher left it) are cut into equal contiguous
// shares, one per rank of the job on this host in rank order, and every
// thread of this process is bound to its share at Join. Unless the
// GOMAXPROCS variable is set, GOMAXPROCS becomes the share's size. With
// more ranks on the host than CPUs no rank is bound (Stats.Unbound says
// so), as with mpirun. A process with threads of its own that must run
// elsewhere should leave it off: the binding covers every thread the
// process has at Join, and those its threads start later inherit it.
func WithCPUBinding(on bool) Option {
	return func(c *config) error { c.bind = on; return nil }
}

// fromEnv reads the variables behind the options. Rank, size and root are
// left to the bootstrap's reading of the launchers unless given.
func fromEnv(lookup func(string) (string, bool)) (config, error) {
	c := config{connectTimeout: verbsio.DefaultConfig().ConnectTimeout, peerTimeout: verbsio.DefaultConfig().PeerTimeout, gpu: -1}
	get := func(k string) string { v, _ := lookup(k); return strings.TrimSpace(v) }
	if v := get("GDRLINK_PROVIDER"); v != "" {
		if err := WithProvider(v)(&c); err != nil {
			return c, fmt.Errorf("GDRLINK_PROVIDER=%q: %w", v, err)
		}
	}
	if v := get("GDRLINK_POOL_LIMIT"); v != "" {
		n, err := humanize.ParseBytes(v)
		if err != nil || n > 1<<62 {
			return c, fmt.Errorf("%w: GDRLINK_POOL_LIMIT=%q is not a byte size", verbsio.ErrBadConfig, v)
		}
		c.poolLimit = int64(n)
	}
	if v := get("GDRLINK_EAGER_MAX"); v != "" {
		n, err := humanize.ParseBytes(v)
		if err != nil || n > wire.MaxEager {
			return c, fmt.Errorf("%w: GDRLINK_EAGER_MAX=%q, want a byte size of at most %d", verbsio.ErrBadConfig, v, wire.MaxEager)
		}
		c.eagerMax, c.eagerSet = int(n), true
	}
	if v := get("GDRLINK_CHECKSUM"); v != "" {
		on, err := strconv.ParseBool(v)
		if err != nil {
			return c, fmt.Errorf("%w: GDRLINK_CHECKSUM=%q, want 0 or 1", verbsio.ErrBadConfig, v)
		}
		c.checksum, c.checksumSet = on, true
	}
	if v := get("GDRLINK_CONNECT_TIMEOUT"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d <= 0 {
			return c, fmt.Errorf("%w: GDRLINK_CONNECT_TIMEOUT=%q is not a positive duration", verbsio.ErrBadConfig, v)
		}
		c.connectTimeout = d
	}
	if v := get("GDRLINK_PEER_TIMEOUT"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d <= 0 || d > verbsio.MaxPeerTimeout {
			return c, fmt.Errorf("%w: GDRLINK_PEER_TIMEOUT=%q is not a positive duration of at most %v", verbsio.ErrBadConfig, v, verbsio.MaxPeerTimeout)
		}
		c.peerTimeout = d
	}
	switch v := get("GDRLINK_BIND"); v {
	case "", "none":
	case "cores":
		c.bind = true
	default:
		return c, fmt.Errorf("%w: GDRLINK_BIND=%q, want cores or none", verbsio.ErrBadConfig, v)
	}
	switch v := get("GDRLINK_YIELD"); v {
	case "", "auto", "on", "off":
		c.yield = v
	default:
		return c, fmt.Errorf("%w: GDRLINK_YIELD=%q, want auto, on or off", verbsio.ErrBadConfig, v)
	}
	if v := get("GDRLINK_GPU"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 {
			return c, fmt.Errorf("%w: GDRLINK_GPU=%q is not a GPU ordinal", verbsio.ErrBadConfig, v)
		}
		c.gpu = n
	}
	if v := get("GDRLINK_CUDA_IPC"); v != "" {
		switch v {
		case "auto", "vmm", "legacy", "off":
			c.cudaIPC = v
		default:
			return c, fmt.Errorf("%w: GDRLINK_CUDA_IPC=%q, want auto, vmm, legacy or off", verbsio.ErrBadConfig, v)
		}
	}
	if v := get("GDRLINK_AGGREGATOR"); v != "" {
		if err := WithAggregator(v)(&c); err != nil {
			return c, fmt.Errorf("GDRLINK_AGGREGATOR=%q: %w", v, err)
		}
	}
	if v := get("GDRLINK_AGGREGATOR_PORT"); v != "" {
		p, err := strconv.ParseUint(v, 10, 16)
		if err != nil || p == 0 {
			return c, fmt.Errorf("%w: GDRLINK_AGGREGATOR_PORT=%q is not a UDP port", verbsio.ErrBadConfig, v)
		}
		c.aggregatorPort = uint16(p)
	}
	if v := get("GDRLINK_SWITCHML_TRANSPORT"); v != "" {
		switch v {
		case "auto", "verbs", "udp":
			c.switchmlTransport = v
		default:
			return c, fmt.Errorf("%w: GDRLINK_SWITCHML_TRANSPORT=%q, want auto, verbs or udp", verbsio.ErrBadConfig, v)
		}
	}
	if v := get("GDRLINK_SWITCHML_MSG_PACKETS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > 4 {
			return c, fmt.Errorf("%w: GDRLINK_SWITCHML_MSG_PACKETS=%q, want 1 to 4 packets per message", verbsio.ErrBadConfig, v)
		}
		c.switchmlPackets = n
	}
	if v := get("GDRLINK_METRICS_ADDR"); v != "" {
		if err := WithMetricsAddr(v)(&c); err != nil {
			return c, fmt.Errorf("GDRLINK_METRICS_ADDR=%q: %w", v, err)
		}
	}
	k, src, err := jobauth.FromEnv(get)
	if err != nil {
		return c, fmt.Errorf("%w: %w", verbsio.ErrBadConfig, err)
	}
	c.key, c.keySource = k, src
	c.jobID, c.jobIDSource = jobauth.JobIDFromEnv(get)
	if v := get(jobauth.InsecureEnv); v != "" && v != "0" && v != "1" {
		return c, fmt.Errorf("%w: %s=%q, want 0 or 1", verbsio.ErrBadConfig, jobauth.InsecureEnv, v)
	}
	c.insecure = jobauth.Insecure(get)
	if v := get("GDRLINK_LOG"); v != "" {
		var lvl slog.Level
		if err := lvl.UnmarshalText([]byte(v)); err != nil {
			return c, fmt.Errorf("%w: GDRLINK_LOG=%q, want debug, info, warn or error", verbsio.ErrBadConfig, v)
		}
		c.log = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: lvl}))
	}
	return c, nil
}

// NewJobKey makes a fresh random job key's secret, for a process that
// spawns its job's other processes: give it to them in GDRLINK_JOB_KEY and
// to this process with WithJobKey (or the same variable).
func NewJobKey() (string, error) {
	_, secret, err := jobauth.Generate()
	return secret, err
}

// WithAggregator makes AllReduce of float32, float16, bfloat16 and int32
// tensors run through a SwitchML aggregator (cmd/switchml-agg, or a switch)
// whose control endpoint is at addr ("host:port"; GDRLINK_AGGREGATOR).
// Every rank sets up the job with it on its first AllReduce, proving the
// job key; values travel as block floating point, so float sums carry the
// error bound of that format (README). The RoCEv2 traffic uses UDP port
// 4791 on both sides unless GDRLINK_AGGREGATOR_PORT says otherwise; ranks
// on one host with the aggregator on loopback receive on 127.0.0.2,
// 127.0.0.3, ... (by rank). Other element types, Broadcast and AllGather
// run on the ring.
func WithAggregator(addr string) Option {
	return func(c *config) error {
		if _, _, err := net.SplitHostPort(addr); err != nil {
			return fmt.Errorf("%w: aggregator %q: %w", verbsio.ErrBadConfig, addr, err)
		}
		c.aggregator = addr
		return nil
	}
}

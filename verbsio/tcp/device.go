package tcp

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gdrlink/gdrlink/internal/adaptspin"
	"github.com/gdrlink/gdrlink/internal/hostid"
	"github.com/gdrlink/gdrlink/internal/jobauth"
	"github.com/gdrlink/gdrlink/internal/refuselog"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

// Name is the provider's registered name.
const Name = "tcp"

func init() { verbsio.Register(provider{}) }

type provider struct{}

// Name is "tcp".
func (provider) Name() string { return Name }

// Devices always lists one device, "tcp": any host with a TCP stack has it.
func (provider) Devices() ([]verbsio.DeviceInfo, error) {
	return []verbsio.DeviceInfo{{Provider: Name, Name: Name, NUMANode: -1}}, nil
}

// Open opens the device with Options from the environment (OptionsFromEnv).
func (provider) Open(cfg verbsio.Config) (verbsio.Device, error) {
	opt, err := OptionsFromEnv()
	if err != nil {
		return nil, err
	}
	return OpenDevice(cfg, opt)
}

// Options tune the tcp provider beyond verbsio.Config.
type Options struct {
	// Lanes is how many TCP connections each queue pair opens to its peer
	// (GDRLINK_TCP_LANES, 1..16). Writes of at least StripeMin bytes are
	// striped across them. 0 means 1.
	Lanes int
	// StripeMin is the smallest write that is striped; 0 means 1 MiB.
	StripeMin int
	// SocketBuffer sets SO_SNDBUF and SO_RCVBUF of every connection
	// (GDRLINK_TCP_SOCKET_BUFFER, bytes); 0 leaves the kernel's automatic
	// tuning on, which measured best on loopback.
	SocketBuffer int
	// RNRTimeout is how long a send or write with immediate waits at the
	// receiver for a posted receive before it fails the sender with
	// StatusRemoteOperation; 0 means 5s.
	RNRTimeout time.Duration
	// AdvertiseAddr is the "host:port" put in endpoints
	// (GDRLINK_ADVERTISE_ADDR); "" means the listener's address, with an
	// unspecified IP replaced by the first up non-loopback interface address.
	AdvertiseAddr string
	// Spin is the longest CompletionQueue.Wait polls, reading the lanes
	// itself, before it sleeps (GDRLINK_TCP_SPIN, a Go duration; there 0
	// never polls). Within it each queue learns from its own waits how
	// long to poll. 0 means 200us; negative never polls. Where polls
	// yield the CPU (verbsio.Config.Yield) a wait may poll 25 times longer
	// (adaptspin.LongFactor).
	Spin time.Duration
}

// Defaults of Options, and the largest inline payload.
const (
	defaultLanes      = 1
	defaultStripeMin  = 1 << 20
	defaultRNRTimeout = 5 * time.Second
	maxInline         = 4096
)

// OptionsFromEnv reads GDRLINK_TCP_LANES, GDRLINK_TCP_SOCKET_BUFFER and
// GDRLINK_ADVERTISE_ADDR; a malformed value is an error wrapping
// verbsio.ErrBadConfig that names the variable.
func OptionsFromEnv() (Options, error) {
	var o Options
	if v := os.Getenv("GDRLINK_TCP_LANES"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > maxLanes {
			return o, fmt.Errorf("%w: GDRLINK_TCP_LANES=%q, want 1..%d", verbsio.ErrBadConfig, v, maxLanes)
		}
		o.Lanes = n
	}
	if v := os.Getenv("GDRLINK_TCP_SOCKET_BUFFER"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 {
			return o, fmt.Errorf("%w: GDRLINK_TCP_SOCKET_BUFFER=%q, want a byte count", verbsio.ErrBadConfig, v)
		}
		o.SocketBuffer = n
	}
	o.AdvertiseAddr = os.Getenv("GDRLINK_ADVERTISE_ADDR")
	if v := os.Getenv("GDRLINK_TCP_SPIN"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d < 0 {
			return o, fmt.Errorf("%w: GDRLINK_TCP_SPIN=%q, want a duration", verbsio.ErrBadConfig, v)
		}
		o.Spin = d
		if d == 0 {
			o.Spin = -1
		}
	}
	return o, nil
}

func (o Options) withDefaults() Options {
	if o.Lanes == 0 {
		o.Lanes = defaultLanes
	}
	if o.StripeMin == 0 {
		o.StripeMin = defaultStripeMin
	}
	if o.RNRTimeout == 0 {
		o.RNRTimeout = defaultRNRTimeout
	}
	if o.Spin == 0 {
		o.Spin = adaptspin.DefaultMax
	}
	return o
}

// device is an open tcp device: a listener that peers' queue pairs dial,
// and the tables of its protection domains, completion queues and queue
// pairs. It implements verbsio.Device.
type device struct {
	cfg       verbsio.Config
	opt       Options
	key       jobauth.Key // the zero Key: lanes are not authenticated
	ln        net.Listener
	addr      string
	host      string
	userTO    time.Duration
	keepalive net.KeepAliveConfig

	// waits counts the completion queue waits in progress, for their
	// long polls (adaptspin.Waits).
	waits adaptspin.Waits

	mu     sync.Mutex
	closed bool
	pds    map[*pd]struct{}
	cqs    map[*cq]struct{}
	qps    map[uint32]*qp
	nextQP uint32
	keys   map[uint32]struct{}
	// conns are the accepted connections whose hello is not answered yet;
	// unproven counts those whose other end has proven nothing (see
	// maxUnproven), acceptSeq orders them, oldest first.
	conns      map[net.Conn]*pending
	unproven   int
	unprovenBy map[string]int // unproven, by the other end's IP
	acceptSeq  uint64
	// refused counts the accepted connections closed before they reached a
	// queue pair (no job key proven, a bad hello, evicted), evicted those
	// closed to make room for newer ones, lastRefusal says why the last
	// one was.
	refused     uint64
	evicted     uint64
	lastRefusal error
	// refuseLog logs them (cfg.Logger), at most a line a second.
	refuseLog *refuselog.Log
	wg        sync.WaitGroup

	// The lanes of its queue pairs and the retransmits of those closed
	// (retransmits.go); lanesMu is taken last, under any other lock.
	lanesMu     sync.Mutex
	lanes       map[net.Conn]struct{}
	retransGone uint64
	// retransOf reads a lane's retransmits (tcpRetransmits; tests fake it).
	retransOf func(net.Conn) (uint64, error)
	// dialFn opens a lane's connection (nil: a plain dial; tests record
	// what goes through it). Set before the first Connect.
	dialFn func(ctx context.Context, addr string) (net.Conn, error)
}

// OpenDevice opens a tcp device with explicit options; verbsio.Open("tcp",
// cfg) does the same with OptionsFromEnv. The device listens on cfg.ListenAddr
// (an ephemeral loopback port when empty), and its Info().Address says
// where peers reach it. cfg.Device is ignored: the provider has one device.
// With cfg.JobKey every lane proves the key (see the package
// documentation); a key of the wrong length is an error wrapping
// verbsio.ErrBadConfig and jobauth.ErrBadKey. Without one, a ListenAddr
// beyond loopback is an error wrapping verbsio.ErrBadConfig and
// jobauth.ErrInsecure unless cfg.Insecure is set.
func OpenDevice(cfg verbsio.Config, opt Options) (verbsio.Device, error) {
	d, err := openDevice(cfg, opt)
	if err != nil {
		return nil, err
	}
	return d, nil
}

// openDevice is OpenDevice returning the concrete device.
func openDevice(cfg verbsio.Config, opt Options) (*device, error) {
	cfg, err := cfg.Resolve()
	if err != nil {
		return nil, err
	}
	opt = opt.withDefaults()
	if opt.Lanes < 1 || opt.Lanes > maxLanes {
		return nil, fmt.Errorf("%w: %d lanes, want 1..%d", verbsio.ErrBadConfig, opt.Lanes, maxLanes)
	}
	key, err := jobauth.FromBytes(cfg.JobKey)
	if err != nil {
		return nil, fmt.Errorf("%w: tcp: %w", verbsio.ErrBadConfig, err)
	}
	la := cfg.ListenAddr
	if la == "" {
		la = "127.0.0.1:0"
	}
	if err := jobauth.CheckListen(key, la, cfg.Insecure); err != nil {
		return nil, fmt.Errorf("%w: tcp: %w", verbsio.ErrBadConfig, err)
	}
	ln, err := net.Listen("tcp", la)
	if err != nil {
		return nil, fmt.Errorf("%w: tcp: listening on %s: %w", verbsio.ErrBadConfig, la, err)
	}
	adv := opt.AdvertiseAddr
	if adv == "" {
		adv = advertised(ln.Addr().(*net.TCPAddr))
	}
	host, _ := hostid.Get()
	to, ka := socketLiveness(cfg)
	d := &device{cfg: cfg, opt: opt, key: key, ln: ln, addr: adv, host: host, userTO: to, keepalive: ka,
		pds: map[*pd]struct{}{}, cqs: map[*cq]struct{}{}, qps: map[uint32]*qp{},
		nextQP: rand.Uint32N(1 << 20), keys: map[uint32]struct{}{}, conns: map[net.Conn]*pending{}, unprovenBy: map[string]int{},
		refuseLog: refuselog.New(cfg.Logger, "tcp", ln.Addr().String()),
		lanes:     map[net.Conn]struct{}{}, retransOf: tcpRetransmits}
	d.wg.Add(1)
	go d.acceptLoop()
	return d, nil
}

// Socket liveness: the kernel gives up on a connection whose data or
// keepalive probes go unacknowledged for TCP_USER_TIMEOUT.
const (
	// userTimeoutFloor keeps a loaded host from being taken for a dead one.
	userTimeoutFloor = 10 * time.Second
	keepaliveIdle    = 5 * time.Second
	keepaliveMinGap  = 2 * time.Second
	// maxKeepaliveCount is Linux's bound on TCP_KEEPCNT.
	maxKeepaliveCount = 127
)

// socketLiveness derives TCP_USER_TIMEOUT and the keepalive probes of the
// lanes from cfg. The ack timeout of ibverbs (4.096 us * 2^Timeout,
// RetryCount+1 tries) becomes the user timeout, with a floor of 10s, and
// never less than one and a half peer timeouts: the channel above judges
// its peer's silence itself (rendezvous.WithPeerTimeout) and names it, so
// the socket must not give up first. A stopped peer process leaves its
// kernel acknowledging until its receive buffer fills; past that, only
// the user timeout ends the connection, which thus outlasts any pause the
// peer timeout allows. Keepalives start after 5s of quiet and probe every
// 2s (or more, so that the probes last as long as the user timeout within
// Linux's 127 probes).
func socketLiveness(cfg verbsio.Config) (time.Duration, net.KeepAliveConfig) {
	to := time.Duration(4096<<uint(cfg.Timeout)) * time.Nanosecond * time.Duration(cfg.RetryCount+1)
	to = max(to, userTimeoutFloor, cfg.PeerTimeout+cfg.PeerTimeout/2)
	gap := max(keepaliveMinGap, (to-keepaliveIdle+maxKeepaliveCount-1)/maxKeepaliveCount)
	count := max(5, int((to-keepaliveIdle+gap-1)/gap))
	return to, net.KeepAliveConfig{Enable: true, Idle: keepaliveIdle, Interval: gap, Count: count}
}

func advertised(a *net.TCPAddr) string {
	if !a.IP.IsUnspecified() {
		return a.String()
	}
	ifs, _ := net.Interfaces()
	for _, ifc := range ifs {
		if ifc.Flags&net.FlagUp == 0 || ifc.Flags&net.FlagLoopback != 0 {
			continue
		}
		addrs, _ := ifc.Addrs()
		for _, ad := range addrs {
			if ipn, ok := ad.(*net.IPNet); ok && ipn.IP.To4() != nil {
				return net.JoinHostPort(ipn.IP.String(), strconv.Itoa(a.Port))
			}
		}
	}
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(a.Port))
}

// Info describes the device; its Address is the "host:port" that peers
// dial.
func (d *device) Info() verbsio.DeviceInfo {
	return verbsio.DeviceInfo{Provider: Name, Name: Name, NUMANode: -1, Address: d.addr}
}

// Caps is what the device can do.
func (d *device) Caps() verbsio.Caps {
	return verbsio.Caps{
		Provider:           Name,
		MemoryTypes:        []tensor.DeviceKind{tensor.CPU, tensor.PinnedHost},
		DMABuf:             false,
		WriteWithImmediate: true,
		MaxInline:          maxInline,
		MaxSGE:             16,
		MaxQPDepth:         65536,
		MaxMessage:         maxPayload,
		SameHostOnly:       false,
		Grants:             true,
	}
}

// AllocPD makes a protection domain.
func (d *device) AllocPD() (verbsio.ProtectionDomain, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil, fmt.Errorf("%w: tcp device", verbsio.ErrClosed)
	}
	p := &pd{dev: d, byR: map[uint32]*mr{}, byL: map[uint32]*mr{}, qps: map[*qp]struct{}{}, grants: map[uint32]*grant{}}
	d.pds[p] = struct{}{}
	return p, nil
}

// CreateCQ makes a completion queue. depth is a hint: the queue grows as
// needed, so it never overruns.
func (d *device) CreateCQ(depth int) (verbsio.CompletionQueue, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil, fmt.Errorf("%w: tcp device", verbsio.ErrClosed)
	}
	if depth < 1 || depth > 1<<22 {
		return nil, fmt.Errorf("%w: completion queue depth %d", verbsio.ErrBadConfig, depth)
	}
	c := newCQ(d, depth)
	d.cqs[c] = struct{}{}
	return c, nil
}

// Close stops the listener. It fails with ErrBusy while protection domains
// or completion queues live. Idempotent.
func (d *device) Close() error {
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return nil
	}
	if len(d.pds) > 0 || len(d.cqs) > 0 {
		n, m := len(d.pds), len(d.cqs)
		d.mu.Unlock()
		return fmt.Errorf("%w: tcp device has %d protection domains and %d completion queues open", verbsio.ErrBusy, n, m)
	}
	d.closed = true
	for c := range d.conns {
		c.Close()
	}
	d.mu.Unlock()
	err := d.ln.Close()
	d.wg.Wait()
	return err
}

// newKey draws a fresh nonzero key never used by a region of the device;
// grantKeyBit is clear in it. Callers hold d.mu.
func (d *device) newKey() uint32 {
	for {
		k := rand.Uint32() &^ grantKeyBit
		if _, dup := d.keys[k]; k != 0 && !dup {
			d.keys[k] = struct{}{}
			return k
		}
	}
}

// dial opens one lane to a peer's queue pair: with a job key, it proves
// the key (and has the peer prove it) before the hello goes out.
func (d *device) dial(ctx context.Context, addr string, h hello) (net.Conn, error) {
	var c net.Conn
	var err error
	if d.dialFn != nil {
		c, err = d.dialFn(ctx, addr)
	} else {
		var dl net.Dialer
		c, err = dl.DialContext(ctx, "tcp", addr)
	}
	if err != nil {
		return nil, err
	}
	d.tune(c)
	if dl, ok := ctx.Deadline(); ok {
		c.SetDeadline(dl)
	}
	if !d.key.IsZero() {
		// The rank the handshake binds is the dialing queue pair's
		// number: the provider has no rank, and the acceptor checks that
		// the hello names the same queue pair.
		if err := jobauth.Initiate(c, d.key, lanePurpose, h.srcQP, jobauth.EndsOf(c, true)); err != nil {
			c.Close()
			return nil, err
		}
	}
	b := h.Append(make([]byte, 0, helloLen))
	var ans [1]byte
	if _, err := c.Write(b); err == nil {
		_, err = io.ReadFull(c, ans[:])
	}
	if err != nil {
		c.Close()
		return nil, err
	}
	c.SetDeadline(time.Time{})
	switch ans[0] {
	case helloOK:
		return c, nil
	case helloNoQP:
		err = fmt.Errorf("peer %s has no queue pair %d", addr, h.dstQP)
	case helloBadNonce:
		err = fmt.Errorf("peer %s: queue pair %d is not the one in the endpoint (stale endpoint)", addr, h.dstQP)
	case helloNeedKey:
		err = fmt.Errorf("%w: peer %s proves a job key on every lane and this process has none: give every process the same key (%s or %s)", jobauth.ErrRefused, addr, jobauth.KeyEnv, jobauth.KeyFileEnv)
	default:
		err = fmt.Errorf("peer %s refused the hello (code %d)", addr, ans[0])
	}
	c.Close()
	return nil, err
}

// tune sets TCP_NODELAY, keepalive, TCP_USER_TIMEOUT and the socket buffers.
func (d *device) tune(c net.Conn) {
	tc, ok := c.(*net.TCPConn)
	if !ok {
		return
	}
	tc.SetNoDelay(true)
	tc.SetKeepAliveConfig(d.keepalive)
	if n := d.opt.SocketBuffer; n > 0 {
		setBuffer(tc, n)
	}
	if rc, err := tc.SyscallConn(); err == nil {
		rc.Control(func(fd uintptr) {
			unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT, int(d.userTO.Milliseconds()))
		})
	}
}

// setBuffer asks for n-byte socket buffers, past net.core.[rw]mem_max when
// the process may (SO_*BUFFORCE needs CAP_NET_ADMIN), else up to the limit.
func setBuffer(tc *net.TCPConn, n int) {
	rc, err := tc.SyscallConn()
	if err != nil {
		return
	}
	rc.Control(func(fd uintptr) {
		if unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_SNDBUFFORCE, n) != nil {
			unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_SNDBUF, n)
		}
		if unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, n) != nil {
			unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUF, n)
		}
	})
}

// peerLost reports whether err is a connection that ended.
func peerLost(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.ECONNRESET) ||
		errors.Is(err, syscall.EPIPE) || errors.Is(err, net.ErrClosed) || errors.Is(err, syscall.ETIMEDOUT)
}

package verbsio

import (
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"time"

	"github.com/gdrlink/gdrlink/internal/jobauth"
)

// Config chooses and tunes a device. The zero value means "pick the best
// device, defaults everywhere". Every field has an environment variable named
// as in TensorFlow's verbs transport, read by ConfigFromEnv.
type Config struct {
	// Device is the device name (RDMA_DEVICE); "" picks one.
	Device string
	// Port is the 1-based port number (RDMA_DEVICE_PORT); 0 picks the first
	// active port.
	Port int
	// GIDIndex is the GID table index (RDMA_GID_INDEX); -1 picks one,
	// preferring RoCEv2.
	GIDIndex int
	// PKeyIndex is the partition key index (RDMA_QP_PKEY_INDEX).
	PKeyIndex int
	// QueueDepth is the send and receive queue depth (RDMA_QP_QUEUE_DEPTH,
	// default 1024).
	QueueDepth int
	// Timeout is the local ACK timeout exponent (RDMA_QP_TIMEOUT, default 14:
	// 4.096 us * 2^14, about 67 ms).
	Timeout int
	// RetryCount is the transport retry count (RDMA_QP_RETRY_COUNT, default 7).
	RetryCount int
	// SL is the service level (RDMA_QP_SL).
	SL int
	// MTU is the path MTU in bytes (RDMA_QP_MTU); 0 means the port's active MTU.
	MTU int
	// TrafficClass is the GRH traffic class (RDMA_TRAFFIC_CLASS).
	TrafficClass int
	// ListenAddr is where providers that need one listen ("host:port"; TCP
	// provider; GDRLINK_LISTEN_ADDR). "" means an ephemeral loopback port.
	// Once the device is open, Device.Info().Address says where peers
	// reach it.
	ListenAddr string
	// ConnectTimeout bounds Connect when the caller's context has no deadline
	// (GDRLINK_CONNECT_TIMEOUT, a Go duration; default 30s).
	ConnectTimeout time.Duration
	// PeerTimeout is how long a peer may stay silent while a channel has
	// work pending before the channel fails (GDRLINK_PEER_TIMEOUT, a Go
	// duration; default 30s; rendezvous.WithPeerTimeout enforces it).
	// Providers with liveness timers of their own set them so that they
	// never give up on a peer sooner (tcp: TCP_USER_TIMEOUT and the
	// keepalive probes).
	PeerTimeout time.Duration
	// JobKey is the job's key material (the front door's, derived from
	// GDRLINK_JOB_KEY or GDRLINK_JOB_KEY_FILE); nil means the job has none.
	// Providers that accept connections (tcp lanes, the onnode socket)
	// authenticate every one with it before anything of the job crosses,
	// and without it listen on loopback only unless Insecure is set.
	JobKey []byte
	// Insecure lets a provider without a JobKey listen beyond loopback
	// (GDRLINK_INSECURE=1).
	Insecure bool
	// Yield makes completion queues give up their thread's CPU between
	// polls (sched_yield(2)) while they poll, for hosts with more runnable
	// threads than CPUs: there the thread a completion needs may be
	// waiting for the very CPU a poller holds. The front door sets it where
	// its host runs more ranks of the job than this process may use CPUs
	// (GDRLINK_YIELD=auto, the default; on or off force it).
	Yield bool
	// Logger receives what providers log: the connections they refuse
	// (at Warn, at most a line a second per listener, with how many went
	// unlogged). nil logs to slog.Default().
	Logger *slog.Logger
}

// Defaults of Config.
const (
	defaultQueueDepth     = 1024
	defaultTimeout        = 14
	defaultRetryCount     = 7
	defaultConnectTimeout = 30 * time.Second
	defaultPeerTimeout    = 30 * time.Second
)

// MaxPeerTimeout is the longest Config.PeerTimeout (a day): socket timers
// derived from it stay within what the kernel takes.
const MaxPeerTimeout = 24 * time.Hour

// DefaultConfig returns the configuration with every default filled in.
func DefaultConfig() Config {
	return Config{GIDIndex: -1, QueueDepth: defaultQueueDepth, Timeout: defaultTimeout, RetryCount: defaultRetryCount, ConnectTimeout: defaultConnectTimeout, PeerTimeout: defaultPeerTimeout}
}

// Resolve returns c with its zero QueueDepth, Timeout, RetryCount,
// ConnectTimeout and PeerTimeout replaced by their defaults, and checks the
// ranges: queue depth 1..65536, timeout 0..31, retry count 0..7, SL
// 0..15, MTU one of 0/256/512/1024/2048/4096, traffic class 0..255, peer
// timeout up to MaxPeerTimeout. A value out of range is
// an error wrapping ErrBadConfig that names its variable. Providers call it
// first thing in Open.
func (c Config) Resolve() (Config, error) {
	c = c.withDefaults()
	return c, c.validate()
}

// withDefaults returns c with zero fields replaced by their defaults.
func (c Config) withDefaults() Config {
	d := DefaultConfig()
	if c.QueueDepth == 0 {
		c.QueueDepth = d.QueueDepth
	}
	if c.Timeout == 0 {
		c.Timeout = d.Timeout
	}
	if c.RetryCount == 0 {
		c.RetryCount = d.RetryCount
	}
	if c.ConnectTimeout == 0 {
		c.ConnectTimeout = d.ConnectTimeout
	}
	if c.PeerTimeout == 0 {
		c.PeerTimeout = d.PeerTimeout
	}
	return c
}

// validate checks the ranges Resolve documents.
func (c Config) validate() error {
	bad := func(name string, v any, want string) error {
		return fmt.Errorf("%w: %s=%v, want %s", ErrBadConfig, name, v, want)
	}
	switch {
	case c.Port < 0 || c.Port > 255:
		return bad("RDMA_DEVICE_PORT", c.Port, "1..255")
	case c.GIDIndex < -1 || c.GIDIndex > 65535:
		return bad("RDMA_GID_INDEX", c.GIDIndex, "0..65535")
	case c.PKeyIndex < 0 || c.PKeyIndex > 65535:
		return bad("RDMA_QP_PKEY_INDEX", c.PKeyIndex, "0..65535")
	case c.QueueDepth < 1 || c.QueueDepth > 65536:
		return bad("RDMA_QP_QUEUE_DEPTH", c.QueueDepth, "1..65536")
	case c.Timeout < 0 || c.Timeout > 31:
		return bad("RDMA_QP_TIMEOUT", c.Timeout, "0..31")
	case c.RetryCount < 0 || c.RetryCount > 7:
		return bad("RDMA_QP_RETRY_COUNT", c.RetryCount, "0..7")
	case c.SL < 0 || c.SL > 15:
		return bad("RDMA_QP_SL", c.SL, "0..15")
	case c.TrafficClass < 0 || c.TrafficClass > 255:
		return bad("RDMA_TRAFFIC_CLASS", c.TrafficClass, "0..255")
	case c.PeerTimeout < 0 || c.PeerTimeout > MaxPeerTimeout:
		return bad("GDRLINK_PEER_TIMEOUT", c.PeerTimeout, "a positive duration of at most "+MaxPeerTimeout.String())
	}
	switch c.MTU {
	case 0, 256, 512, 1024, 2048, 4096:
	default:
		return bad("RDMA_QP_MTU", c.MTU, "256, 512, 1024, 2048 or 4096")
	}
	return nil
}

// ConfigFromEnv returns DefaultConfig overridden by the RDMA_* and GDRLINK_*
// environment variables, validated.
func ConfigFromEnv() (Config, error) { return configFromLookup(os.LookupEnv) }

func configFromLookup(lookup func(string) (string, bool)) (Config, error) {
	c := DefaultConfig()
	if v, ok := lookup("RDMA_DEVICE"); ok {
		c.Device = v
	}
	if v, ok := lookup("GDRLINK_LISTEN_ADDR"); ok {
		c.ListenAddr = v
	}
	getenv := func(k string) string { v, _ := lookup(k); return v }
	key, _, err := jobauth.FromEnv(getenv)
	if err != nil {
		return c, fmt.Errorf("%w: %w", ErrBadConfig, err)
	}
	if !key.IsZero() {
		c.JobKey = key.Bytes()
	}
	c.Insecure = jobauth.Insecure(getenv)
	if v, ok := lookup("GDRLINK_CONNECT_TIMEOUT"); ok {
		d, err := time.ParseDuration(v)
		if err != nil || d <= 0 {
			return c, fmt.Errorf("%w: GDRLINK_CONNECT_TIMEOUT=%q is not a positive duration", ErrBadConfig, v)
		}
		c.ConnectTimeout = d
	}
	if v, ok := lookup("GDRLINK_PEER_TIMEOUT"); ok {
		d, err := time.ParseDuration(v)
		if err != nil || d <= 0 || d > MaxPeerTimeout {
			return c, fmt.Errorf("%w: GDRLINK_PEER_TIMEOUT=%q is not a positive duration of at most %v", ErrBadConfig, v, MaxPeerTimeout)
		}
		c.PeerTimeout = d
	}
	ints := []struct {
		name string
		dst  *int
	}{
		{"RDMA_DEVICE_PORT", &c.Port}, {"RDMA_GID_INDEX", &c.GIDIndex}, {"RDMA_QP_PKEY_INDEX", &c.PKeyIndex},
		{"RDMA_QP_QUEUE_DEPTH", &c.QueueDepth}, {"RDMA_QP_TIMEOUT", &c.Timeout}, {"RDMA_QP_RETRY_COUNT", &c.RetryCount},
		{"RDMA_QP_SL", &c.SL}, {"RDMA_QP_MTU", &c.MTU}, {"RDMA_TRAFFIC_CLASS", &c.TrafficClass},
	}
	for _, f := range ints {
		v, ok := lookup(f.name)
		if !ok || v == "" {
			continue
		}
		n, err := strconv.Atoi(v)
		if err != nil {
			return c, fmt.Errorf("%w: %s=%q is not an integer", ErrBadConfig, f.name, v)
		}
		*f.dst = n
	}
	return c, c.validate()
}

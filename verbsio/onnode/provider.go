package onnode

import (
	"fmt"
	"github.com/gdrlink/gdrlink/internal/cowlist"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gdrlink/gdrlink/internal/adaptspin"
	"github.com/gdrlink/gdrlink/internal/jobauth"
	"github.com/gdrlink/gdrlink/internal/refuselog"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

// Name is the provider's registered name.
const Name = "onnode"

// deviceName is the name of the provider's one device.
const deviceName = "onnode0"

// Limits advertised in Caps.
const (
	// maxSGE is the most scatter/gather entries per work request.
	maxSGE = 16
	// maxInline is the largest inline payload.
	maxInline = 64 << 10
	// maxQPDepth is the deepest queue a queue pair may ask for.
	maxQPDepth = 65536
	// maxMessage is the largest single write, read or send.
	maxMessage = 1 << 31
)

func init() { verbsio.Register(provider{}) }

// Mechanism is how a write's bytes cross into the peer.
type Mechanism uint8

// Mechanisms.
const (
	// MechAuto uses MechSHM for file-backed regions of the peer and MechVM
	// for the others.
	MechAuto Mechanism = iota
	// MechVM always uses process_vm_writev/readv.
	MechVM
	// MechSHM maps file-backed regions of the peer and copies; regions that
	// are not file-backed still use process_vm_writev.
	MechSHM
)

// String names the mechanism as GDRLINK_ONNODE_MECH spells it.
func (m Mechanism) String() string {
	switch m {
	case MechAuto:
		return "auto"
	case MechVM:
		return "vm"
	case MechSHM:
		return "shm"
	}
	return fmt.Sprintf("Mechanism(%d)", uint8(m))
}

// parseMechanism reads "auto", "vm" or "shm".
func parseMechanism(s string) (Mechanism, error) {
	switch strings.ToLower(s) {
	case "", "auto":
		return MechAuto, nil
	case "vm":
		return MechVM, nil
	case "shm":
		return MechSHM, nil
	}
	return MechAuto, fmt.Errorf("%w: onnode mechanism %q, want auto, vm or shm", verbsio.ErrBadConfig, s)
}

// Options tune the provider beyond verbsio.Config.
type Options struct {
	// Mechanism is how writes cross into the peer (GDRLINK_ONNODE_MECH).
	Mechanism Mechanism
	// Spin is the longest CompletionQueue.Wait polls before it sleeps;
	// within it each queue learns from its own waits how long to poll
	// (GDRLINK_ONNODE_SPIN, a Go duration; default 200us). Where polls
	// yield the CPU (verbsio.Config.Yield) a wait polls while the device
	// had a completion within 25 times that (adaptspin.LongFactor); 0
	// turns polling off in both cases.
	Spin time.Duration
	// DeregTimeout bounds how long closing a memory region waits for writes
	// of peers in flight (default 5s).
	DeregTimeout time.Duration
}

// Defaults of Options.
const (
	defaultSpin         = adaptspin.DefaultMax
	defaultDeregTimeout = 5 * time.Second
)

// OptionsFromEnv reads GDRLINK_ONNODE_MECH and GDRLINK_ONNODE_SPIN.
func OptionsFromEnv() (Options, error) {
	o := Options{Spin: defaultSpin, DeregTimeout: defaultDeregTimeout}
	m, err := parseMechanism(os.Getenv("GDRLINK_ONNODE_MECH"))
	if err != nil {
		return o, err
	}
	o.Mechanism = m
	if v := os.Getenv("GDRLINK_ONNODE_SPIN"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d < 0 {
			return o, fmt.Errorf("%w: GDRLINK_ONNODE_SPIN=%q is not a duration", verbsio.ErrBadConfig, v)
		}
		o.Spin = d
	}
	return o, nil
}

type provider struct{}

func (provider) Name() string { return Name }

func (provider) Devices() ([]verbsio.DeviceInfo, error) {
	if _, err := bootID(); err != nil {
		return nil, fmt.Errorf("%w: onnode: %w", verbsio.ErrNoDevice, err)
	}
	return []verbsio.DeviceInfo{deviceInfo()}, nil
}

func (provider) Open(cfg verbsio.Config) (verbsio.Device, error) {
	o, err := OptionsFromEnv()
	if err != nil {
		return nil, err
	}
	return OpenDevice(cfg, o)
}

func deviceInfo() verbsio.DeviceInfo {
	return verbsio.DeviceInfo{Provider: Name, Name: deviceName, NUMANode: -1}
}

// bootPath is where the host's identity is read.
const bootPath = "/proc/sys/kernel/random/boot_id"

func bootID() (string, error) {
	b, err := os.ReadFile(bootPath)
	if err != nil {
		return "", fmt.Errorf("reading boot id: %w", err)
	}
	id := strings.TrimSpace(string(b))
	if id == "" {
		return "", fmt.Errorf("empty boot id in %s", bootPath)
	}
	return id, nil
}

// OpenDevice opens the provider's device with explicit options;
// verbsio.Open("onnode", cfg) does the same with OptionsFromEnv.
func OpenDevice(cfg verbsio.Config, o Options) (verbsio.Device, error) {
	cfg, err := cfg.Resolve()
	if err != nil {
		return nil, err
	}
	if cfg.Device != "" && cfg.Device != deviceName {
		return nil, fmt.Errorf("%w: onnode has no device %q (it has %s)", verbsio.ErrBadConfig, cfg.Device, deviceName)
	}
	if o.Mechanism > MechSHM {
		return nil, fmt.Errorf("%w: %s", verbsio.ErrBadConfig, o.Mechanism)
	}
	if o.Spin < 0 {
		o.Spin = 0
	}
	if o.DeregTimeout <= 0 {
		o.DeregTimeout = defaultDeregTimeout
	}
	key, err := jobauth.FromBytes(cfg.JobKey)
	if err != nil {
		return nil, fmt.Errorf("%w: onnode: %w", verbsio.ErrBadConfig, err)
	}
	host, err := bootID()
	if err != nil {
		return nil, fmt.Errorf("%w: onnode: %w", verbsio.ErrNoDevice, err)
	}
	return &device{cfg: cfg, opts: o, host: host, key: key, refuseLog: refuselog.New(cfg.Logger, "onnode", deviceName)}, nil
}

// device is the provider's device.
type device struct {
	cfg  verbsio.Config
	opts Options
	host string
	key  jobauth.Key // zero: connections are checked by credentials only
	// refuseLog logs the connections its queue pairs' sockets turn away
	// (cfg.Logger), at most a line a second for the whole device.
	refuseLog *refuselog.Log

	// cqs are the device's completion queues, and lastDone is when a
	// wait of the device last returned completions (UnixNano): where
	// polls yield, waits poll while it is recent and wake the sleeping
	// waits whose completions are ready (cq.busyWait).
	cqs      cowlist.List[*cq]
	lastDone atomic.Int64

	mu       sync.Mutex
	children int
	closed   bool
}

// Info implements verbsio.Device.
func (d *device) Info() verbsio.DeviceInfo { return deviceInfo() }

// Caps implements verbsio.Device.
func (d *device) Caps() verbsio.Caps {
	return verbsio.Caps{
		Provider:           Name,
		MemoryTypes:        []tensor.DeviceKind{tensor.CPU, tensor.PinnedHost},
		DMABuf:             false,
		WriteWithImmediate: true,
		MaxInline:          maxInline,
		MaxSGE:             maxSGE,
		MaxQPDepth:         maxQPDepth,
		MaxMessage:         maxMessage,
		SameHostOnly:       true,
		Grants:             true,
	}
}

func (d *device) addChild() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return fmt.Errorf("%w: device %s", verbsio.ErrClosed, deviceName)
	}
	d.children++
	return nil
}

func (d *device) dropChild() {
	d.mu.Lock()
	d.children--
	d.mu.Unlock()
}

// AllocPD implements verbsio.Device.
func (d *device) AllocPD() (verbsio.ProtectionDomain, error) {
	if err := d.addChild(); err != nil {
		return nil, err
	}
	pd, err := newPD(d)
	if err != nil {
		d.dropChild()
		return nil, err
	}
	return pd, nil
}

// CreateCQ implements verbsio.Device.
func (d *device) CreateCQ(depth int) (verbsio.CompletionQueue, error) {
	if depth < 1 || depth > 1<<22 {
		return nil, fmt.Errorf("%w: completion queue depth %d, want 1..%d", verbsio.ErrBadConfig, depth, 1<<22)
	}
	if err := d.addChild(); err != nil {
		return nil, err
	}
	c := newCQ(d, depth)
	d.cqs.Add(c)
	return c, nil
}

// Close implements verbsio.Device: ErrBusy while domains or queues live.
func (d *device) Close() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil
	}
	if d.children > 0 {
		return fmt.Errorf("%w: device %s has %d live protection domains or completion queues", verbsio.ErrBusy, deviceName, d.children)
	}
	d.closed = true
	return nil
}

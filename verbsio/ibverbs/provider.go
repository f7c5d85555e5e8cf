package ibverbs

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/gdrlink/gdrlink/internal/ibv"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

// Name is the provider's registered name.
const Name = "ibverbs"

func init() { verbsio.Register(newProvider()) }

// Option tunes a provider made with New beyond verbsio.Config.
type Option func(*options)

type options struct {
	sysRoot     string
	rnrRetry    int
	minRNRTimer int
	hopLimit    int
	spin        time.Duration
	spinSet     bool
	// windows says when regions give grants (window.go); windowsSet that
	// withWindows set it, over windowsEnv.
	windows    windowMode
	windowsSet bool
}

// WithSysfsRoot reads sysfs under root instead of /sys (a container that
// mounts the host's as /host/sys).
func WithSysfsRoot(root string) Option { return func(o *options) { o.sysRoot = root } }

// WithRNRRetry sets how often a queue pair retries a send or write with
// immediate that found no posted receive (0..7, 7 = forever; default 7).
func WithRNRRetry(n int) Option { return func(o *options) { o.rnrRetry = n } }

// WithMinRNRTimer sets the receiver-not-ready NAK timer code (0..31, default
// 12: 0.64 ms).
func WithMinRNRTimer(code int) Option { return func(o *options) { o.minRNRTimer = code } }

// WithHopLimit sets the GRH hop limit of RoCE routes (default 64).
func WithHopLimit(n int) Option { return func(o *options) { o.hopLimit = n } }

// WithSpin caps how long a completion queue Wait keeps polling (with
// pauses doubling up to 8 us) before it sleeps on its completion channel.
// Within the cap, each queue learns how long to poll from its own waits,
// as the tcp and onnode providers do (internal/adaptspin): as long as the
// answers come sooner than a wake-up costs (a ping-pong, on an RDMA NIC or
// an emulated one alike), briefly where they come later or the host is
// busy. A queue never polls longer than sixteen wake-ups of its host,
// which the device measures once, at its first completion queue
// (adaptspin.ProbeWake: a completion channel's event cannot say when its
// completion came, so the queue cannot time its own wake-ups): about
// 0.2 ms on an idle host, the whole cap where a wake-up costs a
// millisecond (an emulated machine). The default is GDRLINK_IBVERBS_SPIN
// (a Go duration) or 5 ms. 0 sleeps at once.
func WithSpin(d time.Duration) Option { return func(o *options) { o.spin, o.spinSet = d, true } }

// spinEnv names the environment variable with the default of WithSpin.
const spinEnv = "GDRLINK_IBVERBS_SPIN"

// defaultSpin is the default of WithSpin: a bound, above the sixteen
// wake-ups that cap a queue's polls on any host whose wake-ups cost under
// 0.3 ms.
const defaultSpin = 5 * time.Millisecond

// provider opens libibverbs devices. The one registered as "ibverbs" has
// the defaults.
type provider struct{ o options }

// New returns an ibverbs provider with the given options, to open devices
// with (its Open takes the verbsio.Config) where the defaults of the one
// registered as "ibverbs" do not fit.
func New(opts ...Option) verbsio.Provider { return newProvider(opts...) }

func newProvider(opts ...Option) *provider {
	p := &provider{o: options{sysRoot: "/sys", rnrRetry: 7, minRNRTimer: 12, hopLimit: 64, spin: defaultSpin}}
	for _, f := range opts {
		f(&p.o)
	}
	return p
}

// Name implements verbsio.Provider.
func (p *provider) Name() string { return Name }

func (p *provider) sys() sysfs { return sysfs{root: p.o.sysRoot} }

// Devices lists the RDMA devices of this host. With none it returns an
// error wrapping verbsio.ErrNoDevice that says what is missing.
func (p *provider) Devices() ([]verbsio.DeviceInfo, error) {
	names, err := p.deviceNames()
	if err != nil {
		return nil, err
	}
	out := make([]verbsio.DeviceInfo, 0, len(names))
	for _, n := range names {
		out = append(out, p.info(n, 1))
	}
	return out, nil
}

func (p *provider) info(name string, port int) verbsio.DeviceInfo {
	numa, pci := p.sys().location(name)
	return verbsio.DeviceInfo{Provider: Name, Name: name, NUMANode: numa, PCIAddress: pci, Netdev: p.sys().netdev(name, port)}
}

// memoryTypes lists the memory RegisterMemory accepts on device dev at PCI
// address pci: host memory always, GPU memory where the device is a PCI
// function and a GPU peer-memory module (nvidia_peermem, nv_peer_mem) is
// loaded, for ibv_reg_mr then takes a GPU device pointer. Software devices
// (rxe, siw: no PCI function) never reach GPU memory, module or not. gpuWhy
// says why GPU memory is not listed ("" when it is): not supported, or could
// not tell (which lists it neither).
func (p *provider) memoryTypes(dev, pci string) (kinds []tensor.DeviceKind, gpuWhy string) {
	kinds = []tensor.DeviceKind{tensor.CPU, tensor.PinnedHost}
	if pci == "" {
		return kinds, fmt.Sprintf("%s: %s is a software device (no PCI function), so no NIC can reach GPU memory through it", verbsio.ErrNotSupported, dev)
	}
	if _, err := p.sys().peerMem(); err != nil {
		return kinds, err.Error()
	}
	return append(kinds, tensor.GPU), ""
}

// deviceNames loads libibverbs (missing or too old: the provider is absent,
// and the error says so), asks sysfs, so a host without kernel RDMA support
// gets a clear reason, then asks libibverbs.
func (p *provider) deviceNames() ([]string, error) {
	if err := ibv.Load(); err != nil {
		return nil, fmt.Errorf("%w: %w", verbsio.ErrNoDevice, err)
	}
	s := p.sys()
	sysNames, err := s.devices()
	if errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("%w: no RDMA devices: %s does not exist (the kernel has no RDMA device: no RDMA NIC driver, no rdma_rxe or siw loaded)", verbsio.ErrNoDevice, s.classDir())
	}
	if err != nil {
		return nil, fmt.Errorf("%w: reading %s: %w", verbsio.ErrNoDevice, s.classDir(), err)
	}
	if len(sysNames) == 0 {
		return nil, fmt.Errorf("%w: no RDMA devices: %s is empty (RDMA core loaded, no device driver or Soft-RoCE link)", verbsio.ErrNoDevice, s.classDir())
	}
	devs, err := ibv.Devices()
	if err != nil {
		return nil, fmt.Errorf("%w: libibverbs: %w", verbsio.ErrNoDevice, err)
	}
	if len(devs) == 0 {
		return nil, fmt.Errorf("%w: libibverbs lists no devices although %s has %s (user-space provider missing? install ibverbs-providers; or no /dev/infiniband/uverbs* access)", verbsio.ErrNoDevice, s.classDir(), strings.Join(sysNames, ", "))
	}
	out := make([]string, len(devs))
	for i, d := range devs {
		out[i] = d.Name
	}
	return out, nil
}

// Open implements verbsio.Provider: it opens the device, port and GID that
// cfg names, or the best ones.
func (p *provider) Open(cfg verbsio.Config) (verbsio.Device, error) {
	d, err := p.openDevice(cfg)
	if err != nil {
		return nil, err
	}
	return d, nil
}

// openDevice is Open returning the concrete device.
func (p *provider) openDevice(cfg verbsio.Config) (*device, error) {
	cfg, err := cfg.Resolve()
	if err != nil {
		return nil, err
	}
	o := p.o
	if v, ok := os.LookupEnv(spinEnv); ok && !o.spinSet {
		d, err := time.ParseDuration(v)
		if err != nil || d < 0 {
			return nil, fmt.Errorf("%w: %s=%q is not a duration of at least 0", verbsio.ErrBadConfig, spinEnv, v)
		}
		o.spin = d
	}
	if v, ok := os.LookupEnv(windowsEnv); ok && !o.windowsSet {
		m, err := parseWindowMode(v)
		if err != nil {
			return nil, err
		}
		o.windows = m
	}
	names, err := p.deviceNames()
	if err != nil {
		return nil, err
	}
	facts := make([]deviceFacts, len(names))
	ctxs := map[string]*ibv.Context{}
	defer func() {
		for _, c := range ctxs {
			c.Close()
		}
	}()
	for i, n := range names {
		facts[i] = deviceFacts{Name: n}
		if cfg.Device != "" && n != cfg.Device {
			continue
		}
		c, err := ibv.Open(n)
		if err != nil {
			facts[i].Err = err
			continue
		}
		ctxs[n] = c
		facts[i].Ports, facts[i].Err = p.queryPorts(c)
	}
	ch, err := choose(facts, cfg)
	if err != nil {
		return nil, err
	}
	c := ctxs[ch.Device]
	delete(ctxs, ch.Device)
	d, err := newDevice(&provider{o: o}, c, ch, cfg)
	if err != nil {
		c.Close()
		return nil, err
	}
	return d, nil
}

func (p *provider) queryPorts(c *ibv.Context) ([]portFacts, error) {
	attr, err := c.QueryDevice()
	if err != nil {
		return nil, err
	}
	var ports []portFacts
	total := 0
	for n := 1; n <= attr.PhysPortCount; n++ {
		pa, err := c.QueryPort(n)
		if err != nil {
			return nil, err
		}
		ports = append(ports, portFacts{Num: n, Attr: pa})
		total += pa.GIDTblLen
	}
	// The whole table in one call where the library has the verb, else
	// entry by entry.
	table, terr := c.GIDTable(total)
	for pi := range ports {
		pf := &ports[pi]
		var entries []ibv.GIDEntry
		if terr == nil {
			for _, e := range table {
				if e.Port == pf.Num {
					entries = append(entries, e)
				}
			}
		} else {
			for i := 0; i < pf.Attr.GIDTblLen; i++ {
				if e, err := c.QueryGID(pf.Num, i); err == nil {
					entries = append(entries, e)
				}
			}
		}
		n, pa := pf.Num, pf.Attr
		for _, e := range entries {
			i := e.Index
			if e.GID.IsZero() {
				continue // unused entry: not a candidate
			}
			if e.Type == ibv.GIDTypeUnknown || pa.LinkLayer == ibv.LinkLayerEthernet {
				// sysfs is the authority on RoCE types where it has them.
				if t := p.sys().gidType(c.Name(), n, i); t != ibv.GIDTypeUnknown {
					e.Type = t
				}
			}
			if pa.LinkLayer == ibv.LinkLayerInfiniBand {
				e.Type = ibv.GIDTypeIB
			}
			e.Netdev = p.sys().gidNetdev(c.Name(), n, i)
			pf.GIDs = append(pf.GIDs, e)
		}
	}
	return ports, nil
}

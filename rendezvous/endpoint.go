package rendezvous

import (
	"errors"
	"fmt"
	"sync"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/alloc/visitor"
	"github.com/gdrlink/gdrlink/verbsio"
)

// EndpointConfig says how OpenEndpoint builds an endpoint. The zero value
// picks the best provider for a peer on another host, reads the RDMA_*
// variables, and registers a huge-page mmap pool.
type EndpointConfig struct {
	// Provider is a registered provider's name; "" lets verbsio.Choose pick
	// the best one for the peer (ibverbs, else onnode when PeerOnThisHost,
	// else tcp).
	Provider string
	// PeerOnThisHost lets Choose consider the on-node provider.
	PeerOnThisHost bool
	// Verbs configures the device; nil reads verbsio.ConfigFromEnv.
	Verbs *verbsio.Config
	// Source makes the pool's arenas; nil is anonymous mmap with huge pages.
	Source alloc.Source
	// Access is what the registration visitor allows peers; 0 is local
	// write, remote write and remote read.
	Access verbsio.Access
	// Pool are options of the pool (limit, arena sizes); the registration
	// visitor is always its first visitor.
	Pool []alloc.Option
	// Channel are options of the channel (name, checksum, logger, proxy).
	Channel []Option
}

// Endpoint is what one process needs to exchange tensors with one peer: an
// open device, a protection domain, a pool whose every arena the
// registration visitor registered once, and a channel over them. Tensors for
// Send come from Pool; Recv results are allocated from it.
type Endpoint struct {
	// Provider is the provider chosen, and Choice why better ones were not
	// (empty when EndpointConfig named one).
	Provider string
	Choice   verbsio.Choice
	Device   verbsio.Device
	PD       verbsio.ProtectionDomain
	// Registration is the pool's memory-registration visitor.
	Registration *visitor.MemoryRegistration
	Pool         *alloc.Pool
	Channel      *Channel

	closeOnce sync.Once
	closeErr  error
}

// OpenEndpoint opens a device, a protection domain, a registered pool and a
// channel. The channel still has to be connected (Channel.Connect, or
// Channel.ConnectVia a bootstrap group). On error, everything already opened
// is closed again.
func OpenEndpoint(cfg EndpointConfig) (*Endpoint, error) {
	e := &Endpoint{Provider: cfg.Provider}
	if e.Provider == "" {
		c, err := verbsio.Choose(cfg.PeerOnThisHost)
		if err != nil {
			return nil, fmt.Errorf("rendezvous: endpoint: %w", err)
		}
		e.Provider, e.Choice = c.Provider, c
	}
	vc := verbsio.Config{}
	if cfg.Verbs != nil {
		vc = *cfg.Verbs
	} else {
		var err error
		if vc, err = verbsio.ConfigFromEnv(); err != nil {
			return nil, fmt.Errorf("rendezvous: endpoint: %w", err)
		}
	}
	fail := func(err error) (*Endpoint, error) {
		return nil, errors.Join(fmt.Errorf("rendezvous: endpoint over %s: %w", e.Provider, err), e.Close())
	}
	var err error
	if e.Device, err = verbsio.Open(e.Provider, vc); err != nil {
		return fail(err)
	}
	if e.PD, err = e.Device.AllocPD(); err != nil {
		return fail(err)
	}
	access := cfg.Access
	if access == 0 {
		access = verbsio.AccessLocalWrite | verbsio.AccessRemoteWrite | verbsio.AccessRemoteRead
	}
	e.Registration = visitor.NewMemoryRegistration(e.PD, access)
	src := cfg.Source
	if src == nil {
		src = alloc.NewMmapSource(alloc.MmapOptions{HugePages: true})
	}
	popts := append([]alloc.Option{alloc.WithVisitors(e.Registration)}, cfg.Pool...)
	if e.Pool, err = alloc.New(src, popts...); err != nil {
		return fail(err)
	}
	if e.Channel, err = New(e.Device, e.PD, PoolMemory(e.Registration.RegionOf, e.Pool), cfg.Channel...); err != nil {
		return fail(err)
	}
	return e, nil
}

// Close closes the channel, the pool (deregistering its arenas), the
// protection domain and the device, in that order, and joins their errors.
// It is idempotent.
func (e *Endpoint) Close() error {
	e.closeOnce.Do(func() {
		var errs []error
		if e.Channel != nil {
			errs = append(errs, e.Channel.Close())
		}
		if e.Pool != nil {
			errs = append(errs, e.Pool.Close())
		}
		if e.PD != nil {
			errs = append(errs, e.PD.Close())
		}
		if e.Device != nil {
			errs = append(errs, e.Device.Close())
		}
		e.closeErr = errors.Join(errs...)
	})
	return e.closeErr
}

package verbsio

import (
	"errors"
	"fmt"
	"sort"
	"sync"
)

// The provider registry is the package's one piece of mutable state, as
// database/sql's drivers.
var (
	providersMu sync.RWMutex
	providers   = map[string]Provider{}
)

// Register makes a provider available by name. It panics if the name is
// taken or p is nil, as database/sql.Register does: both are programming
// errors found at init.
func Register(p Provider) {
	providersMu.Lock()
	defer providersMu.Unlock()
	if p == nil {
		panic("verbsio: Register of a nil provider")
	}
	if _, dup := providers[p.Name()]; dup {
		panic("verbsio: Register called twice for provider " + p.Name())
	}
	providers[p.Name()] = p
}

// Providers lists the registered providers' names, sorted.
func Providers() []string {
	providersMu.RLock()
	defer providersMu.RUnlock()
	out := make([]string, 0, len(providers))
	for n := range providers {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

// Lookup returns the provider registered under name.
func Lookup(name string) (Provider, error) {
	providersMu.RLock()
	defer providersMu.RUnlock()
	p, ok := providers[name]
	if !ok {
		return nil, fmt.Errorf("%w: %q (registered: %v; import its package, e.g. _ \"github.com/gdrlink/gdrlink/verbsio/%s\")", ErrNoProvider, name, keys(providers), name)
	}
	return p, nil
}

func keys(m map[string]Provider) []string {
	out := make([]string, 0, len(m))
	for n := range m {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

// Open opens a device of the named provider.
func Open(name string, cfg Config) (Device, error) {
	p, err := Lookup(name)
	if err != nil {
		return nil, err
	}
	return p.Open(cfg)
}

// preference is the order in which Choose tries providers, and
// sameHostOnly the providers that reach only peers on this host. Neither
// changes after init.
var (
	preference   = []string{"ibverbs", "onnode", "tcp"}
	sameHostOnly = map[string]bool{"onnode": true}
)

// Choice is the provider Choose picked and why the better ones were passed over.
type Choice struct {
	Provider string
	// Skipped says, for each better provider not chosen, why.
	Skipped map[string]error
}

// Choose picks the best available provider for a peer: ibverbs when it has
// a device, else onnode when the peer shares this host, else tcp. Nothing is
// skipped silently: Choice.Skipped holds the reasons. A peer shares this
// host when the Host of its Endpoint equals the Host of an endpoint made
// here (both set: providers fill it with the kernel's boot id).
func Choose(peerSameHost bool) (Choice, error) {
	return choose(preference, sameHostOnly, peerSameHost)
}

func choose(preference []string, sameHostOnly map[string]bool, peerSameHost bool) (Choice, error) {
	c := Choice{Skipped: map[string]error{}}
	for _, name := range preference {
		p, err := Lookup(name)
		if err != nil {
			c.Skipped[name] = err
			continue
		}
		if sameHostOnly[name] && !peerSameHost {
			c.Skipped[name] = fmt.Errorf("%w: peer is on another host", ErrNotSupported)
			continue
		}
		if _, err := p.Devices(); err != nil {
			c.Skipped[name] = err
			continue
		}
		c.Provider = name
		return c, nil
	}
	errs := make([]error, 0, len(c.Skipped))
	for _, n := range preference {
		if e := c.Skipped[n]; e != nil {
			errs = append(errs, fmt.Errorf("%s: %w", n, e))
		}
	}
	return c, fmt.Errorf("%w: %w", ErrNoProvider, errors.Join(errs...))
}

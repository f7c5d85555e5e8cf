package rendezvous_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/alloc/visitor"
	"github.com/gdrlink/gdrlink/rendezvous"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
	_ "github.com/gdrlink/gdrlink/verbsio/tcp"
)

// endpointConfig says how openEndpoint builds an endpoint. The zero value
// picks the best provider for a peer on another host, reads the RDMA_*
// variables, and registers a huge-page mmap pool.
type endpointConfig struct {
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
	Channel []rendezvous.Option
}

// localEndpoint is what one process needs to exchange tensors with one peer, as
// a user of the package builds it: an open device, a protection domain, a
// pool whose every arena the registration visitor registered once, and a
// channel over them. Tensors for Send come from Pool; Recv results are
// allocated from it.
type localEndpoint struct {
	// Provider is the provider chosen, and Choice why better ones were not
	// (empty when endpointConfig named one).
	Provider string
	Choice   verbsio.Choice
	Device   verbsio.Device
	PD       verbsio.ProtectionDomain
	// Registration is the pool's memory-registration visitor.
	Registration *visitor.MemoryRegistration
	Pool         *alloc.Pool
	Channel      *rendezvous.Channel

	closeOnce sync.Once
	closeErr  error
}

// openEndpoint opens a device, a protection domain, a registered pool and a
// channel. The channel still has to be connected. On error, everything
// already opened is closed again.
func openEndpoint(cfg endpointConfig) (*localEndpoint, error) {
	e := &localEndpoint{Provider: cfg.Provider}
	if e.Provider == "" {
		c, err := verbsio.Choose(cfg.PeerOnThisHost)
		if err != nil {
			return nil, fmt.Errorf("endpoint: %w", err)
		}
		e.Provider, e.Choice = c.Provider, c
	}
	vc := verbsio.Config{}
	if cfg.Verbs != nil {
		vc = *cfg.Verbs
	} else {
		var err error
		if vc, err = verbsio.ConfigFromEnv(); err != nil {
			return nil, fmt.Errorf("endpoint: %w", err)
		}
	}
	fail := func(err error) (*localEndpoint, error) {
		return nil, errors.Join(fmt.Errorf("endpoint over %s: %w", e.Provider, err), e.Close())
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
	if e.Channel, err = rendezvous.New(e.Device, e.PD, rendezvous.PoolMemory(e.Registration.RegionOf, e.Pool), cfg.Channel...); err != nil {
		return fail(err)
	}
	return e, nil
}

// Close closes the channel, the pool (deregistering its arenas), the
// protection domain and the device, in that order, and joins their errors.
// It is idempotent.
func (e *localEndpoint) Close() error {
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

// connectEndpoints trades hellos between two endpoints of this process.
func connectEndpoints(ctx context.Context, a, b *localEndpoint) error {
	ha, hb := a.Channel.Hello(), b.Channel.Hello()
	errc := make(chan error, 1)
	go func() { errc <- a.Channel.Connect(ctx, hb) }()
	return errors.Join(b.Channel.Connect(ctx, ha), <-errc)
}

func TestEndpoint(t *testing.T) {
	cfg := endpointConfig{Provider: "tcp", Verbs: &verbsio.Config{}, Pool: []alloc.Option{alloc.WithInitialArena(1 << 20)}}
	a, err := openEndpoint(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = a.Close() })
	b, err := openEndpoint(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := connectEndpoints(ctx, a, b); err != nil {
		t.Fatal(err)
	}

	meta, err := tensor.MetaFor(tensor.Int32, tensor.Shape{3, 1000})
	if err != nil {
		t.Fatal(err)
	}
	src, err := a.Pool.NewTensor(meta)
	if err != nil {
		t.Fatal(err)
	}
	// The tensor's arena was registered once, by the endpoint's visitor.
	arena, ok := a.Pool.ArenaOf(src.Addr())
	if !ok {
		t.Fatal("source tensor is not in the endpoint's pool")
	}
	if _, ok := a.Registration.RegionOf(arena); !ok {
		t.Fatal("the pool's arena has no memory region")
	}
	vals, err := tensor.View[int32](src)
	if err != nil {
		t.Fatal(err)
	}
	for i := range vals {
		vals[i] = int32(i*7 + 1)
	}
	if err := a.Channel.Send("w", 1, src); err != nil {
		t.Fatal(err)
	}
	got, tr, err := b.Channel.Recv(ctx, "w", 1)
	if err != nil {
		t.Fatal(err)
	}
	gv, err := tensor.View[int32](got)
	if err != nil {
		t.Fatal(err)
	}
	for i, v := range gv {
		if v != int32(i*7+1) {
			t.Fatalf("element %d = %d, want %d", i, v, i*7+1)
		}
	}
	if tr.Provider != "tcp" {
		t.Errorf("transfer went over %q, want tcp", tr.Provider)
	}
	if _, ok := b.Pool.ArenaOf(got.Addr()); !ok {
		t.Error("the result was not written into the receiving endpoint's pool")
	}

	if err := got.Release(); err != nil {
		t.Fatal(err)
	}
	if err := b.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}
	if err := b.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

func TestEndpointUnknownProvider(t *testing.T) {
	_, err := openEndpoint(endpointConfig{Provider: "no-such-provider", Verbs: &verbsio.Config{}})
	if !errors.Is(err, verbsio.ErrNoProvider) {
		t.Fatalf("err = %v, want ErrNoProvider", err)
	}
}

func TestEndpointBadPoolOption(t *testing.T) {
	// A pool that cannot be built leaves nothing open: the device's close
	// would report live children otherwise.
	_, err := openEndpoint(endpointConfig{Provider: "tcp", Verbs: &verbsio.Config{}, Pool: []alloc.Option{alloc.WithInitialArena(0)}})
	if !errors.Is(err, alloc.ErrBadOption) {
		t.Fatalf("err = %v, want alloc.ErrBadOption", err)
	}
	if errors.Is(err, verbsio.ErrBusy) {
		t.Fatalf("cleanup after the failure left children open: %v", err)
	}
}

// What a process needs to exchange tensors: a device of a provider, a pool
// registered arena by arena, and a channel (openEndpoint, above, builds
// them).
func Example_endpoint() {
	cfg := endpointConfig{Provider: "tcp", Verbs: &verbsio.Config{}}
	sender, err := openEndpoint(cfg)
	if err != nil {
		panic(err)
	}
	defer sender.Close()
	receiver, err := openEndpoint(cfg)
	if err != nil {
		panic(err)
	}
	defer receiver.Close()

	// Two endpoints in one process stand for two processes; between
	// processes, internal/bootstrap trades the hellos (Channel.ConnectVia).
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := connectEndpoints(ctx, sender, receiver); err != nil {
		panic(err)
	}

	meta, _ := tensor.MetaFor(tensor.Float32, tensor.Shape{4})
	src, _ := sender.Pool.NewTensor(meta)
	vals, _ := tensor.View[float32](src)
	copy(vals, []float32{1, 2, 3, 4})
	if err := sender.Channel.Send("grad", 7, src); err != nil {
		panic(err)
	}
	got, tr, err := receiver.Channel.Recv(ctx, "grad", 7)
	if err != nil {
		panic(err)
	}
	defer got.Release()
	v, _ := tensor.View[float32](got)
	arena, _ := receiver.Pool.ArenaOf(got.Addr())
	_, registered := visitor.MemoryRegionOf(arena)
	fmt.Println(v, tr.Path, "registered:", registered)
	// Output: [1 2 3 4] eager registered: true
}

package rendezvous

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
	_ "github.com/gdrlink/gdrlink/verbsio/ibverbs"
	_ "github.com/gdrlink/gdrlink/verbsio/onnode"
	_ "github.com/gdrlink/gdrlink/verbsio/tcp"
)

// providersUnderTest are the providers the tests run against: the
// comma-separated GDRLINK_PROVIDER, or tcp and onnode.
func providersUnderTest() []string {
	if v := os.Getenv("GDRLINK_PROVIDER"); v != "" {
		return strings.Split(v, ",")
	}
	return []string{"tcp", "onnode"}
}

// skipUnavailable skips when the provider cannot run here, and fails
// instead when GDRLINK_REQUIRE_RDMA=1 says an RDMA device should be there.
func skipUnavailable(t testing.TB, provider string, err error) {
	t.Helper()
	if provider == "ibverbs" && os.Getenv("GDRLINK_REQUIRE_RDMA") == "1" {
		t.Fatalf("GDRLINK_REQUIRE_RDMA=1 but provider %s is unusable: %v", provider, err)
	}
	t.Skipf("provider %s unavailable here: %v", provider, err)
}

// forEachProvider runs f as a subtest per provider.
func forEachProvider(t *testing.T, f func(t *testing.T, provider string)) {
	for _, p := range providersUnderTest() {
		t.Run(p, func(t *testing.T) { f(t, p) })
	}
}

// withSendSlots sets how many control-message send buffers the channel has
// (default 64, 1..4096).
func withSendSlots(n int) Option {
	return func(o *options) error {
		if n < 1 || n > 4096 {
			return fmt.Errorf("%w: %d send slots, want 1..4096", ErrBadOption, n)
		}
		o.sendSlots = n
		return nil
	}
}

// withStripeMin sets the smallest write striped over the rails (default
// 4 MiB).
func withStripeMin(n int64) Option {
	return func(o *options) error {
		if n <= 0 {
			return fmt.Errorf("%w: stripe minimum %d", ErrBadOption, n)
		}
		o.stripeMin = n
		return nil
	}
}

type mrKey struct{ rail int }

// registration is the memory-registration visitor the tests use: each arena
// is registered once with pd for local access and remote write (the
// protocol issues no RDMA READ).
func registration(pd verbsio.ProtectionDomain, rail int) alloc.Visitor {
	return registrationWith(pd, rail, verbsio.AccessLocalWrite|verbsio.AccessRemoteWrite)
}

// frontDoorRegistration registers each arena as the front door does over
// dev: for local write only where dev's regions give grants (every buffer
// a peer writes is then a grant, so no arena's own rkey admits a write),
// for local and remote write elsewhere.
func frontDoorRegistration(dev verbsio.Device, pd verbsio.ProtectionDomain, rail int) alloc.Visitor {
	if dev.Caps().Grants {
		return registrationWith(pd, rail, verbsio.AccessLocalWrite)
	}
	return registration(pd, rail)
}

func registrationWith(pd verbsio.ProtectionDomain, rail int, access verbsio.Access) alloc.Visitor {
	key := mrKey{rail}
	return alloc.NewVisitor(fmt.Sprint("test-mr-", rail), func(a *alloc.Arena) error {
		mr, err := pd.RegisterMemory(a.Base(), a.Size(), access)
		if err != nil {
			return err
		}
		a.SetHandle(key, mr)
		return nil
	}, func(a *alloc.Arena) error {
		v, ok := a.Handle(key)
		if !ok {
			return nil
		}
		a.DeleteHandle(key)
		return v.(verbsio.MemoryRegion).Close()
	})
}

// regionIn finds an arena's region registered for rail.
func regionIn(rail int) func(*alloc.Arena) (verbsio.MemoryRegion, bool) {
	return func(a *alloc.Arena) (verbsio.MemoryRegion, bool) {
		v, ok := a.Handle(mrKey{rail})
		if !ok {
			return nil, false
		}
		return v.(verbsio.MemoryRegion), true
	}
}

func regionOf(a *alloc.Arena) (verbsio.MemoryRegion, bool) { return regionIn(0)(a) }

// side is one end: device, protection domain, registered pool, channel,
// and the devices of its extra rails.
type side struct {
	dev   verbsio.Device
	pd    verbsio.ProtectionDomain
	pool  *alloc.Pool
	mem   Memory
	ch    *Channel
	rdevs []verbsio.Device
	rpds  []verbsio.ProtectionDomain
	// after run once the channel is closed, before the pool (a proxy and
	// its pinned pool).
	after []func() error
}

func (s *side) close() error {
	var errs []error
	if s.ch != nil {
		errs = append(errs, s.ch.Close())
	}
	for _, f := range s.after {
		errs = append(errs, f())
	}
	s.after = nil
	if s.pool != nil {
		errs = append(errs, s.pool.Close())
	}
	for _, pd := range append([]verbsio.ProtectionDomain{s.pd}, s.rpds...) {
		if pd != nil {
			errs = append(errs, pd.Close())
		}
	}
	for _, d := range append([]verbsio.Device{s.dev}, s.rdevs...) {
		if d != nil {
			errs = append(errs, d.Close())
		}
	}
	return errors.Join(errs...)
}

// openSide opens provider's device and makes a channel; it returns an error
// wrapping verbsio.ErrNoDevice or ErrNotSupported when the provider cannot
// run here. GDRLINK_RDV_LISTEN (comma-separated "host:port") gives the
// listen address of the device and of one extra rail per further address.
func openSide(provider, name string, opts ...Option) (*side, error) {
	var listen []string
	if v := os.Getenv("GDRLINK_RDV_LISTEN"); v != "" {
		listen = strings.Split(v, ",")
	}
	return openSideRails(provider, name, listen, opts...)
}

// openSideRails is openSide with listen addresses given: the first for the
// channel's device, each further one for an extra rail's device.
func openSideRails(provider, name string, listen []string, opts ...Option) (*side, error) {
	return openSideReg(provider, name, listen, frontDoorRegistration, opts...)
}

// openArenaKeySide is openSide with its arenas registered for remote write
// whatever the device: for a peer that hands out arena rkeys by hand.
func openArenaKeySide(provider, name string, opts ...Option) (*side, error) {
	return openSideReg(provider, name, nil, func(_ verbsio.Device, pd verbsio.ProtectionDomain, rail int) alloc.Visitor {
		return registration(pd, rail)
	}, opts...)
}

// openSideReg is openSideRails with each device's registration visitor
// made by reg.
func openSideReg(provider, name string, listen []string, reg func(verbsio.Device, verbsio.ProtectionDomain, int) alloc.Visitor, opts ...Option) (*side, error) {
	cfg, err := verbsio.ConfigFromEnv()
	if err != nil {
		return nil, err
	}
	s := &side{}
	devCfg := func(i int) verbsio.Config {
		c := cfg
		if i < len(listen) {
			c.ListenAddr = listen[i]
		}
		return c
	}
	if s.dev, err = verbsio.Open(provider, devCfg(0)); err != nil {
		return nil, err
	}
	if s.pd, err = s.dev.AllocPD(); err != nil {
		_ = s.close()
		return nil, err
	}
	visitors := []alloc.Visitor{reg(s.dev, s.pd, 0)}
	for i := 1; i < len(listen); i++ {
		d, err := verbsio.Open(provider, devCfg(i))
		if err != nil {
			_ = s.close()
			return nil, err
		}
		s.rdevs = append(s.rdevs, d)
		pd, err := d.AllocPD()
		if err != nil {
			_ = s.close()
			return nil, err
		}
		s.rpds = append(s.rpds, pd)
		visitors = append(visitors, reg(d, pd, i))
	}
	s.pool, err = alloc.New(alloc.NewMmapSource(alloc.MmapOptions{NUMANode: -1}), alloc.WithVisitors(visitors...), alloc.WithName(name))
	if err != nil {
		_ = s.close()
		return nil, err
	}
	s.mem = PoolMemory(regionOf, s.pool)
	for i := range s.rdevs {
		opts = append(opts, WithRail(s.rdevs[i], s.rpds[i], PoolMemory(regionIn(i+1), s.pool)))
	}
	if s.ch, err = New(s.dev, s.pd, s.mem, append([]Option{WithName(name)}, opts...)...); err != nil {
		_ = s.close()
		return nil, err
	}
	return s, nil
}

// pair makes two connected sides in this process.
func pair(t *testing.T, provider string, opts ...Option) (a, b *side) {
	t.Helper()
	return pairRails(t, provider, nil, nil, opts...)
}

// pairRails is pair with the listen addresses of each side's devices.
func pairRails(t *testing.T, provider string, listenA, listenB []string, opts ...Option) (a, b *side) {
	t.Helper()
	a, err := openSideRails(provider, "a", listenA, opts...)
	if err != nil {
		skipUnavailable(t, provider, err)
	}
	b, err = openSideRails(provider, "b", listenB, opts...)
	if err != nil {
		_ = a.close()
		skipUnavailable(t, provider, err)
	}
	t.Cleanup(func() {
		if err := b.close(); err != nil {
			t.Errorf("closing b: %v", err)
		}
		if err := a.close(); err != nil {
			t.Errorf("closing a: %v", err)
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := connectSides(ctx, a, b); err != nil {
		t.Fatalf("connect: %v", err)
	}
	return a, b
}

// seedOf derives a pattern seed from key and step.
func seedOf(key string, step int64) byte {
	h := fnv.New32a()
	fmt.Fprintf(h, "%s/%d", key, step)
	return byte(h.Sum32())
}

func fill(b []byte, seed byte) {
	for i := range b {
		b[i] = seed + byte(i*7) + byte(i>>8)
	}
}

func checkFill(b []byte, seed byte) error {
	for i := range b {
		if want := seed + byte(i*7) + byte(i>>8); b[i] != want {
			return fmt.Errorf("byte %d of %d is %#x, want %#x", i, len(b), b[i], want)
		}
	}
	return nil
}

// makeTensor makes a tensor of kind ("float32", "dead:int8", "string", ...)
// and shape in pool, filled with the pattern of key and step.
func makeTensor(pool *alloc.Pool, kind string, shape tensor.Shape, key string, step int64) (*tensor.Tensor, error) {
	if d, ok := strings.CutPrefix(kind, "dead:"); ok {
		dt, err := tensor.ParseDType(d)
		if err != nil {
			return nil, err
		}
		return tensor.Dead(dt, shape), nil
	}
	dt, err := tensor.ParseDType(kind)
	if err != nil {
		return nil, err
	}
	if dt == tensor.String {
		n, err := shape.NumElements()
		if err != nil {
			return nil, err
		}
		vals := make([]string, n)
		seed := seedOf(key, step)
		for i := range vals {
			vals[i] = strings.Repeat(string(rune('a'+(int(seed)+i)%26)), i%5) + fmt.Sprint(i)
		}
		return tensor.NewStrings(shape, vals)
	}
	meta, err := tensor.MetaFor(dt, shape)
	if err != nil {
		return nil, err
	}
	t, err := pool.NewTensor(meta)
	if err != nil {
		return nil, err
	}
	b, err := t.Bytes()
	if err != nil {
		return nil, err
	}
	fill(b, seedOf(key, step))
	return t, nil
}

// checkTensor verifies a received tensor against makeTensor's.
func checkTensor(t *tensor.Tensor, kind string, shape tensor.Shape, key string, step int64) error {
	if kind != "string" && !strings.HasPrefix(kind, "dead:") {
		dt, err := tensor.ParseDType(kind)
		if err != nil {
			return err
		}
		meta, err := tensor.MetaFor(dt, shape)
		if err != nil {
			return err
		}
		if !t.Meta().Equal(meta) {
			return fmt.Errorf("meta-data %v, want %v", t.Meta(), meta)
		}
		b, err := t.Bytes()
		if err != nil {
			return err
		}
		return checkFill(b, seedOf(key, step))
	}
	want, err := makeTensor(nil, kind, shape, key, step)
	if err != nil {
		return err
	}
	if !t.Meta().Equal(want.Meta()) {
		return fmt.Errorf("meta-data %v, want %v", t.Meta(), want.Meta())
	}
	if kind == "string" {
		got, err := t.Strings()
		if err != nil {
			return err
		}
		exp, _ := want.Strings()
		for i := range exp {
			if got[i] != exp[i] {
				return fmt.Errorf("string %d is %q, want %q", i, got[i], exp[i])
			}
		}
	}
	return nil
}

// connectSides connects a's and b's channels to each other, both at once
// (each Connect waits for the other side), and returns their errors.
func connectSides(ctx context.Context, a, b *side) error {
	var wg sync.WaitGroup
	var ea, eb error
	ha, hb := a.ch.Hello(), b.ch.Hello()
	wg.Add(2)
	go func() { defer wg.Done(); ea = a.ch.Connect(ctx, hb) }()
	go func() { defer wg.Done(); eb = b.ch.Connect(ctx, ha) }()
	wg.Wait()
	if ea != nil || eb != nil {
		return fmt.Errorf("%v / %v", ea, eb)
	}
	return nil
}

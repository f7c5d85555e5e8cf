package rendezvous_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/alloc/visitor"
	"github.com/gdrlink/gdrlink/rendezvous"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
	_ "github.com/gdrlink/gdrlink/verbsio/tcp"
)

// connectEndpoints trades hellos between two endpoints of this process.
func connectEndpoints(ctx context.Context, a, b *rendezvous.Endpoint) error {
	ha, hb := a.Channel.Hello(), b.Channel.Hello()
	errc := make(chan error, 1)
	go func() { errc <- a.Channel.Connect(ctx, hb) }()
	return errors.Join(b.Channel.Connect(ctx, ha), <-errc)
}

func TestOpenEndpoint(t *testing.T) {
	cfg := rendezvous.EndpointConfig{Provider: "tcp", Verbs: &verbsio.Config{}, Pool: []alloc.Option{alloc.WithInitialArena(1 << 20)}}
	a, err := rendezvous.OpenEndpoint(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = a.Close() })
	b, err := rendezvous.OpenEndpoint(cfg)
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

func TestOpenEndpointUnknownProvider(t *testing.T) {
	_, err := rendezvous.OpenEndpoint(rendezvous.EndpointConfig{Provider: "no-such-provider", Verbs: &verbsio.Config{}})
	if !errors.Is(err, verbsio.ErrNoProvider) {
		t.Fatalf("err = %v, want ErrNoProvider", err)
	}
}

func TestOpenEndpointBadPoolOption(t *testing.T) {
	// A pool that cannot be built leaves nothing open: the device's close
	// would report live children otherwise.
	_, err := rendezvous.OpenEndpoint(rendezvous.EndpointConfig{Provider: "tcp", Verbs: &verbsio.Config{}, Pool: []alloc.Option{alloc.WithInitialArena(0)}})
	if !errors.Is(err, alloc.ErrBadOption) {
		t.Fatalf("err = %v, want alloc.ErrBadOption", err)
	}
	if errors.Is(err, verbsio.ErrBusy) {
		t.Fatalf("cleanup after the failure left children open: %v", err)
	}
}

// OpenEndpoint builds what a process needs to exchange tensors: a device of
// a provider, a pool registered arena by arena, and a channel.
func ExampleOpenEndpoint() {
	cfg := rendezvous.EndpointConfig{Provider: "tcp", Verbs: &verbsio.Config{}}
	sender, err := rendezvous.OpenEndpoint(cfg)
	if err != nil {
		panic(err)
	}
	defer sender.Close()
	receiver, err := rendezvous.OpenEndpoint(cfg)
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
	// Output: [1 2 3 4] direct registered: true
}

package rendezvous_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/alloc/visitor"
	"github.com/gdrlink/gdrlink/rendezvous"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
	_ "github.com/gdrlink/gdrlink/verbsio/tcp"
)

// endpoint opens the tcp provider's device and a pool whose arenas are
// registered with it once, by the memory-registration visitor, and makes a
// channel.
func endpoint(name string) (*rendezvous.Channel, *alloc.Pool, func()) {
	dev, err := verbsio.Open("tcp", verbsio.DefaultConfig())
	if err != nil {
		panic(err)
	}
	pd, err := dev.AllocPD()
	if err != nil {
		panic(err)
	}
	reg := visitor.NewMemoryRegistration(pd, verbsio.AccessLocalWrite|verbsio.AccessRemoteWrite)
	pool, err := alloc.New(alloc.NewMmapSource(alloc.MmapOptions{}), alloc.WithVisitors(reg))
	if err != nil {
		panic(err)
	}
	ch, err := rendezvous.New(dev, pd, rendezvous.PoolMemory(reg.RegionOf, pool), rendezvous.WithName(name))
	if err != nil {
		panic(err)
	}
	return ch, pool, func() { ch.Close(); pool.Close(); pd.Close(); dev.Close() }
}

// Two channels in one process stand for two hosts: the sender sends a
// tensor from its registered pool, the receiver gets it written straight
// into a result tensor of its own pool.
func Example() {
	sender, pool, closeSender := endpoint("worker-0")
	defer closeSender()
	receiver, _, closeReceiver := endpoint("worker-1")
	defer closeReceiver()

	// A bootstrap (internal/bootstrap) carries the hellos between processes.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	hs, hr := sender.Hello(), receiver.Hello()
	errc := make(chan error, 1)
	go func() { errc <- sender.Connect(ctx, hr) }()
	if err := receiver.Connect(ctx, hs); err != nil {
		panic(err)
	}
	if err := <-errc; err != nil {
		panic(err)
	}

	for step := int64(0); step < 2; step++ {
		meta, _ := tensor.MetaFor(tensor.Float32, tensor.Shape{2, 3})
		src, _ := pool.NewTensor(meta)
		vals, _ := tensor.View[float32](src)
		for i := range vals {
			vals[i] = float32(step*10) + float32(i)
		}
		// Send never waits for the network; the channel releases src.
		// A tensor this small, sent before its Recv asks, goes eagerly
		// in a control message (path eager); a larger one is written
		// into the Recv's result (path direct).
		if err := sender.Send("layer0/out", step, src); err != nil {
			panic(err)
		}
		got, tr, err := receiver.Recv(ctx, "layer0/out", step)
		if err != nil {
			panic(err)
		}
		v, _ := tensor.View[float32](got)
		fmt.Println(tr.Meta, v, "path:", tr.Path, "meta-data round trip:", tr.MetaRoundTrip)
		got.Release()
	}
	// Output:
	// float32[2 3] 24 B [0 1 2 3 4 5] path: eager meta-data round trip: false
	// float32[2 3] 24 B [10 11 12 13 14 15] path: eager meta-data round trip: false
}

// Checksum mode is on by default where bytes cross a network that may
// change them unnoticed; WithChecksum chooses for a channel.
func ExampleDefaultChecksum() {
	for _, p := range []string{"tcp", "onnode", "ibverbs"} {
		fmt.Printf("%s: %v\n", p, rendezvous.DefaultChecksum(p))
	}
	fmt.Println("tries at most:", 1+rendezvous.MaxChecksumRetries)
	// Output:
	// tcp: true
	// onnode: false
	// ibverbs: false
	// tries at most: 3
}

// A Recv whose tensor arrived corrupted on every try fails with a
// *ChecksumError naming the sender; it matches ErrChecksum.
func ExampleChecksumError() {
	var err error = &rendezvous.ChecksumError{Peer: "rank 1", Key: "grad", Step: 7, Tries: 3, Got: 0x1234, Want: 0x5678}
	var ce *rendezvous.ChecksumError
	if errors.As(err, &ce) && errors.Is(err, rendezvous.ErrChecksum) {
		fmt.Println(ce.Peer, ce.Tries)
	}
	// Output: rank 1 3
}

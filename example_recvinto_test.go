package gdrlink_test

import (
	"context"
	"fmt"
	"log"
	"net"
	"sync"

	"github.com/gdrlink/gdrlink"
	"github.com/gdrlink/gdrlink/tensor"
)

// ExampleGroup_RecvInto receives into a tensor the receiver already has
// (a layer's input buffer, say): the sender writes it itself. Both ranks
// are goroutines of this process here, as in Example.
func ExampleGroup_RecvInto() {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		log.Fatal(err)
	}
	run := func(rank int) error {
		opts := []gdrlink.Option{gdrlink.WithRank(rank, 2), gdrlink.WithRoot(ln.Addr().String())}
		if rank == 0 {
			opts = append(opts, gdrlink.WithRootListener(ln))
		}
		ctx := context.Background()
		g, err := gdrlink.Join(ctx, opts...)
		if err != nil {
			return err
		}
		defer g.Close()
		if rank == 0 {
			t, _ := g.NewTensor(tensor.Float32, 2, 3)
			v, _ := tensor.View[float32](t)
			for i := range v {
				v[i] = float32(10 * i)
			}
			err = g.Send(1, "layer1/in", 0, t)
		} else {
			in, _ := g.NewTensor(tensor.Float32, 2, 3) // kept from step to step
			defer in.Release()
			var tr gdrlink.Transfer
			if tr, err = g.RecvInto(ctx, in, 0, "layer1/in", 0); err == nil {
				v, _ := tensor.View[float32](in)
				fmt.Println(v, tr.Placed) // Placed: written by the peer, no copy
			}
		}
		if err != nil {
			return err
		}
		return g.Barrier(ctx)
	}
	var wg sync.WaitGroup
	for rank := range 2 {
		wg.Go(func() {
			if err := run(rank); err != nil {
				log.Fatal(err)
			}
		})
	}
	wg.Wait()
	// Output: [0 10 20 30 40 50] true
}

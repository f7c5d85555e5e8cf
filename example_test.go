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

// exchange is what each rank of a job runs: rank 0 sends a tensor, rank 1
// receives it. The README's "Using it" is this function.
func exchange(ctx context.Context, opts ...gdrlink.Option) error {
	g, err := gdrlink.Join(ctx, opts...) // no options under mpirun, srun or torchrun
	if err != nil {
		return err
	}
	defer g.Close()
	if g.Rank() == 0 {
		t, _ := g.NewTensor(tensor.Float32, 2, 3) // registered already: its arena was, once
		v, _ := tensor.View[float32](t)
		for i := range v {
			v[i] = float32(i)
		}
		err = g.Send(1, "layer0/out", 0, t) // never waits on the network
	} else {
		// Into a pool tensor: written there by the sender, or, a small
		// tensor sent before the Recv asked, copied there from the
		// message that brought it (tr.Path says which).
		t, tr, err := g.Recv(ctx, 0, "layer0/out", 0)
		if err != nil {
			return err
		}
		v, _ := tensor.View[float32](t)
		fmt.Println(v, tr.Bytes, "bytes")
		t.Release() // back to the pool
	}
	if err != nil {
		return err
	}
	return g.Barrier(ctx) // nobody closes while a peer still receives
}

// Example runs a job of two ranks. A real job runs one process per rank;
// here both are goroutines of this process, told their rank and the root
// listener by options instead of a launcher's environment.
func Example() {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		log.Fatal(err)
	}
	var wg sync.WaitGroup
	for rank := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			opts := []gdrlink.Option{gdrlink.WithRank(rank, 2), gdrlink.WithRoot(ln.Addr().String())}
			if rank == 0 {
				opts = append(opts, gdrlink.WithRootListener(ln))
			}
			if err := exchange(context.Background(), opts...); err != nil {
				log.Fatal(err)
			}
		}()
	}
	wg.Wait()
	// Output: [0 1 2 3 4 5] 24 bytes
}

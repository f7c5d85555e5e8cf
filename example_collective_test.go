package gdrlink_test

import (
	"context"
	"fmt"
	"log"
	"net"
	"sync"
	"time"

	"github.com/gdrlink/gdrlink"
	"github.com/gdrlink/gdrlink/tensor"
)

// allReduce is what each rank runs: its own gradient in, the average of
// every rank's out, the same bits on every rank.
func allReduce(ctx context.Context, opts ...gdrlink.Option) error {
	g, err := gdrlink.Join(ctx, opts...)
	if err != nil {
		return err
	}
	defer g.Close()
	grad, _ := g.NewTensor(tensor.Float32, 4) // a pool tensor: its pieces go out without a copy
	defer grad.Release()
	v, _ := tensor.View[float32](grad)
	for i := range v {
		v[i] = float32(g.Rank()+1) * float32(i) // rank r holds (r+1)·i
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second) // bounds the call, dead ranks included
	defer cancel()
	rep, err := g.AllReduce(ctx, grad, gdrlink.Average) // in place
	if err != nil {
		return err // a *collective.RankError names the rank at fault
	}
	if g.Rank() == 0 {
		fmt.Println(v, rep.Backend, rep.Ranks, "ranks")
	}
	return g.Barrier(ctx)
}

// Three ranks average a tensor. As in Example, the ranks are goroutines
// of one process here; a real job runs one process per rank.
func ExampleGroup_AllReduce() {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		log.Fatal(err)
	}
	const size = 3
	var wg sync.WaitGroup
	for rank := range size {
		wg.Go(func() {
			opts := []gdrlink.Option{gdrlink.WithRank(rank, size), gdrlink.WithRoot(ln.Addr().String())}
			if rank == 0 {
				opts = append(opts, gdrlink.WithRootListener(ln))
			}
			if err := allReduce(context.Background(), opts...); err != nil {
				log.Fatal(err)
			}
		})
	}
	wg.Wait()
	// Output: [0 2 4 6] ring 3 ranks
}

package bootstrap_test

import (
	"context"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/gdrlink/gdrlink/internal/bootstrap"
	"github.com/gdrlink/gdrlink/verbsio"
	_ "github.com/gdrlink/gdrlink/verbsio/tcp"
)

// Three ranks (goroutines here; processes started by mpirun, srun or
// torchrun in a job, each calling bootstrap.FromEnv) join, connect a queue
// pair to every peer over the tcp provider, and meet at a barrier.
func Example() {
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	const size = 3
	var wg sync.WaitGroup
	out := make([]string, size)
	for rank := 0; rank < size; rank++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			cfg := bootstrap.Config{Rank: rank, Size: size, Root: ln.Addr().String()}
			if rank == 0 {
				cfg.Listener = ln
			}
			g, err := bootstrap.Join(ctx, cfg)
			if err != nil {
				out[rank] = err.Error()
				return
			}
			defer g.Close()
			dev, err := verbsio.Open("tcp", verbsio.Config{})
			if err != nil {
				out[rank] = err.Error()
				return
			}
			defer dev.Close()
			mesh, err := bootstrap.ConnectAll(ctx, g, dev, bootstrap.MeshOptions{})
			if err != nil {
				out[rank] = err.Error()
				return
			}
			defer mesh.Close()
			ready := 0
			for _, qp := range mesh.QPs {
				if qp != nil && qp.State() == verbsio.QPReady {
					ready++
				}
			}
			if err := g.Barrier(ctx); err != nil {
				out[rank] = err.Error()
				return
			}
			out[rank] = fmt.Sprintf("rank %d: %d queue pairs ready", rank, ready)
		}()
	}
	wg.Wait()
	for _, s := range out {
		fmt.Println(s)
	}
	// Output:
	// rank 0: 2 queue pairs ready
	// rank 1: 2 queue pairs ready
	// rank 2: 2 queue pairs ready
}

package gdrlink_test

import (
	"context"
	"log"
	"net"
	"sync"
	"time"

	"github.com/gdrlink/gdrlink"
)

// A job whose ranks may stand still for up to two minutes (a debugger's
// breakpoint, a long checkpoint) without their peers giving up on them;
// GDRLINK_PEER_TIMEOUT=2m does the same. Every rank uses the same value.
func ExampleWithPeerTimeout() {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		log.Fatal(err)
	}
	var wg sync.WaitGroup
	for rank := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			opts := []gdrlink.Option{gdrlink.WithRank(rank, 2), gdrlink.WithRoot(ln.Addr().String()), gdrlink.WithPeerTimeout(2 * time.Minute)}
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

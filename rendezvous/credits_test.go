package rendezvous

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/tensor"
)

// With the smallest ring and one send buffer, traffic both ways at once
// still flows (credits come back piggybacked or alone), and once it stops
// the channel falls silent: no CREDIT answers a CREDIT.
func TestSmallestRingBothWays(t *testing.T) {
	forEachProvider(t, func(t *testing.T, provider string) {
		a, b := pair(t, provider, WithRing(minRing), withSendSlots(1))
		ctx := recvCtx(t)
		const n = 300
		var wg sync.WaitGroup
		errc := make(chan error, 2*n)
		exchange := func(from, to *side, prefix string) {
			for i := 0; i < n; i++ {
				key := fmt.Sprint(prefix, i%10)
				step := int64(i / 10)
				to.ch.RecvFunc(ctx, key, step, func(got *tensor.Tensor, _ Transfer, err error) {
					defer wg.Done()
					if err == nil {
						err = checkTensor(got, "float32", tensor.Shape{17}, key, step)
						_ = got.Release()
					}
					if err != nil {
						errc <- err
					}
				})
				src, err := makeTensor(from.pool, "float32", tensor.Shape{17}, key, step)
				if err != nil {
					errc <- err
					continue // its Recv fails at the test's deadline
				}
				if err := from.ch.Send(key, step, src); err != nil {
					errc <- err
				}
			}
		}
		wg.Add(2 * n)
		go exchange(a, b, "ab")
		go exchange(b, a, "ba")
		wg.Wait()
		close(errc)
		for err := range errc {
			t.Fatal(err)
		}
		time.Sleep(50 * time.Millisecond)
		before := a.ch.Stats().ControlOut + b.ch.Stats().ControlOut
		time.Sleep(100 * time.Millisecond)
		if after := a.ch.Stats().ControlOut + b.ch.Stats().ControlOut; after != before {
			t.Fatalf("idle channel sent %d control messages", after-before)
		}
	})
}

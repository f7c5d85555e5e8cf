package onnode

import (
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/internal/spintest"
	"github.com/gdrlink/gdrlink/verbsio"
)

// A Wait where polls yield keeps polling past the queue's own budget, and
// one that does not yield sleeps (spintest.LongPolls).
func TestYieldingWaitPollsLong(t *testing.T) {
	spintest.LongPolls(t, func(t *testing.T, yield bool, spin time.Duration) (verbsio.CompletionQueue, func() bool) {
		n, err := newNodeConfig(verbsio.Config{Yield: yield}, Options{Spin: spin})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(n.close)
		c := n.rcq.(*cq)
		return c, func() bool { return c.sleepers.Load() > 0 }
	})
}

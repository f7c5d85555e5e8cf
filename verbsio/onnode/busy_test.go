package onnode

import (
	"context"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/internal/adaptspin"
	"github.com/gdrlink/gdrlink/verbsio"
)

// yieldLoopback is loopback with a on a device whose polls yield the CPU
// (verbsio.Config.Yield, a host with more ranks than cores) and b on an
// ordinary one.
func yieldLoopback(t *testing.T, spin time.Duration) (a, b *node) {
	t.Helper()
	a, err := newNodeConfig(verbsio.Config{Yield: true}, Options{Spin: spin})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(a.close)
	if b, err = newNode(Options{Spin: spin}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.close)
	if err := connectLocal(t, a, b); err != nil {
		t.Fatal(err)
	}
	return a, b
}

// waitIn starts a Wait on q that ends with ctx and returns its outcome.
func waitIn(ctx context.Context, q verbsio.CompletionQueue) chan error {
	done := make(chan error, 1)
	go func() {
		var out [1]verbsio.Completion
		_, err := q.Wait(ctx, out[:])
		done <- err
	}()
	return done
}

// Where polls yield, a wait on a queue that gets nothing keeps polling
// while another queue of its device returns completions, four of its own
// long polls and more, and sleeps once the device has been quiet for one.
// (The long poll is 50 ms here, so that a loaded host's gaps between the
// SENDs stay well inside it.)
func TestBusyDeviceKeepsWaitsPolling(t *testing.T) {
	const spin = 2 * time.Millisecond
	long := adaptspin.LongFactor * spin
	a, b := yieldLoopback(t, spin)
	b.rcq.(*cq).poll(true) // b's receives are polled for: no signals
	defer b.rcq.(*cq).poll(false)
	bufs := sendBuffers(t, a, b)
	idle := a.rcq.(*cq)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	done := waitIn(ctx, idle)
	start := time.Now()
	last := start
	for time.Since(start) < 4*long {
		bufs.send(t, true) // a's send queue's Wait returns a completion
		if gap := time.Since(last); gap > long/2 {
			t.Skipf("a SEND took %v, half the long poll of %v: the host is too loaded for this test", gap, long)
		}
		last = time.Now()
		if idle.sleepers.Load() > 0 {
			t.Fatalf("the idle queue's wait slept %v into its wait while the device's other queue completed SENDs (its own long poll %v)", time.Since(start), long)
		}
	}
	quiet := time.Now()
	for idle.sleepers.Load() == 0 {
		if time.Since(quiet) > 2*time.Second {
			t.Fatalf("the idle queue's wait still polls %v after the device's last completion (long poll %v)", time.Since(quiet), long)
		}
		time.Sleep(spin)
	}
	cancel()
	if err := <-done; err == nil {
		t.Error("the idle wait returned no error at its context's end")
	}
}

// A wait that polls wakes a sleeping wait of its device whose completion
// is ready, even when nothing else would: here the sleeper's ring says it
// polls, so the sender does not signal it (as when the process's network
// poller, which would take the signal, is not served because every Go
// processor polls).
func TestPollingWaitWakesSleeper(t *testing.T) {
	const spin = 2 * time.Millisecond // a long poll of 50 ms
	a, b := yieldLoopback(t, spin)
	sleeper := a.rcq.(*cq)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dst, err := a.register("anon", 4096, verbsio.AccessLocalWrite, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := a.qp.PostRecv([]verbsio.RecvWR{{WRID: 1, SG: []verbsio.SGE{{Addr: dst.Addr(), Length: 4096, LKey: dst.LKey()}}}}); err != nil {
		t.Fatal(err)
	}
	got := make(chan verbsio.Completion, 1)
	go func() {
		var out [1]verbsio.Completion
		if _, err := sleeper.Wait(ctx, out[:]); err != nil {
			t.Error(err)
		}
		got <- out[0]
	}()
	for sleeper.sleepers.Load() == 0 {
		time.Sleep(spin)
	}
	a.qp.(*qp).setSleep(0) // the sender will not signal
	pctx, pcancel := context.WithCancel(ctx)
	defer pcancel()
	polling := waitIn(pctx, a.scq) // polls for its own long poll
	src, err := b.register("anon", 4096, verbsio.AccessLocalWrite, 9)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.qp.PostSend([]verbsio.SendWR{{WRID: 2, Op: verbsio.OpSend, SG: []verbsio.SGE{{Addr: src.Addr(), Length: 8, LKey: src.LKey()}}}}); err != nil {
		t.Fatal(err)
	}
	select {
	case c := <-got:
		if c.Status != verbsio.StatusSuccess || c.Op != verbsio.OpRecv || c.WRID != 1 {
			t.Fatalf("the sleeper's completion: %+v", c)
		}
	case <-time.After(adaptspin.LongFactor * spin):
		t.Fatalf("the sleeping wait was not woken within %v of the SEND while another wait of its device polled", adaptspin.LongFactor*spin)
	}
	pcancel()
	<-polling
}

package gdrlink

import (
	"context"
	"errors"
	"fmt"
	"net"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

// brokenPD makes queue pairs whose Connect fails: a provider that is
// usable on paper but cannot connect this pair.
type brokenPD struct{ verbsio.ProtectionDomain }

func (b brokenPD) CreateQP(cfg verbsio.QPConfig) (verbsio.QueuePair, error) {
	qp, err := b.ProtectionDomain.CreateQP(cfg)
	return brokenQP{qp}, err
}

type brokenQP struct{ verbsio.QueuePair }

func (brokenQP) Connect(context.Context, verbsio.Endpoint) error {
	return fmt.Errorf("%w: connection refused for the test", verbsio.ErrPeerLost)
}

// joinPair joins two ranks in this process.
func joinPair(t *testing.T, opts ...Option) [2]*Group {
	t.Helper()
	gs := joinRanks(t, 2, opts...)
	return [2]*Group{gs[0], gs[1]}
}

// joinRanks joins n ranks in this process.
func joinRanks(t *testing.T, n int, opts ...Option) []*Group {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	gs := make([]*Group, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for r := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			o := append([]Option{WithRank(r, n), WithRoot(ln.Addr().String())}, opts...)
			if r == 0 {
				o = append(o, WithRootListener(ln))
			}
			gs[r], errs[r] = Join(ctx, o...)
		}()
	}
	wg.Wait()
	for r, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: %v", r, err)
		}
	}
	return gs
}

// TestFallback: when the best provider of a pair cannot connect (on
// either side), the pair connects over the next one (ibverbs where this
// host has an RDMA device, else tcp), and the transfer works and says
// which.
func TestFallback(t *testing.T) {
	for _, broken := range []int{0, 1} {
		t.Run(fmt.Sprintf("broken-at-rank-%d", broken), func(t *testing.T) {
			gs := joinPair(t, WithConnectTimeout(20*time.Second))
			d := gs[broken].devs["onnode"]
			if d == nil {
				t.Fatalf("onnode not opened: devices %v", gs[broken].providerNames())
			}
			d.pd = brokenPD{d.pd}
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			src, err := gs[0].NewTensor(tensor.Int32, 1000)
			if err != nil {
				t.Fatal(err)
			}
			v, _ := tensor.View[int32](src)
			for i := range v {
				v[i] = int32(i * 3)
			}
			start := time.Now()
			if err := gs[0].Send(1, "x", 0, src); err != nil {
				t.Fatal(err)
			}
			got, tr, err := gs[1].Recv(ctx, 0, "x", 0)
			if err != nil {
				t.Fatal(err)
			}
			w, _ := tensor.View[int32](got)
			for i := range w {
				if w[i] != int32(i*3) {
					t.Fatalf("element %d = %d", i, w[i])
				}
			}
			got.Release()
			next := gs[0].peers[1].cands[1] // the pair's second choice: ibverbs where there is a device, else tcp
			if tr.Provider != next {
				t.Errorf("transfer over %s, want %s after onnode failed", tr.Provider, next)
			}
			if took := time.Since(start); took > 10*time.Second {
				t.Errorf("falling back took %v: a failed attempt waited out a timeout", took)
			}
			for r, g := range gs {
				if s := g.Stats(); s.Connections[next] != 1 || len(s.Connections) != 1 {
					t.Errorf("rank %d connections %v, want one over %s", r, s.Connections, next)
				}
			}
			for r, g := range gs {
				if err := g.Close(); err != nil {
					t.Errorf("rank %d Close: %v", r, err)
				}
			}
		})
	}
}

// TestGiveUp: when no provider can connect a pair, both ranks get the
// error (the higher one from the lower one's give-up), queued Sends are
// released, and the group still closes cleanly.
func TestGiveUp(t *testing.T) {
	gs := joinPair(t, WithProvider("onnode"), WithConnectTimeout(20*time.Second))
	gs[0].devs["onnode"].pd = brokenPD{gs[0].devs["onnode"].pd}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	src, err := gs[1].NewTensor(tensor.Float32, 16)
	if err != nil {
		t.Fatal(err)
	}
	if err := gs[1].Send(0, "y", 0, src); err != nil {
		t.Fatal(err)
	}
	if _, _, err := gs[0].Recv(ctx, 1, "y", 0); !errors.Is(err, verbsio.ErrPeerLost) {
		t.Errorf("rank 0 Recv: %v, want the connect error (ErrPeerLost)", err)
	}
	if _, _, err := gs[1].Recv(ctx, 0, "z", 0); err == nil {
		t.Errorf("rank 1 Recv succeeded with no connection")
	}
	deadline := time.Now().Add(5 * time.Second)
	for gs[1].Stats().Pool.Blocks != 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if n := gs[1].Stats().Pool.Blocks; n != 0 {
		t.Errorf("rank 1 holds %d pool blocks after the give-up: the queued Send was not released", n)
	}
	for r, g := range gs {
		if err := g.Close(); err != nil {
			t.Errorf("rank %d Close: %v", r, err)
		}
	}
}

// stuckPD makes queue pairs whose Connect waits until its context ends: a
// peer that never answers.
type stuckPD struct{ verbsio.ProtectionDomain }

func (s stuckPD) CreateQP(cfg verbsio.QPConfig) (verbsio.QueuePair, error) {
	qp, err := s.ProtectionDomain.CreateQP(cfg)
	return stuckQP{qp}, err
}

type stuckQP struct{ verbsio.QueuePair }

func (stuckQP) Connect(ctx context.Context, _ verbsio.Endpoint) error {
	<-ctx.Done()
	return fmt.Errorf("%w: %w", verbsio.ErrTimeout, ctx.Err())
}

// TestCloseWhileConnecting: closing both ranks while their connection hangs
// ends the waiting Recv with ErrClosed and returns at once, without waiting
// out the connect timeout, and leaves no goroutine behind.
func TestCloseWhileConnecting(t *testing.T) {
	for _, prov := range []string{"onnode", "tcp"} {
		t.Run(prov, func(t *testing.T) { closeWhileConnecting(t, prov) })
	}
}

func closeWhileConnecting(t *testing.T, prov string) {
	before := runtime.NumGoroutine()
	gs := joinPair(t, WithProvider(prov), WithConnectTimeout(time.Minute))
	gs[0].devs[prov].pd = stuckPD{gs[0].devs[prov].pd}
	errc := make(chan error, 1)
	go func() {
		_, _, err := gs[1].Recv(context.Background(), 0, "never", 0)
		errc <- err
	}()
	time.Sleep(200 * time.Millisecond) // the attempt is under way
	start := time.Now()
	for r, g := range gs {
		if err := g.Close(); err != nil {
			t.Errorf("rank %d Close: %v", r, err)
		}
	}
	select {
	case err := <-errc:
		if !errors.Is(err, ErrClosed) {
			t.Errorf("the waiting Recv: %v, want ErrClosed", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the waiting Recv did not end after Close")
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Errorf("Close took %v while a connection hung", took)
	}
	deadline := time.Now().Add(5 * time.Second)
	for runtime.NumGoroutine() > before && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if n := runtime.NumGoroutine(); n > before {
		buf := make([]byte, 1<<16)
		t.Errorf("%d goroutines after Close, %d before:\n%s", n, before, buf[:runtime.Stack(buf, true)])
	}
}

package gdrlink

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/rendezvous"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

// stopJob: rank 0 sends step 0 of "x", meets rank 1 at a barrier, then
// stops itself (SIGSTOP) for good; rank 1 receives step 0, then waits for
// step 1 and prints "stopped-peer MS ERROR": how long after the barrier
// its Recv failed, and with what.
func stopJob(ctx context.Context, g *Group) error {
	if g.Rank() == 0 {
		t, err := g.NewTensor(tensor.Float32, 64)
		if err != nil {
			return err
		}
		if err := g.Send(1, "x", 0, t); err != nil {
			return err
		}
		if err := g.Barrier(ctx); err != nil {
			return err
		}
		// Repeated: a stop has been seen not to hold at once (the call
		// returned straight away for a few milliseconds). Nothing here
		// sends SIGCONT; the test kills this rank.
		for {
			if err := syscall.Kill(syscall.Getpid(), syscall.SIGSTOP); err != nil {
				return err
			}
		}
	}
	t, _, err := g.Recv(ctx, 0, "x", 0)
	if err != nil {
		return err
	}
	t.Release()
	if err := g.Barrier(ctx); err != nil {
		return err
	}
	start := time.Now()
	if _, _, err = g.Recv(ctx, 0, "x", 1); err == nil {
		return errors.New("step 1 arrived from a stopped rank")
	}
	fmt.Printf("stopped-peer %d %v\n", time.Since(start).Milliseconds(), strings.ReplaceAll(err.Error(), "\n", " "))
	if !errors.Is(err, rendezvous.ErrPeerTimeout) || !errors.Is(err, verbsio.ErrPeerLost) {
		return fmt.Errorf("Recv from the stopped rank: %w, want ErrPeerTimeout", err)
	}
	return nil
}

// A rank stopped (SIGSTOP) for longer than GDRLINK_PEER_TIMEOUT: the rank
// waiting on it fails its Recv with rendezvous.ErrPeerTimeout, naming the
// rank, within the timeout and a margin; the variable reaches the
// channels of every provider (ibverbs where a device is usable).
func TestPeerTimeoutEnvironment(t *testing.T) {
	const timeout, margin = 3 * time.Second, 5 * time.Second
	for _, provider := range []string{"tcp", "onnode", "ibverbs"} {
		t.Run(provider, func(t *testing.T) {
			if provider == "ibverbs" {
				p, err := verbsio.Lookup(provider)
				if err == nil {
					_, err = p.Devices()
				}
				if err != nil {
					if os.Getenv("GDRLINK_REQUIRE_RDMA") == "1" {
						t.Fatalf("GDRLINK_REQUIRE_RDMA=1 but ibverbs is not usable: %v", err)
					}
					t.Skipf("provider ibverbs not usable here: %v", err)
				}
			}
			j := startJob(t, "stop", 2, "127.0.0.1", func(int) []string { return nil }, func(int) []string {
				return []string{"GDRLINK_PROVIDER=" + provider, "GDRLINK_PEER_TIMEOUT=" + timeout.String()}
			})
			// Rank 1 ends; rank 0 stays stopped until the job's cleanup
			// kills it.
			done := make(chan error, 1)
			go func() { done <- j.cmds[1].Wait() }()
			select {
			case err := <-done:
				if err != nil {
					t.Fatalf("rank 1: %v: %s", err, j.errs[1].String())
				}
			case <-time.After(90 * time.Second):
				t.Fatal("rank 1 still runs after 90s")
			}
			_ = j.cmds[0].Process.Kill()
			_ = j.cmds[0].Wait()
			out := strings.TrimSpace(j.outs[1].String())
			f := strings.SplitN(out, " ", 3)
			if len(f) != 3 || f[0] != "stopped-peer" {
				t.Fatalf("rank 1 printed %q", out)
			}
			ms, _ := strconv.Atoi(f[1])
			after := time.Duration(ms) * time.Millisecond
			t.Logf("after %v: %s", after, f[2])
			if after < timeout/2 || after > timeout+margin {
				t.Fatalf("rank 1's Recv failed %v after rank 0 stopped, want about %v (at most %v more)", after, timeout, margin)
			}
			if !strings.Contains(f[2], "rank 0") {
				t.Fatalf("error %q does not name rank 0", f[2])
			}
		})
	}
}

package gdrlink

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

// deadPeerJob: the rank named by GDRLINK_TEST_VICTIM sends step 0 of "x",
// meets the other at a barrier and exits; the other receives step 0, then
// waits for step 1 and prints "dead-peer MS ERROR": how long after the
// barrier its Recv failed, and with what.
func deadPeerJob(ctx context.Context, g *Group) error {
	victim, err := strconv.Atoi(os.Getenv("GDRLINK_TEST_VICTIM"))
	if err != nil {
		return err
	}
	other := 1 - victim
	if g.Rank() == victim {
		t, err := g.NewTensor(tensor.Float32, 64)
		if err != nil {
			return err
		}
		if err := g.Send(other, "x", 0, t); err != nil {
			return err
		}
		if err := g.Barrier(ctx); err != nil {
			return err
		}
		os.Exit(0)
	}
	t, _, err := g.Recv(ctx, victim, "x", 0)
	if err != nil {
		return err
	}
	t.Release()
	if err := g.Barrier(ctx); err != nil {
		return err
	}
	start := time.Now()
	if _, _, err = g.Recv(ctx, victim, "x", 1); err == nil {
		return errors.New("step 1 arrived from a dead rank")
	}
	fmt.Printf("dead-peer %d %v\n", time.Since(start).Milliseconds(), strings.ReplaceAll(err.Error(), "\n", " "))
	if !errors.Is(err, verbsio.ErrPeerLost) {
		return fmt.Errorf("Recv from the dead rank: %w, want ErrPeerLost", err)
	}
	return nil
}

// TestDeadPeer: a rank whose peer's process exits fails its pending Recv
// with ErrPeerLost within seconds, whichever of the two is the lower rank
// (the one that makes the pair's connections: the other asks it to, and
// that call finds its port closed), over tcp and onnode. The job's copy
// of the root's listening socket is closed first, as no launcher keeps
// one: while it is open the dead root's port still accepts, and the
// survivor's call waits for an answer until its own deadline (30 s).
func TestDeadPeer(t *testing.T) {
	const limit = 5 * time.Second
	for _, provider := range []string{"tcp", "onnode"} {
		for victim := range 2 {
			t.Run(fmt.Sprintf("%s/rank%d-dies", provider, victim), func(t *testing.T) {
				j := startJob(t, "dead-peer", 2, "127.0.0.1", func(int) []string { return nil }, func(int) []string {
					return []string{"GDRLINK_PROVIDER=" + provider, "GDRLINK_TEST_VICTIM=" + strconv.Itoa(victim)}
				})
				j.rootFile.Close()
				survivor := 1 - victim
				done := make(chan error, 1)
				go func() { done <- j.cmds[survivor].Wait() }()
				select {
				case err := <-done:
					if err != nil {
						t.Fatalf("rank %d: %v: %s", survivor, err, j.errs[survivor].String())
					}
				case <-time.After(60 * time.Second):
					t.Fatalf("rank %d still runs after 60 s", survivor)
				}
				out := strings.TrimSpace(j.outs[survivor].String())
				f := strings.SplitN(out, " ", 3)
				if len(f) != 3 || f[0] != "dead-peer" {
					t.Fatalf("rank %d printed %q", survivor, out)
				}
				ms, _ := strconv.Atoi(f[1])
				after := time.Duration(ms) * time.Millisecond
				t.Logf("after %v: %s", after, f[2])
				if after > limit {
					t.Errorf("the Recv failed after %v, want within %v", after, limit)
				}
			})
		}
	}
}

package gdrlink

import (
	"bytes"
	"context"
	"encoding/json"

	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

// rejoinSteps tensors go from rank 1 to rank 0 in each life of rank 1.
const rejoinSteps = 3

// rejoinJob is rank 1 of TestRejoin: it sends rejoinSteps tensors from
// step GDRLINK_TEST_FROM, then either waits to be killed
// (GDRLINK_TEST_HOLD=1) or returns (the barrier follows in runChild).
func rejoinJob(ctx context.Context, g *Group, rep *childReport) error {
	from, _ := strconv.Atoi(os.Getenv("GDRLINK_TEST_FROM"))
	rep.Rejoined, rep.Incarnation = g.Rejoined(), g.boot.Incarnation(g.Rank())
	for step := from; step < from+rejoinSteps; step++ {
		t, err := g.NewTensor(tensor.Float32, 64<<10)
		if err != nil {
			return err
		}
		b, _ := t.Bytes()
		fill(b, step)
		if err := g.Send(0, "life", int64(step), t); err != nil {
			return err
		}
	}
	if os.Getenv("GDRLINK_TEST_HOLD") == "1" {
		fmt.Println("sent")
		<-ctx.Done() // until killed
		return ctx.Err()
	}
	return nil
}

// TestRejoin: rank 1 of a keyed job of two dies (SIGKILL) while rank 0
// waits on a Recv from it; the Recv fails naming the lost peer, and a new
// process started with rank 1's environment rejoins in its place
// (incarnation 2), and the stream resumes without restarting rank 0. A
// second process claiming rank 1 while its first process is alive is
// refused. On tcp and onnode (ibverbs in the Soft-RoCE guest).
func TestRejoin(t *testing.T) {
	for _, provider := range []string{"tcp", "onnode", "ibverbs"} {
		t.Run(provider, func(t *testing.T) {
			p, err := verbsio.Lookup(provider)
			if err == nil {
				_, err = p.Devices()
			}
			if err != nil {
				if os.Getenv("GDRLINK_REQUIRE_RDMA") == "1" {
					t.Fatalf("GDRLINK_REQUIRE_RDMA=1 but %s is not usable: %v", provider, err)
				}
				t.Skipf("skipping: provider %s not usable here: %v", provider, err)
			}
			testRejoin(t, provider)
		})
	}
}

func testRejoin(t *testing.T, provider string) {
	key, err := NewJobKey()
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	rank1 := func(extra ...string) (*exec.Cmd, *bytes.Buffer, *bytes.Buffer) {
		cmd := exec.Command(self, "-test.run=^$")
		cmd.Env = append(os.Environ(), "GDRLINK_TEST_JOB=rejoin", "GDRLINK_RANK=1", "GDRLINK_SIZE=2",
			"GDRLINK_ROOT="+ln.Addr().String(), "GDRLINK_JOB_KEY="+key, "GDRLINK_PROVIDER="+provider)
		cmd.Env = append(cmd.Env, extra...)
		var out, errb bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &errb
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			if cmd.ProcessState == nil {
				cmd.Process.Kill()
				cmd.Wait()
			}
		})
		return cmd, &out, &errb
	}
	first, _, firstErr := rank1("GDRLINK_TEST_FROM=0", "GDRLINK_TEST_HOLD=1")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	g, err := Join(ctx, WithRank(0, 2), WithRootListener(ln), WithJobKey(key), WithProvider(provider))
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	recvLife := func(from int) {
		t.Helper()
		want := make([]byte, 4*64<<10)
		for step := from; step < from+rejoinSteps; step++ {
			rt, _, err := g.Recv(ctx, 1, "life", int64(step))
			if err != nil {
				t.Fatalf("step %d: %v", step, err)
			}
			b, _ := rt.Bytes()
			fill(want, step)
			if !bytes.Equal(b, want) {
				t.Fatalf("step %d: wrong bytes", step)
			}
			rt.Release()
		}
	}
	recvLife(0)

	// A second process claiming rank 1 while the first lives: refused.
	claim, _, claimErr := rank1("GDRLINK_TEST_FROM=100")
	if err := claim.Wait(); err == nil || !strings.Contains(claimErr.String(), "is alive") {
		t.Fatalf("second claimant of live rank 1: %v, stderr %q; want a refusal saying rank 1 is alive", err, claimErr.String())
	}

	// Rank 1 dies while rank 0 waits on it.
	pending := make(chan error, 1)
	go func() {
		_, _, err := g.Recv(ctx, 1, "life", rejoinSteps)
		pending <- err
	}()
	time.Sleep(50 * time.Millisecond)
	killed := time.Now()
	first.Process.Kill()
	first.Wait()
	select {
	case err := <-pending:
		if err == nil || !strings.Contains(err.Error(), "rank 1") {
			t.Fatalf("Recv pending on the killed rank 1: %v; want an error naming rank 1", err)
		}
		t.Logf("%s: the pending Recv failed %v after the kill: %v", provider, time.Since(killed).Round(time.Millisecond), err)
	case <-time.After(60 * time.Second):
		t.Fatalf("Recv pending on the killed rank 1 still waits a minute later (stderr of rank 1: %s)", firstErr.String())
	}

	// A new process in rank 1's place: rank 0 waits for it, then resumes.
	start := time.Now()
	second, out, secondErr := rank1("GDRLINK_TEST_FROM=10")
	if inc, err := g.WaitRejoin(ctx, 1, 1); err != nil || inc != 2 {
		t.Fatalf("WaitRejoin: incarnation %d, %v; want 2", inc, err)
	}
	recvLife(10)
	if err := g.Barrier(ctx); err != nil {
		t.Fatalf("barrier with the new rank 1: %v", err)
	}
	if err := second.Wait(); err != nil {
		t.Fatalf("new rank 1: %v: %s", err, secondErr.String())
	}
	var rep childReport
	if err := json.Unmarshal(bytes.TrimSpace(out.Bytes()), &rep); err != nil {
		t.Fatalf("new rank 1 printed %q: %v", out.String(), err)
	}
	if !rep.Rejoined || rep.Incarnation != 2 {
		t.Errorf("new rank 1: rejoined %v, incarnation %d; want true, 2", rep.Rejoined, rep.Incarnation)
	}
	if g.boot.Incarnation(1) != 2 || g.Stats().Rejoins != 1 {
		t.Errorf("rank 0: incarnation of rank 1 %d, rejoins %d; want 2, 1", g.boot.Incarnation(1), g.Stats().Rejoins)
	}
	t.Logf("%s: rank 1 rejoined and resumed the stream %v after it was started", provider, time.Since(start).Round(time.Millisecond))
}

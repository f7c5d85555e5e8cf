package gdrlink

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/tensor"
)

// failoverSteps tensors of failoverBytes go from rank 1 to rank 0 in the
// failover job, one every failoverPace.
const (
	failoverSteps = 300
	failoverBytes = 64 << 10
	failoverPace  = 5 * time.Millisecond
)

// failoverJob: rank 1 streams, rank 0 receives and checks every byte; the
// test cuts their connections under them.
func failoverJob(ctx context.Context, g *Group, rep *childReport) error {
	if g.Rank() == 1 {
		for step := 0; step < failoverSteps; step++ {
			t, err := g.NewTensor(tensor.Uint8, failoverBytes)
			if err != nil {
				return err
			}
			b, _ := t.Bytes()
			fill(b, step)
			if err := g.Send(0, "stream", int64(step), t); err != nil {
				return fmt.Errorf("send of step %d: %w", step, err)
			}
			time.Sleep(failoverPace)
		}
		return nil
	}
	want := make([]byte, failoverBytes)
	for step := 0; step < failoverSteps; step++ {
		t, tr, err := g.Recv(ctx, 1, "stream", int64(step))
		if err != nil {
			return fmt.Errorf("recv of step %d: %w", step, err)
		}
		b, _ := t.Bytes()
		fill(want, step)
		if !bytes.Equal(b, want) {
			t.Release()
			return fmt.Errorf("step %d: wrong bytes", step)
		}
		t.Release()
		rep.Received++
		if p := tr.Provider; len(rep.Paths) == 0 || rep.Paths[len(rep.Paths)-1] != p {
			rep.Paths = append(rep.Paths, p)
		}
	}
	return nil
}

// TestFailover: two processes stream while their connection is broken
// under them; the stream goes on over a new connection, every tensor with
// every byte right, and both ranks count the failovers.
//
// tcp: in a network namespace of their own, the test resets every one of
// their data connections (ss -K, as a middlebox or a flapping link would),
// twice; each time a fresh tcp connection takes over. Needs root.
func TestFailover(t *testing.T) {
	t.Run("tcp", func(t *testing.T) {
		ip, ss := failoverTools(t)
		ns := fmt.Sprintf("gdrfo-%d", os.Getpid())
		if out, err := exec.Command(ip, "netns", "add", ns).CombinedOutput(); err != nil {
			t.Skipf("skipping: cannot make a network namespace: %v: %s", err, out)
		}
		t.Cleanup(func() { exec.Command(ip, "netns", "del", ns).Run() })
		if out, err := exec.Command(ip, "-n", ns, "link", "set", "lo", "up").CombinedOutput(); err != nil {
			t.Fatalf("lo up: %v: %s", err, out)
		}
		cuts := 0
		reps := runFailoverJob(t, []string{ip, "netns", "exec", ns}, "tcp", func() {
			// Twice, while the stream runs: reset every connection but
			// the bootstrap's control connection to the root.
			for range 2 {
				time.Sleep(700 * time.Millisecond)
				out, err := exec.Command(ip, "netns", "exec", ns, ss, "-K", "-t", "state", "established",
					"( sport != :"+failoverRootPort+" and dport != :"+failoverRootPort+" )").CombinedOutput()
				if err != nil {
					t.Errorf("ss -K: %v: %s", err, out)
					return
				}
				if n := bytes.Count(out, []byte("\n")) - 1; n > 0 {
					cuts++
					t.Logf("reset %d connections", n)
				}
			}
		})
		if cuts == 0 {
			t.Fatal("no connection was reset: the stream ended before the cuts?")
		}
		checkFailover(t, reps, "tcp")
	})
}

// failoverRootPort is the bootstrap root's port in the failover job.
const failoverRootPort = "29500"

func failoverTools(t *testing.T) (ip, ss string) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("skipping: needs root (a network namespace, ss -K)")
	}
	var err error
	if ip, err = exec.LookPath("ip"); err != nil {
		t.Skip("skipping: needs ip (iproute2)")
	}
	if ss, err = exec.LookPath("ss"); err != nil {
		t.Skip("skipping: needs ss (iproute2)")
	}
	return ip, ss
}

// runFailoverJob runs the failover job's two ranks (each command prefixed
// by wrap) with provider, calls fault while they stream, and returns their
// reports.
func runFailoverJob(t *testing.T, wrap []string, provider string, fault func()) [2]childReport {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	key, err := NewJobKey()
	if err != nil {
		t.Fatal(err)
	}
	var cmds []*exec.Cmd
	var outs, errs []*bytes.Buffer
	for r := range 2 {
		args := append(append([]string(nil), wrap...), self, "-test.run=^$")
		cmd := exec.Command(args[0], args[1:]...)
		cmd.Env = append(os.Environ(), "GDRLINK_TEST_JOB=failover", "GDRLINK_RANK="+strconv.Itoa(r), "GDRLINK_SIZE=2",
			"GDRLINK_ROOT=127.0.0.1:"+failoverRootPort, "GDRLINK_JOB_KEY="+key, "GDRLINK_PROVIDER="+provider)
		var out, errb bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &errb
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		cmds, outs, errs = append(cmds, cmd), append(outs, &out), append(errs, &errb)
	}
	t.Cleanup(func() {
		for _, c := range cmds {
			if c.ProcessState == nil {
				c.Process.Kill()
				c.Wait()
			}
		}
	})
	fault()
	done := make(chan struct{})
	go func() {
		for _, c := range cmds {
			c.Wait()
		}
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(2 * time.Minute):
		for _, c := range cmds {
			c.Process.Kill()
		}
		<-done
		t.Fatal("the job did not end within 2 minutes")
	}
	var reps [2]childReport
	for r, c := range cmds {
		if !c.ProcessState.Success() {
			t.Fatalf("rank %d: %v: %s", r, c.ProcessState, errs[r].String())
		}
		sc := bufio.NewScanner(outs[r])
		var line []byte
		for sc.Scan() {
			line = sc.Bytes()
		}
		if err := json.Unmarshal(line, &reps[r]); err != nil {
			t.Fatalf("rank %d printed %q: %v", r, outs[r].String(), err)
		}
	}
	return reps
}

// checkFailover checks that every tensor arrived, that both ranks failed
// over, and that the providers rank 0 received over were paths, in order.
func checkFailover(t *testing.T, reps [2]childReport, paths ...string) {
	t.Helper()
	if reps[0].Received != failoverSteps {
		t.Fatalf("rank 0 received %d tensors, want %d", reps[0].Received, failoverSteps)
	}
	for r, rep := range reps {
		if rep.Failovers < 1 {
			t.Errorf("rank %d counts %d failovers, want at least 1", r, rep.Failovers)
		}
	}
	if !slices.Equal(reps[0].Paths, paths) {
		t.Errorf("rank 0 received over %v, want %v", reps[0].Paths, paths)
	}
	t.Logf("%d tensors, every byte right; failovers counted %d and %d; providers in turn %v", reps[0].Received, reps[0].Failovers, reps[1].Failovers, reps[0].Paths)
}

package gdrlink

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
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
		if rep.Received == failoverSteps/6 {
			fmt.Fprintln(os.Stderr, failoverProgress) // the test's cue
		}
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
				time.Sleep(300 * time.Millisecond)
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

// TestFailoverIbverbsToTCP: in the Soft-RoCE guest (GDRLINK_TEST_ROCE_VETH=1,
// as root), two network namespaces joined by veth, a Soft-RoCE device on
// each end, the two ranks streaming over "ibverbs,tcp": the test drops all
// RoCE traffic (UDP 4791) of one namespace with nftables mid-stream, and
// the stream moves to tcp with every tensor right. (On one namespace,
// Soft-RoCE delivers between local addresses without the network stack,
// where no rule can drop it.)
func TestFailoverIbverbsToTCP(t *testing.T) {
	if os.Getenv("GDRLINK_TEST_ROCE_VETH") != "1" {
		t.Skip("skipping: set GDRLINK_TEST_ROCE_VETH=1 where this test may make namespaces and Soft-RoCE devices (the guest of make test-rdma does)")
	}
	ip, _ := failoverTools(t)
	var tools []string
	for _, name := range []string{"rdma", "nft"} {
		p, err := exec.LookPath(name)
		if err != nil {
			t.Fatalf("GDRLINK_TEST_ROCE_VETH=1 but %s is missing (Debian: iproute2, nftables): %v", name, err)
		}
		tools = append(tools, p)
	}
	rdma, nft := tools[0], tools[1]
	run := func(args ...string) {
		t.Helper()
		if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
			t.Fatalf("%v: %v: %s", args, err, out)
		}
	}
	id := os.Getpid()
	nsA, nsB := fmt.Sprintf("gdrfa-%d", id), fmt.Sprintf("gdrfb-%d", id)
	va, vb := fmt.Sprintf("fva%d", id%100000), fmt.Sprintf("fvb%d", id%100000)
	ra, rb := fmt.Sprintf("rxfa%d", id%100000), fmt.Sprintf("rxfb%d", id%100000)
	exec.Command("modprobe", "veth").Run()
	run(ip, "netns", "add", nsA)
	t.Cleanup(func() { exec.Command(ip, "netns", "del", nsA).Run() })
	run(ip, "netns", "add", nsB)
	t.Cleanup(func() { exec.Command(ip, "netns", "del", nsB).Run() })
	run(ip, "link", "add", va, "type", "veth", "peer", "name", vb)
	run(ip, "link", "set", va, "netns", nsA)
	run(ip, "link", "set", vb, "netns", nsB)
	run(ip, "-n", nsA, "addr", "add", "10.233.0.1/24", "dev", va)
	run(ip, "-n", nsB, "addr", "add", "10.233.0.2/24", "dev", vb)
	for _, ns := range []string{nsA, nsB} {
		run(ip, "-n", ns, "link", "set", "lo", "up")
	}
	run(ip, "-n", nsA, "link", "set", va, "up")
	run(ip, "-n", nsB, "link", "set", vb, "up")
	run(ip, "netns", "exec", nsA, rdma, "link", "add", ra, "type", "rxe", "netdev", va)
	t.Cleanup(func() { exec.Command(ip, "netns", "exec", nsA, rdma, "link", "delete", ra).Run() })
	run(ip, "netns", "exec", nsB, rdma, "link", "add", rb, "type", "rxe", "netdev", vb)
	t.Cleanup(func() { exec.Command(ip, "netns", "exec", nsB, rdma, "link", "delete", rb).Run() })
	// Each device's RoCE v2 GID of its address appears once the kernel
	// has added it.
	for dev, gid := range map[string]string{ra: "0000:0000:0000:0000:0000:ffff:0ae9:0001", rb: "0000:0000:0000:0000:0000:ffff:0ae9:0002"} {
		found := false
		for deadline := time.Now().Add(15 * time.Second); !found && time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
			files, _ := filepath.Glob("/sys/class/infiniband/" + dev + "/ports/1/gids/*")
			for _, f := range files {
				if b, err := os.ReadFile(f); err == nil && strings.TrimSpace(string(b)) == gid {
					found = true
				}
			}
		}
		if !found {
			t.Fatalf("%s has no GID %s after 15 s", dev, gid)
		}
	}
	const table = "gdrlink_failover_test"
	reps := runFailoverJobIn(t, func(r int) ([]string, []string) {
		ns, dev := nsA, ra
		if r == 1 {
			ns, dev = nsB, rb
		}
		return []string{ip, "netns", "exec", ns}, []string{"RDMA_DEVICE=" + dev, "GDRLINK_LOG=warn"}
	}, "10.233.0.1", "ibverbs,tcp", func() {
		for _, cmd := range [][]string{
			{"add", "table", "inet", table},
			{"add", "chain", "inet", table, "out", "{ type filter hook output priority 0; }"},
			{"add", "chain", "inet", table, "in", "{ type filter hook input priority 0; }"},
			{"add", "rule", "inet", table, "out", "udp", "dport", "4791", "drop"},
			{"add", "rule", "inet", table, "in", "udp", "dport", "4791", "drop"},
		} {
			if out, err := exec.Command(ip, append([]string{"netns", "exec", nsA, nft}, cmd...)...).CombinedOutput(); err != nil {
				t.Errorf("nft %v: %v: %s", cmd, err, out)
				return
			}
		}
		t.Log("dropping RoCE (UDP 4791) in rank 0's namespace from now on")
	})
	// Where Soft-RoCE works in a network namespace (kernels since it got
	// namespace support), the stream starts on ibverbs and the drop moves
	// it; on older ones (the guest's 6.1) the ibverbs queue pair fails at
	// its first send with a general error, a real device failure too: the
	// connection moves to tcp before the first tensor. Either way it went
	// from ibverbs to tcp with every tensor right.
	if !strings.Contains(reps[0].Log, "from=ibverbs to=tcp") {
		t.Errorf("rank 0 did not fail over from ibverbs to tcp:\n%s", reps[0].Log)
	}
	if p := reps[0].Paths; len(p) == 0 || p[len(p)-1] != "tcp" {
		t.Errorf("rank 0 received over %v, want tcp last", p)
	}
	checkFailover(t, reps)
}

// failoverProgress is what rank 0 of the failover job prints (on stderr)
// once a sixth of the stream has arrived: the test injects its fault then.
const failoverProgress = "failover job: streaming"

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
	return runFailoverJobIn(t, func(int) ([]string, []string) { return wrap, []string{"GDRLINK_LOG=warn"} }, "127.0.0.1", provider, fault)
}

// runFailoverJobIn is runFailoverJob with each rank's command prefix and
// extra environment given by per(rank), and the root at rootIP.
func runFailoverJobIn(t *testing.T, per func(rank int) (wrap, env []string), rootIP, provider string, fault func()) [2]childReport {
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
	var outs []*bytes.Buffer
	var errs []*syncBuffer
	for r := range 2 {
		wrap, env := per(r)
		args := append(append([]string(nil), wrap...), self, "-test.run=^$")
		cmd := exec.Command(args[0], args[1:]...)
		cmd.Env = append(os.Environ(), "GDRLINK_TEST_JOB=failover", "GDRLINK_RANK="+strconv.Itoa(r), "GDRLINK_SIZE=2",
			"GDRLINK_ROOT="+rootIP+":"+failoverRootPort, "GDRLINK_JOB_KEY="+key, "GDRLINK_PROVIDER="+provider)
		cmd.Env = append(cmd.Env, env...)
		var out bytes.Buffer
		errb := &syncBuffer{}
		cmd.Stdout, cmd.Stderr = &out, errb
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		cmds, outs, errs = append(cmds, cmd), append(outs, &out), append(errs, errb)
	}
	t.Cleanup(func() {
		for _, c := range cmds {
			if c.ProcessState == nil {
				c.Process.Kill()
				c.Wait()
			}
		}
	})
	// The fault comes once the stream runs (process start is slow in the
	// emulated guest).
	for deadline := time.Now().Add(time.Minute); !bytes.Contains(errs[0].Bytes(), []byte(failoverProgress)); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("rank 0 did not start streaming within a minute: %s", errs[0].String())
		}
	}
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
	t.Cleanup(func() {
		if t.Failed() {
			for r, e := range errs {
				t.Logf("rank %d's stderr:\n%s", r, e.String())
			}
		}
	})
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
		reps[r].Log = errs[r].String()
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
	if paths != nil && !slices.Equal(reps[0].Paths, paths) {
		t.Errorf("rank 0 received over %v, want %v", reps[0].Paths, paths)
	}
	t.Logf("%d tensors, every byte right; failovers counted %d and %d; providers in turn %v", reps[0].Received, reps[0].Failovers, reps[1].Failovers, reps[0].Paths)
}

// syncBuffer is a buffer a child process writes while the test reads it.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

// Bytes is a copy of what was written so far.
func (s *syncBuffer) Bytes() []byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	return bytes.Clone(s.b.Bytes())
}

func (s *syncBuffer) String() string { return string(s.Bytes()) }

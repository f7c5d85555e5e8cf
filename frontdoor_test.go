package gdrlink

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/internal/bootstrap"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

// The tests start real processes: this test binary again, with
// GDRLINK_TEST_JOB naming what the child does. Each child uses the front
// door alone, configured by the environment as a launcher would.
func TestMain(m *testing.M) {
	if os.Getenv(rxeAggEnv) != "" {
		if err := runRXEAggregator(); err != nil {
			fmt.Fprintln(os.Stderr, "aggregator:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	if job := os.Getenv("GDRLINK_TEST_JOB"); job != "" {
		if err := runChild(job); err != nil {
			fmt.Fprintf(os.Stderr, "rank %s: %v\n", os.Getenv("GDRLINK_RANK"), err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// childReport is what each child prints as one JSON line on stdout.
type childReport struct {
	Rank        int            `json:"rank"`
	JoinMS      float64        `json:"join_ms"`
	Connections map[string]int `json:"connections"`
	Paths       []string       `json:"paths"`
	Received    int            `json:"received"`
	// Copied counts the bytes of Broadcasts, AllGathers and RecvInto that were
	// received elsewhere and copied into the call's tensor, and
	// PlacedCalls the collective calls that had bytes written in place.
	Copied      int64 `json:"copied"`
	PlacedCalls int   `json:"placed_calls"`
	// DoublingCalls counts AllReduce calls by recursive doubling, which
	// place nothing (no all-gather).
	DoublingCalls int `json:"doubling_calls"`
	Unusable      map[string]string
	// Scraped is what the child read from its own /metrics (with
	// GDRLINK_METRICS_ADDR): each sample named "name{label=value,...}" with
	// the provider and device labels left out and their samples summed.
	Scraped map[string]float64 `json:"scraped"`
	// Rejoined and Incarnation are the rejoin job's: whether this process
	// joined in place of a dead one, and its incarnation.
	Rejoined    bool   `json:"rejoined"`
	Incarnation uint64 `json:"incarnation"`
	// Failovers is Stats.Failovers at the end.
	Failovers int `json:"failovers"`
	// Log is what the rank wrote on stderr (set by the tests that read it).
	Log string `json:"-"`
	// Digests are the collective job's results (a hash each), to compare
	// across ranks.
	Digests []string `json:"digests,omitempty"`
	// Resent and Stale sum the collective reports' Resent and
	// StaleReplies (the switchml jobs).
	Resent int64 `json:"resent,omitempty"`
	Stale  int64 `json:"stale,omitempty"`
	// FailRank, Failure and FailMS are what the collective that lost a
	// rank said, and how long it took.
	FailRank int     `json:"fail_rank,omitempty"`
	Failure  string  `json:"failure,omitempty"`
	FailMS   float64 `json:"fail_ms,omitempty"`
	// IPC is Stats.IPC as the ipc jobs saw it.
	IPC IPCStats `json:"ipc"`
	// CPUs, Unbound, Yield, Procs, MaxProcs and ThreadCPUs are the bind
	// job's: Stats.CPUs, Stats.Unbound, Stats.Yield and Stats.Procs,
	// GOMAXPROCS, and the distinct affinity masks of the process's
	// threads.
	CPUs       []int   `json:"cpus,omitempty"`
	Unbound    string  `json:"unbound,omitempty"`
	Yield      bool    `json:"yield,omitempty"`
	Procs      int     `json:"procs,omitempty"`
	MaxProcs   int     `json:"max_procs,omitempty"`
	ThreadCPUs [][]int `json:"thread_cpus,omitempty"`
}

// errExitNow ends a job without the final barrier (a peer is dead): the
// child prints its report and exits.
var errExitNow = errors.New("exit without the barrier")

func runChild(job string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	var opts []Option
	if fd := os.Getenv("GDRLINK_TEST_ROOT_FD"); fd != "" {
		n, _ := strconv.Atoi(fd)
		ln, err := net.FileListener(os.NewFile(uintptr(n), "root"))
		if err != nil {
			return err
		}
		opts = append(opts, WithRootListener(ln))
	}
	if os.Getenv("GDRLINK_TEST_SIMGPU") == "1" {
		opts = append(opts, withSimulatedGPU())
	}
	if v := os.Getenv("GDRLINK_TEST_SWITCHML_NET"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil {
			return err
		}
		opts = append(opts, withSwitchMLNet(byte(n)))
	}
	if os.Getenv("GDRLINK_TEST_REALGPU") == "1" {
		opts = append(opts, WithGPU(0))
	}
	g, err := Join(ctx, opts...)
	if err != nil {
		return err
	}
	defer g.Close()
	rep := childReport{Rank: g.Rank()}
	switch job {
	case "pair":
		err = pairJob(ctx, g, &rep)
	case "bind":
		err = bindJob(ctx, g, &rep)
	case "ring":
		err = ringJob(ctx, g, &rep)
	case "gpu":
		err = gpuJob(ctx, g, &rep)
	case "ipc":
		err = ipcJob(ctx, g, &rep)
	case "ipc-notready":
		err = ipcNotReadyJob(ctx, g, &rep)
	case "ipc-kill":
		if err = ipcKillJob(ctx, g, &rep); errors.Is(err, errExitNow) {
			if err := json.NewEncoder(os.Stdout).Encode(rep); err != nil {
				return err
			}
			if g.Rank() == 1 {
				os.Exit(0) // dies: no Close, no BYE; the kernel closes its sockets
			}
			return nil
		}
	case "rejoin":
		err = rejoinJob(ctx, g, &rep)
	case "failover":
		err = failoverJob(ctx, g, &rep)
	case "collectives":
		err = collJob(ctx, g, &rep)
	case "gpu-collectives":
		err = gpuCollJob(ctx, g, &rep)
	case "gpu-pinned-full":
		err = gpuPinnedFullJob(ctx, g, &rep)
	case "switchml":
		err = switchmlJob(ctx, g, &rep)
	case "switchml-rxe":
		err = switchmlRXEJob(ctx, g, &rep)
	case "switchml-types":
		err = switchmlTypesJob(ctx, g, &rep)
	case "switchml-pair":
		err = switchmlPairJob(ctx, g, &rep)
	case "switchml-mismatch":
		err = switchmlMismatchJob(ctx, g, &rep)
	case "switchml-kill":
		// The aggregator or a rank is dead: no barrier.
		if err = switchmlKillJob(ctx, g, &rep); err == nil {
			return json.NewEncoder(os.Stdout).Encode(rep)
		}
	case "collectives-kill":
		// A rank is dead: no barrier.
		if err = killJob(ctx, g, &rep); err == nil {
			return json.NewEncoder(os.Stdout).Encode(rep)
		}
	case "stop":
		return stopJob(ctx, g) // no barrier: rank 0 stays stopped
	case "dead-peer":
		return deadPeerJob(ctx, g) // no barrier: a rank is dead
	default:
		err = fmt.Errorf("unknown job %q", job)
	}
	if err != nil {
		return err
	}
	if err := g.Barrier(ctx); err != nil {
		return err
	}
	if addr := g.metricsAddr(); addr != nil {
		if rep.Scraped, err = scrape(addr.String()); err != nil {
			return err
		}
	}
	s := g.Stats()
	rep.JoinMS = float64(s.Join.Microseconds()) / 1000
	rep.Connections = s.Connections
	rep.Failovers = s.Failovers
	rep.Unusable = s.Unusable
	return json.NewEncoder(os.Stdout).Encode(rep)
}

// fill writes a pattern that depends on the sender, key and step.
func fill(b []byte, seed int) {
	for i := range b {
		b[i] = byte(seed*131 + i*7 + i>>9)
	}
}

// pairItems are the tensors the pair job sends at each of pairSteps steps.
var pairItems = []struct {
	key   string
	dt    tensor.DType
	shape []int64
}{{"small", tensor.Float32, []int64{2, 3}}, {"ids", tensor.Int64, []int64{1000}}, {"weights", tensor.BFloat16, []int64{1024, 1024}}, {"big", tensor.Float32, []int64{4 << 20}}, {"empty", tensor.Float32, []int64{0, 5}}}

const pairSteps = 3

// pairJob: rank 0 sends tensors of several kinds and sizes, rank 1
// receives and checks every byte.
func pairJob(ctx context.Context, g *Group, rep *childReport) error {
	for step := int64(0); step < pairSteps; step++ {
		for i, it := range pairItems {
			seed := int(step)*10 + i
			if g.Rank() == 0 {
				t, err := g.NewTensor(it.dt, it.shape...)
				if err != nil {
					return err
				}
				b, err := t.Bytes()
				if err != nil {
					return err
				}
				fill(b, seed)
				if err := g.Send(1, it.key, step, t); err != nil {
					return err
				}
				continue
			}
			t, tr, err := g.Recv(ctx, 0, it.key, step)
			if err != nil {
				return fmt.Errorf("Recv %s step %d: %w", it.key, step, err)
			}
			b, err := t.Bytes()
			if err != nil {
				return err
			}
			want := make([]byte, len(b))
			fill(want, seed)
			if !bytes.Equal(b, want) || !slices.Equal(t.Meta().Shape, tensor.Shape(it.shape)) || t.Meta().DType != it.dt {
				return fmt.Errorf("%s step %d: %v %v, %d bytes differ from what rank 0 sent", it.key, step, t.Meta().DType, t.Meta().Shape, len(b))
			}
			rep.Paths = append(rep.Paths, tr.Provider+"/"+tr.Path.String())
			rep.Received++
			if err := t.Release(); err != nil {
				return err
			}
		}
	}
	return nil
}

// ringJob: every rank exchanges with its two neighbours, both ways.
func ringJob(ctx context.Context, g *Group, rep *childReport) error {
	n, r := g.Size(), g.Rank()
	next, prev := (r+1)%n, (r+n-1)%n
	for step := int64(0); step < 2; step++ {
		for _, to := range []int{next, prev} {
			t, err := g.NewTensor(tensor.Uint8, 64<<10)
			if err != nil {
				return err
			}
			b, _ := t.Bytes()
			fill(b, r*1000+to+int(step))
			if err := g.Send(to, "halo", step, t); err != nil {
				return err
			}
		}
		for _, from := range []int{prev, next} {
			t, _, err := g.Recv(ctx, from, "halo", step)
			if err != nil {
				return fmt.Errorf("Recv from rank %d step %d: %w", from, step, err)
			}
			b, _ := t.Bytes()
			want := make([]byte, len(b))
			fill(want, from*1000+r+int(step))
			if !bytes.Equal(b, want) {
				return fmt.Errorf("halo from rank %d step %d: bytes differ", from, step)
			}
			rep.Received++
			t.Release()
		}
	}
	return nil
}

// job is a set of child processes of one job.
type job struct {
	t     *testing.T
	cmds  []*exec.Cmd
	outs  []*bytes.Buffer
	errs  []*bytes.Buffer
	start time.Time
	// rootFile is this process's copy of rank 0's listening socket,
	// kept for a rank 0 started again; while it is open, the root's
	// port accepts connections (into the backlog) after rank 0 died.
	rootFile *os.File
}

// startJob starts size children running what; wrap(rank) may prefix a
// child's command (ip netns exec ...) and env(rank) adds variables.
func startJob(t *testing.T, what string, size int, rootIP string, wrap func(int) []string, env func(int) []string) *job {
	t.Helper()
	ln, err := net.Listen("tcp", net.JoinHostPort(rootIP, "0"))
	if err != nil {
		t.Fatal(err)
	}
	lf, err := ln.(*net.TCPListener).File()
	if err != nil {
		t.Fatal(err)
	}
	root := ln.Addr().String()
	ln.Close()
	t.Cleanup(func() { lf.Close() })
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	j := &job{t: t, start: time.Now(), rootFile: lf}
	for r := range size {
		args := append(wrap(r), self, "-test.run=^$")
		cmd := exec.Command(args[0], args[1:]...)
		cmd.Env = append(os.Environ(), "GDRLINK_TEST_JOB="+what, "GDRLINK_RANK="+strconv.Itoa(r), "GDRLINK_SIZE="+strconv.Itoa(size), "GDRLINK_ROOT="+root)
		cmd.Env = append(cmd.Env, env(r)...)
		if r == 0 {
			cmd.ExtraFiles = []*os.File{lf}
			cmd.Env = append(cmd.Env, "GDRLINK_TEST_ROOT_FD=3")
		}
		var out, errb bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &errb
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		j.cmds, j.outs, j.errs = append(j.cmds, cmd), append(j.outs, &out), append(j.errs, &errb)
	}
	t.Cleanup(func() {
		for _, c := range j.cmds {
			if c.ProcessState == nil {
				c.Process.Kill()
				c.Wait()
			}
		}
	})
	return j
}

// wait waits for every child and returns their reports, by rank.
func (j *job) wait(limit time.Duration) []childReport { return j.waitDead(limit, -1) }

// waitDead waits for every child and returns their reports, by rank; rank
// victim (none if negative) must have died of SIGKILL, and its report is
// left empty.
func (j *job) waitDead(limit time.Duration, victim int) []childReport {
	j.t.Helper()
	done := make(chan struct{})
	go func() {
		for _, c := range j.cmds {
			c.Wait()
		}
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(limit):
		for _, c := range j.cmds {
			c.Process.Kill()
		}
		<-done
		j.t.Fatalf("the job did not end within %v", limit)
	}
	// Every rank that failed is named: the first one's error is often
	// only that another left.
	var failed []string
	for r, c := range j.cmds {
		if r != victim && !c.ProcessState.Success() {
			failed = append(failed, fmt.Sprintf("rank %d: %v: %s", r, c.ProcessState, j.errs[r].String()))
		}
	}
	if len(failed) > 0 {
		j.t.Fatal(strings.Join(failed, "\n"))
	}
	reps := make([]childReport, len(j.cmds))
	for r, c := range j.cmds {
		if r == victim {
			if ws, ok := c.ProcessState.Sys().(syscall.WaitStatus); !ok || ws.Signal() != syscall.SIGKILL {
				j.t.Errorf("the victim ended with %v: %s", c.ProcessState, j.errs[r])
			}
			continue
		}
		if !c.ProcessState.Success() {
			j.t.Fatalf("rank %d: %v: %s", r, c.ProcessState, j.errs[r].String())
		}
		sc := bufio.NewScanner(j.outs[r])
		var line []byte
		for sc.Scan() {
			line = sc.Bytes()
		}
		if err := json.Unmarshal(line, &reps[r]); err != nil {
			j.t.Fatalf("rank %d printed %q: %v", r, j.outs[r].String(), err)
		}
	}
	return reps
}

// TestTwoProcesses runs the pair job between two processes on each
// provider, chosen automatically (onnode: both on this node) and by
// GDRLINK_PROVIDER. A provider without a device here skips with the
// reason, or fails where GDRLINK_REQUIRE_RDMA=1 says it must be there.
func TestTwoProcesses(t *testing.T) {
	for _, tc := range []struct{ name, provider, want string }{
		{"auto", "", "onnode"}, {"tcp", "tcp", "tcp"}, {"onnode", "onnode", "onnode"}, {"ibverbs", "ibverbs", "ibverbs"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.provider != "" {
				p, err := verbsio.Lookup(tc.provider)
				if err == nil {
					_, err = p.Devices()
				}
				if err != nil {
					if tc.provider == "ibverbs" && os.Getenv("GDRLINK_REQUIRE_RDMA") == "1" {
						t.Fatalf("GDRLINK_REQUIRE_RDMA=1 but ibverbs is not usable: %v", err)
					}
					t.Skipf("provider %s not usable here: %v", tc.provider, err)
				}
			}
			// The request path, whose counts the metrics check: the
			// eager one (small tensors sent ahead) is TestMetrics'.
			j := startJob(t, "pair", 2, "127.0.0.1", func(int) []string { return nil }, func(int) []string {
				return []string{"GDRLINK_PROVIDER=" + tc.provider, "GDRLINK_METRICS_ADDR=127.0.0.1:0", "GDRLINK_EAGER_MAX=0"}
			})
			reps := j.wait(2 * time.Minute)
			if reps[1].Received != 15 {
				t.Fatalf("rank 1 received %d tensors, want 15", reps[1].Received)
			}
			for r, rep := range reps {
				if len(rep.Connections) != 1 || rep.Connections[tc.want] != 1 {
					t.Errorf("rank %d connections %v, want one over %s", r, rep.Connections, tc.want)
				}
			}
			for _, p := range reps[1].Paths {
				if !strings.HasPrefix(p, tc.want+"/") || !(strings.HasSuffix(p, "/direct") || strings.HasSuffix(p, "/none")) {
					t.Errorf("a transfer went %s, want %s/direct (or none for the empty tensor)", p, tc.want)
				}
			}
			checkPairMetrics(t, reps[1].Scraped)
			t.Logf("%s: join %.1f ms and %.1f ms; %v", tc.name, reps[0].JoinMS, reps[1].JoinMS, reps[1].Paths[:5])
		})
	}
}

// TestErrors checks the front door's refusals without a peer process: a
// job of one rank has nobody to send to, and a closed group says so.
func TestErrors(t *testing.T) {
	ctx := context.Background()
	g, err := Join(ctx, WithRank(0, 1))
	if err != nil {
		t.Fatal(err)
	}
	tn, err := g.NewTensor(tensor.Float32, 4)
	if err != nil {
		t.Fatal(err)
	}
	if err := g.Send(0, "k", 0, tn); !errors.Is(err, verbsio.ErrBadConfig) {
		t.Errorf("Send to itself: %v, want ErrBadConfig", err)
	}
	if _, _, err := g.Recv(ctx, 3, "k", 0); !errors.Is(err, verbsio.ErrBadConfig) {
		t.Errorf("Recv from rank 3 of 1: %v, want ErrBadConfig", err)
	}
	if _, err := g.NewTensor(tensor.Float32, -1); err == nil {
		t.Errorf("negative shape accepted")
	}
	if err := tn.Release(); err != nil {
		t.Fatal(err)
	}
	if err := g.Close(); err != nil {
		t.Fatal(err)
	}
	if err := g.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	if _, err := g.NewTensor(tensor.Float32, 4); !errors.Is(err, ErrClosed) {
		t.Errorf("NewTensor after Close: %v, want ErrClosed", err)
	}
	if err := g.Barrier(ctx); !errors.Is(err, ErrClosed) {
		t.Errorf("Barrier after Close: %v, want ErrClosed", err)
	}
}

func TestEnvironment(t *testing.T) {
	env := func(kv ...string) func(string) (string, bool) {
		m := map[string]string{}
		for i := 0; i < len(kv); i += 2 {
			m[kv[i]] = kv[i+1]
		}
		return func(k string) (string, bool) { v, ok := m[k]; return v, ok }
	}
	c, err := fromEnv(env("GDRLINK_PROVIDER", "tcp", "GDRLINK_POOL_LIMIT", "8GiB", "GDRLINK_CHECKSUM", "1", "GDRLINK_CONNECT_TIMEOUT", "5s", "GDRLINK_LOG", "debug", "GDRLINK_METRICS_ADDR", ":9400", "GDRLINK_PEER_TIMEOUT", "2m", "GDRLINK_CUDA_IPC", "legacy"))
	if err != nil {
		t.Fatal(err)
	}
	if c.provider != "tcp" || c.poolLimit != 8<<30 || !c.checksum || c.connectTimeout != 5*time.Second || c.peerTimeout != 2*time.Minute || c.log == nil || c.metricsAddr != ":9400" || c.cudaIPC != "legacy" {
		t.Errorf("config %+v", c)
	}
	for _, bad := range [][]string{
		{"GDRLINK_PROVIDER", "carrier-pigeon"}, {"GDRLINK_POOL_LIMIT", "lots"}, {"GDRLINK_CHECKSUM", "maybe"},
		{"GDRLINK_CONNECT_TIMEOUT", "-1s"}, {"GDRLINK_LOG", "loud"}, {"GDRLINK_METRICS_ADDR", "9400"},
		{"GDRLINK_PEER_TIMEOUT", "0"}, {"GDRLINK_PEER_TIMEOUT", "soon"}, {"GDRLINK_PEER_TIMEOUT", "48h"},
		{"GDRLINK_CUDA_IPC", "sometimes"}, {"GDRLINK_EAGER_MAX", "5KiB"}, {"GDRLINK_EAGER_MAX", "small"},
	} {
		if _, err := fromEnv(env(bad...)); !errors.Is(err, verbsio.ErrBadConfig) || !strings.Contains(err.Error(), bad[0]) {
			t.Errorf("%s=%s: %v, want ErrBadConfig naming it", bad[0], bad[1], err)
		}
	}
	// Checksums: unset is each provider's default, not off; 0 and
	// WithChecksum(false) are a choice of off.
	if c, _ := fromEnv(env()); c.checksumSet {
		t.Errorf("no GDRLINK_CHECKSUM: checksum chosen (%v), want the provider's default", c.checksum)
	}
	if c, _ := fromEnv(env("GDRLINK_CHECKSUM", "0")); !c.checksumSet || c.checksum {
		t.Errorf("GDRLINK_CHECKSUM=0: set %v on %v, want a choice of off", c.checksumSet, c.checksum)
	}
	c, _ = fromEnv(env("GDRLINK_CHECKSUM", "1"))
	if err := WithChecksum(false)(&c); err != nil || !c.checksumSet || c.checksum {
		t.Errorf("WithChecksum(false) after GDRLINK_CHECKSUM=1: set %v on %v, %v", c.checksumSet, c.checksum, err)
	}
	if c, _ := fromEnv(env("GDRLINK_EAGER_MAX", "0")); !c.eagerSet || c.eagerMax != 0 {
		t.Errorf("GDRLINK_EAGER_MAX=0: set %v to %d, want eager sends off", c.eagerSet, c.eagerMax)
	}
	if c, _ := fromEnv(env("GDRLINK_EAGER_MAX", "2KiB")); c.eagerMax != 2048 {
		t.Errorf("GDRLINK_EAGER_MAX=2KiB: %d, want 2048", c.eagerMax)
	}
	c, _ = fromEnv(env("GDRLINK_EAGER_MAX", "2KiB"))
	if err := WithEagerMax(0)(&c); err != nil || c.eagerMax != 0 || !c.eagerSet {
		t.Errorf("WithEagerMax(0) after GDRLINK_EAGER_MAX=2KiB: %d (set %v), %v; want 0", c.eagerMax, c.eagerSet, err)
	}
	if err := WithEagerMax(8192)(&c); !errors.Is(err, verbsio.ErrBadConfig) {
		t.Errorf("WithEagerMax(8192): %v, want ErrBadConfig", err)
	}
	if c, _ := fromEnv(env()); c.peerTimeout != 30*time.Second {
		t.Errorf("default peer timeout %v, want 30s", c.peerTimeout)
	}
	if err := WithPeerTimeout(-time.Second)(&c); !errors.Is(err, verbsio.ErrBadConfig) {
		t.Errorf("WithPeerTimeout(-1s): %v, want ErrBadConfig", err)
	}
	// A Go option wins over the variable.
	c, _ = fromEnv(env("GDRLINK_PROVIDER", "onnode", "GDRLINK_PEER_TIMEOUT", "1m"))
	if err := WithPeerTimeout(5 * time.Second)(&c); err != nil || c.peerTimeout != 5*time.Second {
		t.Errorf("WithPeerTimeout after GDRLINK_PEER_TIMEOUT: %v, %v", c.peerTimeout, err)
	}
	if err := WithProvider("tcp")(&c); err != nil || c.provider != "tcp" {
		t.Errorf("WithProvider after GDRLINK_PROVIDER: %q, %v", c.provider, err)
	}
}

func TestConnMsg(t *testing.T) {
	for _, m := range []connMsg{{kind: kickMsg}, {kind: connectMsg, provider: "tcp", payload: []byte("hello")}, {kind: giveUpMsg, payload: []byte("no")}, {kind: failedMsg, provider: "onnode", payload: []byte("refused")}} {
		got, err := decodeConnMsg(m.Append(nil))
		if err != nil || got.kind != m.kind || got.provider != m.provider || !bytes.Equal(got.payload, m.payload) {
			t.Errorf("round trip of %+v: %+v, %v", m, got, err)
		}
		enc := m.Append(nil)
		for i := range len(enc) {
			if _, err := decodeConnMsg(enc[:i]); !errors.Is(err, verbsio.ErrBadFrame) {
				t.Errorf("%+v truncated to %d bytes: %v, want ErrBadFrame", m, i, err)
			}
		}
	}
}

func FuzzConnMsg(f *testing.F) {
	f.Add(connMsg{kind: connectMsg, provider: "onnode", payload: []byte{1, 2, 3}}.Append(nil))
	f.Add(connMsg{kind: kickMsg}.Append(nil))
	f.Add(connMsg{kind: ipcMsg, payload: []byte{0x49, 0x50, 1, 1}}.Append(nil))
	f.Add([]byte{1, 2, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := decodeConnMsg(b)
		if err != nil {
			if !errors.Is(err, verbsio.ErrBadFrame) {
				t.Fatalf("%v does not wrap ErrBadFrame", err)
			}
			return
		}
		if !bytes.Equal(m.Append(nil), b) {
			t.Fatalf("re-encoding differs")
		}
	})
}

// TestRootFromOptionRankFromEnv: under mpirun the rank and size come from
// the environment and the root may come from WithRoot alone.
func TestRootFromOptionRankFromEnv(t *testing.T) {
	for _, v := range []string{"GDRLINK_RANK", "GDRLINK_SIZE", "GDRLINK_ROOT", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS", "GDRLINK_PEERS"} {
		t.Setenv(v, "")
	}
	t.Setenv("OMPI_COMM_WORLD_RANK", "1")
	t.Setenv("OMPI_COMM_WORLD_SIZE", "2")
	if _, err := bootstrapConfig(config{}); !errors.Is(err, bootstrap.ErrNoRoot) {
		t.Fatalf("no root anywhere: %v, want ErrNoRoot", err)
	}
	bc, err := bootstrapConfig(config{root: "127.0.0.1:29500"})
	if err != nil {
		t.Fatalf("root from WithRoot, rank from mpirun: %v", err)
	}
	if bc.Rank != 1 || bc.Size != 2 || bc.Root != "127.0.0.1:29500" {
		t.Fatalf("config %+v, want rank 1 of 2 at 127.0.0.1:29500", bc)
	}
}

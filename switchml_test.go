package gdrlink

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/collective"
	"github.com/gdrlink/gdrlink/internal/hostcard"
	"github.com/gdrlink/gdrlink/internal/jobauth"
	"github.com/gdrlink/gdrlink/internal/switchml/aggsrv"
	"github.com/gdrlink/gdrlink/internal/switchml/bfp"
	"github.com/gdrlink/gdrlink/internal/switchml/worker"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

// switchmlJob all-reduces through the aggregator: a random float32 tensor
// (within the block-floating-point bound of the float64 sums, digest
// compared across ranks), an exact int32 sum, and an int64 tensor, which
// the ring takes.
func switchmlJob(ctx context.Context, g *Group, rep *childReport) error {
	n, r := g.Size(), g.Rank()
	const rn = 100_003
	t, err := g.NewTensor(tensor.Float32, rn)
	if err != nil {
		return err
	}
	v, _ := tensor.View[float32](t)
	val := func(r, i int) float32 { return float32(rand.New(rand.NewPCG(uint64(r), uint64(i))).NormFloat64()) }
	for i := range v {
		v[i] = val(r, i)
	}
	cr, err := g.AllReduce(ctx, t, Sum)
	if err != nil {
		return err
	}
	if cr.Backend != "switchml" || cr.Sent < int64(4*rn) || cr.Received < int64(4*rn) {
		return fmt.Errorf("float32 report %+v", cr)
	}
	rep.Paths = append(rep.Paths, fmt.Sprintf("sent %d received %d for %d bytes", cr.Sent, cr.Received, cr.Bytes))
	rep.Resent, rep.Stale = rep.Resent+cr.Resent, rep.Stale+cr.StaleReplies
	for i := 0; i < rn; i += 13 {
		var s float64
		for q := range n {
			s += float64(val(q, i))
		}
		// |x| < 8 for these values: the unit is at most 2^(3+h-31).
		if d := math.Abs(float64(v[i]) - s); d > float64(n)*math.Ldexp(1, 3+3-31)+math.Abs(s)*0x1p-23 {
			return fmt.Errorf("float32 element %d: %v, float64 sum %v", i, v[i], s)
		}
	}
	rep.Digests = append(rep.Digests, digest(t))
	_ = t.Release()

	x, err := g.NewTensor(tensor.Int32, 77_777)
	if err != nil {
		return err
	}
	xv, _ := tensor.View[int32](x)
	for i := range xv {
		xv[i] = int32(r*100_000 - i)
	}
	cr, err = g.AllReduce(ctx, x, Sum)
	if err != nil {
		return err
	}
	rep.Resent, rep.Stale = rep.Resent+cr.Resent, rep.Stale+cr.StaleReplies
	for i := range xv {
		want := int32(0)
		for q := range n {
			want += int32(q*100_000 - i)
		}
		if xv[i] != want {
			return fmt.Errorf("int32 element %d: %d, want %d", i, xv[i], want)
		}
	}
	rep.Digests = append(rep.Digests, digest(x))
	_ = x.Release()

	y, err := g.NewTensor(tensor.Int64, 1000)
	if err != nil {
		return err
	}
	yv, _ := tensor.View[int64](y)
	for i := range yv {
		yv[i] = int64(r + i)
	}
	cr, err = g.AllReduce(ctx, y, Sum)
	if err != nil {
		return err
	}
	if cr.Backend != "ring" || cr.Resent != 0 || cr.StaleReplies != 0 {
		return fmt.Errorf("int64 AllReduce ran on %q (%d resent, %d stale), want the ring, which resends nothing", cr.Backend, cr.Resent, cr.StaleReplies)
	}
	rep.Digests = append(rep.Digests, digest(y))
	return nil
}

// TestAllReduceSwitchML runs 2, 4 and 8 ranks with GDRLINK_AGGREGATOR set to
// an aggregator in this (the parent) process; rank 0's metrics count each
// call under the backend that ran it.
func TestAllReduceSwitchML(t *testing.T) {
	for _, size := range []int{2, 4, 8} {
		t.Run(strconv.Itoa(size), func(t *testing.T) {
			_, secret, err := jobauth.Generate()
			if err != nil {
				t.Fatal(err)
			}
			reps, st := runSwitchmlJob(t, secret, size, 0)
			// The metrics name the backend that ran each call: the
			// float32 and int32 calls switchml, the int64 one the ring.
			for backend, want := range map[string]float64{"switchml": 2, "ring": 1} {
				k := "gdrlink_collectives_total{backend=" + backend + ",op=allreduce,result=ok}"
				if got := reps[0].Scraped[k]; got != want {
					t.Errorf("%s = %v, want %v", k, got, want)
				}
			}
			for r, rep := range reps {
				if len(rep.Digests) != 3 {
					t.Fatalf("rank %d: %d results", r, len(rep.Digests))
				}
				for i, d := range rep.Digests {
					if d != reps[0].Digests[i] {
						t.Errorf("rank %d: result %d differs from rank 0's", r, i)
					}
				}
			}
			t.Logf("rank 0: %v; aggregator %+v", reps[0].Paths, st)
		})
	}
}

// runSwitchmlJob runs the switchml job on size ranks through an aggregator
// in this process that drops the share drop of its packets (with the job
// key secret, none if empty), each rank serving its metrics and given the
// variables extra; it returns the ranks' reports and the aggregator's
// counters once they are done.
func runSwitchmlJob(t *testing.T, secret string, size int, drop float64, extra ...string) ([]childReport, aggsrv.Stats) {
	t.Helper()
	s, env := startLossyAggregator(t, secret, size, drop)
	j := startJob(t, "switchml", size, "127.0.0.1", func(int) []string { return nil }, func(int) []string {
		return append(append(slices.Clip(env), "GDRLINK_METRICS_ADDR=127.0.0.1:0"), extra...)
	})
	reps := j.wait(3 * time.Minute)
	return reps, s.Stats()
}

// packetsPerMessage is the packets the aggregator added per rank per
// message it completed.
func packetsPerMessage(st aggsrv.Stats, ranks int) float64 {
	return float64(st.Applied) / float64(max(st.Completed, 1)) / float64(ranks)
}

// TestAllReduceSwitchMLLoss runs the switchml job twice on 2 ranks, with
// the same tensors: through a lossless aggregator, then through one that
// drops 3% of the packets it receives and sends. The results are the same
// bits; the lossy run's reports count more messages resent than the
// lossless run's, and rank 0's metrics count what its reports said.
func TestAllReduceSwitchMLLoss(t *testing.T) {
	const size = 2
	clean, cst := runSwitchmlJob(t, "", size, 0)
	lossy, lst := runSwitchmlJob(t, "", size, 0.03)
	if lst.Injected == 0 {
		t.Fatalf("the lossy aggregator dropped nothing: %+v", lst)
	}
	var cleanResent, lossyResent int64
	for r := range size {
		if len(clean[r].Digests) != 3 || len(lossy[r].Digests) != 3 {
			t.Fatalf("rank %d: %d and %d results", r, len(clean[r].Digests), len(lossy[r].Digests))
		}
		for i := range clean[r].Digests {
			if clean[r].Digests[i] != lossy[r].Digests[i] {
				t.Errorf("rank %d: result %d with loss differs from the lossless run's", r, i)
			}
		}
		cleanResent += clean[r].Resent
		lossyResent += lossy[r].Resent
		t.Logf("rank %d: lossless %d resent %d stale; lossy %d resent %d stale", r, clean[r].Resent, clean[r].Stale, lossy[r].Resent, lossy[r].Stale)
	}
	// A loaded host can time a lossless message out too (the 8-rank run
	// of TestAllReduceSwitchML does on 2 cores), so the lossless run is
	// only bounded by the lossy one.
	if lossyResent == 0 || lossyResent <= cleanResent {
		t.Errorf("the run that lost %d packets resent %d messages, the lossless run %d (aggregator %+v)", lst.Injected, lossyResent, cleanResent, cst)
	}
	for kind, want := range map[string]int64{"resent": lossy[0].Resent, "stale": lossy[0].Stale} {
		k := "gdrlink_collective_recovery_total{backend=switchml,kind=" + kind + ",op=allreduce}"
		if got := lossy[0].Scraped[k]; got != float64(want) {
			t.Errorf("rank 0: %s = %v, its reports said %d", k, got, want)
		}
	}
	t.Logf("aggregator with loss: %+v", lst)
}

// switchmlPort finds a UDP port free on 127.0.0.1 and on 127.0.net.2 ..
// 127.0.net.(1+n) for each of nets (none: net 0).
func switchmlPort(t *testing.T, n int, nets ...byte) int {
	if len(nets) == 0 {
		nets = []byte{0}
	}
	for range 10 {
		c, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
		if err != nil {
			t.Skip("cannot bind 127.0.0.1:", err)
		}
		port := c.LocalAddr().(*net.UDPAddr).Port
		c.Close()
		ok := true
		for _, nt := range nets {
			for r := range n {
				c, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, nt, byte(2+r)), Port: port})
				if err != nil {
					ok = false
					break
				}
				c.Close()
			}
		}
		if ok {
			return port
		}
	}
	t.Skip("no UDP port free on every loopback address")
	return 0
}

// TestAggregatorEnv: GDRLINK_AGGREGATOR and GDRLINK_AGGREGATOR_PORT are
// read, and bad values refused.
func TestAggregatorEnv(t *testing.T) {
	env := func(kv ...string) func(string) (string, bool) {
		m := map[string]string{}
		for i := 0; i < len(kv); i += 2 {
			m[kv[i]] = kv[i+1]
		}
		return func(k string) (string, bool) { v, ok := m[k]; return v, ok }
	}
	c, err := fromEnv(env("GDRLINK_AGGREGATOR", "10.0.0.5:4792", "GDRLINK_AGGREGATOR_PORT", "5000"))
	if err != nil || c.aggregator != "10.0.0.5:4792" || c.aggregatorPort != 5000 {
		t.Fatalf("%q %d %v", c.aggregator, c.aggregatorPort, err)
	}
	for _, kv := range [][]string{{"GDRLINK_AGGREGATOR", "10.0.0.5"}, {"GDRLINK_AGGREGATOR_PORT", "0"}, {"GDRLINK_AGGREGATOR_PORT", "70000"}} {
		if _, err := fromEnv(env(kv...)); err == nil {
			t.Errorf("%s=%s accepted", kv[0], kv[1])
		}
	}
}

// withSwitchMLNet puts rank r's switchml worker at 127.0.net.(2+r), as if
// the job ran on hosts of its own (GDRLINK_TEST_SWITCHML_NET in a child).
func withSwitchMLNet(net byte) Option {
	return func(c *config) error {
		c.switchmlLocal = func(_ string, rank int) ([4]byte, error) {
			return [4]byte{127, 0, net, byte(2 + rank)}, nil
		}
		return nil
	}
}

// startAggregator starts an aggregator in this (the parent) process for
// jobs of up to ranks ranks whose workers sit at 127.0.net.(2+rank) for
// each of nets (none: net 0), with the job key secret ("": none). It
// returns the server and the children's environment.
func startAggregator(t *testing.T, secret string, ranks int, nets ...byte) (*aggsrv.Server, []string) {
	t.Helper()
	return startLossyAggregator(t, secret, ranks, 0, nets...)
}

// startLossyAggregator is startAggregator with drop (aggsrv.Config.Drop)
// the share of packets it drops, received and sent.
func startLossyAggregator(t *testing.T, secret string, ranks int, drop float64, nets ...byte) (*aggsrv.Server, []string) {
	t.Helper()
	var key jobauth.Key
	if secret != "" {
		var err error
		if key, err = jobauth.Parse(secret); err != nil {
			t.Fatal(err)
		}
	}
	port := switchmlPort(t, ranks, nets...)
	cl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dc, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1), Port: port})
	if err != nil {
		t.Skip("aggregator port taken:", err)
	}
	s, err := aggsrv.New(aggsrv.Config{Key: key, Control: cl, Data: dc, PeerPort: uint16(port), SetupTimeout: 60 * time.Second, Drop: drop})
	if err != nil {
		t.Fatal(err)
	}
	go s.Serve()
	t.Cleanup(func() { s.Close() })
	env := []string{"GDRLINK_PROVIDER=tcp", "GDRLINK_AGGREGATOR=" + cl.Addr().String(), "GDRLINK_AGGREGATOR_PORT=" + strconv.Itoa(port)}
	if secret != "" {
		env = append(env, "GDRLINK_JOB_KEY="+secret)
	}
	return s, env
}

// switchmlTypesJob: Average of float32, float16 and bfloat16 tensors
// through the aggregator. The values are multiples of 1/4 below 2 in
// magnitude, so the block-floating-point sums are exact and each result
// is the exact sum divided by Size(), rounded once to the element type.
func switchmlTypesJob(ctx context.Context, g *Group, rep *childReport) error {
	n, r := g.Size(), g.Rank()
	const rn = 3001 // not a multiple of a block: the last block is short
	val := func(r, i int) float64 { return float64((r*3+i)%11-5) / 4 }
	sum := func(i int) float64 {
		var s float64
		for q := range n {
			s += val(q, i)
		}
		return s
	}
	for _, dt := range []tensor.DType{tensor.Float32, tensor.Float16, tensor.BFloat16} {
		t, err := g.NewTensor(dt, rn)
		if err != nil {
			return err
		}
		var want func(i int) float64
		var got func(i int) float64
		switch dt {
		case tensor.Float32:
			v, _ := tensor.View[float32](t)
			for i := range v {
				v[i] = float32(val(r, i))
			}
			want = func(i int) float64 { return float64(float32(sum(i) / float64(n))) }
			got = func(i int) float64 { return float64(v[i]) }
		case tensor.Float16:
			v, _ := tensor.View[uint16](t)
			for i := range v {
				v[i] = bfp.Float64ToF16(val(r, i))
			}
			want = func(i int) float64 { return bfp.F16ToFloat64(bfp.Float64ToF16(sum(i) / float64(n))) }
			got = func(i int) float64 { return bfp.F16ToFloat64(v[i]) }
		case tensor.BFloat16:
			v, _ := tensor.View[uint16](t)
			for i := range v {
				v[i] = bfp.Float64ToBF16(val(r, i))
			}
			want = func(i int) float64 { return float64(bfp.BF16ToFloat32(bfp.Float64ToBF16(sum(i) / float64(n)))) }
			got = func(i int) float64 { return float64(bfp.BF16ToFloat32(v[i])) }
		}
		cr, err := g.AllReduce(ctx, t, Average)
		if err != nil {
			return fmt.Errorf("%v: %w", dt, err)
		}
		if cr.Backend != "switchml" || cr.Reduce != "average" {
			return fmt.Errorf("%v: report %+v", dt, cr)
		}
		for i := range rn {
			if got(i) != want(i) {
				return fmt.Errorf("%v element %d: %v, want %v (the sum %v over %d ranks)", dt, i, got(i), want(i), sum(i), n)
			}
		}
		rep.Digests = append(rep.Digests, digest(t))
		_ = t.Release()
	}
	return nil
}

// TestAllReduceSwitchMLTypes: float32, float16 and bfloat16 Average
// through the aggregator on 3 ranks (a division that rounds) and 8.
func TestAllReduceSwitchMLTypes(t *testing.T) {
	for _, size := range []int{3, 8} {
		t.Run(strconv.Itoa(size), func(t *testing.T) {
			_, secret, err := jobauth.Generate()
			if err != nil {
				t.Fatal(err)
			}
			s, env := startAggregator(t, secret, size)
			j := startJob(t, "switchml-types", size, "127.0.0.1", func(int) []string { return nil }, func(int) []string { return env })
			reps := j.wait(4 * time.Minute)
			for r, rep := range reps {
				if len(rep.Digests) != 3 || !slices.Equal(rep.Digests, reps[0].Digests) {
					t.Errorf("rank %d: results %v, rank 0's %v", r, rep.Digests, reps[0].Digests)
				}
			}
			t.Logf("%d ranks: aggregator %+v, %v", size, s.Stats(), time.Since(j.start).Round(time.Millisecond))
		})
	}
}

// switchmlPairJob all-reduces an int32 tensor whose values depend on the
// job (GDRLINK_TEST_SEED), exact; rank 1 starts its first AllReduce
// GDRLINK_TEST_DELAY after the others, so that the ranks 0 of two jobs
// started together announce themselves to the aggregator at once.
func switchmlPairJob(ctx context.Context, g *Group, rep *childReport) error {
	seed, _ := strconv.Atoi(os.Getenv("GDRLINK_TEST_SEED"))
	if d, err := time.ParseDuration(os.Getenv("GDRLINK_TEST_DELAY")); err == nil && g.Rank() == 1 {
		time.Sleep(d)
	}
	n, r := g.Size(), g.Rank()
	const rn = 5000
	t, err := g.NewTensor(tensor.Int32, rn)
	if err != nil {
		return err
	}
	defer t.Release()
	v, _ := tensor.View[int32](t)
	val := func(r, i int) int32 { return int32(seed*1_000_000 + r*10_000 + i) }
	for i := range v {
		v[i] = val(r, i)
	}
	cr, err := g.AllReduce(ctx, t, Sum)
	if err != nil {
		return err
	}
	if cr.Backend != "switchml" {
		return fmt.Errorf("ran on %q", cr.Backend)
	}
	for i := range v {
		var want int32
		for q := range n {
			want += val(q, i)
		}
		if v[i] != want {
			return fmt.Errorf("element %d: %d, want %d: another job's data mixed in?", i, v[i], want)
		}
	}
	rep.Digests = append(rep.Digests, digest(t))
	return nil
}

// TestAllReduceSwitchMLTwoJobs: two keyless jobs of the same size, on
// one aggregator at once, their workers at addresses of their own (as on
// hosts of their own), rank 1 of each late so that both ranks 0 wait at
// the aggregator together: each job gets its own sums. With a job name
// that both jobs share, the second rank 0 is refused ("announced twice")
// or the jobs' workers end up in one job.
func TestAllReduceSwitchMLTwoJobs(t *testing.T) {
	const size = 2
	s, env := startAggregator(t, "", size, 0, 1)
	var jobs []*job
	for k := range 2 {
		jobs = append(jobs, startJob(t, "switchml-pair", size, "127.0.0.1", func(int) []string { return nil }, func(int) []string {
			return append(slices.Clip(env), "GDRLINK_TEST_SEED="+strconv.Itoa(k+1), "GDRLINK_TEST_DELAY=3s",
				"GDRLINK_TEST_SWITCHML_NET="+strconv.Itoa(k))
		}))
	}
	var digests []string
	for k, j := range jobs {
		reps := j.wait(3 * time.Minute)
		if len(reps[0].Digests) != 1 || !slices.Equal(reps[0].Digests, reps[1].Digests) {
			t.Errorf("job %d: results %v and %v", k, reps[0].Digests, reps[1].Digests)
		}
		digests = append(digests, reps[0].Digests...)
	}
	if len(digests) == 2 && digests[0] == digests[1] {
		t.Error("both jobs got the same result")
	}
	t.Logf("aggregator %+v", s.Stats())
}

// TestSwitchMLJobName: the job name is the same for the same job and
// differs with each thing that tells two jobs apart, within the control
// protocol's 64 bytes.
func TestSwitchMLJobName(t *testing.T) {
	k1, _, err := jobauth.Generate()
	if err != nil {
		t.Fatal(err)
	}
	k2, _, err := jobauth.Generate()
	if err != nil {
		t.Fatal(err)
	}
	card := func(host, ns string) hostcard.Card { return hostcard.Card{Host: host, NetNS: ns} }
	base := jobName(4, "10.0.0.1:5000", card("boot-a", "net:[1]"), jobauth.Key{})
	if again := jobName(4, "10.0.0.1:5000", card("boot-a", "net:[1]"), jobauth.Key{}); again != base {
		t.Fatalf("%q then %q", base, again)
	}
	seen := map[string]string{base: "base"}
	for what, name := range map[string]string{
		"size":        jobName(8, "10.0.0.1:5000", card("boot-a", "net:[1]"), jobauth.Key{}),
		"root port":   jobName(4, "10.0.0.1:5001", card("boot-a", "net:[1]"), jobauth.Key{}),
		"root host":   jobName(4, "10.0.0.2:5000", card("boot-a", "net:[1]"), jobauth.Key{}),
		"boot id":     jobName(4, "10.0.0.1:5000", card("boot-b", "net:[1]"), jobauth.Key{}),
		"namespace":   jobName(4, "10.0.0.1:5000", card("boot-a", "net:[2]"), jobauth.Key{}),
		"key":         jobName(4, "10.0.0.1:5000", card("boot-a", "net:[1]"), k1),
		"another key": jobName(4, "10.0.0.1:5000", card("boot-a", "net:[1]"), k2),
		// Fields are length-prefixed: moving a byte from one to the
		// next is another job.
		"shifted": jobName(4, "10.0.0.1:5000b", card("oot-a", "net:[1]"), jobauth.Key{}),
	} {
		if len(name) < 1 || len(name) > 64 {
			t.Errorf("%s: %d-byte name %q", what, len(name), name)
		}
		if prev, ok := seen[name]; ok {
			t.Errorf("%s: the same name %q as %s", what, name, prev)
		}
		seen[name] = what
	}
}

// switchmlKillJob: a first AllReduce through the aggregator; then, with
// GDRLINK_TEST_KILL=aggregator, rank 0 starts a second one at once (the
// parent closes the aggregator while it is pending) and the others start
// theirs once the file GDRLINK_TEST_GO exists (the aggregator is gone);
// with GDRLINK_TEST_KILL=RANK that rank kills itself (SIGKILL) and the
// others start a second one. Each records the error, which must come
// well within its 60 s deadline.
func switchmlKillJob(ctx context.Context, g *Group, rep *childReport) error {
	t, err := g.NewTensor(tensor.Float32, 1024)
	if err != nil {
		return err
	}
	defer t.Release()
	if _, err := g.AllReduce(ctx, t, Sum); err != nil {
		return err
	}
	kill := os.Getenv("GDRLINK_TEST_KILL")
	if kill == "aggregator" && g.Rank() != 0 {
		for _, err := os.Stat(os.Getenv("GDRLINK_TEST_GO")); err != nil; _, err = os.Stat(os.Getenv("GDRLINK_TEST_GO")) {
			if ctx.Err() != nil {
				return fmt.Errorf("waiting for the aggregator to go: %w", ctx.Err())
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	if kill == strconv.Itoa(g.Rank()) {
		_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {}
	}
	return failingAllReduce(ctx, g, t, rep, "AllReduce succeeded")
}

// failingAllReduce runs an AllReduce of t that must fail within 60 s and
// reports its error, the rank it names (-1: none) and the time it took;
// a success is an error saying succeeded.
func failingAllReduce(ctx context.Context, g *Group, t *tensor.Tensor, rep *childReport, succeeded string) error {
	return failingCall(ctx, rep, succeeded, func(ctx context.Context) error {
		_, err := g.AllReduce(ctx, t, Sum)
		return err
	})
}

// failingCall runs call, which must fail within 60 s, and reports as
// failingAllReduce does.
func failingCall(ctx context.Context, rep *childReport, succeeded string, call func(context.Context) error) error {
	actx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	start := time.Now()
	err := call(actx)
	rep.FailMS = float64(time.Since(start).Milliseconds())
	if err == nil {
		return errors.New(succeeded)
	}
	rep.FailRank, rep.Failure = -1, err.Error()
	var re *collective.RankError
	if errors.As(err, &re) {
		rep.FailRank = re.Rank
	}
	if actx.Err() != nil {
		return fmt.Errorf("the error came after the deadline: %w", err)
	}
	return nil
}

// TestAllReduceSwitchMLDeath: a killed rank fails the other ranks'
// AllReduce with a RankError naming it (and wrapping ErrPeerLost), as
// the aggregator tells them; an aggregator that goes away fails a
// pending AllReduce, and a later one, with an error naming its address.
// Both well within the calls' 60 s deadline.
func TestAllReduceSwitchMLDeath(t *testing.T) {
	t.Run("rank", func(t *testing.T) {
		const size, victim = 3, 1
		_, env := startAggregator(t, "", size)
		j := startJob(t, "switchml-kill", size, "127.0.0.1", func(int) []string { return nil }, func(int) []string {
			return append(slices.Clip(env), "GDRLINK_TEST_KILL="+strconv.Itoa(victim))
		})
		reps := j.waitDead(2*time.Minute, victim)
		for r, rep := range reps {
			if r == victim {
				continue
			}
			if rep.FailRank != victim || !strings.Contains(rep.Failure, verbsio.ErrPeerLost.Error()) {
				t.Errorf("rank %d: failure names rank %d, want %d: %s", r, rep.FailRank, victim, rep.Failure)
			}
			t.Logf("rank %d failed after %.0f ms: %s", r, rep.FailMS, rep.Failure)
		}
	})
	t.Run("aggregator", func(t *testing.T) {
		const size = 2
		s, env := startAggregator(t, "", size)
		var ctl string
		for _, e := range env {
			if v, ok := strings.CutPrefix(e, "GDRLINK_AGGREGATOR="); ok {
				ctl = v
			}
		}
		gofile := filepath.Join(t.TempDir(), "go")
		j := startJob(t, "switchml-kill", size, "127.0.0.1", func(int) []string { return nil }, func(int) []string {
			return append(slices.Clip(env), "GDRLINK_TEST_KILL=aggregator", "GDRLINK_TEST_GO="+gofile)
		})
		// The first AllReduce is one exponent-only message and one of
		// four packets from each rank; rank 0's second one begins with
		// an exponent-only message that waits for rank 1's.
		deadline := time.Now().Add(2 * time.Minute)
		for st := s.Stats(); !(st.Completed >= 2 && st.Applied > 2*(1+4)); st = s.Stats() {
			if time.Now().After(deadline) {
				t.Fatalf("rank 0's second AllReduce did not reach the aggregator: %+v", st)
			}
			time.Sleep(20 * time.Millisecond)
		}
		t.Logf("closing the aggregator: %+v", s.Stats())
		s.Close()
		if err := os.WriteFile(gofile, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		reps := j.wait(2 * time.Minute)
		for r, rep := range reps {
			if rep.FailRank != -1 || !strings.Contains(rep.Failure, ctl) {
				t.Errorf("rank %d: failure does not name the aggregator %s (or names rank %d): %s", r, ctl, rep.FailRank, rep.Failure)
			}
			t.Logf("rank %d failed after %.0f ms: %s", r, rep.FailMS, rep.Failure)
		}
	})
}

// TestSwitchMLTransportChoice: the mode, the RoCEv2 port and what the probe
// found decide the transport; forced verbs without a device fails, auto
// falls back to UDP and says why.
func TestSwitchMLTransportChoice(t *testing.T) {
	dev := worker.Verbs{Device: "mlx5_0", Port: 1, GIDIndex: 3}
	none := fmt.Errorf("%w: no ibverbs device", worker.ErrNoDevice)
	unsure := errors.New("ibv_open_device: EIO")
	for _, c := range []struct {
		mode      string
		port      uint16
		probe     error
		verbs, ok bool
		why       string
	}{
		{"", 0, nil, true, true, "mlx5_0 port 1"},
		{"auto", 4791, nil, true, true, "GID 3"},
		{"verbs", 0, nil, true, true, "mlx5_0"},
		{"udp", 0, nil, false, true, "GDRLINK_SWITCHML_TRANSPORT=udp"},
		{"", 0, none, false, true, "no ibverbs device"},
		{"auto", 0, unsure, false, true, "could not tell"},
		{"verbs", 0, none, false, false, ""},
		{"verbs", 0, unsure, false, false, ""},
		{"", 5000, nil, false, true, "4791 only"},
		{"verbs", 5000, nil, false, false, ""},
		{"udp", 5000, none, false, true, "=udp"},
	} {
		verbs, why, err := switchmlTransport(c.mode, c.port, dev, c.probe)
		if verbs != c.verbs || (err == nil) != c.ok || !strings.Contains(why, c.why) {
			t.Errorf("mode %q port %d probe %v: verbs %v why %q err %v", c.mode, c.port, c.probe, verbs, why, err)
		}
	}
}

// TestSwitchMLTransportEnv: GDRLINK_SWITCHML_TRANSPORT is read and checked.
func TestSwitchMLTransportEnv(t *testing.T) {
	for v, ok := range map[string]bool{"auto": true, "verbs": true, "udp": true, "rdma": false, "UDP": false} {
		c, err := fromEnv(func(k string) (string, bool) {
			if k == "GDRLINK_SWITCHML_TRANSPORT" {
				return v, true
			}
			return "", false
		})
		if (err == nil) != ok || ok && c.switchmlTransport != v {
			t.Errorf("GDRLINK_SWITCHML_TRANSPORT=%s: %q, %v", v, c.switchmlTransport, err)
		}
	}
}

// TestSwitchMLPacketsEnv: GDRLINK_SWITCHML_MSG_PACKETS is read and checked.
func TestSwitchMLPacketsEnv(t *testing.T) {
	for v, want := range map[string]int{"1": 1, "4": 4, "0": -1, "5": -1, "four": -1} {
		c, err := fromEnv(func(k string) (string, bool) {
			if k == "GDRLINK_SWITCHML_MSG_PACKETS" {
				return v, true
			}
			return "", false
		})
		if want < 0 && !errors.Is(err, verbsio.ErrBadConfig) || want > 0 && (err != nil || c.switchmlPackets != want) {
			t.Errorf("GDRLINK_SWITCHML_MSG_PACKETS=%s: %d, %v", v, c.switchmlPackets, err)
		}
	}
}

// TestAllReduceSwitchMLPackets runs the switchml job on 2 ranks with
// one-packet messages and with the default four-packet ones: the
// aggregator adds about one packet per rank per completed message in the
// first and about four in the second, and the results are the same bits
// (each 256-element block has its own exponent, whatever the message).
func TestAllReduceSwitchMLPackets(t *testing.T) {
	const size = 2
	one, st1 := runSwitchmlJob(t, "", size, 0, "GDRLINK_SWITCHML_MSG_PACKETS=1")
	four, st4 := runSwitchmlJob(t, "", size, 0, "GDRLINK_SWITCHML_MSG_PACKETS=4")
	per := func(st aggsrv.Stats) float64 { return packetsPerMessage(st, size) }
	t.Logf("one-packet messages: %d packets in %d messages (%.2f per rank); four-packet: %d in %d (%.2f)",
		st1.Applied, st1.Completed, per(st1), st4.Applied, st4.Completed, per(st4))
	if p := per(st1); p < 0.9 || p > 1.1 {
		t.Errorf("one-packet messages: %.2f packets per rank per message", p)
	}
	// The first message of each queue pair carries the exponents alone
	// (one packet), so a little under four.
	if p := per(st4); p < 3.5 || p > 4 {
		t.Errorf("four-packet messages: %.2f packets per rank per message", p)
	}
	for r := range size {
		for i := range one[r].Digests {
			if one[r].Digests[i] != four[r].Digests[i] {
				t.Errorf("rank %d: result %d with one-packet messages differs from the four-packet one", r, i)
			}
		}
	}
}

// switchmlMismatchJob: one AllReduce through the aggregator, whose
// error, and the time it took, the rank reports; a success is an error.
func switchmlMismatchJob(ctx context.Context, g *Group, rep *childReport) error {
	t, err := g.NewTensor(tensor.Float32, 4096)
	if err != nil {
		return err
	}
	defer t.Release()
	return failingAllReduce(ctx, g, t, rep, "AllReduce succeeded with ranks of different message sizes")
}

// TestAllReduceSwitchMLSizeMismatch: rank 0 asks for four-packet messages,
// rank 1 for one-packet ones (GDRLINK_SWITCHML_MSG_PACKETS). Their pool
// indexes would hold messages of different sizes, so the aggregator's job
// setup refuses the job (the ranks announce different slot counts): both
// ranks' AllReduce fail, well within the call's deadline, and neither
// adds a packet.
func TestAllReduceSwitchMLSizeMismatch(t *testing.T) {
	const size = 2
	s, env := startAggregator(t, "", size)
	j := startJob(t, "switchml-mismatch", size, "127.0.0.1", func(int) []string { return nil }, func(r int) []string {
		return append(slices.Clip(env), "GDRLINK_SWITCHML_MSG_PACKETS="+[]string{"4", "1"}[r])
	})
	reps := j.wait(2 * time.Minute)
	var slots bool
	for r, rep := range reps {
		if rep.Failure == "" {
			t.Errorf("rank %d: no failure reported", r)
		}
		slots = slots || strings.Contains(rep.Failure, "slots")
		t.Logf("rank %d failed after %.0f ms: %s", r, rep.FailMS, rep.Failure)
	}
	if !slots {
		t.Error("no rank's error names the slot counts that differ")
	}
	if st := s.Stats(); st.Applied != 0 {
		t.Errorf("the aggregator added %d packets of a refused job", st.Applied)
	}
}

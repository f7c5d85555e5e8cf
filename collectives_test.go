package gdrlink

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"math/bits"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/gdrlink/gdrlink/collective"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

// The collectives' tests run jobs of real processes (this test binary
// again, as the other front-door tests do): 2 to 8 ranks on this host,
// over onnode and tcp, and across two network namespaces.

// collCase is one tensor the collective job reduces.
type collCase struct {
	dt tensor.DType
	n  int64
	op ReduceOp
}

// collCases: every type the issue names, sizes from one element to 3 MiB
// (several segments per chunk), both reductions.
var collCases = []collCase{
	{tensor.Float32, 1, Sum}, {tensor.Float32, 1000, Average}, {tensor.Float32, 3 << 18, Sum},
	{tensor.Float64, 12345, Sum}, {tensor.Float64, 777, Average},
	{tensor.Int32, 100003, Sum}, {tensor.Int64, 4096, Sum}, {tensor.Int64, 50, Average},
	{tensor.BFloat16, 3000, Sum}, {tensor.Float16, 3001, Average},
}

// collValue is rank r's element i of case c: a small integer, so that
// every sum is exact in every type and its float64 sum is the answer.
func collValue(c, r int, i int64) int64 { return (int64(r)*31+i*7+int64(c)*5)%33 - 16 }

// collWant is the element every rank must end with, from float64
// arithmetic on the inputs of every rank.
func collWant(c int, cs collCase, size int, i int64) float64 {
	var s float64
	for r := range size {
		s += float64(collValue(c, r, i))
	}
	if cs.op == Average {
		s /= float64(size)
		switch cs.dt {
		case tensor.Int32, tensor.Int64:
			s = math.Trunc(s)
		case tensor.Float32:
			s = float64(float32(s))
		case tensor.Float16:
			s = halfValue(halfOf(s))
		}
	}
	return s
}

// setElem and elem write and read element i as a float64 (the 16-bit
// floats through the collective package's conversions are not needed:
// the values are small integers, exact in every type).
func setElem(t *tensor.Tensor, i int64, v float64) {
	switch t.Meta().DType {
	case tensor.Float32:
		s, _ := tensor.View[float32](t)
		s[i] = float32(v)
	case tensor.Float64:
		s, _ := tensor.View[float64](t)
		s[i] = v
	case tensor.Int32:
		s, _ := tensor.View[int32](t)
		s[i] = int32(v)
	case tensor.Int64:
		s, _ := tensor.View[int64](t)
		s[i] = int64(v)
	case tensor.BFloat16:
		s, _ := tensor.View[uint16](t)
		s[i] = uint16(math.Float32bits(float32(v)) >> 16) // exact for small integers
	case tensor.Float16:
		s, _ := tensor.View[uint16](t)
		s[i] = halfOf(v)
	}
}

func elem(t *tensor.Tensor, i int64) float64 {
	switch t.Meta().DType {
	case tensor.Float32:
		s, _ := tensor.View[float32](t)
		return float64(s[i])
	case tensor.Float64:
		s, _ := tensor.View[float64](t)
		return s[i]
	case tensor.Int32:
		s, _ := tensor.View[int32](t)
		return float64(s[i])
	case tensor.Int64:
		s, _ := tensor.View[int64](t)
		return float64(s[i])
	case tensor.BFloat16:
		s, _ := tensor.View[uint16](t)
		return float64(math.Float32frombits(uint32(s[i]) << 16))
	case tensor.Float16:
		s, _ := tensor.View[uint16](t)
		return halfValue(s[i])
	}
	return math.NaN()
}

// halfOf and halfValue convert normal IEEE halves (and zero), enough for
// the test's values (halfOf rounds ties away from zero: the averages of
// small integers over 3, 5, 6 or 7 ranks never tie), written here apart
// from the package's conversions.
func halfOf(v float64) uint16 {
	if v == 0 {
		return 0
	}
	var sign uint16
	if v < 0 {
		sign, v = 0x8000, -v
	}
	frac, exp := math.Frexp(v) // v = frac × 2^exp, frac in [0.5, 1)
	return sign | uint16(exp-1+15)<<10 | uint16(math.Round((frac*2-1)*1024))
}

func halfValue(h uint16) float64 {
	if h&0x7fff == 0 {
		return 0
	}
	v := math.Ldexp(1+float64(h&0x3ff)/1024, int(h>>10&0x1f)-15)
	if h&0x8000 != 0 {
		return -v
	}
	return v
}

func digest(t *tensor.Tensor) string {
	b, _ := t.Bytes()
	h := sha256.Sum256(b)
	return hex.EncodeToString(h[:8])
}

// collJob: every case through AllReduce, checked element by element
// against the float64 sums; a random float32 tensor (sums that round)
// whose digest the parent compares across ranks; a Broadcast from each
// root and an AllGather.
func collJob(ctx context.Context, g *Group, rep *childReport) error {
	n, r := g.Size(), g.Rank()
	for c, cs := range collCases {
		t, err := g.NewTensor(cs.dt, cs.n)
		if err != nil {
			return err
		}
		for i := range cs.n {
			setElem(t, i, float64(collValue(c, r, i)))
		}
		cr, err := g.AllReduce(ctx, t, cs.op)
		if err != nil {
			return fmt.Errorf("case %d (%s[%d] op %d): %w", c, cs.dt, cs.n, cs.op, err)
		}
		for i := range cs.n {
			if got, want := elem(t, i), collWant(c, cs, n, i); got != want {
				return fmt.Errorf("case %d (%s[%d] op %d): element %d is %v, want %v", c, cs.dt, cs.n, cs.op, i, got, want)
			}
		}
		if n > 1 && cs.n >= int64(n) && (cr.Backend != "ring" || cr.Sent == 0 || cr.Received == 0 || len(cr.Links) == 0) {
			return fmt.Errorf("case %d: report %+v", c, cr)
		}
		if cr.Algorithm == "doubling" {
			// log2(n) steps, each the whole tensor, and no all-gather.
			if want := int64(bits.Len(uint(n))-1) * cs.n * int64(cs.dt.Size()); cr.Sent != want || cr.Placed != 0 {
				return fmt.Errorf("case %d by doubling: sent %d bytes, placed %d, want %d and 0", c, cr.Sent, cr.Placed, want)
			}
			rep.DoublingCalls++
		} else if cr.Placed > 0 {
			rep.PlacedCalls++
		}
		for _, l := range cr.Links {
			rep.Paths = append(rep.Paths, fmt.Sprintf("%d:%s/%s", l.Peer, l.Provider, l.Path))
		}
		rep.Digests = append(rep.Digests, digest(t))
		_ = t.Release()
	}
	// Random float32s: the sums round, so only the fixed order of
	// additions makes the ranks agree; the parent compares digests, and
	// each rank checks the result against float64 sums within rounding.
	const rn = 1<<20 + 3
	t, err := g.NewTensor(tensor.Float32, rn)
	if err != nil {
		return err
	}
	v, _ := tensor.View[float32](t)
	val := func(r int, i int) float32 {
		return float32(rand.New(rand.NewPCG(uint64(r), uint64(i))).NormFloat64())
	}
	for i := range v {
		v[i] = val(r, i)
	}
	if _, err := g.AllReduce(ctx, t, Sum); err != nil {
		return err
	}
	for i := 0; i < rn; i += 997 {
		var s float64
		for q := range n {
			s += float64(val(q, i))
		}
		if math.Abs(float64(v[i])-s) > 1e-5*float64(n)*(1+math.Abs(s)) {
			return fmt.Errorf("random element %d: %v, float64 sum %v", i, v[i], s)
		}
	}
	rep.Digests = append(rep.Digests, digest(t))
	_ = t.Release()

	for root := range n {
		t, err := g.NewTensor(tensor.Int64, 100001)
		if err != nil {
			return err
		}
		w, _ := tensor.View[int64](t)
		for i := range w {
			w[i] = int64(r*1_000_000 + i)
		}
		br, err := g.Broadcast(ctx, t, root)
		if err != nil {
			return err
		}
		rep.Copied += br.Received - br.Placed
		if br.Placed > 0 {
			rep.PlacedCalls++
		}
		for i := range w {
			if w[i] != int64(root*1_000_000+i) {
				return fmt.Errorf("broadcast from %d: element %d is %d", root, i, w[i])
			}
		}
		_ = t.Release()
	}
	in, err := g.NewTensor(tensor.Float64, 3, 1001)
	if err != nil {
		return err
	}
	out, err := g.NewTensor(tensor.Float64, int64(n), 3, 1001)
	if err != nil {
		return err
	}
	iv, _ := tensor.View[float64](in)
	for i := range iv {
		iv[i] = float64(r) + float64(i)/8
	}
	gr, err := g.AllGather(ctx, in, out)
	if err != nil {
		return err
	}
	rep.Copied += gr.Received - gr.Placed
	if gr.Placed > 0 {
		rep.PlacedCalls++
	}
	if err := checkGathered(out, n, len(iv)); err != nil {
		return err
	}
	_ = in.Release()
	_ = out.Release()
	if err := recvIntoJob(ctx, g, rep); err != nil {
		return err
	}
	// Zero-copy: every piece went out from the caller's tensor itself,
	// none through a staging copy.
	if st := g.Stats().Protocol; st.Staged != 0 {
		return fmt.Errorf("%d sends were staged", st.Staged)
	}
	return nil
}

// recvIntoJob: rank 0 sends rank 1 a tensor smaller than the one rank 1
// receives it into (RecvInto); rank 1 checks the front and that the rest
// is as it was, and counts the transfer as placed or copied.
func recvIntoJob(ctx context.Context, g *Group, rep *childReport) error {
	const sent, room = 3000, 4096
	switch g.Rank() {
	case 0:
		src, err := g.NewTensor(tensor.Int32, sent)
		if err != nil {
			return err
		}
		v, _ := tensor.View[int32](src)
		for i := range v {
			v[i] = int32(7*i + 1)
		}
		return g.Send(1, "recv-into", 0, src)
	case 1:
		dst, err := g.NewTensor(tensor.Int32, room)
		if err != nil {
			return err
		}
		defer dst.Release()
		v, _ := tensor.View[int32](dst)
		for i := range v {
			v[i] = -1
		}
		tr, err := g.RecvInto(ctx, dst, 0, "recv-into", 0)
		if err != nil {
			return err
		}
		for i := range v {
			want := int32(-1)
			if i < sent {
				want = int32(7*i + 1)
			}
			if v[i] != want {
				return fmt.Errorf("RecvInto: element %d is %d, want %d (%+v)", i, v[i], want, tr)
			}
		}
		if tr.Meta.ByteSize != 4*sent {
			return fmt.Errorf("RecvInto: transfer says %s came, want %d int32s", tr.Meta, sent)
		}
		if tr.Placed {
			rep.PlacedCalls++
		} else {
			rep.Copied += tr.Bytes
		}
	}
	return nil
}

// checkGathered checks an AllGather's out of n slots of per elements each:
// rank q's element i is q + i/8.
func checkGathered(out *tensor.Tensor, n, per int) error {
	ov, _ := tensor.View[float64](out)
	for q := range n {
		for i := range per {
			if got, want := ov[q*per+i], float64(q)+float64(i)/8; got != want {
				return fmt.Errorf("allgather slot %d element %d: %v, want %v", q, i, got, want)
			}
		}
	}
	return nil
}

// checkCollJob checks a collective job's reports: the same digests on
// every rank, and the provider wanted on every link.
func checkCollJob(t *testing.T, reps []childReport, provider string) {
	t.Helper()
	for r, rep := range reps {
		if len(rep.Digests) != len(collCases)+1 {
			t.Fatalf("rank %d: %d digests, want %d", r, len(rep.Digests), len(collCases)+1)
		}
		for i, d := range rep.Digests {
			if d != reps[0].Digests[i] {
				t.Errorf("rank %d: result %d differs from rank 0's (%s, %s)", r, i, d, reps[0].Digests[i])
			}
		}
		if provider == "onnode" || provider == "tcp" {
			// Both grant the sender a receive's bytes alone, so every
			// all-gather step, broadcast and AllGather lands in place.
			if rep.Copied != 0 || rep.PlacedCalls < (len(collCases)-rep.DoublingCalls)/2 {
				t.Errorf("rank %d: %d bytes of broadcasts, allgathers and RecvInto copied, %d calls with bytes placed; want none copied, and most calls with bytes placed", r, rep.Copied, rep.PlacedCalls)
			}
		}
		for _, p := range rep.Paths {
			// none: an empty piece (a tensor of fewer elements than ranks);
			// eager: a piece of up to 4 KiB sent before its Recv asked.
			_, p, _ = strings.Cut(p, ":")
			if p != provider+"/direct" && p != provider+"/eager" && p != provider+"/none" {
				t.Errorf("rank %d: a collective's bytes came by %s, want %s/direct", r, p, provider)
				break
			}
		}
	}
}

// TestAllReduceProcesses: 2, 3, 5 and 8 ranks on onnode and tcp.
func TestAllReduceProcesses(t *testing.T) {
	for _, provider := range []string{"onnode", "tcp"} {
		for _, size := range []int{2, 3, 5, 8} {
			t.Run(fmt.Sprintf("%s/%d", provider, size), func(t *testing.T) {
				if size == 8 && testing.Short() {
					t.Skip("8 processes: not in -short")
				}
				collProcesses(t, provider, size)
			})
		}
	}
}

// TestCollectivesIbverbs is TestAllReduceProcesses and
// TestAllReduceRankKilled on ibverbs, where there is a device (make
// test-rdma runs it on Soft-RoCE); it skips with the reason elsewhere,
// and fails where GDRLINK_REQUIRE_RDMA=1 says the device must be there.
func TestCollectivesIbverbs(t *testing.T) {
	p, err := verbsio.Lookup("ibverbs")
	if err == nil {
		_, err = p.Devices()
	}
	if err != nil {
		if os.Getenv("GDRLINK_REQUIRE_RDMA") == "1" {
			t.Fatalf("GDRLINK_REQUIRE_RDMA=1 but ibverbs is not usable: %v", err)
		}
		t.Skipf("provider ibverbs not usable here: %v", err)
	}
	for _, size := range []int{2, 4} {
		t.Run(fmt.Sprintf("allreduce/%d", size), func(t *testing.T) { collProcesses(t, "ibverbs", size) })
	}
	t.Run("killed", func(t *testing.T) { rankKilled(t, "ibverbs") })
}

// collProcesses runs the collective job on size processes over provider.
func collProcesses(t *testing.T, provider string, size int) {
	j := startJob(t, "collectives", size, "127.0.0.1", func(int) []string { return nil },
		func(int) []string { return []string{"GDRLINK_PROVIDER=" + provider} })
	checkCollJob(t, j.wait(3*time.Minute), provider)
}

// TestAllReduceAcrossNamespaces: four ranks, two of them in another
// network namespace joined by veth; the two links that cross it are tcp
// (or ibverbs), the others onnode, and the results agree bit for bit.
func TestAllReduceAcrossNamespaces(t *testing.T) {
	ip, ns, hostIP := vethNamespace(t, "coll")
	key, err := NewJobKey()
	if err != nil {
		t.Fatal(err)
	}
	const size = 4
	j := startJob(t, "collectives", size, hostIP, func(r int) []string {
		if r >= size/2 {
			return []string{ip, "netns", "exec", ns}
		}
		return nil
	}, func(int) []string { return []string{"GDRLINK_JOB_KEY=" + key} })
	reps := j.wait(3 * time.Minute)
	for i := range reps {
		// Across the namespaces tcp, or ibverbs where both see a device;
		// within one onnode. Ranks receive from their predecessor round
		// the ring (0 from 3 and 2 from 1 across the namespaces, 1 and 3
		// within one), and by halving from partners at distances 2
		// (across) and 1 (within).
		var across int
		for _, e := range reps[i].Paths {
			peer, p, _ := strings.Cut(e, ":")
			q, _ := strconv.Atoi(peer)
			switch crosses := (q >= size/2) != (i >= size/2); {
			case crosses && p != "tcp/direct" && p != "ibverbs/direct" && p != "tcp/none" && p != "ibverbs/none":
				t.Errorf("rank %d: bytes from rank %d, across the namespaces, came by %s", i, q, p)
			case !crosses && p != "onnode/direct" && p != "onnode/eager" && p != "onnode/none":
				t.Errorf("rank %d: bytes from rank %d, in its namespace, came by %s", i, q, p)
			case crosses:
				across++
			}
		}
		reps[i].Paths = nil
		if across == 0 {
			t.Errorf("rank %d: no bytes came across the namespaces", i)
		}
	}
	checkCollJob(t, reps, "")
}

// killJob: a first AllReduce connects the ring; then the victim kills
// itself (SIGKILL: no goodbye) and the others start a second one, which
// must fail with a RankError naming it well before the deadline.
func killJob(ctx context.Context, g *Group, rep *childReport) error {
	victim, _ := strconv.Atoi(os.Getenv("GDRLINK_TEST_VICTIM"))
	t, err := g.NewTensor(tensor.Float32, 1<<20)
	if err != nil {
		return err
	}
	defer t.Release()
	if _, err := g.AllReduce(ctx, t, Sum); err != nil {
		return err
	}
	// Every rank has finished the first call before the victim dies: a
	// rank's call returns once its own pieces are in and its sends taken,
	// which may be before a partner's last receive from it is done (the
	// barrier goes through rank 0 over the bootstrap, not the victim).
	if err := g.Barrier(ctx); err != nil {
		return err
	}
	if g.Rank() == victim {
		_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {}
	}
	actx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	start := time.Now()
	_, err = g.AllReduce(actx, t, Sum)
	rep.FailMS = float64(time.Since(start).Milliseconds())
	var re *collective.RankError
	switch {
	case err == nil:
		return errors.New("AllReduce with a dead rank succeeded")
	case !errors.As(err, &re):
		return fmt.Errorf("not a RankError: %w", err)
	}
	rep.FailRank, rep.Failure = re.Rank, err.Error()
	if _, err := g.AllReduce(ctx, t, Sum); !errors.Is(err, collective.ErrBroken) {
		return fmt.Errorf("the collective after the failure: %v, want collective.ErrBroken", err)
	}
	// A rank that closed its group at once could be named by its
	// successor in place of the dead one (it closed before the successor
	// asked for the step that carries the news); a job's ranks handle
	// the error a while, as these do here.
	time.Sleep(2 * time.Second)
	return nil
}

// TestAllReduceRankKilled: on onnode and tcp, 4 ranks, one killed; every
// other rank's AllReduce fails with a RankError naming it within the
// deadline (60 s; it takes about a second).
func TestAllReduceRankKilled(t *testing.T) {
	for _, provider := range []string{"onnode", "tcp"} {
		t.Run(provider, func(t *testing.T) { rankKilled(t, provider) })
	}
}

// rankKilled runs the kill job on 4 processes over provider.
func rankKilled(t *testing.T, provider string) {
	const size, victim = 4, 2
	j := startJob(t, "collectives-kill", size, "127.0.0.1", func(int) []string { return nil },
		func(int) []string {
			return []string{"GDRLINK_PROVIDER=" + provider, "GDRLINK_TEST_VICTIM=" + strconv.Itoa(victim)}
		})
	done := make(chan struct{})
	go func() {
		for _, c := range j.cmds {
			c.Wait()
		}
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(2 * time.Minute):
		for _, c := range j.cmds {
			c.Process.Kill()
		}
		<-done
		t.Fatal("the job did not end within 2 minutes")
	}
	for r, c := range j.cmds {
		if r == victim {
			if ws, ok := c.ProcessState.Sys().(syscall.WaitStatus); !ok || ws.Signal() != syscall.SIGKILL {
				t.Errorf("the victim ended with %v: %s", c.ProcessState, j.errs[r])
			}
			continue
		}
		if !c.ProcessState.Success() {
			t.Errorf("rank %d: %v: %s", r, c.ProcessState, j.errs[r])
			continue
		}
		var rep childReport
		sc := bufio.NewScanner(j.outs[r])
		var line []byte
		for sc.Scan() {
			line = sc.Bytes()
		}
		if err := json.Unmarshal(line, &rep); err != nil {
			t.Fatalf("rank %d printed %q: %v", r, j.outs[r], err)
		}
		if rep.FailRank != victim {
			t.Errorf("rank %d: failure names rank %d, want %d: %s", r, rep.FailRank, victim, rep.Failure)
		}
		t.Logf("rank %d failed after %.0f ms: %s", r, rep.FailMS, rep.Failure)
	}
}

// collectiveVecs collects the collective metrics of m alone.
type collectiveVecs struct{ m *metrics }

func (c collectiveVecs) Describe(ch chan<- *prometheus.Desc) {
	c.m.collectives.Describe(ch)
	c.m.collectiveBytes.Describe(ch)
	c.m.collectiveRecovery.Describe(ch)
	c.m.collectiveTook.Describe(ch)
}

func (c collectiveVecs) Collect(ch chan<- prometheus.Metric) {
	c.m.collectives.Collect(ch)
	c.m.collectiveBytes.Collect(ch)
	c.m.collectiveRecovery.Collect(ch)
	c.m.collectiveTook.Collect(ch)
}

// TestCollectiveMetrics: calls by result, wire bytes by direction,
// switchml's resends and stale replies, and the duration of the
// successful ones.
func TestCollectiveMetrics(t *testing.T) {
	m := newMetrics(nil)
	m.collective("allreduce", "ring", collective.Report{Sent: 100, Received: 300, Took: time.Millisecond}, nil)
	m.collective("allreduce", "ring", collective.Report{Sent: 50, Received: 0}, errors.New("lost"))
	m.collective("broadcast", "ring", collective.Report{Received: 7, Took: time.Millisecond}, nil)
	m.collective("allreduce", "switchml", collective.Report{Sent: 4, Received: 4, Resent: 3, StaleReplies: 2, Took: time.Millisecond}, nil)
	m.collective("allreduce", "switchml", collective.Report{Resent: 1}, errors.New("aggregator lost"))
	fams := gather(t, collectiveVecs{m})
	for _, c := range []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{"gdrlink_collectives_total", map[string]string{"op": "allreduce", "backend": "ring", "result": "ok"}, 1},
		{"gdrlink_collectives_total", map[string]string{"op": "allreduce", "backend": "ring", "result": "error"}, 1},
		{"gdrlink_collectives_total", map[string]string{"op": "broadcast", "backend": "ring", "result": "ok"}, 1},
		{"gdrlink_collective_bytes_total", map[string]string{"op": "allreduce", "backend": "ring", "direction": "out"}, 150},
		{"gdrlink_collective_bytes_total", map[string]string{"op": "allreduce", "backend": "ring", "direction": "in"}, 300},
		{"gdrlink_collective_bytes_total", map[string]string{"op": "broadcast", "backend": "ring", "direction": "in"}, 7},
		{"gdrlink_collective_recovery_total", map[string]string{"op": "allreduce", "backend": "switchml", "kind": "resent"}, 4},
		{"gdrlink_collective_recovery_total", map[string]string{"op": "allreduce", "backend": "switchml", "kind": "stale"}, 2},
		{"gdrlink_collective_recovery_total", map[string]string{"op": "allreduce", "backend": "ring", "kind": "resent"}, 0},
	} {
		if got, ok := value(fams[c.name], c.labels); !ok || got != c.want {
			t.Errorf("%s%v = %v (found %v), want %v", c.name, c.labels, got, ok, c.want)
		}
	}
	h := fams["gdrlink_collective_duration_seconds"]
	if h == nil || len(h.GetMetric()) != 3 || h.GetMetric()[0].GetHistogram().GetSampleCount() != 1 {
		t.Errorf("duration histogram: %v, want one observation for each op and backend", h)
	}
}

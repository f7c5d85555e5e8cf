package gdrlink

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/internal/cpubind"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

// bindJob all-reduces a small tensor (so the connections and their
// threads exist), then reports the binding and every thread's mask.
func bindJob(ctx context.Context, g *Group, rep *childReport) error {
	t, err := g.NewTensor(tensor.Float32, 4096)
	if err != nil {
		return err
	}
	defer t.Release()
	if _, err := g.AllReduce(ctx, t, Sum); err != nil {
		return err
	}
	s := g.Stats()
	rep.CPUs, rep.Unbound, rep.Yield, rep.Procs, rep.MaxProcs = s.CPUs, s.Unbound, s.Yield, s.Procs, runtime.GOMAXPROCS(0)
	masks, err := cpubind.ThreadMasks()
	if err != nil {
		return err
	}
	for _, m := range masks {
		if !slices.ContainsFunc(rep.ThreadCPUs, func(x []int) bool { return slices.Equal(x, m) }) {
			rep.ThreadCPUs = append(rep.ThreadCPUs, m)
		}
	}
	return nil
}

// TestCPUBinding: with GDRLINK_BIND=cores the ranks of this host get
// disjoint, equal shares of its CPUs, every thread of each (those started
// after Join included) runs on its share alone, and GOMAXPROCS is the
// share's size; with more ranks than CPUs none is bound, and each says
// why. Without the variable nothing is bound. Polls yield the CPU
// (Stats.Yield) where there are more ranks than CPUs, bound or not, and
// nowhere else unless GDRLINK_YIELD says so; where they yield by default
// and the ranks meet over onnode, GOMAXPROCS becomes the rank's share of
// the CPUs (one), unless the GOMAXPROCS variable is set.
func TestCPUBinding(t *testing.T) {
	allowed, err := cpubind.Allowed()
	if err != nil {
		t.Fatal(err)
	}
	if len(allowed) < 2 {
		t.Skipf("this process may run on %d CPU: binding two ranks needs two", len(allowed))
	}
	run := func(size int, bind string, more ...string) []childReport {
		t.Helper()
		j := startJob(t, "bind", size, "127.0.0.1", func(int) []string { return nil }, func(int) []string {
			env := append([]string{"GDRLINK_PROVIDER=onnode", "GOMAXPROCS=", "GDRLINK_YIELD="}, more...)
			if bind != "" {
				env = append(env, "GDRLINK_BIND="+bind)
			}
			return env
		})
		return j.wait(time.Minute)
	}
	yields := func(what string, reps []childReport, want bool) {
		t.Helper()
		for _, rep := range reps {
			if rep.Yield != want {
				t.Errorf("%s: rank %d's polls yield the CPU: %v, want %v", what, rep.Rank, rep.Yield, want)
			}
		}
	}
	// procs checks GOMAXPROCS (want) and whether Join set it (Stats.Procs).
	procs := func(what string, reps []childReport, want int, set bool) {
		t.Helper()
		for _, rep := range reps {
			if rep.MaxProcs != want || (rep.Procs != 0) != set || (set && rep.Procs != want) {
				t.Errorf("%s: rank %d: GOMAXPROCS %d, Stats.Procs %d; want GOMAXPROCS %d, set by Join: %v", what, rep.Rank, rep.MaxProcs, rep.Procs, want, set)
			}
		}
	}
	reps := run(2, "cores")
	per := len(allowed) / 2
	seen := map[int]int{}
	for _, rep := range reps {
		if len(rep.CPUs) != per || rep.Unbound != "" {
			t.Fatalf("rank %d: bound to %v (%q), want %d of %v", rep.Rank, rep.CPUs, rep.Unbound, per, allowed)
		}
		for _, c := range rep.CPUs {
			if r, ok := seen[c]; ok {
				t.Fatalf("CPU %d is both rank %d's and rank %d's", c, r, rep.Rank)
			}
			if !slices.Contains(allowed, c) {
				t.Fatalf("rank %d bound to CPU %d, which this host's ranks may not use (%v)", rep.Rank, c, allowed)
			}
			seen[c] = rep.Rank
		}
		if len(rep.ThreadCPUs) != 1 || !slices.Equal(rep.ThreadCPUs[0], rep.CPUs) {
			t.Errorf("rank %d: its threads run on %v, want all on %v", rep.Rank, rep.ThreadCPUs, rep.CPUs)
		}
		if rep.MaxProcs != per {
			t.Errorf("rank %d: GOMAXPROCS %d, want %d", rep.Rank, rep.MaxProcs, per)
		}
	}
	yields("2 ranks bound", reps, false)
	procs("2 ranks bound", reps, per, false)
	over := run(len(allowed)+1, "cores")
	overWhat := fmt.Sprintf("%d ranks on %d CPUs", len(allowed)+1, len(allowed))
	yields(overWhat, over, true)
	procs(overWhat, over, 1, true)
	for _, rep := range over {
		if rep.CPUs != nil || rep.Unbound == "" {
			t.Fatalf("%d ranks on %d CPUs: rank %d bound to %v (%q), want unbound with a reason", len(allowed)+1, len(allowed), rep.Rank, rep.CPUs, rep.Unbound)
		}
		if len(rep.ThreadCPUs) != 1 || !slices.Equal(rep.ThreadCPUs[0], allowed) {
			t.Errorf("rank %d, unbound: threads on %v, want %v", rep.Rank, rep.ThreadCPUs, allowed)
		}
	}
	t.Logf("%d ranks on %d CPUs: %s", len(allowed)+1, len(allowed), over[0].Unbound)
	floating := run(2, "")
	for _, rep := range floating {
		if rep.CPUs != nil || len(rep.ThreadCPUs) != 1 || !slices.Equal(rep.ThreadCPUs[0], allowed) {
			t.Errorf("no binding asked: rank %d bound to %v, threads on %v", rep.Rank, rep.CPUs, rep.ThreadCPUs)
		}
	}
	yields("2 ranks floating", floating, false)
	procs("2 ranks floating", floating, len(allowed), false)
	on := run(2, "", "GDRLINK_YIELD=on")
	yields("GDRLINK_YIELD=on", on, true)
	procs("GDRLINK_YIELD=on", on, len(allowed), false)
	off := run(len(allowed)+1, "", "GDRLINK_YIELD=off")
	yields("GDRLINK_YIELD=off", off, false)
	procs("GDRLINK_YIELD=off", off, len(allowed), false)
	overFloating := run(len(allowed)+1, "")
	yields(overWhat+", floating", overFloating, true)
	procs(overWhat+", floating", overFloating, 1, true)
	overTCP := run(len(allowed)+1, "", "GDRLINK_PROVIDER=tcp")
	yields(overWhat+", over tcp", overTCP, true)
	procs(overWhat+", over tcp", overTCP, len(allowed), false)
	given := run(len(allowed)+1, "", fmt.Sprintf("GOMAXPROCS=%d", len(allowed)))
	yields(overWhat+", GOMAXPROCS given", given, true)
	procs(overWhat+", GOMAXPROCS given", given, len(allowed), false)
}

// TestProcsShareInProcess: ranks that are goroutines of one process share
// its CPUs rather than compete for them, so more of them than CPUs yield
// their polls but leave GOMAXPROCS alone; and Close puts back a
// GOMAXPROCS that Join lowered.
func TestProcsShareInProcess(t *testing.T) {
	allowed, err := cpubind.Allowed()
	if err != nil {
		t.Fatal(err)
	}
	t.Setenv("GOMAXPROCS", "")
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(len(allowed)))
	gs := joinRanks(t, len(allowed)+1, WithProvider("onnode"))
	for _, g := range gs {
		s := g.Stats()
		if !s.Yield || s.Procs != 0 {
			t.Errorf("rank %d of %d in this process on %d CPUs: Yield %v, Procs %d; want true, 0", s.Rank, s.Size, len(allowed), s.Yield, s.Procs)
		}
	}
	if n := runtime.GOMAXPROCS(0); n != len(allowed) {
		t.Errorf("GOMAXPROCS %d after Join, want %d as before", n, len(allowed))
	}
	// A Group that lowered it (as one of separate processes would have)
	// puts it back at Close, unless it was changed since.
	for _, changed := range []bool{false, true} {
		g := gs[0]
		g.procs, g.procsBefore = 1, len(allowed)
		runtime.GOMAXPROCS(1)
		want := len(allowed)
		if changed {
			runtime.GOMAXPROCS(3)
			want = 3
		}
		g.restoreProcs()
		if n := runtime.GOMAXPROCS(0); n != want {
			t.Errorf("changed since Join: %v: GOMAXPROCS %d after restore, want %d", changed, n, want)
		}
		runtime.GOMAXPROCS(len(allowed))
	}
	for _, g := range gs {
		if err := g.Close(); err != nil {
			t.Error(err)
		}
	}
}

// TestCPUBindingConfig: GDRLINK_BIND takes cores or none, and names what
// it wants otherwise.
func TestCPUBindingConfig(t *testing.T) {
	bind := func(v string) func(string) (string, bool) {
		return func(k string) (string, bool) {
			if k != "GDRLINK_BIND" {
				return "", false
			}
			return v, true
		}
	}
	for v, want := range map[string]bool{"cores": true, "none": false, "": false} {
		c, err := fromEnv(bind(v))
		if err != nil || c.bind != want {
			t.Errorf("GDRLINK_BIND=%s: %v, %v; want %v", v, c.bind, err, want)
		}
	}
	_, err := fromEnv(bind("socket"))
	if !errors.Is(err, verbsio.ErrBadConfig) || !strings.Contains(err.Error(), `GDRLINK_BIND="socket", want cores or none`) {
		t.Errorf("GDRLINK_BIND=socket: %v, want ErrBadConfig naming cores and none", err)
	}
	yield := func(v string) func(string) (string, bool) {
		return func(k string) (string, bool) {
			if k != "GDRLINK_YIELD" {
				return "", false
			}
			return v, true
		}
	}
	for _, v := range []string{"", "auto", "on", "off"} {
		if c, err := fromEnv(yield(v)); err != nil || c.yield != v {
			t.Errorf("GDRLINK_YIELD=%s: %q, %v", v, c.yield, err)
		}
	}
	_, err = fromEnv(yield("always"))
	if !errors.Is(err, verbsio.ErrBadConfig) || !strings.Contains(err.Error(), `GDRLINK_YIELD="always", want auto, on or off`) {
		t.Errorf("GDRLINK_YIELD=always: %v, want ErrBadConfig naming auto, on and off", err)
	}
}

package main

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"slices"
	"strings"
	"testing"
)

func TestAllocScenario(t *testing.T) {
	var results []Result
	env := &Env{
		Quick:   true,
		Reps:    1,
		MaxSize: 4096,
		Log:     slog.New(slog.NewTextHandler(io.Discard, nil)),
		Emit:    func(r Result) { results = append(results, r) },
	}
	if err := runAlloc(context.Background(), env); err != nil {
		t.Fatal(err)
	}
	cases := map[string]bool{}
	for _, r := range results {
		if err := checkResult(r); err != nil {
			t.Error(err)
		}
		if r.Scenario != "alloc" || r.Unit != "ns/op" || !(r.Value > 0) || !(r.Baseline > 0) || !(r.Ratio > 0) {
			t.Errorf("result %+v", r)
		}
		if !strings.HasSuffix(r.Case, "/vs-"+r.BaselineName) {
			t.Errorf("case %q does not name its baseline %q", r.Case, r.BaselineName)
		}
		cases[r.Case] = true
	}
	// 256 B..4 KiB: five fixed sizes against make, at least.
	fixed := 0
	for _, r := range results {
		if r.Case == "fixed/vs-make" {
			fixed++
		}
	}
	if fixed != 5 {
		t.Errorf("%d fixed sizes against make, want 5", fixed)
	}
	for _, prefix := range []string{"parallel-", "mixed-"} {
		found := false
		for c := range cases {
			found = found || strings.HasPrefix(c, prefix)
		}
		if !found {
			t.Errorf("no %s case in %v", prefix, cases)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := runAlloc(ctx, env); !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled run = %v", err)
	}
}

func TestMixedSizes(t *testing.T) {
	a, b := mixedSizes(100, 256, 1<<20), mixedSizes(100, 256, 1<<20)
	if !slices.Equal(a, b) {
		t.Error("the mixed sequence is not reproducible")
	}
	for _, n := range a {
		if n < 256 || n > 1<<20 {
			t.Errorf("size %d outside [256, 1 MiB]", n)
		}
	}
	if slices.Min(a) == slices.Max(a) {
		t.Error("sizes are not mixed")
	}
}

func TestLockPages(t *testing.T) {
	mem, err := lockPages(64 << 10)
	if err != nil {
		t.Skipf("cannot lock 64 KiB here: %v", err)
	}
	mem[0], mem[len(mem)-1] = 1, 2
	if err := unlockPages(mem); err != nil {
		t.Fatal(err)
	}
}

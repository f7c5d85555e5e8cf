package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"sort"
)

// Result is one measured figure. It is printed as one JSON object per line
// with -json, in this field order.
type Result struct {
	Scenario  string  `json:"scenario"`
	Case      string  `json:"case"`
	SizeBytes int64   `json:"size_bytes"`
	Value     float64 `json:"value"`
	Unit      string  `json:"unit"`
	// Baseline is the figure of the reference measured in the same run, in
	// the same unit; 0 when the case has none.
	Baseline float64 `json:"baseline"`
	// Ratio is Value/Baseline for rates, Baseline/Value for times (so above
	// 1 always means better than the baseline); 0 when there is no baseline.
	Ratio float64 `json:"ratio"`
	// BaselineName says what the baseline is ("memcpy", "raw-tcp", "grpc").
	BaselineName string `json:"baseline_name,omitempty"`
	// Note says anything a reader must know (simulated device, provider
	// skipped and why).
	Note string `json:"note,omitempty"`
}

// Env is what a scenario gets from the command line.
type Env struct {
	// Quick asks for few repetitions and small sizes (used by tests).
	Quick bool
	// Reps is how many times each case is measured; the median is reported.
	Reps int
	// MaxSize caps the sizes of sweeps, in bytes (0: the scenario's own).
	MaxSize int64
	// Log is for progress and debug messages (stderr).
	Log *slog.Logger
	// Emit reports one result.
	Emit func(Result)
	// Args are scenario-specific "key=value" settings from -set.
	Args map[string]string
}

// Scenario is one named benchmark.
type Scenario struct {
	Name string
	// Doc is one line for -list.
	Doc string
	// Run measures and emits results.
	Run func(ctx context.Context, env *Env) error
	// Plots describes the SVG plots drawn from its results with -svg.
	Plots []Plot
	// Child, when set, is the process the bench binary re-executes itself
	// as for this scenario (its peer, or a rank of its job).
	Child *Child
}

// Child is a role the bench binary runs in a process of its own: when the
// environment variable Env is set, main runs Run with its value, and exits
// with what Run returns, instead of reading a command line. main, not an
// init function: Go runs init functions on the main goroutine locked to the
// process's main thread, so a peer run from one hands every wake-up of its
// main goroutine to that one thread (a futex wake and a context switch
// each): a Send and Recv of 4 KiB between two allreduce ranks, on their
// main goroutines, took 260-480 us per exchange from init and 116-125 us
// from main.
type Child struct {
	Env string
	Run func(value string) int
}

// runChild runs the child role the environment names, if any: ok is
// false when it names none. Two roles named at once is an error (exit
// status 2), not a guess.
func runChild(getenv func(string) string) (code int, ok bool) {
	var found []Scenario
	for _, name := range scenarioNames() {
		s := scenarios[name]
		if s.Child != nil && getenv(s.Child.Env) != "" {
			found = append(found, s)
		}
	}
	switch len(found) {
	case 0:
		return 0, false
	case 1:
		return found[0].Child.Run(getenv(found[0].Child.Env)), true
	}
	fmt.Fprintf(os.Stderr, "bench: %s and %s both set: one child role at a time\n", found[0].Child.Env, found[1].Child.Env)
	return exitUsage, true
}

// Plot describes one SVG plot of a sweep: for each case whose name has the
// prefix, value against size (log2 x axis), and its baseline when present.
// A case name that ends in its own size ("tcp/1MiB", "tcp-1048576") is drawn
// on the line of the name without it ("tcp"); baselines are dashed lines,
// one per BaselineName.
type Plot struct {
	// File is the SVG file name, e.g. "xfer-bandwidth.svg".
	File string
	// Title is the plot's title.
	Title string
	// Unit selects the results plotted (e.g. "GB/s").
	Unit string
	// CasePrefix selects the cases plotted ("" for all).
	CasePrefix string
}

// scenarios is the registry of scenarios, filled by init functions of the
// scenario_*.go files.
var scenarios = map[string]Scenario{}

func register(s Scenario) {
	if _, dup := scenarios[s.Name]; dup {
		panic("bench: scenario registered twice: " + s.Name)
	}
	scenarios[s.Name] = s
}

func scenarioNames() []string {
	out := make([]string, 0, len(scenarios))
	for n := range scenarios {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

func lookupScenario(name string) (Scenario, error) {
	s, ok := scenarios[name]
	if !ok {
		return s, fmt.Errorf("unknown scenario %q (have %v)", name, scenarioNames())
	}
	return s, nil
}

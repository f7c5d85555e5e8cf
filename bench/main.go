// Command bench measures gdrlink's scenarios on this machine, each with the
// baseline it must be compared with measured in the same run, and prints a
// table for people, JSON lines for programs (-json) and SVG plots (-svg).
//
//	go run ./bench -list
//	go run ./bench -scenario memcpy -reps 7 -max-size 64MiB
//	go run ./bench -json -quick
//	go run ./bench -svg bench/out
//
// While it runs, a status line on stderr names the scenario and the row last
// measured, when stderr is a terminal (-progress auto|always|never).
//
// A scenario that fails prints its error and the next one runs; the exit
// status is 1 when any failed, 2 for a bad command line.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"os"
	"os/signal"
	"runtime/debug"
	"runtime/pprof"
	"slices"
	"strings"
	"sync"
	"syscall"

	"github.com/dustin/go-humanize"
)

func main() {
	if code, ok := runChild(os.Getenv); ok {
		os.Exit(code)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// Exit statuses.
const (
	exitOK     = 0
	exitFailed = 1 // a scenario or a plot failed
	exitUsage  = 2 // a bad command line
)

// errUsage marks command-line errors.
var errUsage = errors.New("usage")

// options is the parsed command line.
type options struct {
	scenarios []string
	list      bool
	json      bool
	svgDir    string
	reps      int
	quick     bool
	maxSize   int64
	args      map[string]string
	verbose   bool
	progress  progressMode
	cpuProf   string
}

// quickReps is the repetition count of -quick when -reps is not given.
const quickReps = 3

// parseArgs parses the command line; errors wrap errUsage.
func parseArgs(args []string, stderr io.Writer) (options, error) {
	o := options{args: map[string]string{}}
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	scen := fs.String("scenario", "all", "scenarios to run: `NAME[,NAME...]` or all")
	fs.BoolVar(&o.list, "list", false, "list the scenarios and exit")
	fs.BoolVar(&o.json, "json", false, "print one JSON object per result line instead of a table")
	fs.StringVar(&o.svgDir, "svg", "", "draw each scenario's plots as SVG files into `DIR`")
	fs.IntVar(&o.reps, "reps", 5, "measure each case `N` times and report the median")
	fs.BoolVar(&o.quick, "quick", false, "few repetitions and small sizes (for tests)")
	maxSize := fs.String("max-size", "", "cap sweep sizes at `BYTES` (e.g. 64MiB)")
	fs.Func("set", "scenario setting `key=value` (repeatable)", func(s string) error {
		k, v, ok := strings.Cut(s, "=")
		if !ok || k == "" {
			return fmt.Errorf("%q is not key=value", s)
		}
		o.args[k] = v
		return nil
	})
	fs.BoolVar(&o.verbose, "v", false, "log debug messages")
	fs.StringVar(&o.cpuProf, "cpuprofile", "", "write this process's CPU profile (runtime/pprof) to `FILE`")
	fs.Func("progress", "status line on stderr: `auto|always|never` (auto: when stderr is a terminal)", func(s string) error {
		m, err := parseProgressMode(s)
		o.progress = m
		return err
	})
	if err := fs.Parse(args); err != nil {
		return o, fmt.Errorf("%w: %w", errUsage, err)
	}
	if fs.NArg() > 0 {
		return o, fmt.Errorf("%w: unexpected arguments %q", errUsage, fs.Args())
	}
	repsSet := false
	fs.Visit(func(f *flag.Flag) { repsSet = repsSet || f.Name == "reps" })
	if o.quick && !repsSet {
		o.reps = quickReps
	}
	if o.reps < 1 {
		return o, fmt.Errorf("%w: -reps %d, want at least 1", errUsage, o.reps)
	}
	if *maxSize != "" {
		n, err := parseSize(*maxSize)
		if err != nil {
			return o, fmt.Errorf("%w: -max-size: %w", errUsage, err)
		}
		o.maxSize = n
	}
	names, err := selectScenarios(*scen)
	if err != nil {
		return o, fmt.Errorf("%w: -scenario: %w", errUsage, err)
	}
	o.scenarios = names
	return o, nil
}

// parseSize parses a size for people ("64MiB", "1 GB", "4096") into bytes.
func parseSize(s string) (int64, error) {
	n, err := humanize.ParseBytes(s)
	if err != nil {
		return 0, err
	}
	if n > 1<<62 {
		return 0, fmt.Errorf("%s is too large", s)
	}
	return int64(n), nil
}

// selectScenarios turns -scenario's value into registered names, in the
// order given (sorted for all), without repeats.
func selectScenarios(spec string) ([]string, error) {
	if strings.TrimSpace(spec) == "all" {
		return scenarioNames(), nil
	}
	var out []string
	for n := range strings.SplitSeq(spec, ",") {
		n = strings.TrimSpace(n)
		if n == "" {
			continue
		}
		if _, err := lookupScenario(n); err != nil {
			return nil, err
		}
		if !slices.Contains(out, n) {
			out = append(out, n)
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("no scenario named in %q", spec)
	}
	return out, nil
}

// run is the program: it parses args, runs the scenarios, prints their
// results and draws their plots, and returns the exit status.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	o, err := parseArgs(args, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return exitOK
	}
	if err != nil {
		fmt.Fprintln(stderr, "bench:", err)
		return exitUsage
	}
	if o.list {
		if err := writeList(stdout); err != nil {
			fmt.Fprintln(stderr, "bench:", err)
			return exitFailed
		}
		return exitOK
	}
	if o.cpuProf != "" {
		f, err := os.Create(o.cpuProf)
		if err == nil {
			err = pprof.StartCPUProfile(f)
		}
		if err != nil {
			fmt.Fprintln(stderr, "bench: -cpuprofile:", err)
			return exitUsage
		}
		defer func() {
			pprof.StopCPUProfile()
			f.Close()
		}()
	}
	prog := newProgress(stderr, o.progress.draws(stderr))
	prog.width = terminalWidth(stderr)
	defer prog.done()
	stdout, stderr = prog.wrap(stdout), prog.wrap(stderr)

	level := slog.LevelInfo
	if o.verbose {
		level = slog.LevelDebug
	}
	log := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: level}))

	var out resultWriter = newTableWriter(stdout)
	if o.json {
		out = newJSONWriter(stdout)
	}
	code := exitOK
	var all []Result
	for i, name := range o.scenarios {
		s, _ := lookupScenario(name)
		if err := ctx.Err(); err != nil {
			fmt.Fprintf(stderr, "bench: scenario %s not run: %v\n", name, err)
			code = exitFailed
			continue
		}
		prog.start(name, i+1, len(o.scenarios))
		results, err := runScenario(ctx, s, o, log, out, prog)
		all = append(all, results...)
		if err != nil {
			fmt.Fprintf(stderr, "bench: scenario %s failed: %v\n", name, err)
			code = exitFailed
		}
		if err := out.Flush(); err != nil {
			fmt.Fprintln(stderr, "bench:", err)
			return exitFailed
		}
	}
	prog.done()
	if o.svgDir != "" {
		if err := drawPlots(o.svgDir, o.scenarios, all, log); err != nil {
			fmt.Fprintln(stderr, "bench:", err)
			code = exitFailed
		}
	}
	return code
}

// runScenario runs one scenario, passes each valid result to out and to
// prog as it comes, and returns them. A panic in the scenario becomes its
// error, and so does a result that cannot be printed (which is dropped).
func runScenario(ctx context.Context, s Scenario, o options, log *slog.Logger, out resultWriter, prog *progress) (results []Result, err error) {
	var (
		mu      sync.Mutex
		invalid []error
	)
	env := &Env{
		Quick:   o.quick,
		Reps:    o.reps,
		MaxSize: o.maxSize,
		Log:     log.With("scenario", s.Name),
		Args:    maps.Clone(o.args), // a scenario may not change another's settings
	}
	env.Emit = func(r Result) {
		mu.Lock()
		defer mu.Unlock()
		if r.Scenario == "" {
			r.Scenario = s.Name
		}
		if r.Scenario != s.Name {
			invalid = append(invalid, fmt.Errorf("result of scenario %q emitted by %q", r.Scenario, s.Name))
			return
		}
		if err := checkResult(r); err != nil {
			invalid = append(invalid, err)
			return
		}
		results = append(results, r)
		if err := out.Write(r); err != nil {
			invalid = append(invalid, err)
		}
		prog.row(r)
	}
	env.Log.Info("running", "reps", o.reps, "quick", o.quick)
	defer func() {
		if p := recover(); p != nil {
			env.Log.Debug("panic", "stack", string(debug.Stack()))
			err = errors.Join(err, fmt.Errorf("panic: %v", p))
		}
		mu.Lock()
		defer mu.Unlock()
		err = errors.Join(append([]error{err}, invalid...)...)
		if err == nil && len(results) == 0 {
			env.Log.Warn("scenario emitted no results")
		}
	}()
	err = s.Run(ctx, env)
	return results, err
}

// writeList prints the scenarios and what they measure.
func writeList(w io.Writer) error {
	tw := newTabWriter(w)
	for _, n := range scenarioNames() {
		s := scenarios[n]
		var files []string
		for _, p := range s.Plots {
			files = append(files, p.File)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\n", n, s.Doc, strings.Join(files, " "))
	}
	return tw.Flush()
}

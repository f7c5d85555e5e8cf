package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/gdrlink/gdrlink/gdr"
	"github.com/gdrlink/gdrlink/internal/sysfs"
)

func main() {
	os.Exit(run(context.Background(), os.Args[1:], os.Getenv, os.Stdout, os.Stderr))
}

// options are the command line and the environment.
type options struct {
	// getenv reads the environment that holds the job key settings
	// (os.Getenv; tests give a fixed one).
	getenv   func(string) string
	json     bool
	root     string
	gpus     string
	nics     string
	level    string
	color    string
	selftest bool
	size     int
	timeout  time.Duration
	nfd      string
	textfile string
	expiry   time.Duration
}

// now is the clock of --nfd-expiry; tests set it.
var now = time.Now

func usage(fs *flag.FlagSet) func() {
	return func() {
		w := fs.Output()
		fmt.Fprintf(w, "usage: gdrcheck [flags]\n       gdrcheck snapshot [--root DIR] FILE.tar.gz\n\n")
		fmt.Fprintf(w, "Checks whether this node (or the tree under --root) can move tensors with\nGPUDirect RDMA, says why not and how to fix it.\n")
		fmt.Fprintf(w, "Exit status: 0 ready, 1 degraded (CPU proxy for some GPU), 2 not ready or error.\n\n")
		fs.PrintDefaults()
	}
}

// run is main without the process: it returns the exit code. getenv is
// the environment whose job key settings the report describes.
func run(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) int {
	if len(args) > 0 && args[0] == "snapshot" {
		return runSnapshot(ctx, args[1:], stdout, stderr)
	}
	o := options{getenv: getenv}
	fs := flag.NewFlagSet("gdrcheck", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = usage(fs)
	fs.BoolVar(&o.json, "json", false, "print the report as JSON (schema: cmd/gdrcheck/schema.json)")
	fs.StringVar(&o.root, "root", "", "read sysfs and procfs from this directory or snapshot archive (.tar.gz) instead of /")
	fs.StringVar(&o.gpus, "gpu", "", "only these GPUs: indices or PCI addresses, comma-separated")
	fs.StringVar(&o.nics, "nic", "", "only these RDMA devices: names or PCI addresses, comma-separated")
	fs.StringVar(&o.level, "level", "", "policy level: farthest path for GPUDirect (LOC, PIX, PXB, PHB, NODE, SYS or NCCL's 0..5); default $"+gdr.EnvLevel+" or PXB")
	fs.StringVar(&o.color, "color", "auto", "color the human report: auto (on a terminal), always, never")
	fs.BoolVar(&o.selftest, "selftest", false, "also move a pattern through every verbs provider available here and report bandwidth")
	fs.IntVar(&o.size, "selftest-size", 4<<20, "bytes per selftest transfer")
	fs.DurationVar(&o.timeout, "timeout", 60*time.Second, "give up after this long")
	fs.StringVar(&o.nfd, "nfd", "", "also write node labels as a node-feature-discovery feature file DIR/"+nfdFile+" (DIR is usually /etc/kubernetes/node-feature-discovery/features.d)")
	fs.DurationVar(&o.expiry, "nfd-expiry", 0, "with --nfd, labels expire this long after the run (# +expiry-time); 0: never")
	fs.StringVar(&o.textfile, "textfile", "", "also write the facts as Prometheus metrics DIR/"+textfileFile+" for node_exporter's textfile collector")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return exitReady
		}
		return exitNotReady
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "gdrcheck: unexpected argument %q\n", fs.Arg(0))
		return exitNotReady
	}
	ctx, cancel := context.WithTimeout(ctx, o.timeout)
	defer cancel()
	policy, err := gdr.PolicyFromEnv()
	if err != nil {
		fmt.Fprintf(stderr, "gdrcheck: %v\n", err)
		return exitNotReady
	}
	if o.level != "" {
		l, err := gdr.ParseLevel(o.level)
		if err != nil {
			fmt.Fprintf(stderr, "gdrcheck: --level: %v\n", err)
			return exitNotReady
		}
		policy.Level, policy.LevelSource = l, "option --level"
	}
	root, cleanup, err := openRootArg(o.root)
	if err != nil {
		fmt.Fprintf(stderr, "gdrcheck: %v\n", err)
		return exitNotReady
	}
	defer cleanup()
	facts, pci, err := collect(ctx, root)
	if err != nil {
		fmt.Fprintf(stderr, "gdrcheck: %v\n", err)
		return exitNotReady
	}
	if err := filter(facts, o.gpus, o.nics); err != nil {
		fmt.Fprintf(stderr, "gdrcheck: %v\n", err)
		return exitNotReady
	}
	r := buildReport(facts, pci, policy, o.root)
	r.Process = readProcess(root)
	if o.root != "" {
		r.Facts.Root = o.root
	}
	if o.selftest {
		r.Selftest = runSelftest(ctx, o.size)
		if r.Selftest.Failed > 0 && r.ExitCode < exitNotReady {
			r.ExitCode, r.Verdict = exitNotReady, "not-ready"
			r.Summary += fmt.Sprintf("; selftest: %d of %d paths failed", r.Selftest.Failed, len(r.Selftest.Runs))
		}
	}
	r.setJobAuth(jobAuthOf(o.getenv))
	if code := export(o, r, stderr); code != 0 {
		return code
	}
	if o.json {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(r); err != nil {
			fmt.Fprintf(stderr, "gdrcheck: %v\n", err)
			return exitNotReady
		}
	} else {
		color := o.color == "always" || o.color == "auto" && isTerminal(stdout)
		writeHuman(stdout, r, color)
	}
	return r.ExitCode
}

// collect is gdr.Collect of the node under root, which gdrcheck opened, and
// the PCI devices under root by address, which gdrcheck's topology and ACS
// tables show (gdr.Collect read them too, and noted in the facts those it
// could not read). On the node itself gdr asks NVML, then the CUDA driver,
// for the GPUs.
func collect(ctx context.Context, root *sysfs.Root) (*gdr.Facts, map[string]*sysfs.PCIDevice, error) {
	f, err := gdr.Collect(ctx, gdr.CollectOptions{Root: root.Dir()})
	if err != nil {
		return nil, nil, err
	}
	pci, _, _ := sysfs.ReadPCIDevices(root)
	return f, pci, nil
}

// export writes the --nfd and --textfile files; it returns exitNotReady
// when one could not be written (the old file stays), 0 otherwise.
func export(o options, r *Report, stderr io.Writer) int {
	if o.nfd == "" && o.textfile == "" {
		return 0
	}
	n := nodeFactsOf(r)
	code := 0
	if o.nfd != "" {
		var exp time.Time
		if o.expiry > 0 {
			exp = now().Add(o.expiry)
		}
		if err := writeAtomic(o.nfd, nfdFile, nfdFeatures(n, exp)); err != nil {
			fmt.Fprintf(stderr, "gdrcheck: --nfd: %v\n", err)
			code = exitNotReady
		}
	}
	if o.textfile != "" {
		if err := writeAtomic(o.textfile, textfileFile, promText(n)); err != nil {
			fmt.Fprintf(stderr, "gdrcheck: --textfile: %v\n", err)
			code = exitNotReady
		}
	}
	return code
}

// Command exchange is gdrlink's main job on the embedded default: two
// processes on this host (the program re-executes itself as the peer)
// exchange a stream of tensors of several dtypes and shapes through the
// front door, which picks the best provider for the pair, and it prints
// what moved, how fast, and which path each tensor took. It needs no RDMA
// NIC and no GPU. Under a launcher (mpirun -np 2, srun, torchrun, or
// GDRLINK_RANK/GDRLINK_SIZE/GDRLINK_ROOT set by hand) it starts no peer:
// rank 0 receives and rank 1 sends.
//
// Usage:
//
//	go run ./examples/exchange [-steps 10] [-provider NAME] [-checksum] [-v]
//
// GDRLINK_LOG=debug prints every transfer as a structured log record.
package main

import (
	"context"
	"flag"
	"fmt"
	"net"
	"os"
	"os/exec"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/dustin/go-humanize"

	"github.com/gdrlink/gdrlink"
	"github.com/gdrlink/gdrlink/internal/bootstrap"
	"github.com/gdrlink/gdrlink/tensor"
)

// envSteps passes -steps to the re-executed peer; the rest travels in the
// front door's own variables (GDRLINK_RANK, GDRLINK_PROVIDER, ...).
const envSteps = "GDRLINK_EXCHANGE_STEPS"

func main() {
	steps := flag.Int("steps", 10, "steps of the stream")
	provider := flag.String("provider", "", "verbs provider for the pair (default: the best both have; GDRLINK_PROVIDER)")
	checksum := flag.Bool("checksum", false, "checksum mode on every provider: verify a CRC-32C of every tensor (GDRLINK_CHECKSUM=1; without it, each provider's default: on for tcp)")
	verbose := flag.Bool("v", false, "print every transfer")
	flag.Parse()
	if v := os.Getenv(envSteps); v != "" {
		if n, err := strconv.Atoi(v); err == nil {
			*steps = n
		}
	}
	if err := run(*steps, *provider, *checksum, *verbose); err != nil {
		fmt.Fprintln(os.Stderr, "exchange:", err)
		os.Exit(1)
	}
}

// run is one rank's part. Without a launcher's environment it is rank 0 of
// a job of two and starts rank 1 itself.
func run(steps int, provider string, checksum, verbose bool) error {
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Second)
	defer cancel()
	var opts []gdrlink.Option // the environment (GDRLINK_*) configures the rest
	if checksum {
		opts = append(opts, gdrlink.WithChecksum(true))
	}
	if provider != "" {
		opts = append(opts, gdrlink.WithProvider(provider))
	}
	if _, err := bootstrap.FromEnv(); err != nil {
		// No launcher: be rank 0 and start the peer.
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return err
		}
		// A job key of our own, handed to the peer we spawn: every
		// connection of the pair proves it, so no other local process can
		// join in rank 1's place.
		key, err := gdrlink.NewJobKey()
		if err != nil {
			return err
		}
		opts = append(opts, gdrlink.WithJobKey(key))
		peer, err := startPeer(ln.Addr().String(), steps, provider, checksum, key)
		if err != nil {
			ln.Close()
			return err
		}
		defer peer.wait()
		opts = append(opts, gdrlink.WithRank(0, 2), gdrlink.WithRootListener(ln))
	}
	g, err := gdrlink.Join(ctx, opts...)
	if err != nil {
		return err
	}
	defer g.Close()
	if g.Size() != 2 {
		return fmt.Errorf("a job of %d ranks: the exchange is for two", g.Size())
	}
	if g.Rank() == 1 {
		err = runSender(ctx, g, steps)
	} else {
		err = runReceiver(ctx, g, steps, verbose)
	}
	if err != nil {
		return err
	}
	return g.Barrier(ctx) // stay until the other side has everything
}

type peerProc struct {
	cmd  *exec.Cmd
	done chan error
}

// startPeer re-executes this program as rank 1.
func startPeer(root string, steps int, provider string, checksum bool, key string) (*peerProc, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(self)
	var env []string
	for _, kv := range os.Environ() { // the key below replaces any inherited one
		if !strings.HasPrefix(kv, "GDRLINK_JOB_KEY=") && !strings.HasPrefix(kv, "GDRLINK_JOB_KEY_FILE=") {
			env = append(env, kv)
		}
	}
	cmd.Env = append(env, "GDRLINK_RANK=1", "GDRLINK_SIZE=2", "GDRLINK_ROOT="+root,
		envSteps+"="+strconv.Itoa(steps), "GDRLINK_CHECKSUM="+strconv.FormatBool(checksum), "GDRLINK_JOB_KEY="+key)
	if provider != "" {
		cmd.Env = append(cmd.Env, "GDRLINK_PROVIDER="+provider)
	}
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	p := &peerProc{cmd: cmd, done: make(chan error, 1)}
	go func() { p.done <- cmd.Wait() }()
	return p, nil
}

func (p *peerProc) wait() {
	select {
	case <-p.done:
	case <-time.After(5 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}

// item is one tensor of the stream.
type item struct {
	key   string
	kind  string // a dtype, "dead:DTYPE"
	shape func(step int) tensor.Shape
}

func fixed(s ...int64) func(int) tensor.Shape { return func(int) tensor.Shape { return s } }

// stream is what the sender sends every step.
func stream(steps int) []item {
	return []item{
		{"embedding/ids", "int64", fixed(256)},
		{"layer1/weights", "float32", fixed(512, 512)},
		// The batch grows half way (one META_DATA_RESPONSE and one
		// re-request), then shrinks (written straight into the buffer).
		{"layer2/activations", "bfloat16", func(step int) tensor.Shape {
			switch {
			case step >= steps*3/4:
				return tensor.Shape{96, 1024} // shrinks: fits, written at once
			case step >= steps/2:
				return tensor.Shape{128, 1024}
			}
			return tensor.Shape{64, 1024}
		}},
		{"attention/mask", "bool", fixed(32, 32)},
		{"fft/spectrum", "complex64", fixed(16, 16)},
		{"tokens", "string", fixed(8)},
		{"skipped/branch", "dead:float32", fixed(4, 4)},
		{"empty/batch", "float32", fixed(0, 16)},
		{"layer3/weights", "float32", fixed(4, 1024, 1024)}, // 16 MiB
	}
}

// runSender offers every tensor of every step; Send never waits on the
// network, and the group releases each tensor once it is written.
func runSender(ctx context.Context, g *gdrlink.Group, steps int) error {
	for step := 0; step < steps; step++ {
		for _, it := range stream(steps) {
			t, err := makeTensor(g.NewTensor, it.kind, it.shape(step), it.key, int64(step))
			if err != nil {
				return err
			}
			if err := g.Send(0, it.key, int64(step), t); err != nil {
				return err
			}
		}
	}
	return nil
}

type record struct {
	key  string
	tr   gdrlink.Transfer
	took time.Duration
}

func runReceiver(ctx context.Context, g *gdrlink.Group, steps int, verbose bool) error {
	start := time.Now()
	for _, n := range []string{"ibverbs", "onnode", "tcp"} {
		if why := g.Stats().Unusable[n]; why != "" {
			fmt.Printf("provider %-8s not usable here: %s\n", n, why)
		}
	}
	items := stream(steps)
	var recs []record
	t0 := time.Now()
	for step := 0; step < steps; step++ {
		// Every Recv of a step is in flight at once; the sender sends in
		// its own order.
		type res struct {
			it  item
			t   *tensor.Tensor
			tr  gdrlink.Transfer
			err error
		}
		out := make(chan res, len(items))
		for _, it := range items {
			go func() {
				t, tr, err := g.Recv(ctx, 1, it.key, int64(step))
				out <- res{it, t, tr, err}
			}()
		}
		var firstErr error
		for range items {
			r := <-out
			if r.err != nil {
				firstErr = cmpErr(firstErr, fmt.Errorf("step %d: %w", step, r.err))
				continue
			}
			if err := checkTensor(r.t, r.it.kind, r.it.shape(step), r.it.key, int64(step)); err != nil {
				firstErr = cmpErr(firstErr, fmt.Errorf("%s step %d arrived wrong: %w", r.it.key, step, err))
			}
			_ = r.t.Release()
			recs = append(recs, record{r.it.key, r.tr, r.tr.Took})
			if step == 0 && len(recs) == 1 {
				fmt.Printf("peer     rank 1 connected over %s/%s\n\n", r.tr.Provider, r.tr.Device)
			}
			if verbose || step == 0 || r.tr.MetaChanged {
				printTransfer(r.tr)
			}
		}
		if firstErr != nil {
			return firstErr
		}
	}
	wall := time.Since(t0)
	fmt.Println()
	summarize(recs, items, wall)
	st := g.Stats()
	pr := st.Protocol
	fmt.Printf("\nprotocol: %d requests, %d meta-data responses (+%d written in place), %d re-requests, %d final (no-write) responses, %d writes in, %d control sends (%d credit-only), %d full names then indexes\n",
		pr.Requests, pr.MetaResponses, pr.MetaInPlace, pr.ReRequests, pr.Finals, pr.WritesIn, pr.ControlOut, pr.CreditsOnly, pr.NameDefs)
	fmt.Printf("connections: %v; Join took %v\n", st.Connections, st.Join.Round(time.Millisecond))
	fmt.Printf("every tensor verified byte for byte; done in %v\n", time.Since(start).Round(time.Millisecond))
	return nil
}

func cmpErr(a, b error) error {
	if a != nil {
		return a
	}
	return b
}

func printTransfer(tr gdrlink.Transfer) {
	note := ""
	switch {
	case tr.MetaRoundTrip:
		note = " (meta-data round trip)"
	case tr.MetaChanged:
		note = " (changed, fit the offered buffer: no re-request)"
	}
	if tr.Checksummed {
		note += " (crc32c ok)"
	}
	fmt.Printf("step %-3d %-20s %-28s %-10s %9s in %9v via %s/%s%s\n", tr.Step, tr.Key, tr.Meta.String(), tr.Path,
		humanize.IBytes(uint64(tr.Bytes)), tr.Took.Round(time.Microsecond), tr.Provider, tr.Device, note)
}

func summarize(recs []record, items []item, wall time.Duration) {
	by := map[string][]record{}
	var total int64
	for _, r := range recs {
		by[r.key] = append(by[r.key], r)
		total += r.tr.Bytes
	}
	fmt.Println("(req→done: from Recv to the tensor in hand; all Recvs of a step are in flight at once)")
	fmt.Printf("%-20s %6s %-12s %10s %16s %12s\n", "tensor", "count", "path", "bytes", "median req→done", "rate")
	for _, it := range items {
		rs := by[it.key]
		if len(rs) == 0 {
			continue
		}
		ts := make([]time.Duration, len(rs))
		paths := map[string]bool{}
		var bytes int64
		for i, r := range rs {
			ts[i] = r.took
			paths[r.tr.Path.String()] = true
			bytes += r.tr.Bytes
		}
		sort.Slice(ts, func(i, j int) bool { return ts[i] < ts[j] })
		med := ts[len(ts)/2]
		rate := "-"
		// Small tensors wait behind the step's others: a rate means
		// something only for the large ones.
		if per := bytes / int64(len(rs)); per >= 1<<20 && med > 0 {
			rate = humanize.IBytes(uint64(float64(per)/med.Seconds())) + "/s"
		}
		var ps []string
		for p := range paths {
			ps = append(ps, p)
		}
		sort.Strings(ps)
		fmt.Printf("%-20s %6d %-12s %10s %16v %12s\n", it.key, len(rs), strings.Join(ps, ","), humanize.IBytes(uint64(bytes)), med.Round(time.Microsecond), rate)
	}
	fmt.Printf("\n%d tensors, %s in %v: %s/s overall\n", len(recs), humanize.IBytes(uint64(total)), wall.Round(time.Millisecond),
		humanize.IBytes(uint64(float64(total)/wall.Seconds())))
}

// Command exchange is gdrlink's main job on the embedded default: two
// processes on this host (the program re-executes itself as the peer)
// exchange a stream of tensors of several dtypes and shapes through the best
// available verbs provider, and it prints what moved, how fast, and which
// path each tensor took. It needs no RDMA NIC and no GPU.
//
// Usage:
//
//	go run ./examples/exchange [-steps 10] [-provider NAME] [-checksum] [-v]
//
// GDRLINK_LOG=debug prints every transfer as a structured log record.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/dustin/go-humanize"
	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/alloc/visitor"
	"github.com/gdrlink/gdrlink/internal/bootstrap"
	"github.com/gdrlink/gdrlink/rendezvous"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
	_ "github.com/gdrlink/gdrlink/verbsio/ibverbs"
	_ "github.com/gdrlink/gdrlink/verbsio/onnode"
	_ "github.com/gdrlink/gdrlink/verbsio/tcp"
)

// Environment of the re-executed peer.
const (
	envRole     = "GDRLINK_EXCHANGE_ROLE"
	envRoot     = "GDRLINK_EXCHANGE_ROOT"
	envProvider = "GDRLINK_EXCHANGE_PROVIDER"
	envSteps    = "GDRLINK_EXCHANGE_STEPS"
	envChecksum = "GDRLINK_EXCHANGE_CHECKSUM"
)

func main() {
	steps := flag.Int("steps", 10, "steps of the stream")
	provider := flag.String("provider", "", "verbs provider (default: the best available, verbsio.Choose)")
	checksum := flag.Bool("checksum", false, "checksum mode: verify a CRC-32C of every tensor")
	verbose := flag.Bool("v", false, "print every transfer")
	flag.Parse()

	level := slog.LevelInfo
	if strings.EqualFold(os.Getenv("GDRLINK_LOG"), "debug") {
		level = slog.LevelDebug
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))

	var err error
	if os.Getenv(envRole) == "sender" {
		err = runSender(log)
	} else {
		err = runReceiver(log, *steps, *provider, *checksum, *verbose)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "exchange:", err)
		os.Exit(1)
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

// session is one process's endpoint (device, protection domain, registered
// pool, channel) and its bootstrap group.
type session struct {
	dev   verbsio.Device
	pd    verbsio.ProtectionDomain
	pool  *alloc.Pool
	ch    *rendezvous.Channel
	group *bootstrap.Group
}

// close closes the channel, the pool (deregistering its arenas), the
// protection domain, the device and the group, in that order.
func (s *session) close() error {
	var errs []error
	if s.ch != nil {
		errs = append(errs, s.ch.Close())
	}
	if s.pool != nil {
		errs = append(errs, s.pool.Close())
	}
	if s.pd != nil {
		errs = append(errs, s.pd.Close())
	}
	if s.dev != nil {
		errs = append(errs, s.dev.Close())
	}
	if s.group != nil {
		errs = append(errs, s.group.Close())
	}
	return errors.Join(errs...)
}

func open(ctx context.Context, log *slog.Logger, provider, name string, checksum bool, cfg bootstrap.Config, peer int) (*session, error) {
	s := &session{}
	vc, err := verbsio.ConfigFromEnv()
	if err != nil {
		return s, err
	}
	if s.dev, err = verbsio.Open(provider, vc); err != nil {
		return s, err
	}
	if s.pd, err = s.dev.AllocPD(); err != nil {
		return s, err
	}
	// Every arena of the pool is registered with the NIC once, by its
	// registration visitor.
	reg := visitor.NewMemoryRegistration(s.pd, verbsio.AccessLocalWrite|verbsio.AccessRemoteWrite|verbsio.AccessRemoteRead)
	if s.pool, err = alloc.New(alloc.NewMmapSource(alloc.MmapOptions{HugePages: true}),
		alloc.WithVisitors(reg), alloc.WithName(name), alloc.WithInitialArena(64<<20)); err != nil {
		return s, err
	}
	if s.ch, err = rendezvous.New(s.dev, s.pd, rendezvous.PoolMemory(reg.RegionOf, s.pool),
		rendezvous.WithName(name), rendezvous.WithChecksum(checksum), rendezvous.WithLogger(log)); err != nil {
		return s, err
	}
	if s.group, err = bootstrap.Join(ctx, cfg); err != nil {
		return s, err
	}
	return s, s.ch.ConnectVia(ctx, s.group, peer)
}

func runSender(log *slog.Logger) error {
	steps, err := strconv.Atoi(os.Getenv(envSteps))
	if err != nil {
		return fmt.Errorf("%s: %w", envSteps, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Second)
	defer cancel()
	s, err := open(ctx, log, os.Getenv(envProvider), "sender", os.Getenv(envChecksum) == "1",
		bootstrap.Config{Rank: 1, Size: 2, Root: os.Getenv(envRoot)}, 0)
	defer s.close()
	if err != nil {
		return err
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var firstErr error
	for step := 0; step < steps; step++ {
		for _, it := range stream(steps) {
			t, err := makeTensor(s.pool, it.kind, it.shape(step), it.key, int64(step))
			if err != nil {
				return err
			}
			wg.Add(1)
			err = s.ch.SendFunc(it.key, int64(step), t, func(err error) {
				_ = t.Release()
				if err != nil {
					mu.Lock()
					firstErr = cmpErr(firstErr, err)
					mu.Unlock()
				}
				wg.Done()
			})
			if err != nil {
				return err
			}
		}
	}
	wg.Wait()
	if firstErr != nil {
		return firstErr
	}
	// Stay until the receiver has everything.
	return s.group.Barrier(ctx)
}

func cmpErr(a, b error) error {
	if a != nil {
		return a
	}
	return b
}

type record struct {
	key  string
	tr   rendezvous.Transfer
	took time.Duration
}

func runReceiver(log *slog.Logger, steps int, provider string, checksum, verbose bool) error {
	start := time.Now()
	if provider == "" {
		c, err := verbsio.Choose(true)
		for _, n := range []string{"ibverbs", "onnode", "tcp"} {
			if e := c.Skipped[n]; e != nil {
				fmt.Printf("provider %-8s skipped: %v\n", n, e)
			}
		}
		if err != nil {
			return err
		}
		provider = c.Provider
	}
	fmt.Printf("provider %-8s chosen\n", provider)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	self, err := os.Executable()
	if err != nil {
		return err
	}
	cmd := exec.Command(self)
	cmd.Env = append(os.Environ(), envRole+"=sender", envRoot+"="+ln.Addr().String(), envProvider+"="+provider,
		envSteps+"="+strconv.Itoa(steps), envChecksum+"="+map[bool]string{true: "1", false: "0"}[checksum])
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Start(); err != nil {
		return err
	}
	peerDone := make(chan error, 1)
	go func() { peerDone <- cmd.Wait() }()
	defer func() {
		select {
		case <-peerDone:
		case <-time.After(5 * time.Second):
			_ = cmd.Process.Kill()
			<-peerDone
		}
	}()

	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Second)
	defer cancel()
	s, err := open(ctx, log, provider, "receiver", checksum, bootstrap.Config{Rank: 0, Size: 2, Listener: ln}, 1)
	defer s.close()
	if err != nil {
		return err
	}
	fmt.Printf("peer     %-8s connected (pid %d) over %s/%s, checksum mode %v\n\n", s.ch.Peer(), cmd.Process.Pid, s.ch.Provider(), s.ch.Device(), checksum)

	items := stream(steps)
	var recs []record
	t0 := time.Now()
	for step := 0; step < steps; step++ {
		// Every Recv of a step is in flight at once; the sender sends in
		// its own order.
		type res struct {
			it  item
			t   *tensor.Tensor
			tr  rendezvous.Transfer
			err error
		}
		out := make(chan res, len(items))
		for _, it := range items {
			s.ch.RecvFunc(ctx, it.key, int64(step), func(t *tensor.Tensor, tr rendezvous.Transfer, err error) { out <- res{it, t, tr, err} })
		}
		for range items {
			r := <-out
			if r.err != nil {
				return fmt.Errorf("step %d: %w", step, r.err)
			}
			if err := checkTensor(r.t, r.it.kind, r.it.shape(step), r.it.key, int64(step)); err != nil {
				return fmt.Errorf("%s step %d arrived wrong: %w", r.it.key, step, err)
			}
			_ = r.t.Release()
			recs = append(recs, record{r.it.key, r.tr, r.tr.Took})
			if verbose || step == 0 || r.tr.MetaChanged {
				printTransfer(r.tr)
			}
		}
	}
	wall := time.Since(t0)
	if err := s.group.Barrier(ctx); err != nil {
		return err
	}
	fmt.Println()
	summarize(recs, items, wall)
	st := s.ch.Stats()
	fmt.Printf("\nprotocol: %d requests, %d meta-data responses (+%d written in place), %d re-requests, %d final (no-write) responses, %d writes in, %d control sends (%d credit-only), %d full names then indexes\n",
		st.Requests, st.MetaResponses, st.MetaInPlace, st.ReRequests, st.Finals, st.WritesIn, st.ControlOut, st.CreditsOnly, st.NameDefs)
	fmt.Printf("every tensor verified byte for byte; done in %v\n", time.Since(start).Round(time.Millisecond))
	return nil
}

func printTransfer(tr rendezvous.Transfer) {
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

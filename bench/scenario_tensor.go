package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"

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

// The tensor scenario measures the zero-copy tensor protocol
// (rendezvous) between two processes of this host on each available
// provider: tensors per second for small tensors, GB/s for large ones, and
// the latency of one small tensor against the provider's raw write latency.
// Its baselines are measured in the same run against the same peer process:
// gRPC (TensorFlow's default transport), a copy through one fixed
// registered buffer (TensorFlow's original verbs transport), and the
// provider's raw write on a bare queue pair (baseline_copybuf.go). Every
// ratio reads "higher is better for us".
func init() {
	register(Scenario{
		Name: "tensor",
		Doc:  "zero-copy tensor protocol between two processes per provider: 4 KiB tensors/s, 16 and 256 MiB GB/s, vs gRPC, copy-through-buffer and the raw write; 4 KiB latency vs raw write",
		Run:  runTensor,
		Plots: []Plot{
			{File: "tensor-vs-grpc.svg", Title: "tensor protocol vs gRPC", Unit: "GB/s", CasePrefix: "tensor/"},
		},
		// The bench binary re-executes itself as the scenario's peer.
		Child: &Child{Env: tensorPeerEnv, Run: runTensorPeer},
	})
}

const (
	tensorPeerEnv = "GDRLINK_BENCH_TENSOR_PEER"
	tensorRootEnv = "GDRLINK_BENCH_TENSOR_ROOT"
	tensorMaxEnv  = "GDRLINK_BENCH_TENSOR_MAX"

	// setTensorProviders is the -set key that picks the providers
	// measured: a comma-separated subset of ibverbs,onnode,tcp.
	setTensorProviders = "tensor.providers"

	tensorSmall = 4 << 10
	// tensorWindow is how many small-tensor Recvs (and gRPC calls) are in
	// flight at once in the rate cases.
	tensorWindow = 64
)

// tensorSide is one process of the scenario.
type tensorSide struct {
	dev   verbsio.Device
	pd    verbsio.ProtectionDomain
	reg   *visitor.MemoryRegistration
	pool  *alloc.Pool
	ch    *rendezvous.Channel
	raw   *rawPair
	group *bootstrap.Group
	// grants switches the measuring side's results between grants and
	// the arena key (scenario_tensor_grants.go); nil on the peer.
	grants *grantSwitch
}

func (s *tensorSide) close() error {
	var errs []error
	if s.ch != nil {
		errs = append(errs, s.ch.Close())
	}
	if s.grants != nil {
		errs = append(errs, s.grants.close())
	}
	if s.raw != nil {
		s.raw.close()
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

// peerHello is what the sending peer tells the measuring side.
type peerHello struct {
	Raw  rawInfo
	GRPC string
}

// tensorSource is where a side's pools take their memory from: what the
// front door gives each provider (gdrlink.go), so that the scenario
// measures what a job gets. On onnode that is shared mappings of memfds,
// which the peer writes through its own mapping of them (one memcpy);
// anonymous memory would be written with process_vm_writev, a system call
// per write. Elsewhere, anonymous memory in transparent huge pages.
func tensorSource(provider, name string) alloc.Source {
	if provider == "onnode" {
		return alloc.NewMemfdSource(name, alloc.MmapOptions{})
	}
	return alloc.NewMmapSource(alloc.MmapOptions{HugePages: true})
}

// openTensorSide opens the provider, a registered pool, a channel and a raw
// pair, joins the two-process group and connects both.
func openTensorSide(ctx context.Context, provider string, cfg bootstrap.Config, maxSize int, grpcAddr string) (*tensorSide, peerHello, error) {
	s := &tensorSide{}
	var ph peerHello
	vc, err := verbsio.ConfigFromEnv()
	if err != nil {
		return s, ph, err
	}
	if s.dev, err = verbsio.Open(provider, vc); err != nil {
		return s, ph, err
	}
	if s.pd, err = s.dev.AllocPD(); err != nil {
		return s, ph, err
	}
	access := verbsio.AccessLocalWrite | verbsio.AccessRemoteWrite | verbsio.AccessRemoteRead
	s.reg = visitor.NewMemoryRegistration(s.pd, access)
	// Arenas big enough that the largest tensor, its result and the fixed
	// buffer each fit one.
	arena, maxArena := max(64<<20, 2*maxSize), max(1<<30, 2*maxSize)
	if s.pool, err = alloc.New(tensorSource(provider, fmt.Sprint("bench-tensor-rank", cfg.Rank)), alloc.WithVisitors(s.reg),
		alloc.WithInitialArena(arena), alloc.WithMaxArena(maxArena)); err != nil {
		return s, ph, err
	}
	var mem rendezvous.Memory = rendezvous.PoolMemory(s.reg.RegionOf, s.pool)
	if cfg.Rank == 0 {
		src := func(name string) alloc.Source { return tensorSource(provider, "bench-tensor-"+name) }
		if s.grants, err = newGrantSwitch(s.pd, s.reg, s.pool, src, access, arena, maxArena); err != nil {
			return s, ph, err
		}
		mem = s.grants
	}
	opts := []rendezvous.Option{rendezvous.WithName(fmt.Sprint("rank-", cfg.Rank))}
	// GDRLINK_CHECKSUM=0 or 1 chooses checksum mode, as for the front
	// door (both processes see it); unset, the provider's default.
	if v := os.Getenv("GDRLINK_CHECKSUM"); v != "" {
		on, err := strconv.ParseBool(v)
		if err != nil {
			return s, ph, fmt.Errorf("GDRLINK_CHECKSUM=%q, want 0 or 1: %w", v, err)
		}
		opts = append(opts, rendezvous.WithChecksum(on))
	}
	// GDRLINK_EAGER_MAX too (bytes; 0: no tensor sent eagerly).
	if v := os.Getenv("GDRLINK_EAGER_MAX"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil {
			return s, ph, fmt.Errorf("GDRLINK_EAGER_MAX=%q, want a number of bytes: %w", v, err)
		}
		opts = append(opts, rendezvous.WithEager(n))
	}
	if s.ch, err = rendezvous.New(s.dev, s.pd, mem, opts...); err != nil {
		return s, ph, err
	}
	if s.raw, err = newRawPair(s.dev, s.pd, s.pool, s.reg.RegionOf, maxSize); err != nil {
		return s, ph, err
	}
	if s.group, err = bootstrap.Join(ctx, cfg); err != nil {
		return s, ph, err
	}
	peer := 1 - cfg.Rank
	if err := s.ch.ConnectVia(ctx, s.group, peer); err != nil {
		return s, ph, err
	}
	mine, _ := json.Marshal(peerHello{Raw: s.raw.info(), GRPC: grpcAddr})
	theirs, err := s.group.Exchange(ctx, peer, mine)
	if err != nil {
		return s, ph, err
	}
	if err := json.Unmarshal(theirs, &ph); err != nil {
		return s, ph, err
	}
	return s, ph, s.raw.connect(ctx, ph.Raw)
}

// runTensorPeer is the peer process: it sends what it is told to through
// the channel, answers raw requests, and serves gRPC.
func runTensorPeer(provider string) int {
	maxSize, err := strconv.Atoi(os.Getenv(tensorMaxEnv))
	if err != nil {
		fmt.Fprintln(os.Stderr, "tensor peer:", err)
		return 1
	}
	if err := tensorPeer(provider, maxSize); err != nil {
		fmt.Fprintln(os.Stderr, "tensor peer:", err)
		return 1
	}
	return 0
}

func tensorPeer(provider string, maxSize int) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	src := make([]byte, maxSize) // gRPC's source: a Go slice, as a gRPC server holds it
	for i := range src {
		src[i] = byte(i * 13)
	}
	gs, err := startGRPCServer(src)
	if err != nil {
		return err
	}
	defer gs.close()
	s, _, err := openTensorSide(ctx, provider, bootstrap.Config{Rank: 1, Size: 2, Root: os.Getenv(tensorRootEnv)}, maxSize, gs.addr())
	defer s.close()
	if err != nil {
		return err
	}
	// Source tensors by size, in registered memory, reused for every step.
	srcs := map[int]*tensor.Tensor{}
	defer func() {
		for _, t := range srcs {
			_ = t.Release()
		}
	}()
	source := func(size int) (*tensor.Tensor, error) {
		if t, ok := srcs[size]; ok {
			return t, nil
		}
		meta, err := tensor.MetaFor(tensor.Uint8, tensor.Shape{int64(size)})
		if err != nil {
			return nil, err
		}
		t, err := s.pool.NewTensor(meta)
		if err != nil {
			return nil, err
		}
		b, _ := t.Bytes()
		copy(b, src)
		srcs[size] = t
		return t, nil
	}
	reply := []byte("ready")
	var pending, answering sync.WaitGroup
	defer answering.Wait()
	for {
		cmd, err := s.group.Exchange(ctx, 0, reply)
		if err != nil {
			return err
		}
		f := strings.Fields(string(cmd))
		if len(f) == 0 || f[0] == "quit" {
			pending.Wait()
			return nil
		}
		if len(f) != 4 {
			return fmt.Errorf("command %q", cmd)
		}
		n, _ := strconv.Atoi(f[2])
		size, _ := strconv.Atoi(f[3])
		reply = []byte("ok")
		switch f[0] {
		case "send": // send KEY N SIZE: steps 0..N-1 of one source tensor
			t, err := source(size)
			if err != nil {
				return err
			}
			for step := 0; step < n; step++ {
				pending.Add(1)
				if err := s.ch.SendFunc(f[1], int64(step), t, func(error) { pending.Done() }); err != nil {
					return err
				}
			}
		case "answer": // answer copy|raw N SIZE
			var from []byte
			if f[1] == "copy" {
				t, err := source(size)
				if err != nil {
					return err
				}
				from, _ = t.Bytes()
			}
			// Reply first: the measuring side asks only once it has the
			// reply. One answering goroutine at a time owns the raw pair.
			answering.Wait()
			answering.Add(1)
			go func() {
				defer answering.Done()
				if err := s.raw.answer(ctx, n, size, from); err != nil {
					fmt.Fprintln(os.Stderr, "tensor peer: answer:", err)
				}
			}()
		default:
			return fmt.Errorf("command %q", cmd)
		}
	}
}

func runTensor(ctx context.Context, env *Env) error {
	sizes := []int64{16 << 20, 256 << 20}
	if env.Quick {
		sizes = []int64{1 << 20}
	}
	if env.MaxSize > 0 {
		var kept []int64
		for _, s := range sizes {
			if s <= env.MaxSize {
				kept = append(kept, s)
			}
		}
		sizes = kept
	}
	maxSize := tensorSmall
	for _, s := range sizes {
		maxSize = max(maxSize, int(s))
	}
	providers := []string{"ibverbs", "onnode", "tcp"}
	if v, ok := env.Args[setTensorProviders]; ok {
		providers = strings.Split(v, ",")
	}
	ran := 0
	for _, provider := range providers {
		p, err := verbsio.Lookup(provider)
		if err == nil {
			_, err = p.Devices()
		}
		if err != nil {
			env.Log.Info("provider skipped", "provider", provider, "reason", err)
			continue
		}
		if err := tensorProvider(ctx, env, provider, sizes, maxSize); err != nil {
			return fmt.Errorf("%s: %w", provider, err)
		}
		ran++
	}
	if ran == 0 {
		return fmt.Errorf("%w: no provider could run", verbsio.ErrNoProvider)
	}
	return nil
}

func tensorProvider(ctx context.Context, env *Env, provider string, sizes []int64, maxSize int) error {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	self, err := os.Executable()
	if err != nil {
		return err
	}
	cmd := exec.CommandContext(ctx, self, "-test.run=^$")
	cmd.Env = append(os.Environ(), tensorPeerEnv+"="+provider, tensorRootEnv+"="+ln.Addr().String(), tensorMaxEnv+"="+strconv.Itoa(maxSize))
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Start(); err != nil {
		return err
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	defer func() {
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
	}()
	sctx, cancel := context.WithTimeout(ctx, 20*time.Minute)
	defer cancel()
	s, ph, err := openTensorSide(sctx, provider, bootstrap.Config{Rank: 0, Size: 2, Listener: ln}, maxSize, "")
	defer func() { _ = s.close() }()
	if err != nil {
		return err
	}
	defer func() { _, _ = s.group.Exchange(sctx, 1, []byte("quit")) }()
	gc, err := dialGRPC(ph.GRPC)
	if err != nil {
		return err
	}
	defer gc.close()
	m := &tensorMeasure{ctx: sctx, env: env, s: s, gc: gc, provider: provider}
	note := fmt.Sprintf("%s/%s, peer process on this host", provider, s.ch.Device())

	// Small tensors: rate against gRPC and against copy-through-buffer.
	reps := max(env.Reps, 1)
	nSmall := 2000
	if env.Quick {
		nSmall = 200
	}
	ours, err := m.oursRate(tensorSmall, nSmall, reps)
	if err != nil {
		return fmt.Errorf("tensor rate: %w", err)
	}
	grpcRate, err := m.grpcRate(tensorSmall, nSmall, reps)
	if err != nil {
		return fmt.Errorf("gRPC rate: %w", err)
	}
	copyLat, err := m.raw(true, tensorSmall, reps)
	if err != nil {
		return fmt.Errorf("copy-through-buffer: %w", err)
	}
	emit(env, provider, "small/vs-grpc", tensorSmall, ours, "tensors/s", grpcRate, "grpc", note)
	emit(env, provider, "small/vs-copybuf", tensorSmall, ours, "tensors/s", 1/copyLat.Seconds(), "copybuf", note+"; copybuf has one buffer, so one tensor in flight")

	// Small-tensor latency against the raw write: the mean per call, and
	// the median call (a few calls of a hundred times the typical one,
	// a thread waiting for a core, move the mean).
	lat, lats, err := m.oursLatencyCalls(tensorSmall, reps)
	if err != nil {
		return fmt.Errorf("tensor latency: %w", err)
	}
	rawLat, raws, err := m.rawCalls(false, tensorSmall, reps)
	if err != nil {
		return fmt.Errorf("raw write latency: %w", err)
	}
	rawNote := "; raw write = SEND request + write-with-immediate answer on a bare queue pair, neither side waiting for its own send completions; ratio = raw-write time / tensor time, higher is better for us"
	rawNote += fmt.Sprintf("; %d of the tensor path's %d Recvs took a tensor sent eagerly (EAGER: its Send went before the Recv asked, so the Recv makes no round trip; WithEager, GDRLINK_EAGER_MAX)", m.eagerRecvs, m.latRecvs)
	emit(env, provider, "small/latency-vs-raw-write", tensorSmall, us(lat), "us", us(rawLat), "raw-write", note+rawNote+"; mean per call")
	emit(env, provider, "small/latency-median-vs-raw-write", tensorSmall, us(quantile(lats, 0.5)), "us", us(quantile(raws, 0.5)), "raw-write",
		fmt.Sprintf("%s%s; median call of %d, 99th percentile %.1f us against %.1f us", note, rawNote, len(lats), us(quantile(lats, 0.99)), us(quantile(raws, 0.99))))

	for _, size := range sizes {
		// The tensor path and the raw write are measured in turn, rep
		// after rep, apart from the others (gRPC's garbage, the copies'
		// cold caches), so that what falls on one falls on both.
		n := int(size)
		runtime.GC()
		var pathLat, raws []time.Duration
		for r := 0; r < reps; r++ {
			ourLat, err := m.oursLatency(n, 1)
			if err != nil {
				return fmt.Errorf("tensor %d bytes: %w", n, err)
			}
			rl, err := m.raw(false, n, 1)
			if err != nil {
				return fmt.Errorf("raw write %d bytes: %w", n, err)
			}
			pathLat, raws = append(pathLat, ourLat), append(raws, rl)
		}
		emit(env, provider, "large/vs-raw-write", size, rateGBs(size, medianDuration(pathLat)), "GB/s", rateGBs(size, medianDuration(raws)), "raw-write",
			note+"; raw write = SEND request + one write with immediate of the whole tensor from a fixed registered buffer into the peer's, on a bare queue pair, measured in turn with the tensor path; ratio = tensor GB/s / raw-write GB/s, higher is better for us (goal 0.9)")
		// The three are measured in turn, rep after rep, so that the load
		// of a shared machine falls on all of them alike.
		var ours, grpcs, copies []time.Duration
		for r := 0; r < reps; r++ {
			ourLat, err := m.oursLatency(n, 1)
			if err != nil {
				return fmt.Errorf("tensor %d bytes: %w", n, err)
			}
			gl, err := m.grpcLatency(n, 1)
			if err != nil {
				return fmt.Errorf("gRPC %d bytes: %w", n, err)
			}
			cl, err := m.raw(true, n, 1)
			if err != nil {
				return fmt.Errorf("copy-through-buffer %d bytes: %w", n, err)
			}
			ours, grpcs, copies = append(ours, ourLat), append(grpcs, gl), append(copies, cl)
		}
		ourLat := medianDuration(ours)
		emit(env, provider, "large/vs-grpc", size, rateGBs(size, ourLat), "GB/s", rateGBs(size, medianDuration(grpcs)), "grpc", note)
		emit(env, provider, "large/vs-copybuf", size, rateGBs(size, ourLat), "GB/s", rateGBs(size, medianDuration(copies)), "copybuf", note)
	}
	return m.grantRows(sizes, reps, nSmall, note)
}

func us(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }

func emit(env *Env, provider, name string, size int64, value float64, unit string, baseline float64, baseName, note string) {
	r := newResult("tensor", "tensor/"+provider+"/"+name, size, value, unit, baseline, baseName)
	r.Note = note
	env.Emit(r)
}

// tensorMeasure holds what the measurements share.
type tensorMeasure struct {
	ctx      context.Context
	env      *Env
	s        *tensorSide
	gc       *grpcClient
	provider string
	seq      int
	// latRecvs and eagerRecvs count the last oursLatencyCalls' Recvs and
	// those of them that took a tensor sent eagerly.
	latRecvs, eagerRecvs int
}

// command sends the peer a command; the peer carries it out after the
// exchange returns (Recvs and raw requests may start at once: they wait).
func (m *tensorMeasure) command(format string, args ...any) error {
	_, err := m.s.group.Exchange(m.ctx, 1, []byte(fmt.Sprintf(format, args...)))
	return err
}

// oursRate receives n tensors of size bytes with tensorWindow in flight, reps
// times, and returns the median tensors per second.
func (m *tensorMeasure) oursRate(size, n, reps int) (float64, error) {
	var rates []float64
	for r := 0; r <= reps; r++ { // the first round warms up
		m.seq++
		key := fmt.Sprintf("rate-%d-%d", size, m.seq)
		if err := m.command("send %s %d %d", key, n, size); err != nil {
			return 0, err
		}
		start := time.Now()
		sem := make(chan struct{}, tensorWindow)
		errc := make(chan error, 1)
		var wg sync.WaitGroup
		for step := 0; step < n; step++ {
			sem <- struct{}{}
			wg.Add(1)
			m.s.ch.RecvFunc(m.ctx, key, int64(step), func(t *tensor.Tensor, _ rendezvous.Transfer, err error) {
				if err == nil {
					err = t.Release()
				}
				if err != nil {
					select {
					case errc <- err:
					default:
					}
				}
				<-sem
				wg.Done()
			})
		}
		wg.Wait()
		select {
		case err := <-errc:
			return 0, err
		default:
		}
		if r > 0 {
			rates = append(rates, float64(n)/time.Since(start).Seconds())
		}
	}
	return median(rates), nil
}

// oursLatency is the median time of one Recv of size bytes whose Send is
// already in (the steady state: meta-data cached, one round trip; none
// for a tensor that came eagerly, rendezvous.WithEager, before its Recv).
func (m *tensorMeasure) oursLatency(size, reps int) (time.Duration, error) {
	d, _, err := m.oursLatencyCalls(size, reps)
	return d, err
}

// oursLatencyCalls is oursLatency that also returns every timed Recv's own
// time, sorted (timeEachCall).
func (m *tensorMeasure) oursLatencyCalls(size, reps int) (time.Duration, []time.Duration, error) {
	iters := max(1, min(200, (64<<20)/size))
	if size > 64<<20 {
		iters = 1
	}
	total := 1 + reps*iters
	m.seq++
	key := fmt.Sprintf("lat-%d-%d", size, m.seq)
	if err := m.command("send %s %d %d", key, total, size); err != nil {
		return 0, nil, err
	}
	step := 0
	m.eagerRecvs, m.latRecvs = 0, 0
	return timeEachCall(reps, iters, func() error {
		t, tr, err := m.s.ch.Recv(m.ctx, key, int64(step))
		step++
		if err != nil {
			return err
		}
		m.latRecvs++
		if tr.Path == rendezvous.PathEager {
			m.eagerRecvs++
		}
		return t.Release()
	})
}

// grpcRate is oursRate through gRPC: n calls, tensorWindow at once, each
// response copied into a result tensor.
func (m *tensorMeasure) grpcRate(size, n, reps int) (float64, error) {
	var rates []float64
	for r := 0; r <= reps; r++ {
		start := time.Now()
		var wg sync.WaitGroup
		errc := make(chan error, tensorWindow)
		per := n / tensorWindow
		for w := 0; w < tensorWindow; w++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				dst := make([]byte, size)
				for i := 0; i < per; i++ {
					if err := m.gc.get(m.ctx, size, dst); err != nil {
						errc <- err
						return
					}
				}
			}()
		}
		wg.Wait()
		select {
		case err := <-errc:
			return 0, err
		default:
		}
		if r > 0 {
			rates = append(rates, float64(per*tensorWindow)/time.Since(start).Seconds())
		}
	}
	return median(rates), nil
}

// grpcLatency is the median time of one gRPC call of size bytes, copied
// into a result tensor from the pool.
func (m *tensorMeasure) grpcLatency(size, reps int) (time.Duration, error) {
	iters := max(1, min(200, (64<<20)/size))
	if size > 64<<20 {
		iters = 1
	}
	blk, err := m.s.pool.Alloc(size)
	if err != nil {
		return 0, err
	}
	defer blk.Free()
	dst := blk.Bytes()
	return timeEach(reps, iters, func() error { return m.gc.get(m.ctx, size, dst) })
}

// raw is the median time of one request answered over the bare queue pair:
// with copies through the fixed buffers (copy-through-buffer), or without
// (the raw write).
func (m *tensorMeasure) raw(copies bool, size, reps int) (time.Duration, error) {
	d, _, err := m.rawCalls(copies, size, reps)
	return d, err
}

// rawCalls is raw that also returns every timed ask's own time, sorted
// (timeEachCall).
func (m *tensorMeasure) rawCalls(copies bool, size, reps int) (time.Duration, []time.Duration, error) {
	iters := max(1, min(200, (64<<20)/size))
	if size > 64<<20 {
		iters = 1
	}
	total := 1 + reps*iters
	mode := "raw"
	if copies {
		mode = "copy"
	}
	if err := m.command("answer %s %d %d", mode, total, size); err != nil {
		return 0, nil, err
	}
	var dst []byte
	if copies {
		blk, err := m.s.pool.Alloc(size)
		if err != nil {
			return 0, nil, err
		}
		defer blk.Free()
		dst = blk.Bytes()
	}
	return timeEachCall(reps, iters, func() error {
		if err := m.s.raw.ask(m.ctx); err != nil {
			return err
		}
		if copies {
			m.s.raw.copyOut(dst)
		}
		return nil
	})
}

package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"math/bits"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"
	"unsafe"

	"github.com/gdrlink/gdrlink"
	"github.com/gdrlink/gdrlink/internal/jobauth"
	"github.com/gdrlink/gdrlink/internal/roceveth"
	"github.com/gdrlink/gdrlink/internal/switchml/aggsrv"
	"github.com/gdrlink/gdrlink/proxy"
	"github.com/gdrlink/gdrlink/tensor"
)

func init() {
	register(Scenario{
		Name: "allreduce",
		Doc:  "AllReduce (sum) of float32 tensors, 4 KiB..256 MiB, on 2, 4 and 8 worker processes: algorithm bandwidth and bytes on the wire per worker, vs Open MPI's MPI_Allreduce",
		Run:  runAllReduce,
		Plots: []Plot{
			{File: "allreduce-bandwidth.svg", Title: "AllReduce algorithm bandwidth (size / time) vs MPI_Allreduce", Unit: "GB/s", CasePrefix: "ring/"},
		},
		// The bench binary re-executes itself as the job's ranks.
		Child: &Child{Env: allReduceRankEnv, Run: func(role string) int {
			if role == allReduceAggregatorRole {
				return runRXEAggregator()
			}
			return runAllReduceRank()
		}},
	})
}

const (
	allReduceRankEnv  = "GDRLINK_BENCH_ALLREDUCE"
	allReduceSizesEnv = "GDRLINK_BENCH_ALLREDUCE_SIZES"
	allReduceRepsEnv  = "GDRLINK_BENCH_ALLREDUCE_REPS"
	// allReduceGPUEnv set to 1 makes the ranks reduce tensors on GPU 0.
	allReduceGPUEnv  = "GDRLINK_BENCH_ALLREDUCE_GPU"
	allReduceMinSize = 4 << 10
	allReduceMaxSize = 256 << 20

	// The allreduce scenario's -set keys.
	setAllReduceWorkers   = "allreduce.workers"   // comma-separated worker counts (default 2,4,8)
	setAllReduceProviders = "allreduce.providers" // comma-separated providers (default onnode)
	setAllReduceMPI       = "allreduce.mpi"       // "off" skips the Open MPI baseline
	setAllReduceSwitchML  = "allreduce.switchml"  // "on" or "udp" adds switchml rows of software workers (UDP) through an aggregator in this process; "verbs" of workers on a Soft-RoCE device through an aggregator process in a network namespace (root, rdma_rxe); "udp,verbs" both
	setAllReduceGPU       = "allreduce.gpu"       // "on" adds ring rows of tensors on GPU 0 (every worker shares it)
	setAllReduceBind      = "allreduce.bind"      // "cores" (default) binds each ring worker to cores of its own where there is a core per worker, as mpirun binds MPI's ranks; "none" leaves them floating
	setAllReduceRounds    = "allreduce.rounds"    // rounds of an MPI job and a ring job in turn (default 1); rows are medians over rounds, the ratio the median of the rounds' ratios
)

// allReduceRow is what rank 0 of a job prints for one size: the median
// time of one call, and the bytes its last call put on the wire and took
// in.
type allReduceRow struct {
	Size     int64   `json:"size"`
	Seconds  float64 `json:"seconds"`
	Sent     int64   `json:"sent"`
	Received int64   `json:"received"`
	Links    string  `json:"links"`
	// Yield says that rank 0's polls yielded the CPU (gdrlink.Stats.Yield:
	// more workers than CPUs, by default).
	Yield bool `json:"yield,omitempty"`
	// Procs is rank 0's gdrlink.Stats.Procs: the GOMAXPROCS Join set, 0
	// where it left it alone.
	Procs int `json:"procs,omitempty"`
	// Algorithm is rank 0's last call's collective.Report.Algorithm.
	Algorithm string `json:"algorithm,omitempty"`
	// Stage is the median time of the copies between the GPU tensor and
	// its pinned host copy (the GPU rows).
	Stage float64 `json:"stage,omitempty"`
	Err   string  `json:"err,omitempty"`
}

func runAllReduce(ctx context.Context, env *Env) error {
	sizes := env.sizes(allReduceMinSize, allReduceMaxSize)
	workers := []int{2, 4, 8}
	if env.Quick {
		workers = []int{2, 3}
	}
	if v, ok := env.Args[setAllReduceWorkers]; ok {
		workers = nil
		for _, f := range strings.Split(v, ",") {
			n, err := strconv.Atoi(f)
			if err != nil || n < 2 {
				return fmt.Errorf("%w: -set %s=%s: want worker counts of at least 2", errUsage, setAllReduceWorkers, v)
			}
			workers = append(workers, n)
		}
	}
	providers := []string{"onnode"}
	if v, ok := env.Args[setAllReduceProviders]; ok {
		providers = strings.Split(v, ",")
	}
	reps := max(env.Reps, 1)
	rounds := 1
	if v, ok := env.Args[setAllReduceRounds]; ok {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			return fmt.Errorf("%w: -set %s=%s: want a number of rounds of at least 1", errUsage, setAllReduceRounds, v)
		}
		rounds = n
	}
	var bind ringBind
	switch v := env.Args[setAllReduceBind]; v {
	case "", "cores":
		bind = ringBind{env: "GDRLINK_BIND=cores", note: "; each worker bound to cores of its own where the host has a core per worker, as mpirun binds MPI's ranks (allreduce.bind=cores)"}
	case "none":
		bind = ringBind{env: "GDRLINK_BIND=none", note: "; workers not bound to cores (allreduce.bind=none), while mpirun binds MPI's ranks where the host has a core per rank"}
	default:
		return fmt.Errorf("%w: -set %s=%s: want cores or none", errUsage, setAllReduceBind, v)
	}
	if env.Args[setAllReduceGPU] == "on" {
		dev, err := proxy.NewCUDADevice(0)
		if err != nil {
			return fmt.Errorf("-set %s=on: %w", setAllReduceGPU, err)
		}
		_ = dev.Close()
	}
	var switchmlModes []string
	var rxe *roceveth.Link
	if v, ok := env.Args[setAllReduceSwitchML]; ok {
		for _, m := range strings.Split(v, ",") {
			switch m {
			case "on", "udp":
				switchmlModes = append(switchmlModes, "udp")
			case "verbs":
				switchmlModes = append(switchmlModes, "verbs")
			case "off":
			default:
				return fmt.Errorf("%w: -set %s=%s: want on, udp, verbs or off", errUsage, setAllReduceSwitchML, v)
			}
		}
		if slices.Contains(switchmlModes, "verbs") {
			l, cleanup, err := roceveth.New("ab", []string{rxeWorkerNet}, rxeAggNet)
			if err != nil {
				return fmt.Errorf("-set %s=verbs needs a Soft-RoCE device on veth to a namespace: %w", setAllReduceSwitchML, err)
			}
			defer cleanup()
			rxe = l
		}
	}
	mpi, mpiErr := buildMPIAllReduce(ctx)
	if env.Args[setAllReduceMPI] == "off" {
		mpiErr = errors.New("-set " + setAllReduceMPI + "=off")
	}
	if mpiErr != nil {
		env.Log.Info("MPI_Allreduce baseline skipped", "reason", mpiErr)
	} else {
		defer os.RemoveAll(filepath.Dir(mpi))
	}
	for _, w := range workers {
		// Each round runs the MPI job and a ring job per provider, in
		// turn (the order alternates), so that what a busy host does to
		// one round falls on both; a row is the median over rounds.
		var base []map[int64]float64
		baseNote := ""
		ringRuns := make([][][]allReduceRow, len(providers)) // [provider][round]
		for round := range rounds {
			runMPI := func() {
				if mpiErr != nil || baseNote != "" {
					return
				}
				b, err := runMPIAllReduce(ctx, mpi, w, sizes, reps)
				if err != nil {
					env.Log.Info("MPI_Allreduce baseline failed", "workers", w, "err", err)
					baseNote = fmt.Sprintf("; no baseline: MPI_Allreduce failed: %v", err)
					base = nil
					return
				}
				base = append(base, b)
			}
			if round%2 == 0 {
				runMPI()
			}
			for i, prov := range providers {
				rows, err := runRingAllReduce(ctx, prov, w, sizes, reps, ringRun{bind: bind.env})
				if err != nil {
					return fmt.Errorf("%d workers on %s: %w", w, prov, err)
				}
				ringRuns[i] = append(ringRuns[i], rows)
			}
			if round%2 == 1 {
				runMPI()
			}
		}
		if mpiErr != nil {
			baseNote = fmt.Sprintf("; no baseline: %v", mpiErr)
		}
		// ringRate is the ring's figure per size on the first provider,
		// the switchml rows' baseline.
		ringRate, ringName := map[int64]float64{}, ""
		for i, prov := range providers {
			for _, row := range roundMedians(ringRuns[i]) {
				d := time.Duration(row.Seconds * float64(time.Second))
				b, name, paired := 0.0, "", pairedRatios(ringRuns[i], base, row.Size)
				if len(paired) > 0 {
					b, name = rateGBs(row.Size, time.Duration(roundMedian(base, row.Size)*float64(time.Second))), "mpi-allreduce"
				}
				how := ""
				if row.Yield {
					how = "; polls yield the CPU (GDRLINK_YIELD=auto: more workers than CPUs)"
				}
				if row.Procs > 0 {
					how += fmt.Sprintf("; GOMAXPROCS %d (each worker's share of the CPUs)", row.Procs)
				}
				switch row.Algorithm {
				case "halving":
					how += "; by recursive halving and doubling (a tensor of one segment per chunk on a power-of-two number of workers)"
				case "doubling":
					how += "; by recursive doubling (a tensor of at most 128 KiB on a power-of-two number of workers: log2(W) steps, each the whole tensor)"
				}
				note := fmt.Sprintf("%d worker processes, float32 average (MPI_Allreduce: sum, it has no average; ours divides as it makes the last addition), median of %d; received over %s%s%s%s", w, reps, row.Links, bind.note, how, baseNote)
				r := newResult("allreduce", fmt.Sprintf("ring/%s/%dw", prov, w), row.Size, rateGBs(row.Size, d), "GB/s", b, name)
				if rounds > 1 {
					note += fmt.Sprintf("; %d rounds, each an MPI job and a ring job in turn: value and baseline the medians over rounds", rounds)
					if len(paired) > 0 {
						r.Ratio = median(paired)
						note += fmt.Sprintf(", ratio the median of the rounds' own ratios (%s)", formatRatios(paired))
					}
				}
				r.Note = note
				env.Emit(r)
				wire := newResult("allreduce", fmt.Sprintf("wire/%s/%dw", prov, w), row.Size, float64(row.Sent), "B", 0, "")
				wire.Note = fmt.Sprintf("bytes one worker put on the wire per call; a ring's least is 2(W-1)/W × size = %d", 2*int64(w-1)*row.Size/int64(w))
				if row.Algorithm == "doubling" {
					wire.Note += fmt.Sprintf(", recursive doubling's log2(W) × size = %d", int64(bits.Len(uint(w))-1)*row.Size)
				}
				env.Emit(wire)
				if ringRate[row.Size] == 0 {
					ringRate[row.Size], ringName = r.Value, "ring/"+prov
				}
			}
		}
		if env.Args[setAllReduceGPU] == "on" {
			rows, err := runRingAllReduce(ctx, providers[0], w, sizes, reps, ringRun{gpu: true, bind: bind.env})
			if err != nil {
				return fmt.Errorf("%d workers on GPU 0: %w", w, err)
			}
			for _, row := range rows {
				d := time.Duration(row.Seconds * float64(time.Second))
				// The baseline is the host ring of the same run: the
				// ratio is what staging through pinned memory costs.
				r := newResult("allreduce", fmt.Sprintf("ring-gpu/%s/%dw", providers[0], w), row.Size, rateGBs(row.Size, d), "GB/s", ringRate[row.Size], ringName)
				r.Note = fmt.Sprintf("%d worker processes sharing GPU 0, float32 average of GPU tensors, copied to pinned host memory, reduced there and copied back (median %.3f ms a call on copies outside the ring's steps), median of %d; received over %s", w, row.Stage*1e3, reps, row.Links)
				env.Emit(r)
			}
		}
		for _, mode := range switchmlModes {
			var rows []allReduceRow
			var err error
			case_, where := "switchml", "a software aggregator (aggsrv, in the bench process) at a UDP port of its own on loopback"
			if mode == "verbs" {
				rows, err = runRingAllReduce(ctx, "tcp", w, sizes, reps, ringRun{rxe: rxe})
				case_, where = "switchml-verbs", fmt.Sprintf("a software aggregator process in network namespace %s, reached over veth from Soft-RoCE device %s (UC queue pairs)", rxe.NS, rxe.Dev)
			} else {
				rows, err = runRingAllReduce(ctx, "tcp", w, sizes, reps, ringRun{aggregator: true})
			}
			if err != nil {
				return fmt.Errorf("%d workers through the aggregator (%s): %w", w, mode, err)
			}
			for _, row := range rows {
				d := time.Duration(row.Seconds * float64(time.Second))
				// The baseline is the ring of the same run, same workers
				// and size (on the first provider): ratio above 1 is
				// switchml ahead.
				r := newResult("allreduce", fmt.Sprintf("%s/%dw", case_, w), row.Size, rateGBs(row.Size, d), "GB/s", ringRate[row.Size], ringName)
				r.Note = fmt.Sprintf("%d worker processes through %s, float32 average, median of %d; results over %s (switchml/udp: software workers; switchml/verbs: the device's queue pairs)", w, where, reps, row.Links)
				env.Emit(r)
				wire := newResult("allreduce", fmt.Sprintf("wire/%s/%dw", case_, w), row.Size, float64(row.Sent), "B", 0, "")
				wire.Note = "payload bytes one worker sent per call: S rounded up to 4 KiB (the exponents of each queue pair's first message ride in a zero-length write), plus 4 KiB for each message resent after a timeout (a lost packet, or another worker more than the 50 ms timeout late)"
				env.Emit(wire)
				in := newResult("allreduce", fmt.Sprintf("wire-in/%s/%dw", case_, w), row.Size, float64(row.Received), "B", 0, "")
				in.Note = "payload bytes of results one worker took in per call: S rounded up to 4 KiB (a result sent again after a resend is not taken twice)"
				env.Emit(in)
			}
		}
	}
	return nil
}

// roundMedians is the rows of several rounds of one job, one per size in
// the first round's order: each the first round's row with the median
// time over the rounds that have its size.
func roundMedians(runs [][]allReduceRow) []allReduceRow {
	if len(runs) == 0 {
		return nil
	}
	out := slices.Clone(runs[0])
	for i := range out {
		var secs []float64
		for _, rows := range runs {
			if row, ok := rowOf(rows, out[i].Size); ok {
				secs = append(secs, row.Seconds)
			}
		}
		out[i].Seconds = median(secs)
	}
	return out
}

func rowOf(rows []allReduceRow, size int64) (allReduceRow, bool) {
	for _, r := range rows {
		if r.Size == size {
			return r, true
		}
	}
	return allReduceRow{}, false
}

// roundMedian is the median over rounds of MPI's time for size (0 when
// no round has it).
func roundMedian(base []map[int64]float64, size int64) float64 {
	var secs []float64
	for _, b := range base {
		if s, ok := b[size]; ok && s > 0 {
			secs = append(secs, s)
		}
	}
	if len(secs) == 0 {
		return 0
	}
	return median(secs)
}

// pairedRatios is, for each round that has both, the ring's rate for size
// over MPI's in the same round (above 1: the ring ahead).
func pairedRatios(runs [][]allReduceRow, base []map[int64]float64, size int64) []float64 {
	var out []float64
	for i := range min(len(runs), len(base)) {
		row, ok := rowOf(runs[i], size)
		s := base[i][size]
		if ok && row.Seconds > 0 && s > 0 {
			out = append(out, s/row.Seconds)
		}
	}
	return out
}

// formatRatios prints ratios in round order, two decimals each.
func formatRatios(rs []float64) string {
	parts := make([]string, len(rs))
	for i, r := range rs {
		parts[i] = strconv.FormatFloat(r, 'f', 2, 64)
	}
	return strings.Join(parts, ", ")
}

// ringBind is the allreduce.bind setting: the ring workers' GDRLINK_BIND
// and what the rows' notes say of it.
type ringBind struct{ env, note string }

// ringRun says how runRingAllReduce runs a job.
type ringRun struct {
	// aggregator: the job's AllReduce goes through a SwitchML aggregator
	// run in this process.
	aggregator bool
	// gpu: the ranks reduce tensors on GPU 0.
	gpu bool
	// rxe: the job's AllReduce goes through an aggregator process in
	// rxe's namespace, the ranks' SwitchML queue pairs on its Soft-RoCE
	// device.
	rxe *roceveth.Link
	// bind is the ranks' GDRLINK_BIND=... (empty: not set).
	bind string
}

// runRingAllReduce runs a job of w processes of this binary over provider
// and returns rank 0's rows.
func runRingAllReduce(ctx context.Context, provider string, w int, sizes []int64, reps int, run ringRun) ([]allReduceRow, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	lf, err := ln.(*net.TCPListener).File()
	root := ln.Addr().String()
	ln.Close()
	if err != nil {
		return nil, err
	}
	defer lf.Close()
	key, err := gdrlink.NewJobKey()
	if err != nil {
		return nil, err
	}
	var extra []string
	if run.aggregator {
		a, err := startAggregator(key, w)
		if err != nil {
			return nil, fmt.Errorf("aggregator: %w", err)
		}
		defer a.close()
		extra = a.env
	}
	if run.rxe != nil {
		a, err := startRXEAggregator(ctx, run.rxe, self, key)
		if err != nil {
			return nil, fmt.Errorf("aggregator in %s: %w", run.rxe.NS, err)
		}
		defer a.close()
		extra = a.env
	}
	var ss []string
	for _, s := range sizes {
		ss = append(ss, strconv.FormatInt(s, 10))
	}
	cmds := make([]*exec.Cmd, w)
	var out0 bytes.Buffer
	errs := make([]bytes.Buffer, w)
	for r := range w {
		c := exec.CommandContext(ctx, self, "-test.run=^$")
		c.Env = append(os.Environ(), allReduceRankEnv+"=1", allReduceSizesEnv+"="+strings.Join(ss, ","), allReduceRepsEnv+"="+strconv.Itoa(reps),
			"GDRLINK_RANK="+strconv.Itoa(r), "GDRLINK_SIZE="+strconv.Itoa(w), "GDRLINK_ROOT="+root, "GDRLINK_PROVIDER="+provider, "GDRLINK_JOB_KEY="+key)
		c.Env = append(c.Env, extra...)
		if run.bind != "" {
			c.Env = append(c.Env, run.bind)
		}
		if run.gpu {
			c.Env = append(c.Env, allReduceGPUEnv+"=1")
		}
		if r == 0 {
			c.ExtraFiles = []*os.File{lf}
			c.Stdout = &out0
		}
		c.Stderr = &errs[r]
		c.WaitDelay = 5 * time.Second
		if err := c.Start(); err != nil {
			for _, c := range cmds[:r] {
				c.Process.Kill()
				c.Wait()
			}
			return nil, err
		}
		cmds[r] = c
	}
	var failed []error
	for r, c := range cmds {
		if err := c.Wait(); err != nil {
			failed = append(failed, fmt.Errorf("rank %d: %w: %s", r, err, strings.TrimSpace(errs[r].String())))
		}
	}
	if len(failed) > 0 {
		return nil, errors.Join(failed...)
	}
	var rows []allReduceRow
	sc := bufio.NewScanner(&out0)
	for sc.Scan() {
		var row allReduceRow
		if err := json.Unmarshal(sc.Bytes(), &row); err != nil {
			return nil, fmt.Errorf("rank 0 printed %q: %w", sc.Text(), err)
		}
		if row.Err != "" {
			return nil, errors.New(row.Err)
		}
		rows = append(rows, row)
	}
	if len(rows) != len(sizes) {
		return nil, fmt.Errorf("rank 0 reported %d sizes of %d", len(rows), len(sizes))
	}
	return rows, nil
}

// runAllReduceRank is one rank of the job: for each size, one AllReduce to
// warm up, then reps timed, each after a barrier; rank 0 prints a row per
// size.
func runAllReduceRank() int {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	if err := allReduceRank(ctx); err != nil {
		fmt.Fprintf(os.Stderr, "rank %s: %v\n", os.Getenv("GDRLINK_RANK"), err)
		return 1
	}
	return 0
}

func allReduceRank(ctx context.Context) error {
	var opts []gdrlink.Option
	if os.Getenv("GDRLINK_RANK") == "0" {
		ln, err := net.FileListener(os.NewFile(3, "root"))
		if err != nil {
			return err
		}
		opts = append(opts, gdrlink.WithRootListener(ln))
	}
	reps, err := strconv.Atoi(os.Getenv(allReduceRepsEnv))
	if err != nil {
		return err
	}
	var fill func(t *tensor.Tensor, v []float32) error
	if os.Getenv(allReduceGPUEnv) == "1" {
		dev, err := proxy.NewCUDADevice(0)
		if err != nil {
			return err
		}
		defer dev.Close()
		opts = append(opts, gdrlink.WithGPU(0))
		fill = func(t *tensor.Tensor, v []float32) error { return fillGPU(dev, t, v) }
	}
	g, err := gdrlink.Join(ctx, opts...)
	if err != nil {
		return err
	}
	defer g.Close()
	enc := json.NewEncoder(os.Stdout)
	for _, f := range strings.Split(os.Getenv(allReduceSizesEnv), ",") {
		size, err := strconv.ParseInt(f, 10, 64)
		if err != nil {
			return err
		}
		t, err := g.NewTensor(tensor.Float32, size/4)
		if err != nil {
			return err
		}
		v, _ := tensor.View[float32](t)
		for i := range v {
			v[i] = float32(i%7) / 8
		}
		if fill != nil {
			h := t
			if t, err = g.NewTensorOn(tensor.GPUDevice(0), tensor.Float32, size/4); err != nil {
				return err
			}
			err = fill(t, v)
			_ = h.Release()
			if err != nil {
				return err
			}
		}
		if _, err := g.AllReduce(ctx, t, gdrlink.Average); err != nil {
			return err
		}
		times, stage := make([]float64, reps), make([]float64, reps)
		row := allReduceRow{Size: size}
		for i := range times {
			if err := g.Barrier(ctx); err != nil {
				return err
			}
			start := time.Now()
			rep, err := g.AllReduce(ctx, t, gdrlink.Average)
			if err != nil {
				return err
			}
			times[i] = time.Since(start).Seconds()
			stage[i] = rep.StageTook.Seconds()
			row.Sent, row.Received, row.Algorithm = rep.Sent, rep.Received, rep.Algorithm
			var links []string
			for _, l := range rep.Links {
				links = append(links, l.Provider+"/"+l.Path.String())
			}
			row.Links = strings.Join(links, ",")
		}
		st := g.Stats()
		row.Yield, row.Procs = st.Yield, st.Procs
		_ = t.Release()
		row.Seconds = median(times)
		if fill != nil {
			row.Stage = median(stage)
		}
		if g.Rank() == 0 {
			if err := enc.Encode(row); err != nil {
				return err
			}
		}
	}
	return g.Barrier(ctx)
}

// mpiAllReduceSource times MPI_Allreduce (float32 sum, in place) for each
// size given, after one call to warm up, reps times, each after a
// barrier; rank 0 prints "size seconds..." per size.
const mpiAllReduceSource = `#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv) {
	MPI_Init(&argc, &argv);
	int rank;
	MPI_Comm_rank(MPI_COMM_WORLD, &rank);
	int reps = atoi(argv[1]);
	for (int a = 2; a < argc; a++) {
		long size = atol(argv[a]);
		long n = size / 4;
		float *buf = malloc(size);
		for (long i = 0; i < n; i++) buf[i] = (float)(i % 7) / 8;
		MPI_Allreduce(MPI_IN_PLACE, buf, n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
		if (rank == 0) printf("%ld", size);
		for (int r = 0; r < reps; r++) {
			MPI_Barrier(MPI_COMM_WORLD);
			double t0 = MPI_Wtime();
			MPI_Allreduce(MPI_IN_PLACE, buf, n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
			double t = MPI_Wtime() - t0;
			if (rank == 0) printf(" %.9f", t);
		}
		if (rank == 0) { printf("\n"); fflush(stdout); }
		free(buf);
	}
	MPI_Finalize();
	return 0;
}
`

// buildMPIAllReduce compiles the MPI baseline with mpicc into a temporary
// directory, or says why it cannot.
func buildMPIAllReduce(ctx context.Context) (string, error) {
	for _, tool := range []string{"mpicc", "mpirun"} {
		if _, err := exec.LookPath(tool); err != nil {
			return "", fmt.Errorf("%s not installed (Debian packages libopenmpi-dev and openmpi-bin): %w", tool, err)
		}
	}
	dir, err := os.MkdirTemp("", "gdrlink-mpi-allreduce")
	if err != nil {
		return "", err
	}
	src, bin := filepath.Join(dir, "allreduce.c"), filepath.Join(dir, "allreduce")
	if err := os.WriteFile(src, []byte(mpiAllReduceSource), 0o644); err != nil {
		os.RemoveAll(dir)
		return "", err
	}
	if out, err := exec.CommandContext(ctx, "mpicc", "-O2", "-o", bin, src).CombinedOutput(); err != nil {
		os.RemoveAll(dir)
		return "", fmt.Errorf("mpicc (is libopenmpi-dev installed?): %w: %s", err, bytes.TrimSpace(out))
	}
	return bin, nil
}

// runMPIAllReduce runs the baseline on w processes and returns the median
// seconds per size.
func runMPIAllReduce(ctx context.Context, bin string, w int, sizes []int64, reps int) (map[int64]float64, error) {
	// Open MPI's defaults otherwise: it yields the processor while it
	// waits only when there are more processes than cores.
	args := []string{"--allow-run-as-root", "--oversubscribe", "-np", strconv.Itoa(w), bin, strconv.Itoa(reps)}
	for _, s := range sizes {
		args = append(args, strconv.FormatInt(s, 10))
	}
	cctx, cancel := context.WithTimeout(ctx, 20*time.Minute)
	defer cancel()
	c := exec.CommandContext(cctx, "mpirun", args...)
	var stderr bytes.Buffer
	c.Stderr = &stderr
	out, err := c.Output()
	if err != nil {
		return nil, fmt.Errorf("mpirun: %w: %s", err, bytes.TrimSpace(stderr.Bytes()))
	}
	return parseMPIAllReduce(out, reps)
}

// parseMPIAllReduce reads the baseline's lines: a size and reps times.
func parseMPIAllReduce(out []byte, reps int) (map[int64]float64, error) {
	res := map[int64]float64{}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		f := strings.Fields(line)
		if len(f) != reps+1 {
			return nil, fmt.Errorf("MPI baseline line %q: want a size and %d times", line, reps)
		}
		size, err := strconv.ParseInt(f[0], 10, 64)
		if err != nil || size <= 0 {
			return nil, fmt.Errorf("MPI baseline line %q: bad size", line)
		}
		ts := make([]float64, reps)
		for i := range ts {
			if ts[i], err = strconv.ParseFloat(f[i+1], 64); err != nil || !(ts[i] > 0) || math.IsInf(ts[i], 0) {
				return nil, fmt.Errorf("MPI baseline line %q: bad time %q", line, f[i+1])
			}
		}
		res[size] = median(ts)
	}
	return res, nil
}

// The addresses of the verbs switchml rows: the workers' Soft-RoCE device
// on the root-side end of the veth, the aggregator in the namespace.
const (
	rxeWorkerNet = "10.236.0.10/24"
	rxeAggNet    = "10.236.0.2/24"
	rxeAggAddr   = "10.236.0.2"
	// allReduceAggregatorRole is allReduceRankEnv's value that makes a
	// child the aggregator of the verbs rows.
	allReduceAggregatorRole = "aggregator"
)

// startRXEAggregator starts this binary as an aggregator process in rxe's
// namespace, serving RoCEv2 (port 4791) at rxeAggAddr and reading a raw
// IPv4 socket (rxe's requests carry an IP ID their ICRC covers, which a
// UDP socket does not show), and returns what the ranks need to use it;
// close ends it.
func startRXEAggregator(ctx context.Context, rxe *roceveth.Link, self, secret string) (*runningAggregator, error) {
	c := rxe.Command(self, "-test.run=^$")
	c.Env = append(os.Environ(), allReduceRankEnv+"="+allReduceAggregatorRole, "GDRLINK_JOB_KEY="+secret)
	stdin, err := c.StdinPipe()
	if err != nil {
		return nil, err
	}
	stdout, err := c.StdoutPipe()
	if err != nil {
		return nil, err
	}
	var stderr bytes.Buffer
	c.Stderr = &stderr
	if err := c.Start(); err != nil {
		return nil, err
	}
	stop := func() {
		stdin.Close()
		done := make(chan struct{})
		go func() { c.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			c.Process.Kill()
			<-done
		}
	}
	line := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		if sc.Scan() {
			line <- sc.Text()
		}
		close(line)
		io.Copy(io.Discard, stdout)
	}()
	select {
	case l, ok := <-line:
		ctl, found := strings.CutPrefix(l, "ready ")
		if !ok || !found {
			stop()
			return nil, fmt.Errorf("the aggregator process said %q: %s", l, strings.TrimSpace(stderr.String()))
		}
		return &runningAggregator{
			env:   []string{"GDRLINK_AGGREGATOR=" + ctl, "GDRLINK_SWITCHML_TRANSPORT=verbs"},
			close: stop,
		}, nil
	case <-time.After(30 * time.Second):
		stop()
		return nil, errors.New("the aggregator process did not start within 30 s")
	case <-ctx.Done():
		stop()
		return nil, ctx.Err()
	}
}

// runRXEAggregator is the aggregator process of the verbs rows: it serves
// at rxeAggAddr until its standard input closes.
func runRXEAggregator() int {
	if err := serveRXEAggregator(); err != nil {
		fmt.Fprintf(os.Stderr, "aggregator: %v\n", err)
		return 1
	}
	return 0
}

func serveRXEAggregator() error {
	key, _, err := jobauth.FromEnv(os.Getenv)
	if err != nil {
		return err
	}
	s, ctl, err := aggsrv.ListenRoCE(rxeAggAddr, aggsrv.Config{Key: key, SetupTimeout: time.Minute})
	if err != nil {
		return err
	}
	go s.Serve()
	fmt.Printf("ready %s\n", ctl)
	io.Copy(io.Discard, os.Stdin)
	return s.Close()
}

// runningAggregator is a SwitchML aggregator in this process.
type runningAggregator struct {
	env   []string // what the ranks need to use it
	close func()
}

// startAggregator serves a software aggregator for a job of w ranks with
// key on loopback: the ranks receive on 127.0.0.2, 127.0.0.3, ... at one
// UDP port free on all of them.
func startAggregator(secret string, w int) (*runningAggregator, error) {
	key, err := jobauth.Parse(secret)
	if err != nil {
		return nil, err
	}
	for range 10 {
		dc, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
		if err != nil {
			return nil, err
		}
		port := dc.LocalAddr().(*net.UDPAddr).Port
		free := true
		for r := range w {
			c, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, byte(2+r)), Port: port})
			if err != nil {
				free = false
				break
			}
			c.Close()
		}
		if !free {
			dc.Close()
			continue
		}
		dc.SetReadBuffer(8 << 20)
		cl, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			dc.Close()
			return nil, err
		}
		s, err := aggsrv.New(aggsrv.Config{Key: key, Control: cl, Data: dc, PeerPort: uint16(port), SetupTimeout: time.Minute})
		if err != nil {
			cl.Close()
			dc.Close()
			return nil, err
		}
		go s.Serve()
		return &runningAggregator{
			env:   []string{"GDRLINK_AGGREGATOR=" + cl.Addr().String(), "GDRLINK_AGGREGATOR_PORT=" + strconv.Itoa(port)},
			close: func() { s.Close() },
		}, nil
	}
	return nil, errors.New("no UDP port free on every loopback address")
}

// fillGPU copies v into t, a tensor on dev, and waits.
func fillGPU(dev proxy.Device, t *tensor.Tensor, v []float32) error {
	s, err := dev.NewStream()
	if err != nil {
		return err
	}
	defer s.Close()
	n := len(v) * 4
	if n == 0 {
		return nil
	}
	if err := dev.CopyHtoDAsync(proxy.DevicePtr(t.Addr()), uintptr(unsafe.Pointer(&v[0])), n, s); err != nil {
		return err
	}
	return s.Synchronize()
}

// Command ddp trains a two-layer MLP data-parallel across processes with
// gdrlink: every rank holds the same parameters, computes the gradient of
// its shard of a synthetic data set on gorgonia.org/tensor views of pool
// tensors, and the gradients are averaged with AllReduce (the ring, in
// place, no copies). Rank 0 prints the loss per step; at the end the ranks
// compare a SHA-256 of their parameters with AllGather and fail unless
// all are bitwise identical.
//
// It runs under any launcher gdrlink.Join understands, or starts its own:
//
//	ddp -n 4                      # self-launch: 4 processes on this host
//	mpirun -np 4 ddp              # OMPI_COMM_WORLD_RANK/SIZE; root 127.0.0.1:29500 unless GDRLINK_ROOT or MASTER_ADDR/PORT say
//	RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 ddp &
//	RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 ddp
//
// With -check, rank 0 also trains the same model in-process on the whole
// batch without gdrlink and fails if any parameter differs from the
// distributed result by more than -tol.
package main

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"time"

	"github.com/gdrlink/gdrlink"
	ggorgonia "github.com/gdrlink/gdrlink/contrib/gorgonia"
	"github.com/gdrlink/gdrlink/tensor"
	gt "gorgonia.org/tensor"
)

// defaultMPIRoot is where rank 0 listens under mpirun when neither
// GDRLINK_ROOT nor MASTER_ADDR/MASTER_PORT is set (one host).
const defaultMPIRoot = "127.0.0.1:29500"

// options are the command's flags.
type options struct {
	n         int
	steps     int
	lr        float64
	sizes     sizes
	seed      uint64
	paramsDir string
	check     bool
	tol       float64
	timeout   time.Duration
}

func main() {
	if err := run(context.Background(), os.Args[1:], os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "ddp:", err)
		os.Exit(1)
	}
}

func parse(args []string) (options, error) {
	var o options
	fs := flag.NewFlagSet("ddp", flag.ContinueOnError)
	fs.IntVar(&o.n, "n", 1, "processes to start on this host when no launcher set the rank")
	fs.IntVar(&o.steps, "steps", 20, "training steps (full-batch gradient descent)")
	fs.Float64Var(&o.lr, "lr", 0.2, "learning rate")
	fs.IntVar(&o.sizes.In, "in", 8, "input features")
	fs.IntVar(&o.sizes.Hidden, "hidden", 16, "hidden units")
	fs.IntVar(&o.sizes.Samples, "samples", 512, "samples in the data set; a multiple of the rank count")
	fs.Uint64Var(&o.seed, "seed", 1, "seed of the data set and the initial parameters")
	fs.StringVar(&o.paramsDir, "params", "", "directory to write each rank's final parameters to (params.rankN, little-endian float64)")
	fs.BoolVar(&o.check, "check", false, "rank 0 also trains on the whole batch in-process and compares")
	fs.Float64Var(&o.tol, "tol", 1e-12, "largest |difference| -check accepts")
	fs.DurationVar(&o.timeout, "timeout", 2*time.Minute, "bound on the whole run")
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if o.n < 1 || o.steps < 0 || o.sizes.In < 1 || o.sizes.Hidden < 1 || o.sizes.Samples < 1 {
		return o, fmt.Errorf("bad flags: -n %d -steps %d -in %d -hidden %d -samples %d", o.n, o.steps, o.sizes.In, o.sizes.Hidden, o.sizes.Samples)
	}
	return o, nil
}

// launched reports whether a launcher set this process's rank.
func launched() bool {
	for _, k := range []string{"GDRLINK_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"} {
		if os.Getenv(k) != "" {
			return true
		}
	}
	return false
}

func run(ctx context.Context, args []string, stdout io.Writer) error {
	o, err := parse(args)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, o.timeout)
	defer cancel()
	switch {
	case launched():
		if os.Getenv("OMPI_COMM_WORLD_RANK") != "" && os.Getenv("GDRLINK_ROOT") == "" && os.Getenv("MASTER_ADDR") == "" {
			// Join reads the root from the environment alongside the
			// rank, so the default goes there too.
			if err := os.Setenv("GDRLINK_ROOT", defaultMPIRoot); err != nil {
				return err
			}
		}
		return rank(ctx, o, stdout)
	case o.n == 1:
		return rank(ctx, o, stdout, gdrlink.WithRank(0, 1))
	default:
		return selfLaunch(ctx, o, args, stdout)
	}
}

// selfLaunch runs rank 0 in this process and starts ranks 1..n-1 as
// copies of this program with GDRLINK_RANK, GDRLINK_SIZE and GDRLINK_ROOT.
func selfLaunch(ctx context.Context, o options, args []string, stdout io.Writer) error {
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	errs := make(chan error, o.n-1)
	for r := 1; r < o.n; r++ {
		cmd := exec.CommandContext(ctx, exe, args...)
		cmd.Env = append(os.Environ(), "GDRLINK_RANK="+strconv.Itoa(r), "GDRLINK_SIZE="+strconv.Itoa(o.n), "GDRLINK_ROOT="+ln.Addr().String())
		cmd.Stdout, cmd.Stderr = stdout, os.Stderr
		if err := cmd.Start(); err != nil {
			ln.Close()
			return fmt.Errorf("start rank %d: %w", r, err)
		}
		go func() {
			if err := cmd.Wait(); err != nil {
				errs <- fmt.Errorf("rank %d: %w", r, err)
				return
			}
			errs <- nil
		}()
	}
	err = rank(ctx, o, stdout, gdrlink.WithRank(0, o.n), gdrlink.WithRoot(ln.Addr().String()), gdrlink.WithRootListener(ln))
	if err != nil {
		cancel()
	}
	for range o.n - 1 {
		err = errors.Join(err, <-errs)
	}
	return err
}

// rank is one rank's training.
func rank(ctx context.Context, o options, stdout io.Writer, opts ...gdrlink.Option) (err error) {
	g, err := gdrlink.Join(ctx, opts...)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, g.Close()) }()
	r, w := g.Rank(), g.Size()
	s := o.sizes
	if s.Samples%w != 0 {
		return fmt.Errorf("%d samples do not split evenly over %d ranks", s.Samples, w)
	}
	np := s.numParams()
	params, err := g.NewTensor(tensor.Float64, int64(np))
	if err != nil {
		return err
	}
	defer params.Release()
	// The gradient and, in its last element, the shard's loss: one
	// AllReduce a step averages both.
	grads, err := g.NewTensor(tensor.Float64, int64(np+1))
	if err != nil {
		return err
	}
	defer grads.Release()
	pd, err := ggorgonia.Dense(params)
	if err != nil {
		return err
	}
	gd, err := ggorgonia.Dense(grads)
	if err != nil {
		return err
	}
	p, gv := pd.Float64s(), gd.Float64s()
	if r == 0 {
		initParams(s, p, o.seed)
	}
	if _, err := g.Broadcast(ctx, params, 0); err != nil {
		return fmt.Errorf("broadcast of the initial parameters: %w", err)
	}
	x, y := dataset(s, o.seed)
	m := s.Samples / w
	xs, ys := x[r*m*s.In:(r+1)*m*s.In], y[r*m:(r+1)*m]
	if r == 0 {
		fmt.Fprintf(stdout, "ddp: %d ranks, %d samples (%d per rank), MLP %d-%d-1 (%d parameters), lr %g\n", w, s.Samples, m, s.In, s.Hidden, np, o.lr)
	}
	for step := range o.steps {
		loss, err := lossGrad(s, p, xs, ys, gv[:np])
		if err != nil {
			return err
		}
		gv[np] = loss
		if _, err := g.AllReduce(ctx, grads, gdrlink.Average); err != nil {
			return fmt.Errorf("step %d: %w", step, err)
		}
		if r == 0 {
			fmt.Fprintf(stdout, "step %3d loss %.12f\n", step, gv[np])
		}
		if err := sgd(p, gv[:np], o.lr); err != nil {
			return err
		}
	}
	sum, err := sameEverywhere(ctx, g, p)
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "rank %d/%d: params sha256 %x\n", r, w, sum[:8])
	if o.paramsDir != "" {
		if err := os.WriteFile(filepath.Join(o.paramsDir, fmt.Sprintf("params.rank%d", r)), floatBytes(p), 0o644); err != nil {
			return err
		}
	}
	if o.check && r == 0 {
		ref, err := reference(o)
		if err != nil {
			return err
		}
		d := maxAbsDiff(p, ref)
		fmt.Fprintf(stdout, "max |distributed - single-process| = %.3g (tolerance %g)\n", d, o.tol)
		if !(d <= o.tol) {
			return fmt.Errorf("parameters differ from the single-process run by %g > %g", d, o.tol)
		}
	}
	return g.Barrier(ctx)
}

// sgd does p -= lr·grad on gorgonia Dense views of the two, in place.
func sgd(p, grad []float64, lr float64) error {
	P := gt.New(gt.WithShape(len(p)), gt.WithBacking(p))
	G := gt.New(gt.WithShape(len(grad)), gt.WithBacking(grad))
	if _, err := G.MulScalar(lr, true, gt.UseUnsafe()); err != nil {
		return fmt.Errorf("lr·grad: %w", err)
	}
	if _, err := P.Sub(G, gt.UseUnsafe()); err != nil {
		return fmt.Errorf("p - lr·grad: %w", err)
	}
	return nil
}

// reference trains the same model on the whole batch in one process,
// with ordinary Go memory and no gdrlink.
func reference(o options) ([]float64, error) {
	s := o.sizes
	p, g := make([]float64, s.numParams()), make([]float64, s.numParams())
	initParams(s, p, o.seed)
	x, y := dataset(s, o.seed)
	for range o.steps {
		if _, err := lossGrad(s, p, x, y, g); err != nil {
			return nil, err
		}
		if err := sgd(p, g, o.lr); err != nil {
			return nil, err
		}
	}
	return p, nil
}

// sameEverywhere gathers every rank's SHA-256 of p and fails unless all
// are equal; it returns this rank's.
func sameEverywhere(ctx context.Context, g *gdrlink.Group, p []float64) ([sha256.Size]byte, error) {
	sum := sha256.Sum256(floatBytes(p))
	in, err := g.NewTensor(tensor.Uint8, sha256.Size)
	if err != nil {
		return sum, err
	}
	defer in.Release()
	out, err := g.NewTensor(tensor.Uint8, int64(g.Size()), sha256.Size)
	if err != nil {
		return sum, err
	}
	defer out.Release()
	b, _ := in.Bytes()
	copy(b, sum[:])
	if _, err := g.AllGather(ctx, in, out); err != nil {
		return sum, fmt.Errorf("gather of the parameter hashes: %w", err)
	}
	all, _ := out.Bytes()
	for r := range g.Size() {
		if [sha256.Size]byte(all[r*sha256.Size:(r+1)*sha256.Size]) != sum {
			return sum, fmt.Errorf("rank %d's parameters differ from rank %d's (sha256 %x, %x)", r, g.Rank(), all[r*sha256.Size:r*sha256.Size+8], sum[:8])
		}
	}
	return sum, nil
}

func floatBytes(p []float64) []byte {
	b := make([]byte, 0, 8*len(p))
	for _, f := range p {
		b = binary.LittleEndian.AppendUint64(b, math.Float64bits(f))
	}
	return b
}

func maxAbsDiff(a, b []float64) float64 {
	if len(a) != len(b) {
		return math.Inf(1)
	}
	var d float64
	for i := range a {
		d = max(d, math.Abs(a[i]-b[i]))
	}
	return d
}

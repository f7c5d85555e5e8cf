package main

import (
	"bytes"
	"context"
	"encoding/binary"
	"math"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// TestMain makes the test binary the ddp command when DDP_MAIN is set, so
// tests (and self-launch from them) start real processes of it.
func TestMain(m *testing.M) {
	if os.Getenv("DDP_MAIN") == "1" {
		main()
		return
	}
	os.Exit(m.Run())
}

// tolerance is the largest |difference| accepted between a parameter
// trained on N ranks and on one: float64 sums of the same gradients in
// another order, over 20 steps.
const tolerance = 1e-12

const steps = 20

// cleanEnv is this process's environment without any launcher's
// variables, plus DDP_MAIN=1 and extra.
func cleanEnv(extra ...string) []string {
	var env []string
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		switch k {
		case "GDRLINK_RANK", "GDRLINK_SIZE", "GDRLINK_ROOT", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS":
			continue
		}
		if strings.HasPrefix(k, "OMPI_") || strings.HasPrefix(k, "PMIX_") {
			continue
		}
		env = append(env, kv)
	}
	return append(append(env, "DDP_MAIN=1"), extra...)
}

// launch runs the command with -n n as a separate process (which starts
// the other ranks itself) and returns its output and each rank's final
// parameters.
func launch(t *testing.T, n int) (string, [][]float64) {
	t.Helper()
	dir := t.TempDir()
	cmd := exec.Command(os.Args[0], "-n", strconv.Itoa(n), "-steps", strconv.Itoa(steps), "-params", dir)
	cmd.Env = cleanEnv()
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("-n %d: %v\n%s", n, err, out)
	}
	return string(out), readParams(t, dir, n, out)
}

// readParams reads the n ranks' parameter files and checks that they are
// bitwise equal.
func readParams(t *testing.T, dir string, n int, out []byte) [][]float64 {
	t.Helper()
	params := make([][]float64, n)
	for r := range n {
		b, err := os.ReadFile(filepath.Join(dir, "params.rank"+strconv.Itoa(r)))
		if err != nil {
			t.Fatalf("%d ranks: %v\n%s", n, err, out)
		}
		if r > 0 && !bytes.Equal(b, floatBytes(params[0])) {
			t.Fatalf("%d ranks: rank %d's parameters are not bitwise rank 0's", n, r)
		}
		params[r] = make([]float64, len(b)/8)
		for i := range params[r] {
			params[r][i] = math.Float64frombits(binary.LittleEndian.Uint64(b[8*i:]))
		}
	}
	return params
}

// freePort is a loopback port that was free a moment ago.
func freePort(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	_, p, _ := net.SplitHostPort(ln.Addr().String())
	return p
}

// TestMPIRun launches two ranks with Open MPI's mpirun, which sets
// OMPI_COMM_WORLD_RANK and OMPI_COMM_WORLD_SIZE.
func TestMPIRun(t *testing.T) {
	mpirun, err := exec.LookPath("mpirun")
	if err != nil {
		t.Skip("mpirun not found (Debian: openmpi-bin)")
	}
	dir := t.TempDir()
	root := "127.0.0.1:" + freePort(t)
	cmd := exec.Command(mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", "DDP_MAIN", "-x", "GDRLINK_ROOT="+root,
		os.Args[0], "-steps", strconv.Itoa(steps), "-params", dir, "-check")
	cmd.Env = cleanEnv("OMPI_ALLOW_RUN_AS_ROOT=1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("mpirun: %v\n%s", err, out)
	}
	losses(t, string(out))
	readParams(t, dir, 2, out)
	if !strings.Contains(string(out), "max |distributed - single-process|") {
		t.Fatalf("no comparison with the single-process run:\n%s", out)
	}
}

// TestTorchrunVariables starts two ranks by hand with the variables
// torchrun sets: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
func TestTorchrunVariables(t *testing.T) {
	dir := t.TempDir()
	port := freePort(t)
	outs := make([]bytes.Buffer, 2)
	cmds := make([]*exec.Cmd, 2)
	for r := range 2 {
		cmds[r] = exec.Command(os.Args[0], "-steps", strconv.Itoa(steps), "-params", dir)
		cmds[r].Env = cleanEnv("RANK="+strconv.Itoa(r), "WORLD_SIZE=2", "MASTER_ADDR=127.0.0.1", "MASTER_PORT="+port)
		cmds[r].Stdout, cmds[r].Stderr = &outs[r], &outs[r]
		if err := cmds[r].Start(); err != nil {
			t.Fatal(err)
		}
	}
	for r, c := range cmds {
		if err := c.Wait(); err != nil {
			t.Fatalf("rank %d: %v\n%s", r, err, outs[r].String())
		}
	}
	l := losses(t, outs[0].String())
	p := readParams(t, dir, 2, outs[0].Bytes())
	o, _ := parse([]string{"-steps", strconv.Itoa(steps)})
	ref, err := reference(o)
	if err != nil {
		t.Fatal(err)
	}
	if d := maxAbsDiff(p[1], ref); !(d <= tolerance) {
		t.Fatalf("parameters differ from the single-process run by %g", d)
	}
	t.Logf("torchrun-style, 2 ranks: final loss %.12f", l[steps-1])
}

// losses are the per-step losses rank 0 printed.
func losses(t *testing.T, out string) []float64 {
	t.Helper()
	var l []float64
	for _, line := range strings.Split(out, "\n") {
		f := strings.Fields(line)
		if len(f) == 4 && f[0] == "step" && f[2] == "loss" {
			v, err := strconv.ParseFloat(f[3], 64)
			if err != nil {
				t.Fatalf("%q: %v", line, err)
			}
			l = append(l, v)
		}
	}
	if len(l) != steps {
		t.Fatalf("%d loss lines, want %d:\n%s", len(l), steps, out)
	}
	return l
}

// TestDataParallel trains on 1, 2 and 4 processes: the parameters are
// bitwise identical across the ranks of a run, and those of 2 and 4 ranks
// match the single-process run and the in-process reference within
// tolerance, as do the losses.
func TestDataParallel(t *testing.T) {
	out1, p1 := launch(t, 1)
	l1 := losses(t, out1)
	if !(l1[steps-1] < 0.8*l1[0]) {
		t.Fatalf("loss went from %g to %g: not training", l1[0], l1[steps-1])
	}
	o, err := parse([]string{"-steps", strconv.Itoa(steps)})
	if err != nil {
		t.Fatal(err)
	}
	ref, err := reference(o)
	if err != nil {
		t.Fatal(err)
	}
	if d := maxAbsDiff(p1[0], ref); d != 0 {
		t.Fatalf("one rank through gdrlink differs from the in-process run by %g", d)
	}
	for _, n := range []int{2, 4} {
		out, p := launch(t, n)
		l := losses(t, out)
		d := maxAbsDiff(p[0], ref)
		t.Logf("%d ranks: max |difference| to the single-process run %.3g; loss %.6f → %.6f", n, d, l[0], l[steps-1])
		if !(d <= tolerance) {
			t.Fatalf("%d ranks: parameters differ from the single-process run by %g > %g", n, d, tolerance)
		}
		for i := range l {
			if math.Abs(l[i]-l1[i]) > tolerance {
				t.Fatalf("%d ranks: step %d loss %g, single process %g", n, i, l[i], l1[i])
			}
		}
	}
}

// TestGradient checks the hand-written backward pass against central
// differences of the loss.
func TestGradient(t *testing.T) {
	s := sizes{In: 3, Hidden: 5, Samples: 7}
	p, g, scratch := make([]float64, s.numParams()), make([]float64, s.numParams()), make([]float64, s.numParams())
	initParams(s, p, 3)
	for i := range p {
		p[i] += 0.01 * float64(i%5) // non-zero biases too
	}
	x, y := dataset(s, 3)
	if _, err := lossGrad(s, p, x, y, g); err != nil {
		t.Fatal(err)
	}
	const h = 1e-6
	for i := range p {
		old := p[i]
		p[i] = old + h
		lp, _ := lossGrad(s, p, x, y, scratch)
		p[i] = old - h
		lm, _ := lossGrad(s, p, x, y, scratch)
		p[i] = old
		if num := (lp - lm) / (2 * h); math.Abs(num-g[i]) > 1e-7 {
			t.Fatalf("d loss/d p[%d] = %g, numerically %g", i, g[i], num)
		}
	}
}

func TestBadInput(t *testing.T) {
	if err := run(context.Background(), []string{"-n", "0"}, nil); err == nil {
		t.Fatal("-n 0 accepted")
	}
	if _, err := lossGrad(sizes{In: 2, Hidden: 2, Samples: 1}, nil, nil, nil, nil); err == nil {
		t.Fatal("empty input accepted")
	}
	if err := run(context.Background(), []string{"-n", "1", "-samples", "3", "-steps", "1"}, &bytes.Buffer{}); err != nil {
		t.Fatalf("one rank, 3 samples: %v", err)
	}
}

package worker

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/internal/jobauth"
	"github.com/gdrlink/gdrlink/internal/switchml/aggsrv"
	"github.com/gdrlink/gdrlink/internal/switchml/bfp"
)

const roleEnv = "SWITCHML_WORKER_TEST_ROLE"

func TestMain(m *testing.M) {
	switch os.Getenv(roleEnv) {
	case "agg":
		if err := runAggregator(); err != nil {
			fmt.Fprintln(os.Stderr, "aggregator child:", err)
			os.Exit(1)
		}
		os.Exit(0)
	case "idle":
		if err := runIdle(); err != nil {
			fmt.Fprintln(os.Stderr, "idle worker child:", err)
			os.Exit(1)
		}
		os.Exit(0)
	case "worker":
		if err := runWorker(); err != nil {
			fmt.Fprintln(os.Stderr, "worker child:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// runAggregator serves until its standard input closes.
func runAggregator() error {
	key, _, err := jobauth.FromEnv(os.Getenv)
	if err != nil {
		return err
	}
	peer, _ := strconv.Atoi(os.Getenv(roleEnv + "_PEER_PORT"))
	drop, _ := strconv.ParseFloat(os.Getenv(roleEnv+"_AGG_DROP"), 64)
	cl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	dc, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		return err
	}
	s, err := aggsrv.New(aggsrv.Config{Key: key, Control: cl, Data: dc, PeerPort: uint16(peer), Seed: 3, SetupTimeout: 60 * time.Second, Drop: drop})
	if err != nil {
		return err
	}
	go s.Serve()
	fmt.Printf("ready %s %d\n", cl.Addr(), dc.LocalAddr().(*net.UDPAddr).Port)
	io.Copy(io.Discard, os.Stdin)
	return s.Close()
}

// testLen is not a whole number of messages, on purpose.
const testLen = 40_000 + 77

// data is worker r's input: blocks of very different magnitudes.
func data(r int) ([]float32, []int32) {
	rng := rand.New(rand.NewPCG(uint64(r), 99))
	f := make([]float32, testLen)
	x := make([]int32, testLen)
	for i := range f {
		scale := math.Ldexp(1, (i/256)%40-20)
		f[i] = float32(rng.NormFloat64() * scale)
		x[i] = rng.Int32N(1<<20) - 1<<19
	}
	return f, x
}

// runWorker all-reduces float32, int32, float16 and bfloat16 tensors and
// writes the results to its file.
func runWorker() error {
	key, _, err := jobauth.FromEnv(os.Getenv)
	if err != nil {
		return err
	}
	env := func(k string) int { v, _ := strconv.Atoi(os.Getenv(roleEnv + "_" + k)); return v }
	rank, workers := env("RANK"), env("WORKERS")
	drop, _ := strconv.ParseFloat(os.Getenv(roleEnv+"_DROP"), 64)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	w, err := New(ctx, Config{Control: os.Getenv(roleEnv + "_CONTROL"), Key: key, Job: "test", Workers: workers, Rank: rank,
		Local: [4]byte{127, 0, 0, byte(2 + rank)}, Port: uint16(env("PORT")), DataPort: uint16(env("DATA_PORT")),
		DropSend: drop, DropRecv: drop, Seed: uint64(rank) + 1, Timeout: 100 * time.Millisecond})
	if err != nil {
		return err
	}
	defer w.Close()
	if os.Getenv(roleEnv+"_LINK") == "1" {
		w.tr.(*udpLink).link = chaos(uint64(rank))
	}
	f, x := data(rank)
	h := make([]uint16, len(f))
	bh := make([]uint16, len(f))
	for i, v := range f {
		h[i] = bfp.Float64ToF16(float64(v))
		bh[i] = bfp.Float64ToBF16(float64(v))
	}
	if err := w.AllReduceFloat32(ctx, f); err != nil {
		return err
	}
	if err := w.AllReduceInt32(ctx, x); err != nil {
		return err
	}
	if err := w.AllReduceFloat16(ctx, h); err != nil {
		return err
	}
	if err := w.AllReduceBFloat16(ctx, bh); err != nil {
		return err
	}
	var out []byte
	for _, v := range f {
		out = binary.LittleEndian.AppendUint32(out, math.Float32bits(v))
	}
	for _, v := range x {
		out = binary.LittleEndian.AppendUint32(out, uint32(v))
	}
	for i := range h {
		out = binary.LittleEndian.AppendUint16(out, h[i])
		out = binary.LittleEndian.AppendUint16(out, bh[i])
	}
	st := w.Stats()
	fmt.Printf("stats %+v\n", st)
	return os.WriteFile(os.Getenv(roleEnv+"_OUT"), out, 0o600)
}

// chaos is a link that loses, duplicates and reorders 2% of the packets
// each (a packet held back goes out after a later one, of any queue pair).
func chaos(seed uint64) func([]byte) [][]byte {
	var mu sync.Mutex
	rng := rand.New(rand.NewPCG(seed, 0xc4a05))
	var held []byte
	return func(b []byte) [][]byte {
		mu.Lock()
		defer mu.Unlock()
		b = append([]byte(nil), b...)
		var out [][]byte
		switch v := rng.Float64(); {
		case v < 0.02:
		case v < 0.04:
			out = [][]byte{b, b}
		case v < 0.06 && held == nil:
			held = b
			return nil
		default:
			out = [][]byte{b}
		}
		if held != nil && len(out) > 0 {
			out, held = append(out, held), nil
		}
		return out
	}
}

// aggregator starts the aggregator process; workers receive on port.
func aggregator(t *testing.T, secret string, port int, drop float64) (control string, dataPort int, stop func()) {
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), roleEnv+"=agg", roleEnv+"_AGG_DROP="+strconv.FormatFloat(drop, 'g', -1, 64), roleEnv+"_PEER_PORT="+strconv.Itoa(port), jobauth.KeyEnv+"="+secret)
	stdin, _ := cmd.StdinPipe()
	stdout, _ := cmd.StdoutPipe()
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	sc := bufio.NewScanner(stdout)
	if !sc.Scan() {
		cmd.Process.Kill()
		t.Fatal("the aggregator process said nothing")
	}
	f := strings.Fields(sc.Text())
	if len(f) != 3 || f[0] != "ready" {
		cmd.Process.Kill()
		t.Fatalf("aggregator: %q", sc.Text())
	}
	dataPort, _ = strconv.Atoi(f[2])
	return f[1], dataPort, func() { stdin.Close(); cmd.Process.Kill(); cmd.Wait() }
}

// freePort finds a UDP port free on 127.0.0.2 .. 127.0.0.(1+n).
func freePort(t testing.TB, n int) int {
	for try := 0; try < 10; try++ {
		s, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 2)})
		if err != nil {
			t.Skip("cannot bind 127.0.0.2:", err)
		}
		port := s.LocalAddr().(*net.UDPAddr).Port
		s.Close()
		ok := true
		for r := 1; r < n; r++ {
			c, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, byte(2+r)), Port: port})
			if err != nil {
				ok = false
				break
			}
			c.Close()
		}
		if ok {
			return port
		}
	}
	t.Skip("no UDP port free on every loopback address")
	return 0
}

// job runs an aggregator process and n worker processes and returns each
// worker's result file.
// drop is the share of packets lost at each worker, both ways; aggDrop at
// the aggregator.
func job(t *testing.T, n int, drop, aggDrop float64, link bool) [][]byte {
	_, secret, err := jobauth.Generate()
	if err != nil {
		t.Fatal(err)
	}
	port := freePort(t, n)
	control, dataPort, stop := aggregator(t, secret, port, aggDrop)
	defer stop()
	dir := t.TempDir()
	var wg sync.WaitGroup
	outs := make([][]byte, n)
	errs := make([]error, n)
	var resent atomic.Int32
	for r := range n {
		out := filepath.Join(dir, strconv.Itoa(r))
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), roleEnv+"=worker", jobauth.KeyEnv+"="+secret,
			roleEnv+"_RANK="+strconv.Itoa(r), roleEnv+"_WORKERS="+strconv.Itoa(n),
			roleEnv+"_CONTROL="+control, roleEnv+"_PORT="+strconv.Itoa(port),
			roleEnv+"_DATA_PORT="+strconv.Itoa(dataPort), roleEnv+"_OUT="+out,
			roleEnv+"_DROP="+strconv.FormatFloat(drop, 'g', -1, 64))
		if link {
			cmd.Env = append(cmd.Env, roleEnv+"_LINK=1")
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			b, err := cmd.CombinedOutput()
			if err != nil {
				errs[r] = fmt.Errorf("worker %d: %v: %s", r, err, b)
				return
			}
			t.Logf("worker %d: %s", r, strings.TrimSpace(string(b)))
			if !strings.Contains(string(b), "Resent:0 ") {
				resent.Add(1)
			}
			if strings.Contains(string(b), "RoundTrips:0 ") {
				errs[r] = fmt.Errorf("worker %d measured no round trip, so it never learned a timeout: %s", r, b)
				return
			}
			outs[r], errs[r] = os.ReadFile(out)
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	if (drop > 0 || aggDrop > 0 || link) && resent.Load() == 0 {
		t.Fatal("packets were lost and no worker resent a message")
	}
	return outs
}

// check compares the workers' results with one another and with exact sums.
func check(t *testing.T, n int, outs [][]byte) {
	for r := 1; r < n; r++ {
		if string(outs[r]) != string(outs[0]) {
			t.Fatalf("worker %d's result differs from worker 0's", r)
		}
	}
	c, _ := bfp.NewCodec(n)
	fs := make([][]float32, n)
	xs := make([][]int32, n)
	for r := range n {
		fs[r], xs[r] = data(r)
	}
	res := outs[0]
	worst := 0.0
	for i := range testLen {
		got := math.Float32frombits(binary.LittleEndian.Uint32(res[4*i:]))
		var exact float64
		var exp uint8
		b := i / 256 * 256
		for r := range n {
			exact += float64(fs[r][i])
			exp = max(exp, bfp.Exponent32(fs[r][b:min(b+256, testLen)]))
		}
		bound := c.SumErrorBound(exp, n) + math.Abs(exact)*0x1p-24*1.0001
		if d := math.Abs(float64(got) - exact); d > bound {
			t.Fatalf("float32 element %d: %g, exact %g, off by %g > bound %g", i, got, exact, d, bound)
		} else if bound > 0 {
			worst = max(worst, d/bound)
		}
		gi := int32(binary.LittleEndian.Uint32(res[4*testLen+4*i:]))
		var sum int32
		for r := range n {
			sum += xs[r][i]
		}
		if gi != sum {
			t.Fatalf("int32 element %d: %d, want %d", i, gi, sum)
		}
	}
	// float16 and bfloat16: within the bound of their own inputs' sums,
	// plus the final rounding (2^-11 and 2^-8 relative).
	hs := make([][]uint16, n)
	bs := make([][]uint16, n)
	for r := range n {
		hs[r], bs[r] = make([]uint16, testLen), make([]uint16, testLen)
		for i, v := range fs[r] {
			hs[r][i], bs[r][i] = bfp.Float64ToF16(float64(v)), bfp.Float64ToBF16(float64(v))
		}
	}
	off := 8 * testLen
	for i := range testLen {
		b := i / 256 * 256
		var eh, eb uint8
		var sh, sb float64
		for r := range n {
			eh = max(eh, bfp.ExponentF16(hs[r][b:min(b+256, testLen)]))
			eb = max(eb, bfp.ExponentBF16(bs[r][b:min(b+256, testLen)]))
			sh += bfp.F16ToFloat64(hs[r][i])
			sb += float64(bfp.BF16ToFloat32(bs[r][i]))
		}
		gh := bfp.F16ToFloat64(binary.LittleEndian.Uint16(res[off+4*i:]))
		gb := float64(bfp.BF16ToFloat32(binary.LittleEndian.Uint16(res[off+4*i+2:])))
		// float16's smallest subnormal is 2^-24: a result may round to it;
		// sums beyond its range (these inputs reach 2^20) become infinite,
		// and a block with an infinite input all NaN.
		switch {
		case eh == bfp.NonFinite:
			if !math.IsNaN(gh) {
				t.Fatalf("float16 element %d: %g in a block with an infinity", i, gh)
			}
		case math.Abs(sh) >= 65520:
			if !math.IsInf(gh, int(math.Copysign(1, sh))) {
				t.Fatalf("float16 element %d: %g, exact %g beyond float16", i, gh, sh)
			}
		case math.Abs(gh-sh) > c.SumErrorBound(eh, n)+math.Abs(sh)*0x1p-11*1.0001+0x1p-25:
			t.Fatalf("float16 element %d: %g, exact %g", i, gh, sh)
		}
		if d := math.Abs(gb - sb); d > c.SumErrorBound(eb, n)+math.Abs(sb)*0x1p-8*1.0001 {
			t.Fatalf("bfloat16 element %d: %g, exact %g", i, gb, sb)
		}
	}
	t.Logf("%d workers: results bitwise identical; float32 error at most %.3f of the bound, float16 and bfloat16 within theirs; int32 exact", n, worst)
}

// TestProcesses all-reduces across 2, 4 and 8 worker processes and an
// aggregator process, without and with packet loss (at every worker, both
// ways, and at the aggregator) and over a link that also duplicates and
// reorders: the lossy runs' results are bitwise those of the lossless one.
func TestProcesses(t *testing.T) {
	for _, n := range []int{2, 4, 8} {
		t.Run(strconv.Itoa(n), func(t *testing.T) {
			clean := job(t, n, 0, 0, false)
			check(t, n, clean)
			if lossy := job(t, n, 0.02, 0, false); string(lossy[0]) != string(clean[0]) {
				t.Fatal("the result with packet loss at the workers differs from the lossless one")
			}
			if lossy := job(t, n, 0, 0.02, false); string(lossy[0]) != string(clean[0]) {
				t.Fatal("the result with packet loss at the aggregator differs from the lossless one")
			}
			if lossy := job(t, n, 0, 0, true); string(lossy[0]) != string(clean[0]) {
				t.Fatal("the result over a link that loses, duplicates and reorders differs from the lossless one")
			}
		})
	}
}

package worker

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/internal/jobauth"
	"github.com/gdrlink/gdrlink/internal/switchml/aggsrv"
)

// pair sets up two workers in this process against control.
func pair(t *testing.T, key jobauth.Key, control string, port, dataPort int) [2]*Worker {
	var ws [2]*Worker
	var errs [2]error
	var wg sync.WaitGroup
	for r := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			ws[r], errs[r] = New(ctx, Config{Control: control, Key: key, Job: "fault", Workers: 2, Rank: r,
				Local: [4]byte{127, 0, 0, byte(2 + r)}, Port: uint16(port), DataPort: uint16(dataPort),
				Timeout: 50 * time.Millisecond, Retries: 40})
		}()
	}
	wg.Wait()
	if err := errors.Join(errs[:]...); err != nil {
		t.Fatal(err)
	}
	return ws
}

// TestDeadAggregator kills the aggregator process: a pending AllReduce
// fails within its deadline with an error naming the aggregator.
func TestDeadAggregator(t *testing.T) {
	key, secret, err := jobauth.Generate()
	if err != nil {
		t.Fatal(err)
	}
	port := freePort(t, 2)
	control, dataPort, stop := aggregator(t, secret, port, 0)
	ws := pair(t, key, control, port, dataPort)
	defer ws[0].Close()
	defer ws[1].Close()
	x := make([]int32, 1<<16)
	// Only worker 0 calls: its AllReduce stays pending until the
	// aggregator dies.
	done := make(chan error, 1)
	start := time.Now()
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		done <- ws[0].AllReduceInt32(ctx, x)
	}()
	time.Sleep(200 * time.Millisecond)
	stop()
	select {
	case err := <-done:
		if !errors.Is(err, ErrAggregator) || !strings.Contains(err.Error(), control) {
			t.Fatalf("AllReduce with the aggregator dead: %v, want ErrAggregator naming %s", err, control)
		}
		t.Logf("after %v: %v", time.Since(start).Round(time.Millisecond), err)
	case <-time.After(30 * time.Second):
		t.Fatal("AllReduce still pending 30 s after the aggregator died")
	}
}

// TestDeadWorker closes one worker while the other waits in AllReduce: the
// aggregator ends the job and the pending AllReduce fails naming the rank
// that left.
func TestDeadWorker(t *testing.T) {
	key, s, control, port, dataPort := server(t)
	defer s.Close()
	ws := pair(t, key, control, port, dataPort)
	defer ws[0].Close()
	done := pendingAllReduce(ws[0])
	time.Sleep(200 * time.Millisecond)
	ws[1].Close()
	select {
	case err := <-done:
		if !errors.Is(err, ErrWorker) || !strings.Contains(err.Error(), "rank 1 left") {
			t.Fatalf("AllReduce with the other worker gone: %v, want ErrWorker naming rank 1", err)
		}
		t.Log(err)
	case <-time.After(30 * time.Second):
		t.Fatal("AllReduce still pending 30 s after the other worker left")
	}
}

// TestAbandon: a worker that abandons the job while the other waits in
// AllReduce fails that AllReduce at once with a LeftError naming it, its
// reason and Abandoned; the job's name can be set up again at once, and
// the new job all-reduces.
func TestAbandon(t *testing.T) {
	key, s, control, port, dataPort := server(t)
	defer s.Close()
	ws := pair(t, key, control, port, dataPort)
	done := pendingAllReduce(ws[0])
	time.Sleep(200 * time.Millisecond)
	start := time.Now()
	if err := ws[1].Abandon("pinned pool exhausted"); err != nil {
		t.Fatalf("Abandon: %v", err)
	}
	if err := ws[1].Abandon("again"); !errors.Is(err, ErrClosed) {
		t.Fatalf("a second Abandon: %v, want ErrClosed", err)
	}
	select {
	case err := <-done:
		var left *LeftError
		if !errors.As(err, &left) || left.Rank != 1 || !left.Abandoned || left.Why != "pinned pool exhausted" {
			t.Fatalf("AllReduce with the other worker abandoning: %v, want a LeftError naming rank 1, abandoned, with its reason", err)
		}
		t.Logf("after %v: %v", time.Since(start).Round(time.Millisecond), err)
	case <-time.After(10 * time.Second):
		t.Fatal("AllReduce still pending 10 s after the other worker abandoned")
	}
	ws[0].Close()

	ws = pair(t, key, control, port, dataPort)
	defer ws[0].Close()
	defer ws[1].Close()
	errs := make(chan error, 2)
	for r := range 2 {
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			x := []int32{int32(r + 1), 10}
			err := ws[r].AllReduceInt32(ctx, x)
			if err == nil && (x[0] != 3 || x[1] != 20) {
				err = fmt.Errorf("rank %d: %v, want [3 20]", r, x)
			}
			errs <- err
		}()
	}
	for range 2 {
		if err := <-errs; err != nil {
			t.Fatalf("the job set up again: %v", err)
		}
	}
}

// pendingAllReduce starts an AllReduce on w alone (20 s deadline), which
// stays pending until the job ends; its error comes on the channel.
func pendingAllReduce(w *Worker) <-chan error {
	done := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		done <- w.AllReduceFloat32(ctx, make([]float32, 5000))
	}()
	return done
}

// server runs an aggregator in this process.
func server(t *testing.T) (jobauth.Key, *aggsrv.Server, string, int, int) {
	key, _, err := jobauth.Generate()
	if err != nil {
		t.Fatal(err)
	}
	port := freePort(t, 2)
	cl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dc, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	s, err := aggsrv.New(aggsrv.Config{Key: key, Control: cl, Data: dc, PeerPort: uint16(port), SetupTimeout: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	go s.Serve()
	return key, s, cl.Addr().String(), port, dc.LocalAddr().(*net.UDPAddr).Port
}

// TestCorruptICRC corrupts a payload byte of some packets after the ICRC
// was computed: the aggregator drops them, and the sum stays exact.
func TestCorruptICRC(t *testing.T) {
	key, s, control, port, dataPort := server(t)
	defer s.Close()
	ws := pair(t, key, control, port, dataPort)
	defer ws[0].Close()
	defer ws[1].Close()
	n := 0
	var mu sync.Mutex
	ws[0].tr.(*udpLink).mangle = func(b []byte) {
		mu.Lock()
		defer mu.Unlock()
		n++
		if n%7 == 0 {
			b[len(b)/2] ^= 0x10
		}
	}
	a := make([]int32, 30000)
	b := make([]int32, 30000)
	for i := range a {
		a[i], b[i] = int32(i*3-7), int32(1000-i)
	}
	var wg sync.WaitGroup
	var errs [2]error
	for r, x := range [][]int32{a, b} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			errs[r] = ws[r].AllReduceInt32(ctx, x)
		}()
	}
	wg.Wait()
	if err := errors.Join(errs[:]...); err != nil {
		t.Fatal(err)
	}
	for i := range a {
		if want := int32(i*3-7) + int32(1000-i); a[i] != want || b[i] != want {
			t.Fatalf("element %d: %d and %d, want %d", i, a[i], b[i], want)
		}
	}
	st := s.Stats()
	if st.BadICRC == 0 {
		t.Fatalf("no packet with a bad ICRC counted: %+v", st)
	}
	t.Logf("%d packets with a bad ICRC dropped; worker 0 resent %d messages", st.BadICRC, ws[0].Stats().Resent)
}

// TestClosePrompt closes a worker while its AllReduce is pending and the
// other worker neither calls nor leaves: the pending call fails with
// ErrClosed at once, and Close returns after at most its CloseTimeout
// (DefaultCloseTimeout here), not after the call's deadline.
func TestClosePrompt(t *testing.T) {
	key, s, control, port, dataPort := server(t)
	defer s.Close()
	ws := pair(t, key, control, port, dataPort)
	defer ws[1].Close()
	done := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		done <- ws[0].AllReduceFloat32(ctx, make([]float32, 5000))
	}()
	time.Sleep(200 * time.Millisecond)
	start := time.Now()
	if err := ws[0].Close(); err != nil {
		t.Fatal(err)
	}
	took := time.Since(start)
	select {
	case err := <-done:
		if !errors.Is(err, ErrClosed) {
			t.Fatalf("pending AllReduce after Close: %v, want ErrClosed", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("AllReduce still pending 10 s after Close returned")
	}
	// Generous margin over DefaultCloseTimeout for a loaded machine; the
	// pending call's deadline is a minute.
	if took > DefaultCloseTimeout+10*time.Second {
		t.Fatalf("Close took %v", took)
	}
	if err := ws[0].AllReduceInt32(context.Background(), make([]int32, 10)); !errors.Is(err, ErrClosed) {
		t.Fatalf("AllReduce after Close: %v, want ErrClosed", err)
	}
	t.Logf("Close took %v", took.Round(time.Millisecond))
}

// runIdle joins a job as a worker, says "joined", and then does nothing
// until its standard input closes (or it is killed).
func runIdle() error {
	key, _, err := jobauth.FromEnv(os.Getenv)
	if err != nil {
		return err
	}
	env := func(k string) int { v, _ := strconv.Atoi(os.Getenv(roleEnv + "_" + k)); return v }
	rank, workers := env("RANK"), env("WORKERS")
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	w, err := New(ctx, Config{Control: os.Getenv(roleEnv + "_CONTROL"), Key: key, Job: "killed", Workers: workers, Rank: rank,
		Local: [4]byte{127, 0, 0, byte(2 + rank)}, Port: uint16(env("PORT")), DataPort: uint16(env("DATA_PORT"))})
	if err != nil {
		return err
	}
	defer w.Close()
	fmt.Println("joined")
	_, err = io.Copy(io.Discard, os.Stdin)
	return err
}

// TestWorkerKilled kills a worker process (SIGKILL) while the others wait
// in AllReduce: every pending call fails, well within its deadline, with
// ErrWorker naming the dead worker's rank, which the aggregator (its own
// process) reports to the others when the dead worker's control
// connection ends.
func TestWorkerKilled(t *testing.T) {
	key, secret, err := jobauth.Generate()
	if err != nil {
		t.Fatal(err)
	}
	const n, dead = 3, 2
	port := freePort(t, n)
	control, dataPort, stop := aggregator(t, secret, port, 0)
	defer stop()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), roleEnv+"=idle", jobauth.KeyEnv+"="+secret,
		roleEnv+"_RANK="+strconv.Itoa(dead), roleEnv+"_WORKERS="+strconv.Itoa(n),
		roleEnv+"_CONTROL="+control, roleEnv+"_PORT="+strconv.Itoa(port),
		roleEnv+"_DATA_PORT="+strconv.Itoa(dataPort))
	stdin, _ := cmd.StdinPipe()
	defer stdin.Close()
	stdout, _ := cmd.StdoutPipe()
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { cmd.Process.Kill(); cmd.Wait() }()
	ws := make([]*Worker, dead)
	errs := make([]error, dead)
	var wg sync.WaitGroup
	for r := range dead {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			ws[r], errs[r] = New(ctx, Config{Control: control, Key: key, Job: "killed", Workers: n, Rank: r,
				Local: [4]byte{127, 0, 0, byte(2 + r)}, Port: uint16(port), DataPort: uint16(dataPort)})
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	for _, w := range ws {
		defer w.Close()
	}
	if !bufio.NewScanner(stdout).Scan() {
		t.Fatal("the worker process did not join")
	}
	done := make(chan error, dead)
	for _, w := range ws {
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			done <- w.AllReduceFloat32(ctx, make([]float32, 100000))
		}()
	}
	time.Sleep(300 * time.Millisecond)
	start := time.Now()
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	for range dead {
		select {
		case err := <-done:
			want := fmt.Sprintf("rank %d left", dead)
			var le *LeftError
			if !errors.Is(err, ErrWorker) || !errors.As(err, &le) || le.Rank != dead || !strings.Contains(err.Error(), want) {
				t.Fatalf("AllReduce with rank %d killed: %v, want a LeftError saying %q", dead, err, want)
			}
			t.Logf("after %v: %v", time.Since(start).Round(time.Millisecond), err)
		case <-time.After(25 * time.Second):
			t.Fatal("AllReduce still pending 25 s after a worker was killed")
		}
	}
}

// TestBytesOnWire counts the payload each worker sends and receives: a
// float AllReduce of S bytes moves S bytes each way (rounded up to whole
// messages), the exponents of the first chunks riding in payload-free
// messages; the results still agree bitwise.
func TestBytesOnWire(t *testing.T) {
	key, s, control, port, dataPort := server(t)
	defer s.Close()
	ws := pair(t, key, control, port, dataPort)
	defer ws[0].Close()
	defer ws[1].Close()
	msg := DefaultSlotBytes * DefaultMsgSlots
	for _, n := range []int{1, 1000, 64 << 10 / 4, 1 << 20 / 4, 1<<20/4 + 3} {
		var xs [2][]float32
		for r := range 2 {
			xs[r] = make([]float32, n)
			for i := range xs[r] {
				xs[r][i] = float32(i%97-48) * float32(r+1) / 7
			}
		}
		st0 := [2]Stats{ws[0].Stats(), ws[1].Stats()}
		var wg sync.WaitGroup
		var errs [2]error
		for r := range 2 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
				defer cancel()
				errs[r] = ws[r].AllReduceFloat32(ctx, xs[r])
			}()
		}
		wg.Wait()
		if err := errors.Join(errs[:]...); err != nil {
			t.Fatal(err)
		}
		for i := range xs[0] {
			if math.Float32bits(xs[0][i]) != math.Float32bits(xs[1][i]) {
				t.Fatalf("%d elements: element %d differs between the workers", n, i)
			}
		}
		want := uint64((4*n + msg - 1) / msg * msg)
		for r := range 2 {
			st := ws[r].Stats()
			sent, recv := st.BytesSent-st0[r].BytesSent, st.BytesReceived-st0[r].BytesReceived
			// Results are taken once per message; a resent message
			// sends its payload again.
			if recv != want || sent != want && st.Resent == st0[r].Resent {
				t.Fatalf("%d float32: worker %d sent %d and received %d payload bytes, want %d", n, r, sent, recv, want)
			}
			t.Logf("%d float32 (%d bytes): worker %d sent %d, received %d payload bytes", n, 4*n, r, sent, recv)
		}
	}
}

package worker

import (
	"context"
	"errors"
	"net"
	"strings"
	"sync"
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
// aggregator ends the job and the pending AllReduce fails.
func TestDeadWorker(t *testing.T) {
	key, s, control, port, dataPort := server(t)
	defer s.Close()
	ws := pair(t, key, control, port, dataPort)
	defer ws[0].Close()
	done := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		done <- ws[0].AllReduceFloat32(ctx, make([]float32, 5000))
	}()
	time.Sleep(200 * time.Millisecond)
	ws[1].Close()
	select {
	case err := <-done:
		if !errors.Is(err, ErrAggregator) || !strings.Contains(err.Error(), "a worker left") {
			t.Fatalf("AllReduce with the other worker gone: %v", err)
		}
		t.Log(err)
	case <-time.After(30 * time.Second):
		t.Fatal("AllReduce still pending 30 s after the other worker left")
	}
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
	ws[0].mangle = func(b []byte) {
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

package bootstrap

import (
	"context"
	"errors"
	"io"
	"net"
	"os"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/internal/adaptspin"
)

// tcpPair returns both ends of a loopback TCP connection.
func tcpPair(t *testing.T) (a, b net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	acc := make(chan net.Conn, 1)
	go func() {
		c, _ := ln.Accept()
		acc <- c
	}()
	a, err = net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	b = <-acc
	if b == nil {
		t.Fatal("accept failed")
	}
	t.Cleanup(func() { a.Close(); b.Close() })
	return a, b
}

func TestSpinReaderReads(t *testing.T) {
	for _, tc := range []struct {
		name  string
		delay time.Duration
		slept bool // the wait outlasts the spin and sleeps
	}{
		{"queued", 0, false},
		{"while spinning", 30 * time.Microsecond, false},
		{"after the spin", 20 * time.Millisecond, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, b := tcpPair(t)
			spin := adaptspin.New(adaptspin.Bounds{Max: 5 * time.Millisecond, Min: 2 * time.Microsecond})
			if tc.slept {
				spin = adaptspin.New(adaptspin.Bounds{Max: time.Millisecond, Min: 2 * time.Microsecond})
			}
			msg := appendMsg(nil, tGathered, []byte("all ranks are here"))
			go func() {
				time.Sleep(tc.delay)
				a.Write(msg[:3]) // the header in two pieces
				time.Sleep(time.Millisecond)
				a.Write(msg[3:])
			}()
			b.SetDeadline(time.Now().Add(10 * time.Second))
			m, err := readMsg(newSpinReader(b, spin), 1<<10)
			if err != nil {
				t.Fatal(err)
			}
			if m.typ != tGathered || string(m.body) != "all ranks are here" {
				t.Fatalf("read type %d %q", m.typ, m.body)
			}
		})
	}
}

func TestSpinReaderEnds(t *testing.T) {
	spin := adaptspin.New(adaptspin.Bounds{Max: adaptspin.DefaultMax, Min: adaptspin.DefaultMin})
	t.Run("peer closed", func(t *testing.T) {
		a, b := tcpPair(t)
		a.Close()
		_, err := newSpinReader(b, spin).Read(make([]byte, 8))
		if !errors.Is(err, io.EOF) {
			t.Fatalf("read of a closed connection: %v, want EOF", err)
		}
	})
	t.Run("peer closed while spinning", func(t *testing.T) {
		a, b := tcpPair(t)
		go func() { time.Sleep(20 * time.Microsecond); a.Close() }()
		_, err := readMsg(newSpinReader(b, spin), 64)
		if !errors.Is(err, io.EOF) {
			t.Fatalf("read of a connection closed mid-wait: %v, want EOF", err)
		}
	})
	t.Run("deadline", func(t *testing.T) {
		_, b := tcpPair(t)
		b.SetReadDeadline(time.Now().Add(30 * time.Millisecond))
		start := time.Now()
		_, err := newSpinReader(b, spin).Read(make([]byte, 8))
		if !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("read past its deadline: %v, want ErrDeadlineExceeded", err)
		}
		if d := time.Since(start); d > 5*time.Second {
			t.Fatalf("read returned %v after its deadline", d)
		}
	})
	t.Run("deadline passed before", func(t *testing.T) {
		a, b := tcpPair(t)
		a.Write([]byte("x"))
		b.SetReadDeadline(time.Unix(1, 0))
		_, err := newSpinReader(b, spin).Read(make([]byte, 8))
		if !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("read after its deadline: %v, want ErrDeadlineExceeded", err)
		}
	})
	t.Run("not a socket", func(t *testing.T) {
		a, b := net.Pipe()
		defer a.Close()
		defer b.Close()
		go a.Write([]byte("pipe"))
		buf := make([]byte, 8)
		n, err := newSpinReader(b, spin).Read(buf)
		if err != nil || string(buf[:n]) != "pipe" {
			t.Fatalf("read of a pipe: %q, %v", buf[:n], err)
		}
	})
}

// The policy learns from the reads: a read answered while it polled
// keeps the poll, reads that sleep shrink it to the minimum.
func TestSpinReaderTeachesPolicy(t *testing.T) {
	a, b := tcpPair(t)
	spin := adaptspin.New(adaptspin.Bounds{Max: 500 * time.Microsecond, Min: 2 * time.Microsecond})
	for range 12 {
		go func() { time.Sleep(10 * time.Millisecond); a.Write([]byte{1}) }()
		if _, err := newSpinReader(b, spin).Read(make([]byte, 1)); err != nil {
			t.Fatal(err)
		}
	}
	if got := spin.Stats().Budget; got > 10*time.Microsecond {
		t.Fatalf("after 12 reads that slept the poll is %v, want near the minimum", got)
	}
}

// A spin reader whose policy yields gives up the CPU between its looks at
// the socket (counted by the policy), and still reads what comes while it
// polls.
func TestSpinReaderYields(t *testing.T) {
	a, b := tcpPair(t)
	spin := adaptspin.New(adaptspin.Bounds{Max: 5 * time.Second, Min: 5 * time.Second, Yield: true})
	msg := appendMsg(nil, tGathered, []byte("late"))
	go func() {
		time.Sleep(2 * time.Millisecond)
		a.Write(msg)
	}()
	b.SetDeadline(time.Now().Add(10 * time.Second))
	m, err := readMsg(newSpinReader(b, spin), 1<<10)
	if err != nil {
		t.Fatal(err)
	}
	if string(m.body) != "late" {
		t.Fatalf("read %q", m.body)
	}
	if y := spin.Stats().Yields; y == 0 {
		t.Fatal("the reader polled 2 ms without yielding the CPU once")
	}
}

// SetYield switches the all-gathers' polls to yielding long polls and
// back; barriers work either way.
func TestGroupSetYield(t *testing.T) {
	gs := joinAll(t, 3)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for _, on := range []bool{true, false, true} {
		for _, g := range gs {
			g.SetYield(on)
			g.gatherMu.Lock()
			yields, budget := g.gatherSpin.Yields(), g.gatherSpin.Stats().Budget
			g.gatherMu.Unlock()
			if yields != on {
				t.Fatalf("SetYield(%v): the all-gather's polls yield: %v", on, yields)
			}
			if on && budget != gatherYieldSpin {
				t.Fatalf("SetYield(true): polls for %s, want %s", budget, gatherYieldSpin)
			}
		}
		errs := make(chan error, len(gs))
		for _, g := range gs {
			go func() { errs <- g.Barrier(ctx) }()
		}
		for range gs {
			if err := <-errs; err != nil {
				t.Fatalf("barrier with yielding %v: %v", on, err)
			}
		}
	}
}

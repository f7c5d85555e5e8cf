package bootstrap

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gdrlink/gdrlink/internal/jobauth"
)

func testKey(t *testing.T, name string) jobauth.Key {
	t.Helper()
	k, err := jobauth.Parse("bootstrap test key " + name)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// joining is a Join run in the background.
type joining struct {
	ch   chan struct{}
	once sync.Once
	g    *Group
	err  error
}

// result waits for the Join to end.
func (j *joining) result() (*Group, error) {
	j.once.Do(func() { <-j.ch })
	return j.g, j.err
}

// joinAsync runs Join in the background. When the test ends, it waits for
// the Join (the test's context ends it) and closes the group it made.
func joinAsync(t *testing.T, ctx context.Context, cfg Config) *joining {
	t.Helper()
	j := &joining{ch: make(chan struct{})}
	go func() {
		j.g, j.err = Join(ctx, cfg)
		close(j.ch)
	}()
	t.Cleanup(func() {
		if g, _ := j.result(); g != nil {
			g.Close()
		}
	})
	return j
}

// wait takes the group of joinAsync, failing the test on an error.
func wait(t *testing.T, j *joining, who string) *Group {
	t.Helper()
	g, err := j.result()
	if err != nil {
		t.Fatalf("%s: %v", who, err)
	}
	return g
}

// barrier has every group meet at a barrier.
func barrier(t *testing.T, gs ...*Group) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	errs := make([]error, len(gs))
	var wg sync.WaitGroup
	for i, g := range gs {
		wg.Add(1)
		go func() { defer wg.Done(); errs[i] = g.Barrier(ctx) }()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("rank %d: barrier: %v", gs[i].Rank(), err)
		}
	}
}

// TestAuthJob: three ranks with the same key join and use every operation,
// each of which opens connections of its own.
func TestAuthJob(t *testing.T) {
	const n = 3
	key := testKey(t, "job")
	gs := joinAllCfg(t, n, func(rank int, cfg *Config) {
		cfg.Key = key
		cfg.OnCall = func(ctx context.Context, from int, req []byte) ([]byte, error) {
			return []byte(fmt.Sprintf("%d answers %d: %s", rank, from, req)), nil
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	errs := make(chan error, 4*n*n)
	for r, g := range gs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			all, err := g.AllGather(ctx, []byte(fmt.Sprint("rank ", r)))
			if err != nil {
				errs <- err
				return
			}
			for p, b := range all {
				if want := fmt.Sprint("rank ", p); string(b) != want {
					errs <- fmt.Errorf("rank %d: all-gather entry %d = %q", r, p, b)
				}
			}
			for p := 0; p < n; p++ {
				got, err := g.Exchange(ctx, p, []byte(fmt.Sprintf("%d->%d", r, p)))
				if want := fmt.Sprintf("%d->%d", p, r); err != nil || string(got) != want {
					errs <- fmt.Errorf("rank %d: exchange with %d: %q, %v; want %q", r, p, got, err, want)
				}
				if p == r {
					continue
				}
				got, err = g.Call(ctx, p, []byte("hi"))
				if want := fmt.Sprintf("%d answers %d: hi", p, r); err != nil || string(got) != want {
					errs <- fmt.Errorf("call %d->%d: %q, %v; want %q", r, p, got, err, want)
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

// TestAuthStranger: a process without the key that says hello as rank 1
// is refused and disconnected, an idle one holds nothing up, a holder of
// the key cannot claim a rank other than the one it proved, and the real
// rank 1 joins in the slot they asked for.
func TestAuthStranger(t *testing.T) {
	key := testKey(t, "stranger")
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	root := joinAsync(t, ctx, Config{Rank: 0, Size: 3, Listener: ln, Key: key})

	idle, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer idle.Close()

	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Write(appendMsg(nil, tHello, helloBody{rank: 1, size: 3, contact: "127.0.0.1:1"}.Append(nil))); err != nil {
		t.Fatal(err)
	}
	m, err := readMsg(c, 4096)
	if err != nil || m.typ != tRefused || !strings.Contains(string(m.body), "job key") {
		t.Fatalf("a stranger's hello: %+v, %v; want a refusal that asks for the job key", m, err)
	}
	if _, err := readMsg(c, 4096); err == nil || isTimeout(err) {
		t.Fatalf("the stranger's connection stayed open after the refusal: %v", err)
	}

	// A holder of the key that proves it as rank 2 cannot say hello as
	// rank 1 either.
	k, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer k.Close()
	k.SetDeadline(time.Now().Add(5 * time.Second))
	if err := jobauth.Initiate(k, key, "bootstrap", 2, jobauth.EndsOf(k, true)); err != nil {
		t.Fatal(err)
	}
	if _, err := k.Write(appendMsg(nil, tHello, helloBody{rank: 1, size: 3, contact: "127.0.0.1:1"}.Append(nil))); err != nil {
		t.Fatal(err)
	}
	if m, err := readMsg(k, 4096); err != nil || m.typ != tRefused || !strings.Contains(string(m.body), "proven for rank 2") {
		t.Fatalf("a hello as rank 1 after proving the key as rank 2: %+v, %v; want a refusal", m, err)
	}

	r1 := joinAsync(t, ctx, Config{Rank: 1, Size: 3, Root: ln.Addr().String(), Key: key})
	r2 := joinAsync(t, ctx, Config{Rank: 2, Size: 3, Root: ln.Addr().String(), Key: key})
	gs := []*Group{wait(t, root, "root"), wait(t, r1, "rank 1"), wait(t, r2, "rank 2")}
	barrier(t, gs...)
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// TestAuthWrongKey: a rank with another key, or none, is turned away at
// once with a clear error, and the job goes on without it.
func TestAuthWrongKey(t *testing.T) {
	key := testKey(t, "right")
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	root := ln.Addr().String()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	r0 := joinAsync(t, ctx, Config{Rank: 0, Size: 3, Listener: ln, Key: key})
	r2 := joinAsync(t, ctx, Config{Rank: 2, Size: 3, Root: root, Key: key})
	for _, tc := range []struct {
		name   string
		key    jobauth.Key
		wantJA bool // the error wraps jobauth.ErrRefused too
		says   string
	}{
		{"WrongKey", testKey(t, "wrong"), true, "job's key"},
		{"NoKey", jobauth.Key{}, false, "job key"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			start := time.Now()
			g, err := Join(ctx, Config{Rank: 1, Size: 3, Root: root, Key: tc.key})
			if err == nil {
				g.Close()
				t.Fatal("joined")
			}
			if took := time.Since(start); took > 5*time.Second {
				t.Errorf("refused after %v, want at once", took)
			}
			if !errors.Is(err, ErrRefused) || tc.wantJA != errors.Is(err, jobauth.ErrRefused) || !strings.Contains(err.Error(), tc.says) {
				t.Errorf("Join: %v; want ErrRefused (jobauth.ErrRefused: %v) saying %q", err, tc.wantJA, tc.says)
			}
		})
	}
	r1 := joinAsync(t, ctx, Config{Rank: 1, Size: 3, Root: root, Key: key})
	gs := []*Group{wait(t, r0, "root"), wait(t, r1, "rank 1"), wait(t, r2, "rank 2")}
	barrier(t, gs...)
}

// recConn records what this side writes on a connection.
type recConn struct {
	net.Conn
	addr string
	mu   sync.Mutex
	sent bytes.Buffer
}

// Close resets the connection, which frees its local port at once (no
// TIME_WAIT): a replay can then come from that very address and port, so
// that only the nonces tell it from the original.
func (c *recConn) Close() error {
	if tc, ok := c.Conn.(*net.TCPConn); ok {
		tc.SetLinger(0)
	}
	return c.Conn.Close()
}

func (c *recConn) Write(b []byte) (int, error) {
	c.mu.Lock()
	c.sent.Write(b)
	c.mu.Unlock()
	return c.Conn.Write(b)
}

func (c *recConn) bytes() []byte {
	c.mu.Lock()
	defer c.mu.Unlock()
	return bytes.Clone(c.sent.Bytes())
}

// recorder dials for a group and records every connection it makes.
type recorder struct {
	mu    sync.Mutex
	conns []*recConn
}

func (r *recorder) dial(ctx context.Context, addr string) (net.Conn, error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	rc := &recConn{Conn: c, addr: addr}
	r.mu.Lock()
	r.conns = append(r.conns, rc)
	r.mu.Unlock()
	return rc, nil
}

// to is what was written on the connections dialled to addr, in order.
func (r *recorder) to(addr string) [][]byte {
	var out [][]byte
	for _, c := range r.connsTo(addr) {
		out = append(out, c.bytes())
	}
	return out
}

// connsTo are the connections dialled to addr, in order.
func (r *recorder) connsTo(addr string) []*recConn {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []*recConn
	for _, c := range r.conns {
		if c.addr == addr {
			out = append(out, c)
		}
	}
	return out
}

// replay writes b on a new connection to addr and returns what came back
// until the other side closed it; a connection still open after 5 seconds
// fails the test.
func replay(t *testing.T, addr string, b []byte) []byte {
	t.Helper()
	return replayFrom(t, "", addr, b)
}

// replayFrom is replay from the local address from ("" for any): the
// address and port of the recorded connection, freed by its reset.
func replayFrom(t *testing.T, from, addr string, b []byte) []byte {
	t.Helper()
	d := net.Dialer{Timeout: 5 * time.Second}
	if from != "" {
		la, err := net.ResolveTCPAddr("tcp", from)
		if err != nil {
			t.Fatal(err)
		}
		d.LocalAddr = la
		d.Control = func(_, _ string, rc syscall.RawConn) error {
			var serr error
			err := rc.Control(func(fd uintptr) { serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEADDR, 1) })
			return errors.Join(err, serr)
		}
	}
	// The recorded connection, just closed, holds its port until its peer
	// closes too (a loaded host may take a while): bind again until then.
	c, err := d.Dial("tcp", addr)
	for deadline := time.Now().Add(5 * time.Second); errors.Is(err, syscall.EADDRINUSE) && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
		c, err = d.Dial("tcp", addr)
	}
	if err != nil {
		t.Fatal(err)
	}
	if from != "" && c.LocalAddr().String() != from {
		t.Fatalf("replaying from %s, want %s", c.LocalAddr(), from)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Write(b); err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(c)
	if isTimeout(err) {
		t.Fatalf("the replayed connection to %s is still open: %v", addr, err)
	}
	return got
}

// TestAuthReplay: what a rank of the job sent, replayed word for word on a
// new connection, proves nothing. A replayed Call (of rank 0 or of rank 1)
// comes from the recorded address and port, so the endpoints the
// handshake binds are the original's and only the acceptor's fresh nonce
// refuses it (with a fixed nonce it gets through). A replayed hello, to
// another root of the same key with the slot free, is refused too (there
// the root's address differs as well).
func TestAuthReplay(t *testing.T) {
	key := testKey(t, "replay")
	recs := make([]recorder, 3)
	var calls atomic.Int32
	gs := joinAllCfg(t, 3, func(rank int, cfg *Config) {
		cfg.Key = key
		cfg.dial = recs[rank].dial
		if rank == 2 {
			cfg.OnCall = func(ctx context.Context, from int, req []byte) ([]byte, error) {
				calls.Add(1)
				return []byte(fmt.Sprintf("paid rank %d", from)), nil
			}
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for from := 0; from < 2; from++ {
		if got, err := gs[from].Call(ctx, 2, []byte("pay me")); err != nil || string(got) != fmt.Sprintf("paid rank %d", from) {
			t.Fatalf("Call from rank %d: %q, %v", from, got, err)
		}
	}
	hellos := recs[1].to(gs[0].RootAddr())
	if len(hellos) != 1 {
		t.Fatalf("recorded %d connections from rank 1 to the root, want 1", len(hellos))
	}

	for from := 0; from < 2; from++ {
		t.Run(fmt.Sprintf("CallOfRank%d", from), func(t *testing.T) {
			sent := recs[from].connsTo(gs[0].Addrs()[2])
			if len(sent) != 1 {
				t.Fatalf("recorded %d connections to rank 2, want 1", len(sent))
			}
			// From the recorded address and port, so that the
			// endpoints the handshake binds are the same and only the
			// acceptor's fresh nonce refuses the replay.
			sent[0].Close()
			before := calls.Load()
			got := replayFrom(t, sent[0].LocalAddr().String(), gs[0].Addrs()[2], sent[0].bytes())
			if n := calls.Load() - before; n != 0 || bytes.Contains(got, []byte("paid")) {
				t.Errorf("the replayed call reached the handler (%d calls, answer %q)", n, got)
			}
		})
	}

	t.Run("Hello", func(t *testing.T) {
		// A second job of the same key, waiting for its rank 1.
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		root := joinAsync(t, ctx, Config{Rank: 0, Size: 3, Listener: ln, Key: key})
		replay(t, ln.Addr().String(), hellos[0])
		r1 := joinAsync(t, ctx, Config{Rank: 1, Size: 3, Root: ln.Addr().String(), Key: key})
		r2 := joinAsync(t, ctx, Config{Rank: 2, Size: 3, Root: ln.Addr().String(), Key: key})
		barrier(t, wait(t, root, "root"), wait(t, r1, "rank 1"), wait(t, r2, "rank 2"))
	})
}

// TestAuthCallClaim: a Call must come from the rank its connection's
// handshake proved the key for.
func TestAuthCallClaim(t *testing.T) {
	key := testKey(t, "claim")
	var calls atomic.Int32
	gs := joinAllCfg(t, 3, func(rank int, cfg *Config) {
		cfg.Key = key
		cfg.OnCall = func(ctx context.Context, from int, req []byte) ([]byte, error) {
			calls.Add(1)
			return []byte(fmt.Sprintf("rank %d answers %d", rank, from)), nil
		}
	})
	for _, tc := range []struct {
		proven, claimed int
		ok              bool
	}{
		{2, 1, false},
		{2, 2, true}, // the control: the same call with matching ranks
	} {
		t.Run(fmt.Sprintf("Proven%dClaimed%d", tc.proven, tc.claimed), func(t *testing.T) {
			before := calls.Load()
			c, err := net.Dial("tcp", gs[0].RootAddr())
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			c.SetDeadline(time.Now().Add(5 * time.Second))
			if err := jobauth.Initiate(c, key, "bootstrap", uint32(tc.proven), jobauth.EndsOf(c, true)); err != nil {
				t.Fatal(err)
			}
			if _, err := c.Write(appendMsg(nil, tCall, callBody{rank: tc.claimed, size: 3, inc: 1, req: []byte("x")}.Append(nil))); err != nil {
				t.Fatal(err)
			}
			m, err := readMsg(c, 4096)
			switch {
			case err != nil:
				t.Fatal(err)
			case tc.ok && (m.typ != tReply || string(m.body) != fmt.Sprintf("rank 0 answers %d", tc.claimed)):
				t.Errorf("got type %d %q, want the reply", m.typ, m.body)
			case !tc.ok && (m.typ != tRefused || !strings.Contains(string(m.body), "proven for rank 2")):
				t.Errorf("got type %d %q, want a refusal naming the proven rank", m.typ, m.body)
			}
			if n := calls.Load() - before; tc.ok != (n == 1) {
				t.Errorf("the handler ran %d times", n)
			}
		})
	}
}

// hostIP is an address of this host beyond loopback, if it has one.
func hostIP() string {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return ""
	}
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok && n.IP.To4() != nil && !n.IP.IsLoopback() && !n.IP.IsLinkLocalUnicast() {
			return n.IP.String()
		}
	}
	return ""
}

// TestInsecureListen: without a key, listening beyond loopback (the root
// address, a root listener, a rank's pairwise address) fails with
// ErrInsecure naming the address, unless Insecure says otherwise; a key
// allows it.
func TestInsecureListen(t *testing.T) {
	hosts := []string{"0.0.0.0"} // every host has it, and it is not loopback
	if ip := hostIP(); ip != "" {
		hosts = append(hosts, ip)
	} else {
		t.Log("no IPv4 address beyond loopback on this host: testing 0.0.0.0 only")
	}
	key := testKey(t, "insecure")
	for _, host := range hosts {
		addr := net.JoinHostPort(host, "0")
		for _, tc := range []struct {
			name     string
			key      jobauth.Key
			insecure bool
			ok       bool
		}{
			{"NoKey", jobauth.Key{}, false, false},
			{"Insecure", jobauth.Key{}, true, true},
			{"Key", key, false, true},
		} {
			check := func(t *testing.T, err error, named string) {
				t.Helper()
				switch {
				case tc.ok && err != nil:
					t.Errorf("Join: %v", err)
				case !tc.ok && (!errors.Is(err, jobauth.ErrInsecure) || !strings.Contains(fmt.Sprint(err), named)):
					t.Errorf("Join: %v; want ErrInsecure naming %s", err, named)
				}
			}
			t.Run(host+"/"+tc.name, func(t *testing.T) {
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				defer cancel()
				// The root listening at its address.
				g, err := Join(ctx, Config{Rank: 0, Size: 1, Root: addr, Key: tc.key, Insecure: tc.insecure})
				if err == nil {
					g.Close()
				}
				check(t, err, addr)

				// The root given a listener.
				ln, err := net.Listen("tcp", addr)
				if err != nil {
					t.Fatal(err)
				}
				g, err = Join(ctx, Config{Rank: 0, Size: 1, Listener: ln, Key: tc.key, Insecure: tc.insecure})
				if err == nil {
					g.Close()
				}
				ln.Close()
				check(t, err, ln.Addr().String())

				// A rank's pairwise address, its root on loopback.
				rln, err := net.Listen("tcp", "127.0.0.1:0")
				if err != nil {
					t.Fatal(err)
				}
				peers := []string{rln.Addr().String(), addr}
				root := joinAsync(t, ctx, Config{Rank: 0, Size: 2, Peers: peers, Listener: rln, Key: tc.key})
				g, err = Join(ctx, Config{Rank: 1, Size: 2, Peers: peers, Key: tc.key, Insecure: tc.insecure})
				check(t, err, addr)
				if err != nil {
					return
				}
				defer g.Close()
				barrier(t, wait(t, root, "root"), g)
			})
		}
	}
}

// TestAcceptFlood: 500 idle connections to the root, which prove nothing,
// neither keep the job's ranks out nor grow the root's goroutines beyond
// the bound: the oldest waiting connections are closed to make room.
func TestAcceptFlood(t *testing.T) {
	key := testKey(t, "flood")
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	before := runtime.NumGoroutine()
	root := joinAsync(t, ctx, Config{Rank: 0, Size: 3, Listener: ln, Key: key})
	var flood []net.Conn
	defer func() {
		for _, c := range flood {
			c.Close()
		}
	}()
	for range 500 {
		c, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatalf("flood connection %d: %v", len(flood), err)
		}
		flood = append(flood, c)
	}
	start := time.Now()
	r1 := joinAsync(t, ctx, Config{Rank: 1, Size: 3, Root: ln.Addr().String(), Key: key})
	r2 := joinAsync(t, ctx, Config{Rank: 2, Size: 3, Root: ln.Addr().String(), Key: key})
	g0, g1, g2 := wait(t, root, "root"), wait(t, r1, "rank 1"), wait(t, r2, "rank 2")
	took := time.Since(start)
	barrier(t, g0, g1, g2)
	g0.mu.Lock()
	pending, evicted, bound := len(g0.pending), g0.evicted, g0.maxPending()
	g0.mu.Unlock()
	// An evicted connection's greeter ends once its read sees the close,
	// which the scheduler may not have run yet: give those a moment to go,
	// while the 500 connections stay open. A goroutine per flood connection
	// would never fall below the bound.
	during := runtime.NumGoroutine()
	for settle := time.Now().Add(2 * time.Second); during-before > bound+40 && time.Now().Before(settle); {
		time.Sleep(10 * time.Millisecond)
		during = runtime.NumGoroutine()
	}
	t.Logf("500 idle connections: ranks joined in %v; root holds %d waiting (bound %d), evicted %d; goroutines %d before, %d during",
		took.Round(time.Millisecond), pending, bound, evicted, before, during)
	if pending > bound || evicted < 500-bound {
		t.Errorf("root holds %d waiting connections and evicted %d, bound %d", pending, evicted, bound)
	}
	if took > 5*time.Second {
		t.Errorf("the job took %v to join under the flood", took)
	}
	if during-before > bound+40 {
		t.Errorf("goroutines grew from %d to %d under the flood (bound %d)", before, during, bound)
	}
}

// BenchmarkJoin measures a 4-rank join on loopback with and without a job
// key: the cost of proving the key on every connection, side by side.
func BenchmarkJoin(b *testing.B) {
	for _, keyed := range []bool{false, true} {
		name := "nokey"
		var key jobauth.Key
		if keyed {
			name = "key"
			key, _, _ = jobauth.Generate()
		}
		b.Run(name, func(b *testing.B) {
			for range b.N {
				ln, err := net.Listen("tcp", "127.0.0.1:0")
				if err != nil {
					b.Fatal(err)
				}
				ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
				gs := make([]*Group, 4)
				errs := make([]error, 4)
				var wg sync.WaitGroup
				for r := range 4 {
					wg.Add(1)
					go func() {
						defer wg.Done()
						cfg := Config{Rank: r, Size: 4, Root: ln.Addr().String(), Key: key}
						if r == 0 {
							cfg.Listener = ln
						}
						gs[r], errs[r] = Join(ctx, cfg)
					}()
				}
				wg.Wait()
				for r, err := range errs {
					if err != nil {
						b.Fatalf("rank %d: %v", r, err)
					}
				}
				// Every pair meets once, as a job's first exchanges would.
				var ex sync.WaitGroup
				for r := range 4 {
					ex.Add(1)
					go func() {
						defer ex.Done()
						if _, err := gs[r].AllGather(ctx, []byte{byte(r)}); err != nil {
							b.Error(err)
						}
					}()
				}
				ex.Wait()
				for _, g := range gs {
					g.Close()
				}
				cancel()
			}
		})
	}
}

package bootstrap

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/internal/logcapture"
)

// TestRefusalLogged: the root logs, at Warn, a stranger's hello sent
// without proving the key, with the listener, the stranger's address and
// the reason, and the job still joins.
func TestRefusalLogged(t *testing.T) {
	var logs logcapture.Buffer
	key := testKey(t, "logged")
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	root := joinAsync(t, ctx, Config{Rank: 0, Size: 2, Listener: ln, Key: key, Logger: logs.Logger()})
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(20 * time.Second))
	if _, err := c.Write(appendMsg(nil, tHello, helloBody{rank: 1, size: 2, contact: "127.0.0.1:1"}.Append(nil))); err != nil {
		t.Fatal(err)
	}
	if m, err := readMsg(c, 4096); err != nil || m.typ != tRefused {
		t.Fatalf("a stranger's hello: %+v, %v; want a refusal", m, err)
	}
	l := logs.WaitLine(t, "level=WARN", `msg="bootstrap: connection refused"`, "listener="+ln.Addr().String(), "peer="+c.LocalAddr().String(), "without a handshake", "refused_total=1")
	t.Log(l)
	r1 := joinAsync(t, ctx, Config{Rank: 1, Size: 2, Root: ln.Addr().String(), Key: key})
	barrier(t, wait(t, root, "root"), wait(t, r1, "rank 1"))
}

// dialFrom opens a connection to addr from the local IP from.
func dialFrom(t *testing.T, from, addr string) net.Conn {
	t.Helper()
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(from)}, Timeout: 10 * time.Second}
	c, err := d.Dial("tcp", addr)
	if err != nil {
		t.Fatalf("dial from %s: %v", from, err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// TestPerHostBound: idle connections from one address hold at most
// maxPerHost of the root's waiting slots, the oldest of that address
// going first, and never evict another address's; a Call from a rank
// (a third address) still gets through, and the eviction is logged.
func TestPerHostBound(t *testing.T) {
	var logs logcapture.Buffer
	key := testKey(t, "per-host")
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	onCall := func(ctx context.Context, from int, req []byte) ([]byte, error) {
		return append([]byte("re: "), req...), nil
	}
	root := joinAsync(t, ctx, Config{Rank: 0, Size: 3, Listener: ln, Key: key, Logger: logs.Logger(), OnCall: onCall})
	r1 := joinAsync(t, ctx, Config{Rank: 1, Size: 3, Root: ln.Addr().String(), Key: key})
	r2 := joinAsync(t, ctx, Config{Rank: 2, Size: 3, Root: ln.Addr().String(), Key: key})
	g0, g1 := wait(t, root, "root"), wait(t, r1, "rank 1")
	wait(t, r2, "rank 2")

	state := func() (by map[string]int, waiting, evicted int) {
		g0.mu.Lock()
		defer g0.mu.Unlock()
		by = map[string]int{}
		for h, n := range g0.unprovenBy {
			by[h] = n
		}
		return by, len(g0.pending), g0.evicted
	}
	accepted := 0
	flood := func(from string, n int) {
		for range n {
			dialFrom(t, from, ln.Addr().String())
		}
		accepted += n
		for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(time.Millisecond) {
			_, waiting, evicted := state()
			if waiting+evicted >= accepted {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%d waiting and %d evicted, want %d accepted", waiting, evicted, accepted)
			}
		}
	}
	flood("127.0.0.2", 200)
	flood("127.0.0.3", 10)
	flood("127.0.0.2", 200)
	by, waiting, evicted := state()
	t.Logf("400 idle connections from 127.0.0.2 and 10 from 127.0.0.3: unproven by address %v, %d waiting (bound %d, %d per address), %d evicted",
		by, waiting, g0.maxPending(), g0.maxPerHost(), evicted)
	if by["127.0.0.2"] != g0.maxPerHost() || by["127.0.0.3"] != 10 || evicted != 400-g0.maxPerHost() {
		t.Fatalf("unproven by address %v, %d evicted: want %d from 127.0.0.2, 10 from 127.0.0.3, %d evicted", by, evicted, g0.maxPerHost(), 400-g0.maxPerHost())
	}
	logs.WaitLine(t, `msg="bootstrap: connection refused"`, "peer=127.0.0.2:", "127.0.0.2 opened 19 newer connections")
	reply, err := g1.Call(ctx, 0, []byte("still here"))
	if err != nil || string(reply) != "re: still here" {
		t.Fatalf("a Call during the flood: %q, %v", reply, err)
	}
}

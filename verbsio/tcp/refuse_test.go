package tcp

import (
	"context"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/internal/logcapture"
	"github.com/gdrlink/gdrlink/verbsio"
)

// TestRefusalLogged: a lane hello without the job key is refused with a
// line at Warn naming the listener, the peer's address and the reason; a
// flood of refusals writes at most a line a second, each saying how many
// went unlogged, and every refusal is counted.
func TestRefusalLogged(t *testing.T) {
	var logs logcapture.Buffer
	key := newJobKey(t)
	z := openAuthSideConfig(t, verbsio.Config{JobKey: key.Bytes(), Logger: logs.Logger()}, 0x22)
	addr := z.dev.Info().Address
	h := hello{lanes: 1, dstQP: z.qp.id, dstNonce: z.qp.nonce}
	hello := h.Append(nil)
	stranger := func() string {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(20 * time.Second))
		if _, err := c.Write(hello); err != nil {
			t.Fatal(err)
		}
		var b [1]byte
		c.Read(b[:]) // helloNeedKey, then the close
		return c.LocalAddr().String()
	}
	start := time.Now()
	peer := stranger()
	l := logs.WaitLine(t, "level=WARN", `msg="tcp: connection refused"`, "listener="+z.dev.ln.Addr().String(), "peer="+peer, "without proving the job key", "refused_total=1")
	t.Log(l)
	const flood = 50
	for range flood {
		stranger()
	}
	for deadline := time.Now().Add(20 * time.Second); z.dev.refuseLog.Total() < flood+1; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d refusals recorded, want %d", z.dev.refuseLog.Total(), flood+1)
		}
	}
	took := time.Since(start)
	if n, most := len(logs.Lines()), int(took/time.Second)+1; n > most {
		t.Errorf("%d lines for %d refusals in %v, want at most %d:\n%s", n, flood+1, took, most, strings.Join(logs.Lines(), "\n"))
	}
	// One more, a second after the last line: its line counts the
	// refusals left unlogged.
	time.Sleep(time.Second)
	stranger()
	logs.WaitLine(t, fmt.Sprintf("refused_total=%d", flood+2))
	// Each refusal has a line, or is counted in the next line's suppressed.
	lines, suppressed := logs.Lines(), 0
	for _, l := range lines {
		var n int
		if _, rest, ok := strings.Cut(l, " suppressed="); ok {
			fmt.Sscan(rest, &n)
		}
		suppressed += n
	}
	if len(lines)+suppressed != flood+2 {
		t.Errorf("%d lines and %d suppressed for %d refusals:\n%s", len(lines), suppressed, flood+2, strings.Join(lines, "\n"))
	}
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
// maxUnprovenPerHost of the device's unproven slots, the oldest going
// first; those of another address are not evicted by them, nor by a
// flood from four addresses that fills the device, and a Connect (from
// a third address) gets through.
func TestPerHostBound(t *testing.T) {
	var logs logcapture.Buffer
	key := newJobKey(t)
	cfg := verbsio.Config{JobKey: key.Bytes(), Logger: logs.Logger()}
	a, z := openAuthSide(t, key, 0x11), openAuthSideConfig(t, cfg, 0x22)
	addr := z.dev.Info().Address
	state := func() (accepted uint64, by map[string]int, evicted uint64) {
		z.dev.mu.Lock()
		defer z.dev.mu.Unlock()
		by = map[string]int{}
		for h, n := range z.dev.unprovenBy {
			by[h] = n
		}
		return z.dev.acceptSeq, by, z.dev.evicted
	}
	waitAccepted := func(n uint64) {
		t.Helper()
		for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(time.Millisecond) {
			if got, _, _ := state(); got >= n {
				return
			}
			if time.Now().After(deadline) {
				got, _, _ := state()
				t.Fatalf("%d connections accepted, want %d", got, n)
			}
		}
	}
	var sent uint64
	flood := func(from string, n int) []net.Conn {
		var cs []net.Conn
		for range n {
			cs = append(cs, dialFrom(t, from, addr))
		}
		sent += uint64(n)
		waitAccepted(sent)
		return cs
	}
	flood("127.0.0.2", 100)
	quiet := flood("127.0.0.3", 10)
	flood("127.0.0.2", 100)
	_, by, evicted := state()
	t.Logf("after 200 idle connections from 127.0.0.2 and 10 from 127.0.0.3: unproven by address %v, %d evicted", by, evicted)
	if by["127.0.0.2"] != maxUnprovenPerHost || by["127.0.0.3"] != len(quiet) || evicted != 200-maxUnprovenPerHost {
		t.Fatalf("unproven by address %v, %d evicted: want %d from 127.0.0.2, %d from 127.0.0.3, %d evicted", by, evicted, maxUnprovenPerHost, len(quiet), 200-maxUnprovenPerHost)
	}
	logs.WaitLine(t, `msg="tcp: connection refused"`, "peer=127.0.0.2:", "127.0.0.2 opened 16 newer ones")

	// Four more addresses fill the device: each new connection evicts the
	// oldest of the address holding the most, never 127.0.0.3's.
	for _, h := range []string{"127.0.0.4", "127.0.0.5", "127.0.0.6", "127.0.0.7"} {
		flood(h, maxUnprovenPerHost)
	}
	_, by, _ = state()
	total := 0
	for _, n := range by {
		total += n
	}
	t.Logf("after four more addresses: unproven by address %v", by)
	if by["127.0.0.3"] != len(quiet) || total > maxUnproven {
		t.Fatalf("unproven by address %v: want %d from 127.0.0.3, at most %d in all", by, len(quiet), maxUnproven)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if errA, errZ := connectBoth(ctx, a, z); errA != nil || errZ != nil {
		t.Fatalf("Connect during the flood: %v, %v", errA, errZ)
	}
}

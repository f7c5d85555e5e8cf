package onnode

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/internal/logcapture"
	"github.com/gdrlink/gdrlink/verbsio"
)

// TestRefusalLogged: while a queue pair waits for its peer's process,
// connections of another process to its socket are refused with a line at
// Warn naming that process and the reason; a flood of them writes at most
// a line a second, and every refusal has a line or is counted in the next
// one's suppressed.
func TestRefusalLogged(t *testing.T) {
	var logs logcapture.Buffer
	n, err := newNodeConfig(verbsio.Config{Logger: logs.Logger()}, Options{Spin: defaultSpin})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(n.close)
	p := startPeer(t, MechAuto)
	s := startPeer(t, MechAuto)
	spid := peerPID(t, s)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	errc := make(chan error, 1)
	peer := fakePeer(n, peerPID(t, p))
	go func() { errc <- n.qp.Connect(ctx, peer) }()
	const flood = 20
	start := time.Now()
	if got := s.one("flood", "flood %s %d", n.qp.(*qp).name, flood); got[0] != fmt.Sprint(flood) {
		t.Fatalf("flood connected %s of %d", got[0], flood)
	}
	rl := n.dev.(*device).refuseLog
	for deadline := time.Now().Add(20 * time.Second); rl.Total() < flood; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d refusals recorded, want %d", rl.Total(), flood)
		}
	}
	took := time.Since(start)
	cancel()
	if err := <-errc; !errors.Is(err, verbsio.ErrTimeout) {
		t.Fatalf("Connect: %v, want ErrTimeout", err)
	}
	lines, suppressed := logs.Lines(), 0
	for _, l := range lines {
		if !strings.Contains(l, `level=WARN msg="onnode: connection refused"`) || !strings.Contains(l, fmt.Sprintf(`peer="pid %d uid `, spid)) || !strings.Contains(l, "onnode refuses pid") {
			t.Errorf("line %q: want a refusal of pid %d at Warn with its reason", l, spid)
		}
		var k int
		if _, rest, ok := strings.Cut(l, " suppressed="); ok {
			fmt.Sscan(rest, &k)
		}
		suppressed += k
	}
	t.Log(lines[0])
	if most := int(took/time.Second) + 1; len(lines) > most {
		t.Errorf("%d lines in %v, want at most %d", len(lines), took, most)
	}
	// The refusals after the last line wait for the next one's count.
	if len(lines)+suppressed > flood || len(lines) == 0 {
		t.Errorf("%d lines and %d suppressed for %d refusals", len(lines), suppressed, flood)
	}
}

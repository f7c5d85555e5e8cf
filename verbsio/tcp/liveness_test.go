package tcp

import (
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/verbsio"
)

// The socket never gives up on a peer before the peer timeout has passed
// (with a margin), its keepalive probes last as long as the user timeout,
// and short peer timeouts keep the floor.
func TestSocketLivenessOutlastsPeerTimeout(t *testing.T) {
	for _, pt := range []time.Duration{time.Second, 3 * time.Second, 30 * time.Second, 10 * time.Minute, 24 * time.Hour} {
		cfg, err := verbsio.Config{PeerTimeout: pt}.Resolve()
		if err != nil {
			t.Fatal(err)
		}
		to, ka := socketLiveness(cfg)
		probes := ka.Idle + ka.Interval*time.Duration(ka.Count)
		t.Logf("peer timeout %v: TCP_USER_TIMEOUT %v, keepalive %v + %d x %v = %v", pt, to, ka.Idle, ka.Count, ka.Interval, probes)
		if to < pt+pt/2 || to < userTimeoutFloor {
			t.Errorf("peer timeout %v: user timeout %v, want at least %v and %v", pt, to, pt+pt/2, userTimeoutFloor)
		}
		if !ka.Enable || probes < to || ka.Count > maxKeepaliveCount || ka.Count < 1 || ka.Interval < keepaliveMinGap {
			t.Errorf("peer timeout %v: keepalive %+v gives up after %v, before the user timeout %v (or is out of range)", pt, ka, probes, to)
		}
	}
	// With the default peer timeout (30s) the user timeout is 45s.
	cfg, _ := verbsio.Config{}.Resolve()
	if to, _ := socketLiveness(cfg); to != 45*time.Second {
		t.Errorf("default user timeout %v, want 45s (1.5 x the default peer timeout)", to)
	}
}

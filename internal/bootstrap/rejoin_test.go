package bootstrap

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/internal/jobauth"
)

// TestRejoin: rank 2 of a keyed job of three dies (its group closes, as a
// killed process's sockets do); a new process joins as rank 2, becomes
// incarnation 2, tells ranks 0 and 1 (whose handlers hear of it and answer
// with their data), and the job goes on: barriers, calls both ways. A call
// made as the old incarnation is refused afterwards.
func TestRejoin(t *testing.T) {
	const n = 3
	key := testKey(t, "rejoin")
	type heard struct {
		rank int
		inc  uint64
		data string
	}
	var mu sync.Mutex
	heardBy := map[int][]heard{}
	set := func(rank int, cfg *Config) {
		cfg.Key = key
		cfg.RejoinData = []byte(fmt.Sprint("data of rank ", rank))
		cfg.OnCall = func(ctx context.Context, from int, req []byte) ([]byte, error) {
			return []byte(fmt.Sprintf("%d answers %d", rank, from)), nil
		}
		cfg.OnRejoin = func(ctx context.Context, from int, inc uint64, data []byte) ([]byte, error) {
			mu.Lock()
			heardBy[rank] = append(heardBy[rank], heard{from, inc, string(data)})
			mu.Unlock()
			return []byte(fmt.Sprint("answer of rank ", rank)), nil
		}
	}
	gs := joinAllCfg(t, n, set)
	for r, g := range gs {
		if g.Rejoined() || g.Incarnation(2) != 1 {
			t.Fatalf("rank %d: rejoined %v, incarnation of rank 2 %d; want false, 1", r, g.Rejoined(), g.Incarnation(2))
		}
	}
	oldAddr := gs[2].Addrs()[2]
	gs[2].Close() // rank 2's process dies

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	cfg := Config{Rank: 2, Size: n, Root: gs[0].RootAddr()}
	set(2, &cfg)
	cfg.RejoinData = []byte("data of rank 2, second life")
	start := time.Now()
	ng, err := Join(ctx, cfg)
	if err != nil {
		t.Fatalf("rejoin: %v", err)
	}
	t.Cleanup(func() { ng.Close() })
	t.Logf("rejoined in %v", time.Since(start).Round(time.Millisecond))
	if !ng.Rejoined() || ng.Incarnation(2) != 2 {
		t.Fatalf("new rank 2: rejoined %v, incarnation %d; want true, 2", ng.Rejoined(), ng.Incarnation(2))
	}
	pd := ng.PeerData()
	for r := 0; r < 2; r++ {
		if want := fmt.Sprint("answer of rank ", r); string(pd[r]) != want {
			t.Errorf("peer data of rank %d: %q, want %q", r, pd[r], want)
		}
	}
	for r := 0; r < 2; r++ {
		if got := gs[r].Incarnation(2); got != 2 {
			t.Errorf("rank %d knows incarnation %d of rank 2, want 2", r, got)
		}
		if a := gs[r].Addrs()[2]; a != ng.Addrs()[2] || a == oldAddr {
			t.Errorf("rank %d has rank 2 at %s; the new process is at %s, the old was at %s", r, a, ng.Addrs()[2], oldAddr)
		}
		if gs[r].Rejoins() != 1 {
			t.Errorf("rank %d counts %d rejoins, want 1", r, gs[r].Rejoins())
		}
		mu.Lock()
		h := heardBy[r]
		mu.Unlock()
		if len(h) != 1 || h[0] != (heard{2, 2, "data of rank 2, second life"}) {
			t.Errorf("rank %d's handler heard %+v", r, h)
		}
	}
	barrier(t, gs[0], gs[1], ng)
	for _, pair := range [][2]*Group{{ng, gs[0]}, {ng, gs[1]}, {gs[1], ng}, {gs[0], ng}} {
		from, to := pair[0], pair[1]
		got, err := from.Call(ctx, to.Rank(), []byte("hi"))
		if want := fmt.Sprintf("%d answers %d", to.Rank(), from.Rank()); err != nil || string(got) != want {
			t.Errorf("call %d->%d after the rejoin: %q, %v; want %q", from.Rank(), to.Rank(), got, err, want)
		}
	}
	// The old incarnation (a process that was only stopped, say) is
	// refused: a call claiming incarnation 1 of rank 2.
	m, err := rawCall(ctx, gs[1].Addrs()[1], key, callBody{rank: 2, size: n, inc: 1, req: []byte("stale")})
	if err != nil {
		t.Fatal(err)
	}
	if m.typ != tRefused || !strings.Contains(string(m.body), "replaced") {
		t.Errorf("call as incarnation 1 of rank 2: type %d %q, want a refusal naming the replacement", m.typ, m.body)
	}
}

// TestRejoinLiveRefused: a second process claiming a rank whose process is
// alive is refused, and the live one keeps its rank.
func TestRejoinLiveRefused(t *testing.T) {
	key := testKey(t, "live")
	gs := joinAllCfg(t, 2, func(rank int, cfg *Config) { cfg.Key = key })
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	_, err := Join(ctx, Config{Rank: 1, Size: 2, Root: gs[0].RootAddr(), Key: key})
	if !errors.Is(err, ErrRefused) || !strings.Contains(err.Error(), "is alive") {
		t.Fatalf("second claimant of live rank 1: %v; want ErrRefused saying it is alive", err)
	}
	if gs[0].Incarnation(1) != 1 || gs[0].Rejoins() != 0 {
		t.Errorf("root: incarnation of rank 1 %d, rejoins %d; want 1, 0", gs[0].Incarnation(1), gs[0].Rejoins())
	}
	barrier(t, gs...)
	// A claimant without the key is refused before anything else.
	_, err = Join(ctx, Config{Rank: 1, Size: 2, Root: gs[0].RootAddr(), Key: testKey(t, "other")})
	if !errors.Is(err, ErrRefused) {
		t.Fatalf("claimant with another key: %v; want ErrRefused", err)
	}
}

// rawCall sends one call body on a connection of its own, proving key as
// the body's rank, and returns the answer.
func rawCall(ctx context.Context, addr string, key jobauth.Key, cb callBody) (msg, error) {
	c, err := net.Dial("tcp", addr)
	if err != nil {
		return msg{}, err
	}
	defer c.Close()
	g := &Group{rank: cb.rank, size: cb.size, key: key, max: DefaultMaxMessage}
	if err := g.initiate(ctx, c); err != nil {
		return msg{}, err
	}
	if _, err := c.Write(appendMsg(nil, tCall, cb.Append(nil))); err != nil {
		return msg{}, err
	}
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	return readMsg(c, DefaultMaxMessage)
}

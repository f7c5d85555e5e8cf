package bootstrap

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/verbsio"
)

func TestFromEnv(t *testing.T) {
	cases := []struct {
		name string
		env  map[string]string
		want Config
		bad  string // the variable the error must name
	}{
		{"Explicit", map[string]string{"GDRLINK_RANK": "2", "GDRLINK_SIZE": "4", "GDRLINK_ROOT": "10.0.0.1:5000", "RANK": "0", "WORLD_SIZE": "9"},
			Config{Rank: 2, Size: 4, Root: "10.0.0.1:5000"}, ""},
		{"Torchrun", map[string]string{"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "node0", "MASTER_PORT": "29500", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"},
			Config{Rank: 1, Size: 2, Root: "node0:29500"}, ""},
		{"OpenMPI", map[string]string{"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "GDRLINK_ROOT": "127.0.0.1:7000", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"},
			Config{Rank: 3, Size: 4, Root: "127.0.0.1:7000"}, ""},
		{"Slurm", map[string]string{"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "MASTER_ADDR": "n1", "MASTER_PORT": "1234"},
			Config{Rank: 5, Size: 8, Root: "n1:1234"}, ""},
		{"RootWins", map[string]string{"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "GDRLINK_ROOT": "a:1", "MASTER_ADDR": "b", "MASTER_PORT": "2"},
			Config{Rank: 0, Size: 2, Root: "a:1"}, ""},
		{"SingleNoRoot", map[string]string{"RANK": "0", "WORLD_SIZE": "1"}, Config{Rank: 0, Size: 1}, ""},
		{"Peers", map[string]string{"GDRLINK_RANK": "0", "GDRLINK_SIZE": "2", "GDRLINK_PEERS": "h0:1,h1:2"},
			Config{Rank: 0, Size: 2, Peers: []string{"h0:1", "h1:2"}}, ""},
		{"Nothing", map[string]string{}, Config{}, "GDRLINK_RANK"},
		{"RankOnly", map[string]string{"RANK": "1"}, Config{}, "WORLD_SIZE"},
		{"BadRank", map[string]string{"OMPI_COMM_WORLD_RANK": "x", "OMPI_COMM_WORLD_SIZE": "2"}, Config{}, "OMPI_COMM_WORLD_RANK"},
		{"RankTooBig", map[string]string{"SLURM_PROCID": "4", "SLURM_NTASKS": "4", "GDRLINK_ROOT": "a:1"}, Config{}, "SLURM_PROCID"},
		{"ZeroSize", map[string]string{"GDRLINK_RANK": "0", "GDRLINK_SIZE": "0"}, Config{}, "GDRLINK_SIZE"},
		{"NoRoot", map[string]string{"RANK": "0", "WORLD_SIZE": "2"}, Config{}, "GDRLINK_ROOT"},
		{"NoMasterPort", map[string]string{"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "x"}, Config{}, "MASTER_PORT"},
		{"BadMasterPort", map[string]string{"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "x", "MASTER_PORT": "http"}, Config{}, "MASTER_PORT"},
		{"BadRoot", map[string]string{"RANK": "0", "WORLD_SIZE": "2", "GDRLINK_ROOT": "nohostport"}, Config{}, "GDRLINK_ROOT"},
		{"EmptyFallsThrough", map[string]string{"GDRLINK_RANK": "", "GDRLINK_SIZE": "", "RANK": " ", "WORLD_SIZE": "", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "GDRLINK_ROOT": "h:1"},
			Config{Rank: 1, Size: 2, Root: "h:1"}, ""},
		{"HalfEmpty", map[string]string{"RANK": "1", "WORLD_SIZE": ""}, Config{}, "WORLD_SIZE"},
		{"PeersCount", map[string]string{"GDRLINK_RANK": "0", "GDRLINK_SIZE": "3", "GDRLINK_PEERS": "h0:1,h1:2"}, Config{}, "GDRLINK_PEERS"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := fromLookup(func(k string) (string, bool) { v, ok := tc.env[k]; return v, ok })
			if tc.bad != "" {
				if !errors.Is(err, verbsio.ErrBadConfig) || !strings.Contains(err.Error(), tc.bad) {
					t.Fatalf("error %v, want ErrBadConfig naming %s", err, tc.bad)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got.Rank != tc.want.Rank || got.Size != tc.want.Size || got.Root != tc.want.Root || strings.Join(got.Peers, ",") != strings.Join(tc.want.Peers, ",") {
				t.Errorf("got %+v, want %+v", got, tc.want)
			}
		})
	}
}

// joinAllWith joins n ranks in this process, rank 0 on an ephemeral port,
// each with the handler onCall(rank) answering its Calls.
func joinAllWith(t *testing.T, n int, onCall func(rank int) Handler) []*Group {
	t.Helper()
	return joinAllCfg(t, n, func(rank int, cfg *Config) { cfg.OnCall = onCall(rank) })
}

// joinAllCfg joins n ranks in this process, rank 0 on an ephemeral port,
// each with the configuration set(rank) completes.
func joinAllCfg(t *testing.T, n int, set func(rank int, cfg *Config)) []*Group {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	gs := make([]*Group, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for r := 0; r < n; r++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			cfg := Config{Rank: r, Size: n, Root: ln.Addr().String()}
			set(r, &cfg)
			if r == 0 {
				cfg.Listener = ln
			}
			gs[r], errs[r] = Join(ctx, cfg)
		}()
	}
	wg.Wait()
	for r, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: %v", r, err)
		}
	}
	t.Cleanup(func() {
		for _, g := range gs {
			g.Close()
			g.Close() // idempotent
		}
	})
	return gs
}

// TestCall: any rank calls any other, concurrently and in both directions
// at once; a handler's error comes back as ErrRefused with its reason; a
// rank without a handler refuses; a call to itself is a bad config.
func TestCall(t *testing.T) {
	const n = 4
	gs := joinAllWith(t, n, func(rank int) Handler {
		if rank == n-1 {
			return nil
		}
		return func(ctx context.Context, from int, req []byte) ([]byte, error) {
			if string(req) == "fail" {
				return nil, fmt.Errorf("rank %d does not like %q", rank, req)
			}
			return []byte(fmt.Sprintf("%d answers %d: %s", rank, from, req)), nil
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	errs := make(chan error, n*n)
	for from := 0; from < n; from++ {
		for to := 0; to < n-1; to++ {
			if from == to {
				continue
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				got, err := gs[from].Call(ctx, to, []byte("hi"))
				if want := fmt.Sprintf("%d answers %d: hi", to, from); err != nil || string(got) != want {
					errs <- fmt.Errorf("call %d->%d: %q, %v; want %q", from, to, got, err, want)
				}
			}()
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if _, err := gs[1].Call(ctx, 0, []byte("fail")); !errors.Is(err, ErrRefused) || !strings.Contains(err.Error(), "does not like") {
		t.Errorf("a handler's error: %v, want ErrRefused quoting it", err)
	}
	if _, err := gs[0].Call(ctx, n-1, []byte("hi")); !errors.Is(err, ErrRefused) || !strings.Contains(err.Error(), "answers no calls") {
		t.Errorf("a rank without a handler: %v, want ErrRefused", err)
	}
	if _, err := gs[0].Call(ctx, 0, nil); !errors.Is(err, verbsio.ErrBadConfig) {
		t.Errorf("a call to itself: %v, want ErrBadConfig", err)
	}
}

// TestLateHelloRefused: a process that says hello to the root after the
// job joined (a second claimant of a rank) is told why and disconnected
// at once, not parked until the group closes.
func TestLateHelloRefused(t *testing.T) {
	gs := joinAll(t, 2)
	for _, rank := range []int{1, 0} {
		c, err := net.Dial("tcp", gs[0].RootAddr())
		if err != nil {
			t.Fatal(err)
		}
		c.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := c.Write(appendMsg(nil, tHello, helloBody{rank: rank, size: 2, contact: "127.0.0.1:1"}.Append(nil))); err != nil {
			t.Fatal(err)
		}
		m, err := readMsg(c, 4096)
		if err != nil || m.typ != tRefused || !strings.Contains(string(m.body), "already joined") {
			t.Fatalf("late hello for rank %d: %+v, %v; want a refusal saying the job already joined", rank, m, err)
		}
		if _, err := readMsg(c, 4096); err == nil {
			t.Fatalf("the connection stayed open after the refusal")
		}
		c.Close()
	}
	// The job itself goes on.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	for _, g := range gs {
		wg.Add(1)
		go func() { defer wg.Done(); _ = g.Barrier(ctx) }()
	}
	wg.Wait()
	if ctx.Err() != nil {
		t.Fatal("barrier after the refusals timed out")
	}
}

// joinAll joins n ranks in this process, rank 0 on an ephemeral port.
func joinAll(t *testing.T, n int) []*Group {
	t.Helper()
	return joinAllWith(t, n, func(int) Handler { return nil })
}

func TestGroup(t *testing.T) {
	const n = 5
	gs := joinAll(t, n)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	errs := make(chan error, 4*n*n)
	for r, g := range gs {
		if g.Rank() != r || g.Size() != n || len(g.Addrs()) != n {
			t.Fatalf("rank %d: group %d/%d with %d addresses", r, g.Rank(), g.Size(), len(g.Addrs()))
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			for round := 0; round < 3; round++ {
				all, err := g.AllGather(ctx, []byte(fmt.Sprintf("rank %d round %d", r, round)))
				if err != nil {
					errs <- err
					return
				}
				for p, b := range all {
					if want := fmt.Sprintf("rank %d round %d", p, round); string(b) != want {
						errs <- fmt.Errorf("rank %d round %d: entry %d = %q", r, round, p, b)
					}
				}
			}
			var pw sync.WaitGroup
			for p := 0; p < n; p++ {
				pw.Add(1)
				go func() {
					defer pw.Done()
					got, err := g.Exchange(ctx, p, []byte(fmt.Sprintf("%d->%d", r, p)))
					if err != nil {
						errs <- err
					} else if want := fmt.Sprintf("%d->%d", p, r); string(got) != want {
						errs <- fmt.Errorf("rank %d from %d: %q, want %q", r, p, got, want)
					}
				}()
			}
			pw.Wait()
			if err := g.Barrier(ctx); err != nil {
				errs <- err
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

func TestMissingRankNamed(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	done := make(chan error, 1)
	go func() {
		g, err := Join(ctx, Config{Rank: 1, Size: 3, Root: ln.Addr().String()})
		if err == nil {
			g.Close()
		}
		done <- err
	}()
	_, err = Join(ctx, Config{Rank: 0, Size: 3, Listener: ln})
	if !errors.Is(err, verbsio.ErrTimeout) || !strings.Contains(err.Error(), "rank(s) 2 ") || !strings.Contains(err.Error(), ln.Addr().String()) {
		t.Errorf("root: %v, want ErrTimeout naming rank 2 and the root address", err)
	}
	if err := <-done; !errors.Is(err, verbsio.ErrTimeout) {
		t.Errorf("rank 1: %v, want ErrTimeout", err)
	}
	// A rank whose root never listens names the root.
	ctx2, cancel2 := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel2()
	_, err = Join(ctx2, Config{Rank: 1, Size: 2, Root: "127.0.0.1:1"})
	if !errors.Is(err, verbsio.ErrTimeout) || !strings.Contains(err.Error(), "127.0.0.1:1") {
		t.Errorf("rank without a root: %v, want ErrTimeout naming the root", err)
	}
}

func TestExchangeCancelled(t *testing.T) {
	gs := joinAll(t, 2)
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(50*time.Millisecond, cancel)
	// Rank 1 never answers: the exchange ends with the context.
	_, err := gs[0].Exchange(ctx, 1, []byte("x"))
	if !errors.Is(err, verbsio.ErrTimeout) {
		t.Errorf("exchange with a silent peer: %v, want ErrTimeout", err)
	}
	if _, err := gs[0].Exchange(context.Background(), 7, nil); !errors.Is(err, verbsio.ErrBadConfig) {
		t.Errorf("exchange with rank 7 of 2: %v", err)
	}
}

func TestEndpointRoundTrip(t *testing.T) {
	e := verbsio.Endpoint{Provider: "tcp", Host: "3b0c", Data: []byte{1, 2, 3}}
	got, err := DecodeEndpoint(EncodeEndpoint(nil, e))
	if err != nil || got.Provider != e.Provider || got.Host != e.Host || !bytes.Equal(got.Data, e.Data) {
		t.Fatalf("round trip: %+v, %v", got, err)
	}
}

// FuzzMsg decodes arbitrary bytes as control messages and their bodies:
// errors wrap ErrBadFrame, nothing panics, and what decodes re-encodes to
// the same bytes.
func FuzzMsg(f *testing.F) {
	f.Fuzz(func(t *testing.T, data []byte) {
		m, rest, err := parseMsg(data, 1<<16)
		if err != nil {
			if !errors.Is(err, verbsio.ErrBadFrame) {
				t.Fatalf("error %v does not wrap ErrBadFrame", err)
			}
			return
		}
		if re := appendMsg(nil, m.typ, m.body); !bytes.Equal(re, data[:len(data)-len(rest)]) {
			t.Fatalf("message re-encodes to %x", re)
		}
		if m2, err := readMsg(bytes.NewReader(data), 1<<16); err != nil || m2.typ != m.typ || !bytes.Equal(m2.body, m.body) {
			t.Fatalf("readMsg disagrees with parseMsg: %v", err)
		}
		check := func(err error) {
			if err != nil && !errors.Is(err, verbsio.ErrBadFrame) {
				t.Fatalf("body error %v does not wrap ErrBadFrame", err)
			}
		}
		if h, err := parseHello(m.body); err == nil {
			if re := h.Append(nil); !bytes.Equal(re, m.body) {
				t.Fatalf("hello re-encodes to %x", re)
			}
		} else {
			check(err)
		}
		if len(m.body) >= 4 {
			n := int(m.body[3]) // small counts only, as the real callers pass
			if l, err := parseList(m.body, n); err == nil {
				if re := appendList(nil, l); !bytes.Equal(re, m.body) {
					t.Fatalf("list re-encodes to %x", re)
				}
			} else {
				check(err)
			}
			if a, incs, err := parseAddrs(m.body, n); err == nil {
				if re := appendAddrs(nil, a, incs); !bytes.Equal(re, m.body) {
					t.Fatalf("address list re-encodes to %x", re)
				}
			} else {
				check(err)
			}
		}
		if nb, err := parseNotice(m.body); err == nil {
			if re := nb.Append(nil); !bytes.Equal(re, m.body) {
				t.Fatalf("notice re-encodes to %x", re)
			}
		} else {
			check(err)
		}
		if cb, err := parseCall(m.body); err == nil {
			if re := cb.Append(nil); !bytes.Equal(re, m.body) {
				t.Fatalf("call re-encodes to %x", re)
			}
		} else {
			check(err)
		}
		if e, err := DecodeEndpoint(m.body); err == nil {
			if re := EncodeEndpoint(nil, e); !bytes.Equal(re, m.body) {
				t.Fatalf("endpoint re-encodes to %x", re)
			}
		} else {
			check(err)
		}
	})
}

func TestJobOfOne(t *testing.T) {
	g, err := Join(context.Background(), Config{Rank: 0, Size: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	all, err := g.AllGather(context.Background(), []byte("solo"))
	if err != nil || len(all) != 1 || string(all[0]) != "solo" {
		t.Errorf("AllGather = %q, %v", all, err)
	}
	if b, err := g.Exchange(context.Background(), 0, []byte("me")); err != nil || string(b) != "me" {
		t.Errorf("Exchange with itself = %q, %v", b, err)
	}
}

// TestRootLate starts a rank before its root: the rank keeps dialing until
// the root listens.
func TestRootLate(t *testing.T) {
	addr := func() string {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		return ln.Addr().String()
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	done := make(chan error, 1)
	go func() {
		g, err := Join(ctx, Config{Rank: 1, Size: 2, Root: addr})
		if err == nil {
			_, err = g.AllGather(ctx, []byte("late"))
			g.Close()
		}
		done <- err
	}()
	time.Sleep(300 * time.Millisecond)
	g, err := Join(ctx, Config{Rank: 0, Size: 2, Root: addr})
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	all, err := g.AllGather(ctx, []byte("root"))
	if err != nil || string(all[1]) != "late" {
		t.Fatalf("AllGather = %q, %v", all, err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

package gdrlink

import (
	"context"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

// withPeerPools gives each peer a result pool of its own on tcp too, as on
// an ibverbs device whose memory windows do not bound writes.
func withPeerPools() Option {
	return func(c *config) error {
		c.peerPools = true
		return nil
	}
}

// TestPeerResultPools: where a device gives no bounded grants, the results
// of each peer come from a pool of that peer's own, whose arenas alone are
// registered for remote write, and the group's pool (the application's
// tensors, the sources of Sends) is registered for local write only; so
// no region a peer's rkey names covers another peer's results or the
// group's tensors. Run on tcp with the per-peer pools forced (the
// fallback's own device, Soft-RoCE, runs it through the three-process
// hostile test in make test-rdma). Without them, on a provider that gives
// grants, no arena is registered for remote write at all.
func TestPeerResultPools(t *testing.T) {
	t.Run("per-peer", func(t *testing.T) { testResultPools(t, true) })
	t.Run("grants", func(t *testing.T) { testResultPools(t, false) })
}

func testResultPools(t *testing.T, perPeerPools bool) {
	opts := []Option{WithProvider("tcp")}
	if perPeerPools {
		opts = append(opts, withPeerPools())
	}
	gs := joinRanks(t, 3, opts...)
	defer func() {
		for _, g := range gs {
			g.Close()
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	d := gs[0].devs["tcp"]
	if d == nil {
		t.Fatalf("tcp not opened: %v", gs[0].providerNames())
	}
	if !d.dev.Caps().Grants {
		t.Fatal("tcp gives no grants")
	}
	if (d.writable != nil) != perPeerPools {
		t.Fatalf("per-peer registration %v, want %v", d.writable != nil, perPeerPools)
	}
	// Rank 0 receives from ranks 1 and 2, and keeps the results.
	results := map[int]*tensor.Tensor{}
	for _, from := range []int{1, 2} {
		src, err := gs[from].NewTensor(tensor.Uint8, 1<<16)
		if err != nil {
			t.Fatal(err)
		}
		if err := gs[from].Send(0, "x", 0, src); err != nil {
			t.Fatal(err)
		}
		got, tr, err := gs[0].Recv(ctx, from, "x", 0)
		if err != nil {
			t.Fatalf("from rank %d: %v", from, err)
		}
		if tr.Provider != "tcp" {
			t.Fatalf("from rank %d over %s, want tcp", from, tr.Provider)
		}
		defer got.Release()
		results[from] = got
	}
	own, err := gs[0].NewTensor(tensor.Uint8, 1<<16)
	if err != nil {
		t.Fatal(err)
	}
	defer own.Release()

	g := gs[0]
	region := func(tt *tensor.Tensor) verbsio.MemoryRegion {
		t.Helper()
		pools := []*alloc.Pool{g.pool}
		for _, p := range g.peerPools {
			pools = append(pools, p)
		}
		for _, p := range pools {
			if a, ok := p.ArenaOf(tt.Addr()); ok {
				if mr, ok := d.regionOf(a); ok {
					return mr
				}
			}
		}
		t.Fatalf("no tcp region holds the tensor at %#x", tt.Addr())
		return nil
	}
	covers := func(mr verbsio.MemoryRegion, tt *tensor.Tensor) bool {
		n := uintptr(tt.Meta().ByteSize)
		return mr.Addr() <= tt.Addr() && tt.Addr()+n <= mr.Addr()+uintptr(mr.Len())
	}
	if a := region(own).Access(); a != verbsio.AccessLocalWrite {
		t.Errorf("the group's tensor lies in a region with access %v, want %v", a, verbsio.AccessLocalWrite)
	}
	for from, res := range results {
		mr := region(res)
		other := results[3-from]
		switch {
		case !perPeerPools && mr.Access() != verbsio.AccessLocalWrite:
			t.Errorf("rank %d's result: region access %v, want %v (grants serve every write)", from, mr.Access(), verbsio.AccessLocalWrite)
		case perPeerPools && mr.Access() != verbsio.AccessLocalWrite|verbsio.AccessRemoteWrite:
			t.Errorf("rank %d's result: region access %v, want local and remote write", from, mr.Access())
		}
		if !perPeerPools {
			continue
		}
		p := g.peerPools[peerPoolKey{from, "tcp"}]
		if p == nil {
			t.Fatalf("no result pool for rank %d", from)
		}
		if _, ok := p.ArenaOf(res.Addr()); !ok {
			t.Errorf("rank %d's result is not in its own pool", from)
		}
		if covers(mr, other) || covers(mr, own) {
			t.Errorf("the region of rank %d's results [%#x+%d) covers rank %d's result or the group's tensor", from, mr.Addr(), mr.Len(), 3-from)
		}
		if mr.RKey() == region(other).RKey() {
			t.Errorf("ranks 1 and 2 results share rkey %#x", mr.RKey())
		}
	}
	if perPeerPools {
		st := g.Stats().Pool
		var peers int64
		for _, p := range g.peerPools {
			peers += p.Stats().Reserved
		}
		if peers == 0 || st.Reserved < peers {
			t.Errorf("pool stats reserve %d bytes, the peers' pools %d: the peers' pools are not counted", st.Reserved, peers)
		}
	}
}

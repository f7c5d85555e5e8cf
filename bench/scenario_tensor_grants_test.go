package main

import (
	"strings"
	"testing"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/alloc/visitor"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

// The switch hands out buffers from the pool of its mode, and the
// arena-key pool's regions come without their Granter.
func TestGrantSwitch(t *testing.T) {
	dev, err := verbsio.Open("tcp", verbsio.Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Close()
	pd, err := dev.AllocPD()
	if err != nil {
		t.Fatal(err)
	}
	defer pd.Close()
	access := verbsio.AccessLocalWrite | verbsio.AccessRemoteWrite
	reg := visitor.NewMemoryRegistration(pd, access)
	pool, err := alloc.New(alloc.NewMmapSource(alloc.MmapOptions{}), alloc.WithVisitors(reg), alloc.WithInitialArena(1<<20))
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	g, err := newGrantSwitch(pd, reg, pool, access, 1<<20, 1<<30)
	if err != nil {
		t.Fatal(err)
	}
	defer g.close()
	if err := g.grantsActive(); err != nil {
		t.Fatalf("tcp regions: %v", err)
	}
	for _, arenaKey := range []bool{false, true} {
		g.useArena.Store(arenaKey)
		b, err := g.Alloc(4096, tensor.Host)
		if err != nil {
			t.Fatal(err)
		}
		_, inGrantPool := pool.ArenaOf(b.Addr())
		_, inArenaPool := g.arenaPool.ArenaOf(b.Addr())
		r, ok := g.Region(b.Addr(), b.Len())
		if !ok {
			t.Fatalf("arena key %v: no region", arenaKey)
		}
		_, granter := r.(verbsio.Granter)
		if inGrantPool == arenaKey || inArenaPool != arenaKey || granter == arenaKey {
			t.Errorf("arena key %v: buffer in the grant pool %v, in the arena-key pool %v, region gives grants %v", arenaKey, inGrantPool, inArenaPool, granter)
		}
		b.Free()
	}
}

// checkGrantRows fails the test unless out has the grant rows of tcp and
// onnode, each value and baseline measured.
func checkGrantRows(t *testing.T, rows []Result) {
	t.Helper()
	seen := map[string]bool{}
	for _, r := range rows {
		if strings.HasPrefix(r.Case, "tensor-grants/") {
			if r.BaselineName != "arena-rkey" || r.Value <= 0 || r.Baseline <= 0 {
				t.Errorf("grant row without both figures: %+v", r)
			}
			seen[r.Case] = true
		}
	}
	for _, p := range []string{"tcp", "onnode"} {
		for _, c := range []string{"small-rate", "small-latency", "large"} {
			if !seen["tensor-grants/"+p+"/"+c] {
				t.Errorf("no tensor-grants/%s/%s row", p, c)
			}
		}
	}
}

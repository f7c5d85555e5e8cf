package main

import (
	"strings"
	"testing"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/alloc/visitor"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

// The switch hands out buffers from the pool of its mode: the scenario's
// outside the grant rows, in them the grant pool or the arena-key pool,
// whose regions come without their Granter.
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
	g, err := newGrantSwitch(pd, reg, pool, func(name string) alloc.Source { return tensorSource("tcp", name) }, access, 1<<20, 1<<30)
	if err != nil {
		t.Fatal(err)
	}
	defer g.close()
	if err := g.grantsActive(); err != nil {
		t.Fatalf("tcp regions: %v", err)
	}
	for _, c := range []struct {
		name          string
		inRows, arena bool
		want          *alloc.Pool
		wantGranter   bool
	}{
		{"outside the rows", false, false, pool, true},
		{"grants", true, false, g.grantPool, true},
		{"arena key", true, true, g.arenaPool, false},
	} {
		g.inRows.Store(c.inRows)
		g.useArena.Store(c.arena)
		b, err := g.Alloc(4096, tensor.Host)
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range []*alloc.Pool{pool, g.grantPool, g.arenaPool} {
			if _, in := p.ArenaOf(b.Addr()); in != (p == c.want) {
				t.Errorf("%s: buffer in pool %q %v", c.name, p.Stats().Name, in)
			}
		}
		r, ok := g.Region(b.Addr(), b.Len())
		if !ok {
			t.Fatalf("%s: no region", c.name)
		}
		if _, granter := r.(verbsio.Granter); granter != c.wantGranter {
			t.Errorf("%s: region gives grants %v, want %v", c.name, granter, c.wantGranter)
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

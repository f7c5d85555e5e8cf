package proxy_test

import (
	"context"
	"testing"

	"github.com/gdrlink/gdrlink/gpusim"
	"github.com/gdrlink/gdrlink/proxy"
)

// BenchmarkReceive measures a 16 MiB receive through the proxy on the
// simulated GPU (unthrottled: memory copies only), with the chunks reported
// one by one (pipelined) or as one chunk after the whole tensor (whole).
func BenchmarkReceive(b *testing.B) {
	const n = 16 << 20
	for _, bc := range []struct {
		name  string
		chunk int
	}{{"pipelined-1MiB", 1 << 20}, {"whole", n}} {
		b.Run(bc.name, func(b *testing.B) {
			r := newRigB(b)
			dst, err := r.sim.Alloc(n)
			if err != nil {
				b.Fatal(err)
			}
			defer r.sim.Free(dst)
			b.SetBytes(n)
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				rc, err := r.px.Receive(dst, n, nil)
				if err != nil {
					b.Fatal(err)
				}
				for off := 0; off < n; off += bc.chunk {
					if err := rc.ChunkArrived(off, min(bc.chunk, n-off)); err != nil {
						b.Fatal(err)
					}
				}
				if err := rc.Wait(context.Background()); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// newRigB is newRig for benchmarks.
func newRigB(b *testing.B) *rig {
	b.Helper()
	sim := gpusim.New(gpusim.Config{})
	pool, err := newPinnedPool(sim)
	if err != nil {
		b.Fatal(err)
	}
	px, err := proxy.New(sim, pool)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { px.Close(); pool.Close(); sim.Close() })
	return &rig{sim: sim, pool: pool, px: px}
}

package rendezvous

import (
	"testing"

	"github.com/gdrlink/gdrlink/tensor"
)

// Two tcp devices per side stand for two NICs: large writes are striped
// over both, small ones are not, and every byte arrives.
func TestRailsStripeLargeWrites(t *testing.T) {
	lo := []string{"127.0.0.1:0", "127.0.0.1:0"}
	a, b := pairRails(t, "tcp", lo, lo, withStripeMin(1<<20))
	ctx := recvCtx(t)
	if a.ch.active != 1 || b.ch.active != 1 {
		t.Fatalf("%d and %d extra rails active, want 1", a.ch.active, b.ch.active)
	}
	sizes := []tensor.Shape{{64}, {3 << 20}, {3 << 20}, {5<<20 + 3}, {100}}
	for step, sh := range sizes {
		src, err := makeTensor(a.pool, "uint8", sh, "r", int64(step))
		if err != nil {
			t.Fatal(err)
		}
		if err := a.ch.Send("r", int64(step), src); err != nil {
			t.Fatal(err)
		}
		got, _, err := b.ch.Recv(ctx, "r", int64(step))
		if err != nil {
			t.Fatalf("step %d: %v", step, err)
		}
		if err := checkTensor(got, "uint8", sh, "r", int64(step)); err != nil {
			t.Fatalf("step %d: %v", step, err)
		}
		_ = got.Release()
	}
	// Steps 1..3 are large; step 1 arrives after a meta-data round trip, in
	// whose re-request the rail keys travel too.
	if n := a.ch.Stats().Striped; n != 3 {
		t.Fatalf("%d writes striped, want 3 (the large ones)", n)
	}
}

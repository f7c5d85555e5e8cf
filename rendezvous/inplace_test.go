package rendezvous

import (
	"fmt"
	"testing"

	"github.com/gdrlink/gdrlink/tensor"
)

// A tensor that changed but still fits the buffer the request offered is
// written at once: the META_DATA_RESPONSE only announces it, and no
// re-request follows. Growth still needs the round trip.
func TestChangedTensorThatFitsNeedsNoReRequest(t *testing.T) {
	forEachProvider(t, func(t *testing.T, provider string) {
		a, b := pair(t, provider, WithChecksum(true), WithEager(0))
		ctx := recvCtx(t)
		steps := []struct {
			shape             tensor.Shape
			roundTrip, change bool
		}{
			{tensor.Shape{128}, true, true},    // nothing cached
			{tensor.Shape{128}, false, false},  // steady state
			{tensor.Shape{64}, false, true},    // shrinks: fits, written at once
			{tensor.Shape{2, 32}, false, true}, // reshaped, same size
			{tensor.Shape{256}, true, true},    // grows: round trip
		}
		for step, s := range steps {
			src, _ := makeTensor(a.pool, "float32", s.shape, "act", int64(step))
			if err := a.ch.Send("act", int64(step), src); err != nil {
				t.Fatal(err)
			}
			got, tr, err := b.ch.Recv(ctx, "act", int64(step))
			if err != nil {
				t.Fatalf("step %d: %v", step, err)
			}
			if err := checkTensor(got, "float32", s.shape, "act", int64(step)); err != nil {
				t.Fatalf("step %d: %v", step, err)
			}
			if tr.MetaRoundTrip != s.roundTrip || tr.MetaChanged != s.change || !tr.Checksummed {
				t.Errorf("step %d: round trip %v changed %v checksummed %v; want %v %v true", step, tr.MetaRoundTrip, tr.MetaChanged, tr.Checksummed, s.roundTrip, s.change)
			}
			_ = got.Release()
		}
		st := b.ch.Stats()
		if st.MetaInPlace != 2 || st.ReRequests != 2 {
			t.Fatalf("%d in-place meta-data responses and %d re-requests, want 2 and 2", st.MetaInPlace, st.ReRequests)
		}
	})
}

// String tensors change size from step to step; the result buffer has room
// to spare, so small changes cost no round trip.
func TestStringsOfChangingLength(t *testing.T) {
	a, b := pair(t, "tcp")
	ctx := recvCtx(t)
	for step := 0; step < 6; step++ {
		vals := make([]string, 16)
		for i := range vals {
			vals[i] = fmt.Sprintf("token-%d-%d", step*3, i) // lengths vary a little
		}
		src, err := tensor.NewStrings(tensor.Shape{16}, vals)
		if err != nil {
			t.Fatal(err)
		}
		if err := a.ch.Send("tok", int64(step), src); err != nil {
			t.Fatal(err)
		}
		got, tr, err := b.ch.Recv(ctx, "tok", int64(step))
		if err != nil {
			t.Fatal(err)
		}
		out, _ := got.Strings()
		for i := range vals {
			if out[i] != vals[i] {
				t.Fatalf("step %d string %d: %q, want %q", step, i, out[i], vals[i])
			}
		}
		if step > 0 && tr.MetaRoundTrip {
			t.Errorf("step %d: a round trip for a small change of length", step)
		}
	}
	if st := b.ch.Stats(); st.ReRequests != 1 {
		t.Fatalf("%d re-requests, want 1 (the first step)", st.ReRequests)
	}
}

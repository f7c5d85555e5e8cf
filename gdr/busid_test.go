package gdr

import (
	"strings"
	"testing"
)

// Under CUDA_VISIBLE_DEVICES=2,0 a process's CUDA ordinal 0 is the GPU that
// NVML (and so Facts) numbers 2. Deciding by bus id gives that GPU its own
// NIC (mlx5_1, on its PCIe switch); deciding by the CUDA ordinal would give
// it GPU 0's NIC (mlx5_0, on the other socket).
func TestDecideByBusIDUnderVisibleDevices(t *testing.T) {
	f := collectFixture(t, "dgx")
	// What cuDeviceGetPCIBusId answers for CUDA ordinals 0 and 1 of a
	// process started with CUDA_VISIBLE_DEVICES=2,0 (upper case, as the
	// driver spells it).
	visible := []string{"0000:9C:00.0", "0000:1A:00.0"}
	wantNIC := []string{"mlx5_1", "mlx5_0"}
	for ordinal, bus := range visible {
		d := DecideGPUByBusID(f, bus, defaultPolicy())
		if d.NIC != wantNIC[ordinal] || d.Mode != Direct {
			t.Errorf("CUDA ordinal %d (%s): %s over %s, want Direct over %s (%s)", ordinal, bus, d.Mode, d.NIC, wantNIC[ordinal], strings.Join(d.Reasons, "; "))
		}
		if g := f.gpu(d.GPU); g == nil || !strings.EqualFold(g.PCIBusID, bus) {
			t.Errorf("CUDA ordinal %d (%s): decision for GPU index %d, another GPU", ordinal, bus, d.GPU)
		}
	}
	// The defect this guards against: the ordinal read as an index.
	if d := DecideGPU(f, 0, defaultPolicy()); d.NIC == wantNIC[0] {
		t.Fatalf("fixture does not tell the two apart: index 0 also uses %s", d.NIC)
	}
	for _, bad := range []string{"0000:77:00.0", "not-a-bus-id"} {
		if d := DecideGPUByBusID(f, bad, defaultPolicy()); d.Mode != Unavailable || len(d.Reasons) == 0 {
			t.Errorf("bus id %q: %+v, want Unavailable with a reason", bad, d)
		}
	}
}

package ibverbs

import (
	"testing"

	"github.com/gdrlink/gdrlink/internal/ibv"
)

// dma-buf registrations (GPU memory) ask for PCIe relaxed ordering,
// IBV_ACCESS_RELAXED_ORDERING = IBV_ACCESS_OPTIONAL_FIRST = 1<<20 in verbs.h,
// unless the kernel refused it once.
func TestDMABufRelaxedOrdering(t *testing.T) {
	if ibv.AccessRelaxedOrdering != 1<<20 {
		t.Fatalf("AccessRelaxedOrdering = %#x, want IBV_ACCESS_RELAXED_ORDERING 0x100000", ibv.AccessRelaxedOrdering)
	}
	base := ibv.AccessLocalWrite | ibv.AccessRemoteWrite
	if got := dmabufFlags(base, true); got != base|ibv.AccessRelaxedOrdering {
		t.Fatalf("flags with relaxed ordering = %#x", got)
	}
	if got := dmabufFlags(base, false); got != base {
		t.Fatalf("flags after the kernel refused relaxed ordering = %#x", got)
	}
}

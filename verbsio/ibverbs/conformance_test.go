package ibverbs

import (
	"fmt"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/verbsio/verbstest"
)

// TestConformance runs verbsio's conformance suite on the RDMA device, with
// this process and a re-executed peer on the same device.
func TestConformance(t *testing.T) {
	cfg := testConfig(t)
	// Short ACK timeouts find the killed peer in well under a second.
	cfg.Timeout = 12
	verbstest.Run(t, verbstest.Harness{
		Provider: Name,
		Config:   cfg,
		PeerEnv: []string{"RDMA_DEVICE=" + cfg.Device, fmt.Sprintf("RDMA_GID_INDEX=%d", cfg.GIDIndex),
			fmt.Sprintf("RDMA_QP_TIMEOUT=%d", cfg.Timeout)},
		RequireEnv: "GDRLINK_REQUIRE_RDMA",
		// Emulated RDMA on busy cores answers in milliseconds, not microseconds.
		Timeout: 60 * time.Second,
	})
}

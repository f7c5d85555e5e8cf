package onnode

import (
	"testing"

	"github.com/gdrlink/gdrlink/verbsio/verbstest"
)

// TestConformance runs the providers' conformance suite against a real
// second process, once per mechanism.
func TestConformance(t *testing.T) {
	for _, mech := range []string{"auto", "vm", "shm"} {
		t.Run(mech, func(t *testing.T) {
			t.Setenv("GDRLINK_ONNODE_MECH", mech)
			verbstest.Run(t, verbstest.Harness{Provider: Name, PeerEnv: []string{"GDRLINK_ONNODE_MECH=" + mech}})
		})
	}
}

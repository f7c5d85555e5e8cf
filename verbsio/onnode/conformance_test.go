package onnode

import (
	"testing"

	"github.com/gdrlink/gdrlink/internal/jobauth"
	"github.com/gdrlink/gdrlink/verbsio"
	"github.com/gdrlink/gdrlink/verbsio/verbstest"
)

// TestConformance runs the providers' conformance suite against a real
// second process, once per mechanism, and once more with a job key.
func TestConformance(t *testing.T) {
	for _, mech := range []string{"auto", "vm", "shm"} {
		t.Run(mech, func(t *testing.T) {
			t.Setenv("GDRLINK_ONNODE_MECH", mech)
			verbstest.Run(t, verbstest.Harness{Provider: Name, PeerEnv: []string{"GDRLINK_ONNODE_MECH=" + mech}})
		})
	}
	// Both processes with a job key: every connection is authenticated.
	t.Run("auto+key", func(t *testing.T) {
		k, secret, err := jobauth.Generate()
		if err != nil {
			t.Fatal(err)
		}
		t.Setenv("GDRLINK_ONNODE_MECH", "auto")
		verbstest.Run(t, verbstest.Harness{Provider: Name, Config: verbsio.Config{JobKey: k.Bytes()},
			PeerEnv: []string{"GDRLINK_ONNODE_MECH=auto", jobauth.KeyEnv + "=" + secret}})
	})
}

package tcp_test

import (
	"os"
	"testing"

	_ "github.com/gdrlink/gdrlink/verbsio/tcp"
	"github.com/gdrlink/gdrlink/verbsio/verbstest"
)

func TestMain(m *testing.M) {
	verbstest.PeerMain()
	os.Exit(m.Run())
}

func TestConformance(t *testing.T) {
	verbstest.Run(t, verbstest.Harness{Provider: "tcp"})
}

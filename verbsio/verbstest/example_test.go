package verbstest_test

import (
	"fmt"
	"os"
	"testing"

	"github.com/gdrlink/gdrlink/verbsio/verbstest"
)

// A provider's test file: TestMain lets the binary serve as the suite's peer
// process, and one test runs the suite. The peer is the same binary started
// with PeerEnv set to the provider's name.
func Example() {
	_ = func(m *testing.M) {
		verbstest.PeerMain() // returns unless this process is the peer
		os.Exit(m.Run())
	}
	_ = func(t *testing.T) {
		verbstest.Run(t, verbstest.Harness{Provider: "tcp", RequireEnv: "GDRLINK_REQUIRE_RDMA"})
	}
	fmt.Println("a peer runs with", verbstest.PeerEnv+"=tcp")
	// Output: a peer runs with GDRLINK_VERBSTEST_PEER=tcp
}

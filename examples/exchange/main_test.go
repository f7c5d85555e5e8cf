package main

import (
	"os"
	"strconv"
	"testing"
)

func TestMain(m *testing.M) {
	// The test binary stands in for the program when it re-executes itself
	// as rank 1.
	if os.Getenv("GDRLINK_RANK") == "1" {
		steps, _ := strconv.Atoi(os.Getenv(envSteps))
		if err := run(steps, "", false, false); err != nil {
			os.Stderr.WriteString("exchange rank 1: " + err.Error() + "\n")
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// The program's job, short: two processes, every tensor of the stream
// checked byte for byte, with the provider's default checksum mode (off
// on onnode, on for tcp) and with checksum mode chosen, on the provider
// the front door picks (onnode here) and on tcp.
func TestExchange(t *testing.T) {
	for _, provider := range []string{"", "tcp"} {
		for _, checksum := range []bool{false, true} {
			if err := run(4, provider, checksum, false); err != nil {
				t.Fatalf("provider %q checksum %v: %v", provider, checksum, err)
			}
		}
	}
}

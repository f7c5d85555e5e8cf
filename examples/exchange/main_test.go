package main

import (
	"io"
	"log/slog"
	"os"
	"testing"
)

func TestMain(m *testing.M) {
	// The test binary stands in for the program when it re-executes itself
	// as the sending peer.
	if os.Getenv(envRole) == "sender" {
		if err := runSender(slog.New(slog.NewTextHandler(io.Discard, nil))); err != nil {
			os.Stderr.WriteString("exchange sender: " + err.Error() + "\n")
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// The program's job, short: two processes, every tensor of the stream
// checked byte for byte, with and without checksum mode, on each provider
// this host has.
func TestExchange(t *testing.T) {
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	for _, provider := range []string{"", "tcp"} {
		for _, checksum := range []bool{false, true} {
			if err := runReceiver(log, 4, provider, checksum, false); err != nil {
				t.Fatalf("provider %q checksum %v: %v", provider, checksum, err)
			}
		}
	}
}

package gdr

import (
	"errors"
	"testing"

	"github.com/gdrlink/gdrlink/internal/sysfs"
)

// Each decoder of outside input is fuzzed: it must return a value or an
// error wrapping its sentinel, never panic, and what it returns must be
// consistent.

func FuzzParseLevel(f *testing.F) {
	f.Add("PIX")
	f.Add("3")
	f.Add("?")
	f.Fuzz(func(t *testing.T, s string) {
		if _, err := ParseLevel(s); err != nil && !errors.Is(err, errBadLevel) {
			t.Fatal(err)
		}
	})
}

func FuzzParseSnapshotFacts(f *testing.F) {
	f.Add([]byte(`{"version":1,"gpus":{"driver":{"driver_version":"550","cuda_version":"12.4"},"gpus":[{"index":0,"name":"x","pci_bus_id":"3b:00.0","numa_node":0,"bar1_total":null,"bar1_free":null,"persistence_mode":null,"gdr_supported":true,"dmabuf_supported":null,"source":"nvml"}],"topology":[{"a":0,"b":1,"path":"PXB","nvlinks":0}]}}`))
	f.Add([]byte(`{"version":1,"libibverbs_dmabuf":{"status":"not-supported","detail":"x"},"libibverbs":{"status":"not-supported","detail":"x"}}`))
	f.Add([]byte(`{"version":2}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		s, err := parseSnapshotFacts(b)
		if err != nil {
			if !errors.Is(err, sysfs.ErrMalformed) {
				t.Fatal(err)
			}
			return
		}
		if s.Version != snapshotFactsVersion {
			t.Fatalf("version %d accepted", s.Version)
		}
	})
}

package proxy

import (
	"errors"
	"testing"

	"github.com/gdrlink/gdrlink/internal/cuda"
)

func TestChooseFlush(t *testing.T) {
	ampere := &gpuDirectFacts{ComputeCapability: 80}
	ampereHost := &gpuDirectFacts{ComputeCapability: 80, HostFlush: true}
	hopper := &gpuDirectFacts{ComputeCapability: 90, HostFlush: true}
	grace := &gpuDirectFacts{ComputeCapability: 90, C2C: true}
	cases := []struct {
		name    string
		mode    flushMode
		ordered bool
		facts   *gpuDirectFacts
		reader  bool
		want    flushMethod
		fails   bool
	}{
		{"off never flushes", flushOff, false, ampere, false, flushNone, false},
		{"auto, caller says ordered", flushAuto, true, ampere, false, flushNone, false},
		{"auto, 9.0 orders writes", flushAuto, false, hopper, false, flushNone, false},
		{"auto, below 9.0 with host flush", flushAuto, false, ampereHost, true, flushByDriver, false},
		{"auto, below 9.0, loopback read", flushAuto, false, ampere, true, flushByRead, false},
		{"auto, below 9.0, no way to flush", flushAuto, false, ampere, false, flushNone, true},
		{"auto, C2C flushes on 9.0", flushAuto, false, grace, true, flushByRead, false},
		{"auto, no facts, loopback read", flushAuto, false, nil, true, flushByRead, false},
		{"auto, no facts, no reader", flushAuto, false, nil, false, flushNone, true},
		{"on flushes even when ordered", flushOn, true, hopper, false, flushByDriver, false},
		{"on without a way fails", flushOn, true, grace, false, flushNone, true},
	}
	for _, c := range cases {
		got, err := chooseFlush(c.mode, c.ordered, c.facts, c.reader)
		if c.fails {
			if !errors.Is(err, ErrCopyFailed) {
				t.Errorf("%s: %v, %v; want ErrCopyFailed", c.name, got, err)
			}
			continue
		}
		if err != nil || got != c.want {
			t.Errorf("%s: %v, %v; want %v", c.name, got, err, c.want)
		}
	}
}

// TestGPUDirectFactsOfC2C: NVML's C2C answer reaches the flush choice, so
// a Grace Hopper GPU (compute capability 9.0 over C2C) flushes, through the
// driver where it can, while the same GPU on PCIe does not.
func TestGPUDirectFactsOfC2C(t *testing.T) {
	f := cuda.Facts{ComputeCapability: 90, FlushWritesOptions: flushWritesOptionHost}
	for _, c := range []struct {
		c2c  bool
		want flushMethod
	}{{false, flushNone}, {true, flushByDriver}} {
		facts := gpuDirectFactsOf(f, c.c2c)
		if facts.C2C != c.c2c || !facts.HostFlush || facts.ComputeCapability != 90 {
			t.Fatalf("C2C %v: facts %+v", c.c2c, facts)
		}
		got, err := chooseFlush(flushAuto, false, &facts, false)
		if err != nil || got != c.want {
			t.Errorf("C2C %v: flush %v, %v; want %v", c.c2c, got, err, c.want)
		}
	}
}

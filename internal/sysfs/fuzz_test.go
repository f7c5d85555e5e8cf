package sysfs

import (
	"errors"
	"testing"
)

// Each decoder of outside input is fuzzed: it must return a value or an
// error wrapping its sentinel, never panic, and what it returns must be
// consistent.

func FuzzParsePCIPath(f *testing.F) {
	f.Add("../../../devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0")
	f.Add("../../devices/pci0000:00/0000:00:01.0/0000:06:00.0/infiniband/mlx5_0")
	f.Add("/sys/devices/VMBUS:00/x/pci7870:00/7870:00:00.0")
	f.Fuzz(func(t *testing.T, s string) {
		p, err := ParsePCIPath(s)
		if err != nil {
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("error %v does not wrap ErrMalformed", err)
			}
			return
		}
		if p.Device == "" || p.HostBridge == "" {
			t.Fatalf("%q: incomplete %+v", s, p)
		}
		for _, a := range append(p.Bridges, p.Device) {
			if c, err := ParsePCIAddress(a); err != nil || c != a {
				t.Fatalf("%q: non-canonical address %q", s, a)
			}
		}
	})
}

func FuzzParsePCIAddress(f *testing.F) {
	f.Add("0000:3b:00.0")
	f.Add("00000000:3B:00.0")
	f.Fuzz(func(t *testing.T, s string) {
		a, err := ParsePCIAddress(s)
		if err != nil {
			if !errors.Is(err, ErrBadPCIAddress) {
				t.Fatal(err)
			}
			return
		}
		if b, err := ParsePCIAddress(a); err != nil || b != a {
			t.Fatalf("%q -> %q -> %q, %v: not idempotent", s, a, b, err)
		}
	})
}

func FuzzParseACS(f *testing.F) {
	f.Add(acsConfig(4096, [2]uint16{0x0001, 0}, [2]uint16{0x000d, 0x001d}))
	f.Add(make([]byte, 256))
	f.Fuzz(func(t *testing.T, b []byte) {
		a, err := ParseACS(b)
		if err != nil {
			if !errors.Is(err, ErrMalformed) && !errors.Is(err, ErrNotSupported) {
				t.Fatal(err)
			}
			return
		}
		if a != nil && (a.Offset < 0x100 || a.Offset+8 > len(b)) {
			t.Fatalf("capability at %#x in %d bytes", a.Offset, len(b))
		}
	})
}

func FuzzParseLimits(f *testing.F) {
	f.Add("Limit                     Soft Limit           Hard Limit           Units     \nMax locked memory         65536                unlimited            bytes     \n")
	f.Fuzz(func(t *testing.T, s string) {
		m, err := ParseLimits(s)
		if err != nil {
			if !errors.Is(err, ErrMalformed) {
				t.Fatal(err)
			}
			return
		}
		for k, l := range m {
			if l.Soft < Unlimited || l.Hard < Unlimited {
				t.Fatalf("%q: negative limit %+v", k, l)
			}
		}
	})
}

func FuzzParseMeminfo(f *testing.F) {
	f.Add("HugePages_Total:     16\nHugepagesize:       2048 kB\n")
	f.Fuzz(func(t *testing.T, s string) {
		if _, err := ParseMeminfo(s); err != nil && !errors.Is(err, ErrMalformed) {
			t.Fatal(err)
		}
	})
}

func FuzzParseSmall(f *testing.F) {
	f.Add("4: ACTIVE")
	f.Add("100 Gb/sec (4X EDR)")
	f.Add("0-27,56-83")
	f.Add("6.1.0-56-amd64")
	f.Fuzz(func(t *testing.T, s string) {
		for _, err := range []error{
			func() error { _, _, err := ParsePortState(s); return err }(),
			func() error { _, err := ParseRate(s); return err }(),
			func() error { _, err := ParseCPUList(s); return err }(),
			func() error { _, _, err := ParseKernelRelease(s); return err }(),
		} {
			if err != nil && !errors.Is(err, ErrMalformed) {
				t.Fatal(err)
			}
		}
		_ = ParseModules(s)
		_ = ParseKernelConfig(s, "CONFIG_DMA_SHARED_BUFFER")
	})
}

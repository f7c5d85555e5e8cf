package main

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestCopyBuffers(t *testing.T) {
	const size = 4 << 20
	for _, huge := range []bool{false, true} {
		b, err := newCopyBuffers(size, huge)
		if err != nil {
			t.Fatal(err)
		}
		if len(b.src.b) != size || len(b.dst.b) != size {
			t.Fatalf("buffers of %d and %d bytes", len(b.src.b), len(b.dst.b))
		}
		gbs, err := b.measure(context.Background(), 1<<20, 1)
		if err != nil || !(gbs > 0) {
			t.Fatalf("measure = %v, %v", gbs, err)
		}
		// The copy really happened: the destination holds the pattern.
		i := 12345
		if b.dst.b[size-1] != b.src.b[size-1] || b.dst.b[i] != byte(i%4096*7+1) {
			t.Fatalf("destination not copied")
		}
		if _, err := b.measure(context.Background(), 2*size, 1); err == nil {
			t.Fatal("a copy larger than the buffers was measured")
		}
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		if _, err := b.measure(ctx, 1<<20, 1); !errors.Is(err, context.Canceled) {
			t.Fatalf("measure with a cancelled context = %v", err)
		}
		if huge, err := b.hugeBytes("/proc"); err != nil || huge < 0 || huge > 2*size {
			t.Fatalf("hugeBytes = %d, %v", huge, err)
		} else if !b.huge && huge != 0 {
			t.Errorf("MADV_NOHUGEPAGE buffers have %d bytes of huge pages", huge)
		}
		if err := b.Close(); err != nil {
			t.Fatal(err)
		}
		if err := b.Close(); err != nil {
			t.Fatalf("second Close = %v", err)
		}
		if _, err := b.measure(context.Background(), 1<<20, 1); err == nil {
			t.Fatal("measure after Close succeeded")
		}
	}
	if _, err := newCopyBuffers(0, false); err == nil {
		t.Fatal("empty buffers")
	}
}

func TestAnonHugeBytes(t *testing.T) {
	const smaps = `7f0000000000-7f0000200000 rw-p 00000000 00:00 0
Size:               2048 kB
AnonHugePages:         0 kB
7f0000200000-7f0000600000 rw-p 00000000 00:00 0
Size:               4096 kB
AnonHugePages:      4096 kB
THPeligible:        1
7f0000600000-7f0000800000 rw-p 00000000 00:00 0
AnonHugePages:      2048 kB
7f0001000000-7f0001200000 rw-p 00000000 00:00 0
AnonHugePages:      1024 kB
`
	got, err := anonHugeBytes(strings.NewReader(smaps), [][2]uint64{{0x7f0000200000, 0x7f0000600000}, {0x7f0001000000, 0x7f0001200000}})
	if err != nil || got != 5<<20 {
		t.Fatalf("anonHugeBytes = %d, %v; want %d", got, err, 5<<20)
	}
	// A range no mapping covers is an error, not zero.
	if _, err := anonHugeBytes(strings.NewReader(smaps), [][2]uint64{{0x7f0002000000, 0x7f0002200000}}); err == nil {
		t.Fatal("uncovered range gave no error")
	}
	if _, err := anonHugeBytes(strings.NewReader("7f0000200000-7f0000600000 rw-p\nAnonHugePages: x kB\n"), [][2]uint64{{0x7f0000200000, 0x7f0000600000}}); err == nil {
		t.Fatal("bad number gave no error")
	}
}

func TestTHPMode(t *testing.T) {
	for in, want := range map[string]string{
		"always [madvise] never\n": "madvise",
		"[always] madvise never":   "always",
		"always madvise [never]":   "never",
		"":                         "unknown",
		"always [":                 "unknown",
	} {
		if got := parseTHPMode(in); got != want {
			t.Errorf("parseTHPMode(%q) = %q, want %q", in, got, want)
		}
	}
	root := t.TempDir()
	if got := thpMode(root); got != "unknown" {
		t.Errorf("thpMode of an empty root = %q", got)
	}
	writeFile(t, filepath.Join(root, "kernel/mm/transparent_hugepage/enabled"), "[always] madvise never\n")
	if got := thpMode(root); got != "always" {
		t.Errorf("thpMode = %q", got)
	}
}

func TestLastLevelCache(t *testing.T) {
	root := t.TempDir()
	if _, err := lastLevelCache(root); err == nil {
		t.Fatal("no cache dir gave no error")
	}
	dir := filepath.Join(root, "devices/system/cpu/cpu0/cache")
	for idx, c := range map[string][3]string{
		"index0": {"1", "Data", "32K"},
		"index1": {"1", "Instruction", "32K"},
		"index2": {"2", "Unified", "1024K"},
		"index3": {"3", "Unified", "32768K"},
		"index4": {"4", "Instruction", "99M"}, // not data: ignored
	} {
		writeFile(t, filepath.Join(dir, idx, "level"), c[0]+"\n")
		writeFile(t, filepath.Join(dir, idx, "type"), c[1]+"\n")
		writeFile(t, filepath.Join(dir, idx, "size"), c[2]+"\n")
	}
	got, err := lastLevelCache(root)
	if err != nil || got != 32<<20 {
		t.Fatalf("lastLevelCache = %d, %v; want 32 MiB", got, err)
	}
	for in, want := range map[string]int64{"32K": 32 << 10, "2M": 2 << 20, "1G": 1 << 30, "512": 512} {
		if got, err := parseCacheSize(in); err != nil || got != want {
			t.Errorf("parseCacheSize(%q) = %d, %v", in, got, err)
		}
	}
	for _, in := range []string{"", "K", "-1K", "abc", "0"} {
		if _, err := parseCacheSize(in); err == nil {
			t.Errorf("parseCacheSize(%q) accepted", in)
		}
	}
}

func TestMemcpyWorkingSetSetting(t *testing.T) {
	code, _, errOut := runBench(t, "-quick", "-scenario", "memcpy", "-set", "memcpy.working-set=64KiB")
	if code != exitFailed || !strings.Contains(errOut, "memcpy.working-set") {
		t.Fatalf("a working set smaller than the largest copy: exit %d, %s", code, errOut)
	}
}

func writeFile(t *testing.T, path, data string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(data), 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestMemcpyWorkingSet(t *testing.T) {
	for _, tc := range []struct{ largest, llc, want int64 }{
		{1 << 20, 32 << 20, 64 << 20},
		{1 << 20, 0, 64 << 20},
		{1 << 20, 96 << 20, 192 << 20},
		{256 << 20, 32 << 20, 256 << 20},
	} {
		if got := memcpyWorkingSet(tc.largest, tc.llc); got != tc.want {
			t.Errorf("memcpyWorkingSet(%d, %d) = %d, want %d", tc.largest, tc.llc, got, tc.want)
		}
	}
}

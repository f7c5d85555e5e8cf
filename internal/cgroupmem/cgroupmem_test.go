package cgroupmem

import (
	"errors"
	"testing"
)

func TestLimit(t *testing.T) {
	for _, tc := range []struct {
		root  string
		want  uint64
		ok    bool
		isErr bool
	}{
		{"testdata/v1-container", 0, false, false}, // the path is not under the mount: its root says no limit
		{"testdata/v1-limited", 8 << 30, true, false},
		{"testdata/v2-parent", 4 << 30, true, false}, // the leaf says max, the pod 4 GiB, the slice 16 GiB
		{"testdata/v2-subtree", 2 << 30, true, false},
		{"testdata/none", 0, false, false},
		{"testdata/missing", 0, false, false}, // no /proc at all
		{"testdata/bad", 0, false, true},
	} {
		t.Run(tc.root, func(t *testing.T) {
			got, ok, err := Limit(tc.root)
			if (err != nil) != tc.isErr || got != tc.want || ok != tc.ok {
				t.Fatalf("Limit = %d, %v, %v; want %d, %v, error %v", got, ok, err, tc.want, tc.ok, tc.isErr)
			}
			if err != nil && !errors.Is(err, ErrMalformed) {
				t.Errorf("error %v does not wrap ErrMalformed", err)
			}
		})
	}
}

func TestThisMachine(t *testing.T) {
	l, ok, err := Limit("/")
	if err != nil {
		t.Fatalf("Limit(/): %v", err)
	}
	t.Logf("this process's memory cgroup limit: %d (limited: %v)", l, ok)
	if ok && l == 0 {
		t.Error("a limit of 0 bytes")
	}
}

func TestParseLimit(t *testing.T) {
	for _, tc := range []struct {
		in      string
		v       uint64
		limited bool
		isErr   bool
	}{
		{"max\n", 0, false, false}, {"8589934592\n", 8 << 30, true, false},
		{"9223372036854771712", 9223372036854771712, false, false}, {"-1", 0, false, true}, {"", 0, false, true},
	} {
		v, lim, err := ParseLimit([]byte(tc.in))
		if v != tc.v || lim != tc.limited || (err != nil) != tc.isErr {
			t.Errorf("ParseLimit(%q) = %d, %v, %v", tc.in, v, lim, err)
		}
	}
}

func TestParseMountinfoEscapes(t *testing.T) {
	ms, err := ParseMountinfo([]byte(`40 25 0:40 / /mnt/with\040space rw - cgroup2 cgroup2 rw` + "\n"))
	if err != nil || len(ms) != 1 || ms[0].Point != "/mnt/with space" || ms[0].FSType != "cgroup2" {
		t.Fatalf("ParseMountinfo = %+v, %v", ms, err)
	}
	if _, err := ParseMountinfo([]byte("garbage\n")); !errors.Is(err, ErrMalformed) {
		t.Errorf("garbage: %v", err)
	}
}

func FuzzParse(f *testing.F) {
	f.Add([]byte("25 20 0:23 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"), []byte("0::/a/b\n"), []byte("max\n"))
	f.Add([]byte("35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"), []byte("4:memory:/x\n0::/\n"), []byte("8589934592"))
	f.Fuzz(func(t *testing.T, mi, cg, lim []byte) {
		if _, err := ParseMountinfo(mi); err != nil && !errors.Is(err, ErrMalformed) {
			t.Fatalf("ParseMountinfo: %v does not wrap ErrMalformed", err)
		}
		if ms, err := ParseCgroup(cg); err != nil && !errors.Is(err, ErrMalformed) {
			t.Fatalf("ParseCgroup: %v does not wrap ErrMalformed", err)
		} else if err == nil {
			for _, p := range ms {
				_ = relative(p, "/x")
			}
		}
		if _, _, err := ParseLimit(lim); err != nil && !errors.Is(err, ErrMalformed) {
			t.Fatalf("ParseLimit: %v does not wrap ErrMalformed", err)
		}
	})
}

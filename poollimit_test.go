package gdrlink

import (
	"context"
	"testing"

	"golang.org/x/sys/unix"
)

func TestDefaultPoolLimit(t *testing.T) {
	for _, tc := range []struct {
		physical uint64
		want     int64
	}{
		{0, 64 << 30},         // unknown
		{1, 64 << 30},         // nonsense: unknown
		{8 << 30, 4 << 30},    // half
		{100 << 30, 50 << 30}, // half
		{128 << 30, 64 << 30}, // the cap
		{2 << 40, 64 << 30},   // the cap
	} {
		if got := poolLimitFor(tc.physical); got != tc.want {
			t.Errorf("poolLimitFor(%d) = %d, want %d", tc.physical, got, tc.want)
		}
	}
	var si unix.Sysinfo_t
	if err := unix.Sysinfo(&si); err != nil {
		t.Fatal(err)
	}
	physical := uint64(si.Totalram) * uint64(max(si.Unit, 1))
	got := defaultPoolLimit()
	t.Logf("physical memory %d bytes: default pool limit %d bytes", physical, got)
	if got != poolLimitFor(physical) || got <= 0 || got > 64<<30 {
		t.Errorf("defaultPoolLimit() = %d on %d bytes of memory, want %d", got, physical, poolLimitFor(physical))
	}
}

// Join caps its pool by default; WithPoolLimit and GDRLINK_POOL_LIMIT
// change the cap, and 0 means the default.
func TestPoolLimitApplied(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name string
		env  string
		opts []Option
		want int64
	}{
		{"default", "", nil, defaultPoolLimit()},
		{"option", "", []Option{WithPoolLimit(1 << 30)}, 1 << 30},
		{"zero", "", []Option{WithPoolLimit(0)}, defaultPoolLimit()},
		{"variable", "3GiB", nil, 3 << 30},
		{"variable zero", "0", nil, defaultPoolLimit()},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv("GDRLINK_POOL_LIMIT", tc.env)
			g, err := Join(ctx, append([]Option{WithRank(0, 1)}, tc.opts...)...)
			if err != nil {
				t.Fatal(err)
			}
			defer func() {
				if err := g.Close(); err != nil {
					t.Error(err)
				}
			}()
			if got := g.Stats().Pool.Limit; got != tc.want {
				t.Errorf("pool limit %d, want %d", got, tc.want)
			}
		})
	}
}

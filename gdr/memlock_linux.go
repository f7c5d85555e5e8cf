package gdr

import "golang.org/x/sys/unix"

// getMemlock returns this process's RLIMIT_MEMLOCK in bytes, unlimited when
// unbounded.
func getMemlock() (soft, hard int64, err error) {
	var r unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_MEMLOCK, &r); err != nil {
		return 0, 0, err
	}
	conv := func(v uint64) int64 {
		if v == unix.RLIM_INFINITY || v > 1<<62 {
			return unlimited
		}
		return int64(v)
	}
	return conv(r.Cur), conv(r.Max), nil
}

//go:build !linux

package gdr

import "fmt"

func getMemlock() (soft, hard int64, err error) {
	return 0, 0, fmt.Errorf("%w: RLIMIT_MEMLOCK on this OS", ErrNotSupported)
}

package proxy

import (
	"fmt"
	"strings"
)

// FlushMode says when a GPUDirect flush runs before the GPU may use data a
// NIC wrote into its memory (GDRLINK_GDR_FLUSH).
type FlushMode int

// Flush modes.
const (
	// FlushAuto flushes after Direct writes unless the GPU reports that it
	// orders RDMA writes before its own reads (WithWritesOrdered).
	FlushAuto FlushMode = iota
	// FlushOn always flushes after Direct writes.
	FlushOn
	// FlushOff never flushes.
	FlushOff
)

// String prints the mode as GDRLINK_GDR_FLUSH spells it.
func (m FlushMode) String() string {
	switch m {
	case FlushAuto:
		return "auto"
	case FlushOn:
		return "1"
	case FlushOff:
		return "0"
	}
	return fmt.Sprintf("FlushMode(%d)", int(m))
}

// ParseFlushMode reads a GDRLINK_GDR_FLUSH value: "0"/"off"/"false",
// "1"/"on"/"true", or "auto" (and "" for auto).
func ParseFlushMode(s string) (FlushMode, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "", "auto":
		return FlushAuto, nil
	case "1", "on", "true", "yes":
		return FlushOn, nil
	case "0", "off", "false", "no":
		return FlushOff, nil
	}
	return FlushAuto, fmt.Errorf("%w: %q (want 0, 1 or auto)", ErrBadFlushSetting, s)
}

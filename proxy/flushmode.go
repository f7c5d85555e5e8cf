package proxy

import (
	"fmt"
	"strings"
)

// flushMode says when a GPUDirect flush runs before the GPU may use data a
// NIC wrote into its memory (GDRLINK_GDR_FLUSH).
type flushMode int

// Flush modes.
const (
	// flushAuto flushes after Direct writes unless the GPU orders RDMA
	// writes before its own reads (WithDirect's writesOrdered).
	flushAuto flushMode = iota
	// flushOn always flushes after Direct writes.
	flushOn
	// flushOff never flushes.
	flushOff
)

// String prints the mode as GDRLINK_GDR_FLUSH spells it.
func (m flushMode) String() string {
	switch m {
	case flushAuto:
		return "auto"
	case flushOn:
		return "1"
	case flushOff:
		return "0"
	}
	return fmt.Sprintf("FlushMode(%d)", int(m))
}

// parseFlushMode reads a GDRLINK_GDR_FLUSH value: "0"/"off"/"false",
// "1"/"on"/"true", or "auto" (and "" for auto).
func parseFlushMode(s string) (flushMode, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "", "auto":
		return flushAuto, nil
	case "1", "on", "true", "yes":
		return flushOn, nil
	case "0", "off", "false", "no":
		return flushOff, nil
	}
	return flushAuto, fmt.Errorf("%w: %q (want 0, 1 or auto)", errBadFlushSetting, s)
}

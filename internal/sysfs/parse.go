package sysfs

import (
	"fmt"
	"strconv"
	"strings"
)

// The parsers below are pure functions of a file's content, so they are
// table-tested and fuzzed apart from the files.

// ParseModules returns the names of the modules listed in /proc/modules.
func ParseModules(text string) map[string]bool {
	out := map[string]bool{}
	for _, line := range strings.Split(text, "\n") {
		f := strings.Fields(line)
		if len(f) > 0 {
			out[f[0]] = true
		}
	}
	return out
}

// Unlimited is the value of a resource limit without a bound.
const Unlimited int64 = -1

// Limit is one row of /proc/<pid>/limits.
type Limit struct {
	// Soft and Hard are in the row's unit, Unlimited when unbounded.
	Soft int64  `json:"soft"`
	Hard int64  `json:"hard"`
	Unit string `json:"unit,omitempty"`
}

// ParseLimits parses /proc/<pid>/limits into rows keyed by name ("Max
// locked memory").
func ParseLimits(text string) (map[string]Limit, error) {
	out := map[string]Limit{}
	lines := strings.Split(text, "\n")
	if len(lines) == 0 || !strings.HasPrefix(lines[0], "Limit") {
		return nil, fmt.Errorf("%w: limits: no header line", ErrMalformed)
	}
	for _, line := range lines[1:] {
		if strings.TrimSpace(line) == "" {
			continue
		}
		// The name column is padded to 26 characters; values follow as
		// fields. Names contain spaces, so split from the right.
		f := strings.Fields(line)
		if len(f) < 3 {
			return nil, fmt.Errorf("%w: limits line %q", ErrMalformed, line)
		}
		n := len(f)
		unit := ""
		softS, hardS := f[n-2], f[n-1]
		if _, err := parseLimitValue(hardS); err != nil {
			if n < 4 {
				return nil, fmt.Errorf("%w: limits line %q", ErrMalformed, line)
			}
			unit, softS, hardS, n = f[n-1], f[n-3], f[n-2], n-1
		}
		soft, err1 := parseLimitValue(softS)
		hard, err2 := parseLimitValue(hardS)
		if err1 != nil || err2 != nil {
			return nil, fmt.Errorf("%w: limits line %q", ErrMalformed, line)
		}
		out[strings.Join(f[:n-2], " ")] = Limit{Soft: soft, Hard: hard, Unit: unit}
	}
	return out, nil
}

func parseLimitValue(s string) (int64, error) {
	if s == "unlimited" {
		return Unlimited, nil
	}
	v, err := strconv.ParseInt(s, 10, 64)
	if err != nil || v < 0 {
		return 0, fmt.Errorf("%w: limit %q", ErrMalformed, s)
	}
	return v, nil
}

// ParseMeminfo parses /proc/meminfo into values keyed by name; values with a
// "kB" unit are converted to bytes, others (HugePages_Total) kept as counts.
func ParseMeminfo(text string) (map[string]uint64, error) {
	out := map[string]uint64{}
	for _, line := range strings.Split(text, "\n") {
		if strings.TrimSpace(line) == "" {
			continue
		}
		name, rest, ok := strings.Cut(line, ":")
		if !ok {
			return nil, fmt.Errorf("%w: meminfo line %q", ErrMalformed, line)
		}
		f := strings.Fields(rest)
		if len(f) == 0 || len(f) > 2 {
			return nil, fmt.Errorf("%w: meminfo line %q", ErrMalformed, line)
		}
		v, err := strconv.ParseUint(f[0], 10, 64)
		if err != nil {
			return nil, fmt.Errorf("%w: meminfo line %q", ErrMalformed, line)
		}
		if len(f) == 2 {
			if f[1] != "kB" || v > 1<<53 {
				return nil, fmt.Errorf("%w: meminfo line %q", ErrMalformed, line)
			}
			v *= 1024
		}
		out[strings.TrimSpace(name)] = v
	}
	return out, nil
}

// ParseKernelRelease returns the major and minor numbers of a kernel
// release ("6.1.0-56-amd64").
func ParseKernelRelease(s string) (major, minor int, err error) {
	s = strings.TrimSpace(s)
	maj, rest, ok := strings.Cut(s, ".")
	if !ok {
		return 0, 0, fmt.Errorf("%w: kernel release %q", ErrMalformed, s)
	}
	end := 0
	for end < len(rest) && rest[end] >= '0' && rest[end] <= '9' {
		end++
	}
	a, err1 := strconv.Atoi(maj)
	b, err2 := strconv.Atoi(rest[:end])
	if err1 != nil || err2 != nil || a < 0 || a > 1000 || b > 1000 {
		return 0, 0, fmt.Errorf("%w: kernel release %q", ErrMalformed, s)
	}
	return a, b, nil
}

// ParseKernelConfig returns the value of key ("CONFIG_DMA_SHARED_BUFFER") in
// a kernel config file: "y", "m", a string, or "" when unset or absent.
func ParseKernelConfig(text, key string) string {
	for _, line := range strings.Split(text, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), key+"="); ok {
			return strings.Trim(v, `"`)
		}
	}
	return ""
}

// ParsePortState parses an InfiniBand port's state or phys_state file
// ("4: ACTIVE", "5: LinkUp") into its code and name.
func ParsePortState(s string) (int, string, error) {
	c, name, ok := strings.Cut(strings.TrimSpace(s), ":")
	n, err := strconv.Atoi(strings.TrimSpace(c))
	if !ok || err != nil || n < 0 || n > 255 {
		return 0, "", fmt.Errorf("%w: port state %q", ErrMalformed, s)
	}
	return n, strings.TrimSpace(name), nil
}

// ParseRate parses an InfiniBand port's rate ("100 Gb/sec (4X EDR)",
// "2.5 Gb/sec (1X SDR)") into Gb/s.
func ParseRate(s string) (float64, error) {
	f := strings.Fields(s)
	if len(f) < 2 || f[1] != "Gb/sec" {
		return 0, fmt.Errorf("%w: rate %q", ErrMalformed, s)
	}
	v, err := strconv.ParseFloat(f[0], 64)
	if err != nil || v < 0 || v > 1e6 {
		return 0, fmt.Errorf("%w: rate %q", ErrMalformed, s)
	}
	return v, nil
}

// RoCEActiveMTU is the RDMA path MTU a RoCE port gets from its network
// device's MTU, as the kernel computes it: the netdev MTU less the RoCE
// headers (GRH, UDP, BTH, the largest extended headers and the ICRC, 96
// bytes), rounded down to 256, 512, 1024, 2048 or 4096; 0 when too small.
func RoCEActiveMTU(netdevMTU int) int {
	m := netdevMTU - (40 + 8 + 12 + 4 + 28 + 4)
	for _, v := range []int{4096, 2048, 1024, 512, 256} {
		if m >= v {
			return v
		}
	}
	return 0
}

// ParseCPUList counts the CPUs in a list such as "0-27,56-83".
func ParseCPUList(s string) (int, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return 0, nil
	}
	n := 0
	for _, part := range strings.Split(s, ",") {
		lo, hi, isRange := strings.Cut(part, "-")
		a, err := strconv.Atoi(lo)
		if err != nil || a < 0 {
			return 0, fmt.Errorf("%w: cpu list %q", ErrMalformed, s)
		}
		b := a
		if isRange {
			if b, err = strconv.Atoi(hi); err != nil || b < a || b-a > 1<<20 {
				return 0, fmt.Errorf("%w: cpu list %q", ErrMalformed, s)
			}
		}
		n += b - a + 1
		if n > 1<<22 {
			return 0, fmt.Errorf("%w: cpu list %q", ErrMalformed, s)
		}
	}
	return n, nil
}

package gdr

import (
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/gdrlink/gdrlink/internal/sysfs"
)

// PathType is how far apart two PCI devices are, as `nvidia-smi topo -m`
// prints it. The order is meaningful: a larger value is a longer path.
type PathType uint8

// Path types, nearest first.
const (
	// PathUnknown: the path could not be determined.
	PathUnknown PathType = iota
	// PathLOC is the device itself. As a policy level it means "never
	// Direct".
	PathLOC
	// PathPIX: through at most one PCIe switch (bridge), no host bridge.
	PathPIX
	// PathPXB: through several PCIe switches, no host bridge.
	PathPXB
	// PathPHB: through one PCIe host bridge (root complex).
	PathPHB
	// PathNODE: across PCIe host bridges within one NUMA node.
	PathNODE
	// PathSYS: across the interconnect between NUMA nodes (QPI/UPI, xGMI).
	PathSYS
)

var pathNames = [...]string{"?", "LOC", "PIX", "PXB", "PHB", "NODE", "SYS"}

// String returns the nvidia-smi name ("PIX"), or "?" for PathUnknown.
func (p PathType) String() string {
	if int(p) < len(pathNames) {
		return pathNames[p]
	}
	return fmt.Sprintf("PathType(%d)", uint8(p))
}

// MarshalText writes the name.
func (p PathType) MarshalText() ([]byte, error) { return []byte(p.String()), nil }

// UnmarshalText reads a name or "?".
func (p *PathType) UnmarshalText(b []byte) error {
	if string(b) == "?" {
		*p = PathUnknown
		return nil
	}
	v, err := ParseLevel(string(b))
	if err != nil {
		return err
	}
	*p = v
	return nil
}

// ParseLevel reads a policy level as PolicyFromEnv reads EnvLevel, for a
// program that takes the level from elsewhere (a flag, a configuration
// file): a name (LOC, PIX, PXB, PHB, NODE, SYS, any case) or one of
// NCCL_NET_GDR_LEVEL's legacy integers (0 LOC, 1 PIX, 2 PXB, 3 PHB, 4 and 5
// SYS). NCCL has no NODE level: its PHB covers both PHB and NODE paths, so a
// policy written "3" allows up to PHB here and one wanting NCCL's behaviour
// across host bridges of a socket says NODE.
func ParseLevel(s string) (PathType, error) {
	t := strings.ToUpper(strings.TrimSpace(s))
	for i := PathLOC; i <= PathSYS; i++ {
		if pathNames[i] == t {
			return i, nil
		}
	}
	if n, err := strconv.Atoi(t); err == nil {
		switch n {
		case 0:
			return PathLOC, nil
		case 1:
			return PathPIX, nil
		case 2:
			return PathPXB, nil
		case 3:
			return PathPHB, nil
		case 4, 5:
			return PathSYS, nil
		}
	}
	return PathUnknown, fmt.Errorf("%w: %q (want LOC, PIX, PXB, PHB, NODE, SYS or 0..5)", errBadLevel, s)
}

// EnvLevel is the environment variable that overrides the policy level
// (PolicyFromEnv).
const EnvLevel = "GDRLINK_NET_GDR_LEVEL"

// Policy is the user's say in the decision.
type Policy struct {
	// Level is the farthest path over which Direct is allowed (default PXB).
	Level PathType `json:"level"`
	// LevelSource says where Level came from ("default", "option",
	// "env GDRLINK_NET_GDR_LEVEL").
	LevelSource string `json:"level_source"`
}

// defaultPolicy is Direct up to PXB, as NCCL's default.
func defaultPolicy() Policy { return Policy{Level: PathPXB, LevelSource: "default"} }

// PolicyFromEnv returns the default policy, Direct up to PXB as NCCL's
// default, overridden by GDRLINK_NET_GDR_LEVEL: a path type name (LOC, PIX,
// PXB, PHB, NODE, SYS, any case) or one of NCCL_NET_GDR_LEVEL's integers (0
// LOC, 1 PIX, 2 PXB, 3 PHB, 4 and 5 SYS). A value that is neither fails.
func PolicyFromEnv() (Policy, error) { return policyFromLookup(os.LookupEnv) }

func policyFromLookup(lookup func(string) (string, bool)) (Policy, error) {
	p := defaultPolicy()
	v, ok := lookup(EnvLevel)
	if !ok || v == "" {
		return p, nil
	}
	l, err := ParseLevel(v)
	if err != nil {
		return p, fmt.Errorf("%s: %w", EnvLevel, err)
	}
	p.Level, p.LevelSource = l, "env "+EnvLevel
	return p, nil
}

// pathTypeOf is the path type of a name as String writes it ("?" and any
// unknown name are PathUnknown).
func pathTypeOf(name string) PathType {
	for i, n := range pathNames {
		if n == name {
			return PathType(i)
		}
	}
	return PathUnknown
}

// classifyPath is sysfs.ClassifyPath's path type.
func classifyPath(a, b sysfs.PCIPath, numaA, numaB *int, numaNodes int) PathType {
	name, _ := sysfs.ClassifyPath(a, b, numaA, numaB, numaNodes)
	return pathTypeOf(name)
}

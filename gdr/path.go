package gdr

import (
	"fmt"
	"os"
	"strconv"
	"strings"
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

// ParseLevel reads a policy level: a name (LOC, PIX, PXB, PHB, NODE, SYS,
// any case) or one of NCCL_NET_GDR_LEVEL's legacy integers (0 LOC, 1 PIX,
// 2 PXB, 3 PHB, 4 and 5 SYS). NCCL has no NODE level: its PHB covers both
// PHB and NODE paths, so a policy written "3" allows up to PHB here and one
// wanting NCCL's behaviour across host bridges of a socket says NODE.
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
	return PathUnknown, fmt.Errorf("%w: %q (want LOC, PIX, PXB, PHB, NODE, SYS or 0..5)", ErrBadLevel, s)
}

// EnvLevel is the environment variable that overrides the policy level.
const EnvLevel = "GDRLINK_NET_GDR_LEVEL"

// Policy is the user's say in the decision.
type Policy struct {
	// Level is the farthest path over which Direct is allowed (default PXB).
	Level PathType `json:"level"`
	// LevelSource says where Level came from ("default", "option",
	// "env GDRLINK_NET_GDR_LEVEL").
	LevelSource string `json:"level_source"`
}

// DefaultPolicy is Direct up to PXB, as NCCL's default.
func DefaultPolicy() Policy { return Policy{Level: PathPXB, LevelSource: "default"} }

// PolicyFromEnv returns DefaultPolicy overridden by GDRLINK_NET_GDR_LEVEL.
func PolicyFromEnv() (Policy, error) { return policyFromLookup(os.LookupEnv) }

func policyFromLookup(lookup func(string) (string, bool)) (Policy, error) {
	p := DefaultPolicy()
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

// ClassifyPath tells how far apart two devices are from their PCI paths and
// NUMA nodes (nil when unknown). numaNodes is how many NUMA nodes the
// machine has (0 when unknown). It returns the path type and one sentence
// saying why.
//
// Below a common bridge, the devices are PIX apart when each is at most two
// levels under it (its own downstream port, then the shared upstream port:
// one switch), PXB otherwise. Under one host bridge without a common bridge
// they are PHB apart; under different host bridges NODE when both are on the
// same NUMA node, SYS when on different ones.
func ClassifyPath(a, b PCIPath, numaA, numaB *int, numaNodes int) (PathType, string) {
	if a.Device == "" || b.Device == "" {
		return PathUnknown, "no PCI location for one of the devices"
	}
	if a.Device == b.Device {
		return PathLOC, "same device"
	}
	if a.HostBridge != b.HostBridge {
		switch {
		case numaA != nil && numaB != nil && *numaA == *numaB:
			return PathNODE, fmt.Sprintf("different host bridges (%s, %s) on NUMA node %d", a.HostBridge, b.HostBridge, *numaA)
		case numaA != nil && numaB != nil:
			return PathSYS, fmt.Sprintf("different NUMA nodes (%d, %d): traffic crosses the inter-socket link", *numaA, *numaB)
		case numaNodes == 1:
			return PathNODE, fmt.Sprintf("different host bridges (%s, %s) on a single-NUMA-node machine", a.HostBridge, b.HostBridge)
		default:
			return PathSYS, fmt.Sprintf("different host bridges (%s, %s) and no NUMA affinity to tell they share a socket", a.HostBridge, b.HostBridge)
		}
	}
	ca := append(append([]string{}, a.Bridges...), a.Device)
	cb := append(append([]string{}, b.Bridges...), b.Device)
	k := 0
	for k < len(a.Bridges) && k < len(b.Bridges) && a.Bridges[k] == b.Bridges[k] {
		k++
	}
	if k == 0 {
		return PathPHB, fmt.Sprintf("no common PCIe bridge below host bridge %s", a.HostBridge)
	}
	common := a.Bridges[k-1]
	if len(ca)-k <= 2 && len(cb)-k <= 2 {
		return PathPIX, fmt.Sprintf("share the PCIe switch at %s", common)
	}
	return PathPXB, fmt.Sprintf("meet at PCIe bridge %s through more than one switch", common)
}

// BridgesBetween lists the bridges a peer transfer between two devices under
// one host bridge passes: each side's bridges below their deepest common
// bridge, and that common bridge. It is empty when the devices do not share
// a bridge.
func BridgesBetween(a, b PCIPath) []string {
	if a.HostBridge != b.HostBridge {
		return nil
	}
	k := 0
	for k < len(a.Bridges) && k < len(b.Bridges) && a.Bridges[k] == b.Bridges[k] {
		k++
	}
	if k == 0 {
		return nil
	}
	out := []string{a.Bridges[k-1]}
	out = append(out, a.Bridges[k:]...)
	out = append(out, b.Bridges[k:]...)
	return out
}

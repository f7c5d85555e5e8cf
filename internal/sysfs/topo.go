package sysfs

import "fmt"

// ClassifyPath tells how far apart two devices are from their PCI paths and
// NUMA nodes (nil when unknown). numaNodes is how many NUMA nodes the
// machine has (0 when unknown). It returns the path type as `nvidia-smi topo
// -m` names it (LOC, PIX, PXB, PHB, NODE, SYS, or "?" when it cannot tell)
// and one sentence saying why.
//
// Below a common bridge, the devices are PIX apart when each is at most two
// levels under it (its own downstream port, then the shared upstream port:
// one switch), PXB otherwise. Under one host bridge without a common bridge
// they are PHB apart; under different host bridges NODE when both are on the
// same NUMA node, SYS when on different ones.
func ClassifyPath(a, b PCIPath, numaA, numaB *int, numaNodes int) (string, string) {
	if a.Device == "" || b.Device == "" {
		return "?", "no PCI location for one of the devices"
	}
	if a.Device == b.Device {
		return "LOC", "same device"
	}
	if a.HostBridge != b.HostBridge {
		switch {
		case numaA != nil && numaB != nil && *numaA == *numaB:
			return "NODE", fmt.Sprintf("different host bridges (%s, %s) on NUMA node %d", a.HostBridge, b.HostBridge, *numaA)
		case numaA != nil && numaB != nil:
			return "SYS", fmt.Sprintf("different NUMA nodes (%d, %d): traffic crosses the inter-socket link", *numaA, *numaB)
		case numaNodes == 1:
			return "NODE", fmt.Sprintf("different host bridges (%s, %s) on a single-NUMA-node machine", a.HostBridge, b.HostBridge)
		default:
			return "SYS", fmt.Sprintf("different host bridges (%s, %s) and no NUMA affinity to tell they share a socket", a.HostBridge, b.HostBridge)
		}
	}
	ca := append(append([]string{}, a.Bridges...), a.Device)
	cb := append(append([]string{}, b.Bridges...), b.Device)
	k := 0
	for k < len(a.Bridges) && k < len(b.Bridges) && a.Bridges[k] == b.Bridges[k] {
		k++
	}
	if k == 0 {
		return "PHB", fmt.Sprintf("no common PCIe bridge below host bridge %s", a.HostBridge)
	}
	common := a.Bridges[k-1]
	if len(ca)-k <= 2 && len(cb)-k <= 2 {
		return "PIX", fmt.Sprintf("share the PCIe switch at %s", common)
	}
	return "PXB", fmt.Sprintf("meet at PCIe bridge %s through more than one switch", common)
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

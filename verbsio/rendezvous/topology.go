package rendezvous

import (
	"fmt"

	"github.com/gdrlink/gdrlink/verbsio"
)

// Closest picks, among a provider's devices, the one nearest to memory on
// NUMA node memNode (-1: unknown): a device on the same node first, then one
// whose node is unknown, then any; ties keep the provider's order. It says
// why in reason, so the choice is never silent. No devices is an error
// wrapping verbsio.ErrNoDevice.
func Closest(devs []verbsio.DeviceInfo, memNode int) (dev verbsio.DeviceInfo, reason string, err error) {
	if len(devs) == 0 {
		return dev, "", fmt.Errorf("%w: no device to choose from", verbsio.ErrNoDevice)
	}
	if len(devs) == 1 {
		return devs[0], "the only device", nil
	}
	if memNode >= 0 {
		for _, d := range devs {
			if d.NUMANode == memNode {
				return d, fmt.Sprintf("on the memory's NUMA node %d", memNode), nil
			}
		}
		for _, d := range devs {
			if d.NUMANode < 0 {
				return d, fmt.Sprintf("no device on NUMA node %d; %s's node is unknown", memNode, d.Name), nil
			}
		}
		return devs[0], fmt.Sprintf("no device on NUMA node %d; first of %d on other nodes", memNode, len(devs)), nil
	}
	return devs[0], fmt.Sprintf("the memory's NUMA node is unknown; first of %d devices", len(devs)), nil
}

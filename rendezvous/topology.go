package rendezvous

import (
	"fmt"
	"strings"

	"github.com/gdrlink/gdrlink/gdr"
	"github.com/gdrlink/gdrlink/verbsio"
)

// Choosing the device a channel is made on is its maker's job (the front
// door's per-peer choice of provider and device); these two helpers are for
// it and are not part of the channel's API.

// closest picks, among a provider's devices, the one nearest to memory on
// NUMA node memNode (-1: unknown): a device on the same node first, then one
// whose node is unknown, then any; ties keep the provider's order. It says
// why in reason, so the choice is never silent. No devices is an error
// wrapping verbsio.ErrNoDevice.
func closest(devs []verbsio.DeviceInfo, memNode int) (dev verbsio.DeviceInfo, reason string, err error) {
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

// forGPU picks the device for tensors of a GPU from gdr's decision for that
// GPU (gdr.DecideGPU: GPUDirect first, then the shortest PCIe path, then the
// GPU's NUMA node). When gdr chose no device of this provider it falls back
// to closest with the GPU's NUMA node, and says so.
func forGPU(devs []verbsio.DeviceInfo, d gdr.Decision, gpuNUMA int) (dev verbsio.DeviceInfo, reason string, err error) {
	if d.NIC != "" && d.Mode != gdr.Unavailable {
		for _, x := range devs {
			if x.Name == d.NIC {
				return x, fmt.Sprintf("gdr: %s for GPU %d over a %s path (%s)", d.Mode, d.GPU, d.PathType, strings.Join(d.Reasons, "; ")), nil
			}
		}
	}
	dev, why, err := closest(devs, gpuNUMA)
	if err != nil {
		return dev, "", err
	}
	if d.NIC == "" || d.Mode == gdr.Unavailable {
		return dev, fmt.Sprintf("gdr found no RDMA path for GPU %d; %s", d.GPU, why), nil
	}
	return dev, fmt.Sprintf("gdr chose %s for GPU %d, which this provider does not have; %s", d.NIC, d.GPU, why), nil
}

package gdr_test

import (
	"context"
	"fmt"

	"github.com/gdrlink/gdrlink/gdr"
)

// Collect the facts of a node (here a fixture tree of a two-socket server
// whose only NIC sits on the other socket) and decide for each GPU.
func Example() {
	facts, err := gdr.Collect(context.Background(), gdr.CollectOptions{Root: "testdata/nodes/two-socket"})
	if err != nil {
		fmt.Println(err)
		return
	}
	// Direct up to PXB, NCCL's default (PolicyFromEnv without
	// GDRLINK_NET_GDR_LEVEL).
	policy := gdr.Policy{Level: gdr.PathPXB, LevelSource: "default"}
	for _, g := range facts.GPUs {
		d := gdr.DecideGPU(facts, g.Index, policy)
		fmt.Printf("GPU%d: %s through %s (%s)\n", g.Index, d.Mode, d.NIC, d.PathType)
		fmt.Println("  fix:", d.Fixes[0])
	}
	// Output:
	// GPU0: proxy through mlx5_0 (SYS)
	//   fix: the NIC is on the other socket (GPU0 on NUMA node 0, mlx5_0 on 1): use a NIC on the GPU's socket, or place the GPU's work there
	// GPU1: proxy through mlx5_0 (SYS)
	//   fix: the NIC is on the other socket (GPU1 on NUMA node 0, mlx5_0 on 1): use a NIC on the GPU's socket, or place the GPU's work there
}

// DecideGPU is pure: facts and a policy in, a verdict with reasons out.
func ExampleDecideGPU() {
	available := func(detail string) gdr.Check { return gdr.Check{Status: gdr.StatusAvailable, Detail: detail} }
	facts := &gdr.Facts{
		GPUs:    []gdr.GPUFacts{{Index: 0, PCIBusID: "0000:3b:00.0"}},
		NICs:    []gdr.NICFacts{{Name: "mlx5_0", Ports: []gdr.PortFacts{{Port: 1, State: "ACTIVE"}}}},
		Pairs:   []gdr.PairPath{{GPU: 0, NIC: "mlx5_0", Path: gdr.PathPHB, Detail: "no common PCIe bridge below host bridge pci0000:3a"}},
		Verbs:   available("libibverbs.so.1 at /usr/lib64/libibverbs.so.1"),
		PeerMem: available("nvidia_peermem is loaded"),
		Memlock: gdr.MemlockFacts{Check: available("getrlimit"), Soft: -1},
	}
	var level gdr.PathType
	_ = level.UnmarshalText([]byte("PHB"))
	fmt.Println(gdr.DecideGPU(facts, 0, gdr.Policy{Level: gdr.PathPXB}).Mode, gdr.DecideGPU(facts, 0, gdr.Policy{Level: level}).Mode)
	// Output: proxy direct
}

// A process knows its GPU by its CUDA ordinal, which CUDA_VISIBLE_DEVICES
// renumbers; its PCI bus id (cuDeviceGetPCIBusId) names the same GPU in
// every process and in Facts.
func ExampleDecideGPUByBusID() {
	available := func(detail string) gdr.Check { return gdr.Check{Status: gdr.StatusAvailable, Detail: detail} }
	facts := &gdr.Facts{
		GPUs: []gdr.GPUFacts{{Index: 0, PCIBusID: "0000:1a:00.0"}, {Index: 1, PCIBusID: "0000:9c:00.0"}},
		NICs: []gdr.NICFacts{{Name: "mlx5_0", Ports: []gdr.PortFacts{{Port: 1, State: "ACTIVE"}}}},
		Pairs: []gdr.PairPath{
			{GPU: 0, NIC: "mlx5_0", Path: gdr.PathSYS, Detail: "across the sockets"},
			{GPU: 1, NIC: "mlx5_0", Path: gdr.PathPIX, Detail: "one PCIe switch"},
		},
		Verbs:   available("libibverbs.so.1 at /usr/lib64/libibverbs.so.1"),
		PeerMem: available("nvidia_peermem is loaded"),
		Memlock: gdr.MemlockFacts{Check: available("getrlimit"), Soft: -1},
	}
	// CUDA ordinal 0 under CUDA_VISIBLE_DEVICES=1 is the GPU at 9C:00.0.
	d := gdr.DecideGPUByBusID(facts, "0000:9C:00.0", gdr.Policy{Level: gdr.PathPXB})
	fmt.Println(d.GPU, d.Mode)
	fmt.Println(gdr.DecideGPU(facts, 0, gdr.Policy{Level: gdr.PathPXB}).Mode)
	// Output:
	// 1 direct
	// proxy
}

package gdr_test

import (
	"context"
	"fmt"

	"github.com/gdrlink/gdrlink/gdr"
)

// Collect the facts of a node (here a fixture tree of a two-socket server
// whose only NIC sits on the other socket) and decide for each GPU.
func Example() {
	root, err := gdr.OpenRoot("testdata/nodes/two-socket")
	if err != nil {
		fmt.Println(err)
		return
	}
	defer root.Close()
	facts, err := gdr.Collect(context.Background(), root, gdr.CollectOptions{})
	if err != nil {
		fmt.Println(err)
		return
	}
	for _, g := range facts.GPUs {
		d := gdr.DecideGPU(facts, g.Index, gdr.DefaultPolicy())
		fmt.Printf("GPU%d: %s through %s (%s)\n", g.Index, d.Mode, d.NIC, d.PathType)
		fmt.Println("  fix:", d.Fixes[0])
	}
	// Output:
	// GPU0: proxy through mlx5_0 (SYS)
	//   fix: the NIC is on the other socket (GPU0 on NUMA node 0, mlx5_0 on 1): use a NIC on the GPU's socket, or place the GPU's work there
	// GPU1: proxy through mlx5_0 (SYS)
	//   fix: the NIC is on the other socket (GPU1 on NUMA node 0, mlx5_0 on 1): use a NIC on the GPU's socket, or place the GPU's work there
}

// Decide is pure: facts and a policy in, a verdict with reasons out.
func ExampleDecide() {
	up := []gdr.PortFacts{{Port: 1, State: "ACTIVE"}}
	pf := gdr.PairFacts{
		GPU:     gdr.GPUFacts{Index: 0, PCIBusID: "0000:3b:00.0"},
		NIC:     gdr.NICFacts{Name: "mlx5_0", Ports: up},
		Path:    gdr.PairPath{Path: gdr.PathPHB, Detail: "no common PCIe bridge below host bridge pci0000:3a"},
		PeerMem: gdr.Available("nvidia_peermem is loaded"),
		Memlock: gdr.MemlockFacts{Check: gdr.Available("getrlimit"), Soft: gdr.Unlimited},
	}
	level, _ := gdr.ParseLevel("PHB")
	fmt.Println(gdr.Decide(pf, gdr.DefaultPolicy()).Mode, gdr.Decide(pf, gdr.Policy{Level: level}).Mode)
	// Output: proxy direct
}

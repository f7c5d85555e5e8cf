// Command gdrcheck tells whether a node can move tensors with GPUDirect
// RDMA, and if not, why and how to fix it.
//
// It inventories the GPUs (through NVML when libnvidia-ml is present, else
// from the PCI tree), the RDMA devices (/sys/class/infiniband: ports, state,
// rate, active MTU, GIDs with their RoCE version, the netdev behind each
// port), the kernel modules (nvidia_peermem or nv_peer_mem, ib_uverbs,
// rdma_rxe), rdma-core's libibverbs (without which no RDMA device is usable),
// dma-buf support, RLIMIT_MEMLOCK, huge pages, the IOMMU mode,
// PCIe ACS on the bridges between GPUs and NICs, and CPU and NUMA affinity;
// prints the topology matrix in the layout of `nvidia-smi topo -m`; and gives
// a verdict per GPU (package gdr decides): Direct, Proxy through a named NIC,
// or Unavailable, each with its reasons and fixes. It also says how a gdrlink
// job started with its environment authenticates connections: with a job
// key, on loopback only, or unauthenticated (GDRLINK_INSECURE=1); unusable
// key settings make the node not ready.
//
// Usage:
//
//	gdrcheck [--json] [--root DIR|FILE.tar.gz] [--gpu 0,1] [--nic mlx5_0] [--level PXB] [--selftest]
//	         [--nfd DIR [--nfd-expiry 2h]] [--textfile DIR]
//	gdrcheck snapshot [--root DIR] FILE.tar.gz
//
// Exit status: 0 ready (every GPU Direct, or no GPU and RDMA usable), 1
// degraded (some GPU needs a CPU proxy), 2 not ready (some GPU has no RDMA
// path, no RDMA at all, a failed selftest, unusable job key settings) or an
// error.
//
// --json prints the report in the versioned schema of schema.json.
// --root reads sysfs and procfs from a copy of another node's tree or from a
// snapshot archive. `gdrcheck snapshot` writes such an archive: the files
// the checks read and NVML's answers, with GIDs hashed and no hostname,
// serial number or MAC address. --selftest allocates from the pool,
// registers through each verbs provider available here, writes a pattern
// over a loopback connection, verifies it and reports the bandwidth.
//
// --nfd writes the verdict as node labels, a node-feature-discovery feature
// file DIR/gdrcheck; --textfile writes it as Prometheus metrics,
// DIR/gdrcheck.prom, for node_exporter's textfile collector. Both replace
// their file atomically.
//
// README.md in this directory is the operators' guide: a sample report and
// what each verdict means.
package main

// Package gdr decides, for each GPU of a node and each RDMA NIC, whether the
// NIC can read and write the GPU's memory directly (GPUDirect RDMA) or must go
// through a pinned host buffer (a CPU proxy), and says why.
//
// It keeps facts apart from decisions. Collect reads the machine under a
// root directory (the live "/", /host in a container, or a copy of another
// node's tree) and returns Facts: GPUs, RDMA devices, the PCIe hierarchy
// between them, kernel modules, rdma-core's libibverbs, dma-buf support,
// the memlock limit, IOMMU and hugepages. Every probe has three outcomes, kept in a Check: available;
// not supported (the reason wraps ErrNotSupported and says what is missing);
// or could not tell. DecideGPU is a pure function from facts and a Policy to
// a Decision for one GPU: Direct, Proxy or Unavailable, through which NIC,
// with the reasons and the fixes a person can apply.
//
// Path types follow `nvidia-smi topo -m`: PIX (at most one PCIe switch
// between the devices), PXB (several switches, no host bridge), PHB (through
// one PCIe host bridge), NODE (across host bridges of one NUMA node) and SYS
// (across the interconnect between NUMA nodes). The policy level, like
// NCCL_NET_GDR_LEVEL, is the farthest path over which Direct is allowed;
// the default is PXB and GDRLINK_NET_GDR_LEVEL overrides it (PolicyFromEnv).
package gdr

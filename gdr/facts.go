package gdr

// GPUFacts is what is known about one GPU. Optional values are pointers:
// nil means nobody could tell, never false or zero. A source that knows more
// (NVML, CUDA device attributes, a snapshot) fills more fields.
type GPUFacts struct {
	// Index is the GPU's ordinal as its source counts them.
	Index int `json:"index"`
	// Name is the product name ("NVIDIA H100 80GB HBM3"), "" when unknown.
	Name string `json:"name"`
	// PCIBusID is the canonical PCI address ("0000:3b:00.0").
	PCIBusID string `json:"pci_bus_id"`
	// NUMANode is the GPU's NUMA node.
	NUMANode *int `json:"numa_node"`
	// BAR1Total and BAR1Free are the BAR1 aperture in bytes, through which
	// a NIC reaches GPU memory.
	BAR1Total *uint64 `json:"bar1_total"`
	BAR1Free  *uint64 `json:"bar1_free"`
	// PersistenceMode reports whether the driver keeps the GPU initialized.
	PersistenceMode *bool `json:"persistence_mode"`
	// GDRSupported is CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED.
	GDRSupported *bool `json:"gdr_supported"`
	// DMABufSupported is CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED.
	DMABufSupported *bool `json:"dmabuf_supported"`
	// Source says where the facts came from ("nvml", "pci", "snapshot").
	Source string `json:"source"`
}

// GPUDriverFacts are node-wide facts of the GPU driver.
type GPUDriverFacts struct {
	// DriverVersion is the kernel driver's version ("550.54.15").
	DriverVersion string `json:"driver_version"`
	// CUDAVersion is the CUDA version the driver supports ("12.4").
	CUDAVersion string `json:"cuda_version"`
}

// GPUTopology is a path between two GPUs as NVML reports it
// (nvmlDeviceGetTopologyCommonAncestor), or an NVLink count.
type GPUTopology struct {
	A    int      `json:"a"`
	B    int      `json:"b"`
	Path PathType `json:"path"`
	// NVLinks is the number of NVLinks between the GPUs (NV# in the
	// matrix), 0 when none or unknown.
	NVLinks int `json:"nvlinks"`
}

// gpuInventory is what a GPU source reports.
type gpuInventory struct {
	Driver   GPUDriverFacts `json:"driver"`
	GPUs     []GPUFacts     `json:"gpus"`
	Topology []GPUTopology  `json:"topology"`
}

// gpuSource supplies GPU facts: NVML, CUDA device attributes.
// A source that is absent on this node (no libnvidia-ml, no libcuda)
// returns an error wrapping ErrNotSupported.
type gpuSource interface {
	// Name names the source ("nvml").
	Name() string
	// GPUs reports the GPUs it sees.
	GPUs() (gpuInventory, error)
}

// GID is one entry of a port's GID table.
type GID struct {
	Index int    `json:"index"`
	GID   string `json:"gid"`
	// Type is "IB/RoCE v1" or "RoCE v2", "" when sysfs does not say.
	Type string `json:"type"`
	// Netdev is the network device the GID belongs to (RoCE).
	Netdev string `json:"netdev"`
}

// PortFacts is one port of an RDMA device, from
// /sys/class/infiniband/<dev>/ports/<n>.
type PortFacts struct {
	Port      int    `json:"port"`
	State     string `json:"state"`
	PhysState string `json:"phys_state"`
	LinkLayer string `json:"link_layer"`
	Rate      string `json:"rate"`
	// RateGbps is the rate in Gb/s, nil when unparsable.
	RateGbps *float64 `json:"rate_gbps"`
	// ActiveMTU is the path MTU in bytes; sysfs has it only indirectly, for
	// RoCE ports through the netdev's MTU, so it is nil for InfiniBand.
	ActiveMTU *int `json:"active_mtu"`
	// Netdev is the network device behind the port (RoCE, IPoIB).
	Netdev string `json:"netdev"`
	GIDs   []GID  `json:"gids"`
}

// active reports whether the port can carry traffic.
func (p PortFacts) active() bool { return p.State == "ACTIVE" }

// NICFacts is one RDMA device from /sys/class/infiniband.
type NICFacts struct {
	Name string `json:"name"`
	// PCIAddress is "" for software devices (rxe, siw).
	PCIAddress string `json:"pci_address"`
	// Software reports a software RDMA device (Soft-RoCE rxe, siw), which
	// moves bytes with the CPU and cannot reach GPU memory.
	Software bool `json:"software"`
	// Driver is the kernel driver of the RDMA device ("mlx5_core", "rxe").
	Driver    string      `json:"driver"`
	NUMANode  *int        `json:"numa_node"`
	LocalCPUs string      `json:"local_cpus"`
	FWVersion string      `json:"fw_version"`
	Ports     []PortFacts `json:"ports"`
}

// activePort returns the first active port, or nil.
func (n *NICFacts) activePort() *PortFacts {
	for i := range n.Ports {
		if n.Ports[i].active() {
			return &n.Ports[i]
		}
	}
	return nil
}

// ModuleFacts says whether a kernel module is loaded.
type ModuleFacts struct {
	Name   string `json:"name"`
	Loaded bool   `json:"loaded"`
}

// MemlockFacts is RLIMIT_MEMLOCK, which bounds how much host memory a
// process may pin, and so register with a NIC.
type MemlockFacts struct {
	Check Check `json:"check"`
	// Soft and Hard are bytes, -1 when unbounded; valid when
	// Check is available.
	Soft int64 `json:"soft"`
	Hard int64 `json:"hard"`
	// Live reports whether the values come from getrlimit in this process
	// rather than from a limits file.
	Live bool `json:"live"`
}

// HugepageFacts describes huge pages.
type HugepageFacts struct {
	Check Check `json:"check"`
	// Total and Free are counts of default-size huge pages.
	Total uint64 `json:"total"`
	Free  uint64 `json:"free"`
	// Size is the default huge page size in bytes.
	Size uint64 `json:"size"`
	// THP is the transparent huge page mode ("always [madvise] never").
	THP string `json:"thp"`
}

// IOMMUFacts describes the IOMMU.
type IOMMUFacts struct {
	Check Check `json:"check"`
	// Mode is "off", "passthrough" (identity domains), "translated" (DMA
	// domains) or "" when unknown.
	Mode string `json:"mode"`
	// Groups is the number of IOMMU groups.
	Groups int `json:"groups"`
}

// KernelFacts describes the running kernel.
type KernelFacts struct {
	Release string `json:"release"`
	// DMABuf: the kernel can export and import dma-bufs for RDMA (5.12 or
	// newer, CONFIG_DMA_SHARED_BUFFER).
	DMABuf Check `json:"dmabuf"`
}

// PairPath is the PCIe path between a GPU and a NIC.
type PairPath struct {
	GPU  int      `json:"gpu"`
	NIC  string   `json:"nic"`
	Path PathType `json:"path"`
	// Detail says why the path has that type.
	Detail string `json:"detail"`
	// Bridges are the PCIe bridges a peer transfer passes.
	Bridges []string `json:"bridges"`
	// ACSBridges are those of Bridges whose ACS redirects peer traffic to
	// the root complex.
	ACSBridges []string `json:"acs_bridges"`
	// ACSUnknown lists bridges whose ACS state could not be read.
	ACSUnknown []string `json:"acs_unknown"`
}

// Facts is everything gdr knows about a node. Collect fills it; DecideGPU
// reads it.
type Facts struct {
	// Root is the directory the files were read from ("/" for this node).
	Root string `json:"root"`
	// Kernel, Modules, PeerMem, Verbs, LibIBVerbs and DMABuf are what
	// RDMA and GPUDirect need from the host software.
	Kernel  KernelFacts   `json:"kernel"`
	Modules []ModuleFacts `json:"modules"`
	// PeerMem: nvidia_peermem or nv_peer_mem is loaded.
	PeerMem Check `json:"peermem"`
	// Verbs: rdma-core's libibverbs.so.1 is installed under the root. Every
	// RDMA transfer needs it, and gdrlink loads it at run time, so a node
	// without it runs gdrlink with no RDMA provider at all.
	Verbs Check `json:"libibverbs"`
	// LibIBVerbs: rdma-core's libibverbs has ibv_reg_dmabuf_mr.
	LibIBVerbs Check `json:"libibverbs_dmabuf"`
	// DMABuf: kernel and rdma-core both support dma-buf registration (each
	// GPU's own attribute is in GPUFacts).
	DMABuf    Check         `json:"dmabuf"`
	Memlock   MemlockFacts  `json:"memlock"`
	Hugepages HugepageFacts `json:"hugepages"`
	IOMMU     IOMMUFacts    `json:"iommu"`
	// NUMANodes is the number of online NUMA nodes (0 when unknown).
	NUMANodes int `json:"numa_nodes"`
	// GPUSource says where the GPU facts came from, or why there are none.
	GPUSource Check `json:"gpu_source"`
	// GPUSourceWhy says why no GPU source answered, "" when one did.
	GPUSourceWhy string         `json:"-"`
	Driver       GPUDriverFacts `json:"gpu_driver"`
	GPUs         []GPUFacts     `json:"gpus"`
	// GPUTopology is what NVML says about GPU pairs, for the matrix and to
	// cross-check the PCI tree.
	GPUTopology []GPUTopology `json:"gpu_topology"`
	// RDMA says whether RDMA devices were found, or why not.
	RDMA  Check      `json:"rdma"`
	NICs  []NICFacts `json:"nics"`
	Pairs []PairPath `json:"pairs"`
	// Notes are things that could not be read, for people.
	Notes []string `json:"notes"`
}

// pair returns the path between a GPU (by index) and a NIC, or nil.
func (f *Facts) pair(gpu int, nic string) *PairPath {
	for i := range f.Pairs {
		if f.Pairs[i].GPU == gpu && f.Pairs[i].NIC == nic {
			return &f.Pairs[i]
		}
	}
	return nil
}

// gpu returns the GPU with the index, or nil.
func (f *Facts) gpu(index int) *GPUFacts {
	for i := range f.GPUs {
		if f.GPUs[i].Index == index {
			return &f.GPUs[i]
		}
	}
	return nil
}

// module reports whether a module is known to be loaded.
func (f *Facts) module(name string) bool {
	for _, m := range f.Modules {
		if m.Name == name {
			return m.Loaded
		}
	}
	return false
}

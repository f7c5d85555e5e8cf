package proxy

import "fmt"

// gpuDirectFacts is what a device says about a NIC's writes into its
// memory, for choosing how (and whether) Direct receives flush.
type gpuDirectFacts struct {
	// ComputeCapability is major*10+minor (90 for an H100); 0 when unknown.
	ComputeCapability int
	// C2C says the GPU reaches the CPU over a chip-to-chip link (Grace
	// Hopper and later), where NIC writes may pass the GPU's reads.
	C2C bool
	// HostFlush says the driver can flush NIC writes from the host
	// (cuFlushGPUDirectRDMAWrites: CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS
	// has its host bit).
	HostFlush bool
}

// rdmaFlushDevice is a Device that reports its GPUDirect facts and can
// itself make completed NIC writes into its memory visible to its later
// work; a Direct receive that needs a flush uses it before a
// DirectFlusher's loopback read. A Device implements it with two methods:
//
//	GPUDirectFacts() (computeCapability int, c2c, hostFlush bool)
//	FlushRDMAWrites() error
//
// computeCapability is major*10+minor (0 when unknown); c2c says the GPU
// reaches the CPU over a chip-to-chip link; hostFlush says the driver can
// flush NIC writes from the host (cuFlushGPUDirectRDMAWrites). The CUDA
// device implements it, and so does gpusim's.
type rdmaFlushDevice interface {
	Device
	GPUDirectFacts() (computeCapability int, c2c, hostFlush bool)
	FlushRDMAWrites() error
}

// flushMethod is how Direct receives flush.
type flushMethod int

const (
	flushNone     flushMethod = iota // no flush needed
	flushByDriver                    // the device's driver flushes (rdmaFlushDevice)
	flushByRead                      // a DirectFlusher's loopback RDMA READ
)

// chooseFlush decides, as NCCL does, how Direct receives flush: not at all
// when GDRLINK_GDR_FLUSH is 0, or under auto when the caller says the GPU
// orders NIC writes or the device is of compute capability 9.0 or later and
// not attached over C2C; otherwise through the driver where it can flush
// from the host, else through the loopback read. facts is nil for a device
// that reports none. A flush needed with no way to make it is an error.
func chooseFlush(mode flushMode, ordered bool, facts *gpuDirectFacts, haveReader bool) (flushMethod, error) {
	switch mode {
	case flushOff:
		return flushNone, nil
	case flushAuto:
		if ordered {
			return flushNone, nil
		}
		if facts != nil && facts.ComputeCapability >= 90 && !facts.C2C {
			return flushNone, nil
		}
	}
	switch {
	case facts != nil && facts.HostFlush:
		return flushByDriver, nil
	case haveReader:
		return flushByRead, nil
	}
	why := "no facts from the device"
	if facts != nil {
		why = fmt.Sprintf("compute capability %d.%d, C2C %v, no host flush in the driver", facts.ComputeCapability/10, facts.ComputeCapability%10, facts.C2C)
	}
	return flushNone, fmt.Errorf("%w: Direct receives need a GPUDirect flush (GDRLINK_GDR_FLUSH=%s; %s) and the proxy has no flusher", ErrCopyFailed, mode, why)
}

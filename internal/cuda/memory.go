package cuda

import (
	"fmt"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Flags of cuMemHostAlloc (CU_MEMHOSTALLOC_*).
const (
	HostAllocPortable      = 0x01
	HostAllocDeviceMap     = 0x02
	HostAllocWriteCombined = 0x04
)

// Flags of cuMemHostRegister (CU_MEMHOSTREGISTER_*).
const (
	HostRegisterPortable  = 0x01
	HostRegisterDeviceMap = 0x02
	HostRegisterIOMemory  = 0x04
	HostRegisterReadOnly  = 0x08
)

// DeviceMemory is device memory from cuMemAlloc_v2.
type DeviceMemory struct {
	closer
	// Ptr is the device pointer.
	Ptr uintptr
	// Size is the allocation's size in bytes.
	Size int
}

// MemAlloc allocates n bytes of device memory (cuMemAlloc_v2).
func (c *Context) MemAlloc(n int) (*DeviceMemory, error) {
	if n <= 0 {
		return nil, fmt.Errorf("%w: allocation of %d bytes", ErrBadArgument, n)
	}
	var p uintptr
	if err := c.do(symMemAlloc, fmt.Sprintf("%d bytes on %s", n, c.dev), uintptr(unsafe.Pointer(&p)), uintptr(n)); err != nil {
		return nil, err
	}
	m := &DeviceMemory{Ptr: p, Size: n}
	m.open(c)
	return m, nil
}

// Close frees the memory (cuMemFree_v2). Idempotent.
func (m *DeviceMemory) Close() error {
	return m.close(func() error {
		return m.ctx.do(symMemFree, fmt.Sprintf("%#x", m.Ptr), m.Ptr)
	})
}

// HostMemory is pinned host memory from cuMemHostAlloc: off the Go heap,
// page-locked, and mapped for the device when allocated with
// HostAllocDeviceMap.
type HostMemory struct {
	closer
	// Ptr is the host address.
	Ptr uintptr
	// Size is the allocation's size in bytes.
	Size int
}

// MemHostAlloc allocates n bytes of pinned host memory (cuMemHostAlloc).
func (c *Context) MemHostAlloc(n int, flags uint32) (*HostMemory, error) {
	if n <= 0 {
		return nil, fmt.Errorf("%w: host allocation of %d bytes", ErrBadArgument, n)
	}
	var p uintptr
	if err := c.do(symMemHostAlloc, fmt.Sprintf("%d bytes, flags %#x", n, flags), uintptr(unsafe.Pointer(&p)), uintptr(n), uintptr(flags)); err != nil {
		return nil, err
	}
	m := &HostMemory{Ptr: p, Size: n}
	m.open(c)
	return m, nil
}

// Bytes is the memory as a byte slice; nil after Close.
func (m *HostMemory) Bytes() []byte {
	if m.check("host memory") != nil {
		return nil
	}
	return unsafe.Slice((*byte)(ptrAt(m.Ptr, 0)), m.Size)
}

// Close frees the memory (cuMemFreeHost). Idempotent.
func (m *HostMemory) Close() error {
	return m.close(func() error {
		return m.ctx.do(symMemFreeHost, fmt.Sprintf("%#x", m.Ptr), m.Ptr)
	})
}

// HostRegistration is host memory page-locked and made known to the driver
// by cuMemHostRegister_v2.
type HostRegistration struct {
	closer
	Ptr  uintptr
	Size int
}

// MemHostRegister page-locks [ptr, ptr+n) of host memory that the caller
// allocated off the Go heap (an mmap'd arena) and registers it with the
// driver. A device pointer handed in by mistake fails with
// ErrWrongMemoryType before the driver is asked.
func (c *Context) MemHostRegister(ptr uintptr, n int, flags uint32) (*HostRegistration, error) {
	if ptr == 0 || n <= 0 {
		return nil, fmt.Errorf("%w: host registration of %d bytes at %#x", ErrBadArgument, n, ptr)
	}
	if mt, err := c.MemoryType(ptr); err == nil && mt == MemoryDevice {
		return nil, fmt.Errorf("%w: %#x is device memory, not host memory", ErrWrongMemoryType, ptr)
	}
	if err := c.do(symMemHostRegister, fmt.Sprintf("%d bytes at %#x, flags %#x", n, ptr, flags), ptr, uintptr(n), uintptr(flags)); err != nil {
		return nil, err
	}
	r := &HostRegistration{Ptr: ptr, Size: n}
	r.open(c)
	return r, nil
}

// Close unregisters the memory (cuMemHostUnregister). Idempotent.
func (r *HostRegistration) Close() error {
	return r.close(func() error {
		return r.ctx.do(symMemHostUnregister, fmt.Sprintf("%#x", r.Ptr), r.Ptr)
	})
}

// HostDevicePointer is the device address of mapped pinned host memory
// (cuMemHostGetDevicePointer_v2).
func (c *Context) HostDevicePointer(host uintptr) (uintptr, error) {
	var p uintptr
	if err := c.do(symMemHostGetDevicePointer, fmt.Sprintf("%#x", host), uintptr(unsafe.Pointer(&p)), host, 0); err != nil {
		return 0, err
	}
	return p, nil
}

// Memset8 sets n bytes of device memory to v (cuMemsetD8_v2, synchronous
// with respect to the host for pageable sources).
func (c *Context) Memset8(dst uintptr, v byte, n int) error {
	return c.do(symMemsetD8, fmt.Sprintf("%d bytes at %#x", n, dst), dst, uintptr(v), uintptr(n))
}

// MemcpyHtoD copies n bytes from host to device and waits (cuMemcpyHtoD_v2).
func (c *Context) MemcpyHtoD(dst, src uintptr, n int) error {
	return c.do(symMemcpyHtoD, fmt.Sprintf("%d bytes %#x -> %#x", n, src, dst), dst, src, uintptr(n))
}

// MemcpyDtoH copies n bytes from device to host and waits (cuMemcpyDtoH_v2).
func (c *Context) MemcpyDtoH(dst, src uintptr, n int) error {
	return c.do(symMemcpyDtoH, fmt.Sprintf("%d bytes %#x -> %#x", n, src, dst), dst, src, uintptr(n))
}

// DMABuf is a dma-buf file descriptor that exports a range of device memory
// (cuMemGetHandleForAddressRange), for ibv_reg_dmabuf_mr.
type DMABuf struct {
	closer
	// FD is the dma-buf file descriptor.
	FD int
	// Ptr and Size are the exported range.
	Ptr  uintptr
	Size int
}

// CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD.
const memRangeHandleTypeDMABufFD = 1

// ExportDMABuf exports [ptr, ptr+n) of device memory as a dma-buf. Both must
// be aligned to the host page size. A driver or device without dma-buf
// support fails with an error matching ErrNotSupported (or ErrNoDriver when
// the driver predates the call).
func (c *Context) ExportDMABuf(ptr uintptr, n int) (*DMABuf, error) {
	pg := uintptr(unix.Getpagesize())
	if ptr == 0 || n <= 0 || ptr%pg != 0 || uintptr(n)%pg != 0 {
		return nil, fmt.Errorf("%w: dma-buf export of %d bytes at %#x (both must be multiples of the %d-byte page)", ErrBadArgument, n, ptr, pg)
	}
	var fd int32 = -1
	if err := c.do(symMemGetHandleForAddressRange, fmt.Sprintf("%d bytes at %#x as dma-buf", n, ptr),
		uintptr(unsafe.Pointer(&fd)), ptr, uintptr(n), memRangeHandleTypeDMABufFD, 0); err != nil {
		return nil, err
	}
	b := &DMABuf{FD: int(fd), Ptr: ptr, Size: n}
	b.open(c)
	return b, nil
}

// Close closes the file descriptor (a memory region registered from it keeps
// its own reference). Idempotent.
func (b *DMABuf) Close() error {
	return b.close(func() error {
		if err := unix.Close(b.FD); err != nil {
			return fmt.Errorf("cuda: close dma-buf fd %d: %w", b.FD, err)
		}
		return nil
	})
}

// IPCHandle is a CUipcMemHandle: 64 opaque bytes that let another process
// map the allocation.
type IPCHandle struct {
	Reserved [64]byte
}

// IPCHandle exports an allocation for other processes (cuIpcGetMemHandle).
func (c *Context) IPCHandle(ptr uintptr) (IPCHandle, error) {
	var h IPCHandle
	err := c.do(symIpcGetMemHandle, fmt.Sprintf("%#x", ptr), uintptr(unsafe.Pointer(&h)), ptr)
	return h, err
}

// IPCMapping is another process's allocation mapped into this one
// (cuIpcOpenMemHandle_v2).
type IPCMapping struct {
	closer
	Ptr uintptr
}

// CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS.
const ipcLazyEnablePeerAccess = 1

// OpenIPCHandle maps an allocation another process exported.
func (c *Context) OpenIPCHandle(h IPCHandle) (*IPCMapping, error) {
	if err := c.usable(); err != nil {
		return nil, err
	}
	var p uintptr
	r := c.withCurrent(func() Result { return c.drv.ipcOpen(&p, h, ipcLazyEnablePeerAccess) })
	if err := check("cuIpcOpenMemHandle_v2", r, c.dev.String()); err != nil {
		return nil, err
	}
	m := &IPCMapping{Ptr: p}
	m.open(c)
	return m, nil
}

// Close unmaps the allocation (cuIpcCloseMemHandle). Idempotent.
func (m *IPCMapping) Close() error {
	return m.close(func() error {
		return m.ctx.do(symIpcCloseMemHandle, fmt.Sprintf("%#x", m.Ptr), m.Ptr)
	})
}

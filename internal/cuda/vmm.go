package cuda

import (
	"fmt"
	"unsafe"
)

// The virtual memory management API's constants (cuda.h), for device
// memory exported as a POSIX file descriptor.
const (
	memAllocationTypePinned    = 1 // CU_MEM_ALLOCATION_TYPE_PINNED
	memHandleTypePOSIXFD       = 1 // CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
	memLocationTypeDevice      = 1 // CU_MEM_LOCATION_TYPE_DEVICE
	memAccessProtReadWrite     = 3 // CU_MEM_ACCESS_FLAGS_PROT_READWRITE
	memAllocGranularityMinimum = 0 // CU_MEM_ALLOC_GRANULARITY_MINIMUM
)

// memAllocationProp is CUmemAllocationProp (32 bytes on 64-bit Linux):
// type, requestedHandleTypes, location {type, id}, win32HandleMetaData,
// allocFlags {compressionType, gpuDirectRDMACapable, usage, reserved[4]}.
type memAllocationProp struct {
	typ            int32
	handleTypes    int32
	locType        int32
	locID          int32
	win32Meta      uintptr
	compression    uint8
	gpuDirectRDMA  uint8
	usage          uint16
	allocReserved4 [4]uint8
}

// memAccessDesc is CUmemAccessDesc (12 bytes): location {type, id}, flags.
type memAccessDesc struct {
	locType int32
	locID   int32
	flags   int32
}

// Both layouts are what cuda.h declares on 64-bit Linux.
var (
	_ [32]byte = [unsafe.Sizeof(memAllocationProp{})]byte{}
	_ [12]byte = [unsafe.Sizeof(memAccessDesc{})]byte{}
)

// Shareable is device memory made with the virtual memory management API
// so that other processes can map it from a POSIX file descriptor
// (cuMemCreate with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, mapped at a
// reserved range with read-write access for the device), or such memory of
// another process mapped into this one (ImportShareable). NCCL prefers it
// to legacy IPC handles: the descriptor passes over a unix socket like any
// other, and the memory lives as long as a process maps it.
type Shareable struct {
	closer
	// Ptr is the device address of the mapping.
	Ptr uintptr
	// Size is the mapping's size in bytes (a multiple of the device's
	// allocation granularity).
	Size   int
	handle uint64
}

// ShareableSupported reports whether the device can make memory shared by
// POSIX file descriptor: the driver has the virtual memory management API
// and the device says it supports both it and descriptor exports.
func (c *Context) ShareableSupported() bool {
	for _, s := range []sym{symMemCreate, symMemExportToShareableHandle, symMemImportFromShareableHandle, symMemAddressReserve, symMemMap, symMemSetAccess} {
		if c.drv.fns[s] == 0 {
			return false
		}
	}
	for _, a := range []Attribute{AttrVirtualMemoryManagement, AttrHandleTypePOSIXFD} {
		if v, err := c.dev.Attribute(a); err != nil || v == 0 {
			return false
		}
	}
	return true
}

// prop is the allocation properties of this context's device with POSIX
// descriptor export.
func (c *Context) prop() memAllocationProp {
	return memAllocationProp{typ: memAllocationTypePinned, handleTypes: memHandleTypePOSIXFD, locType: memLocationTypeDevice, locID: c.dev.handle}
}

// ShareableGranularity is the size every shareable allocation is rounded
// up to (cuMemGetAllocationGranularity, minimum).
func (c *Context) ShareableGranularity() (int, error) {
	p := c.prop()
	var g uint64
	if err := c.do(symMemGetAllocationGranularity, c.dev.String(), uintptr(unsafe.Pointer(&g)), uintptr(unsafe.Pointer(&p)), memAllocGranularityMinimum); err != nil {
		return 0, err
	}
	if g == 0 {
		return 0, fmt.Errorf("%w: allocation granularity 0 on %s", ErrBadArgument, c.dev)
	}
	return int(g), nil
}

// AllocShareable allocates at least n bytes of device memory that other
// processes can map (ExportFD, ImportShareable).
func (c *Context) AllocShareable(n int) (*Shareable, error) {
	if n <= 0 {
		return nil, fmt.Errorf("%w: shareable allocation of %d bytes", ErrBadArgument, n)
	}
	g, err := c.ShareableGranularity()
	if err != nil {
		return nil, err
	}
	size := (n + g - 1) / g * g
	p := c.prop()
	var h uint64
	if err := c.do(symMemCreate, fmt.Sprintf("%d bytes on %s", size, c.dev), uintptr(unsafe.Pointer(&h)), uintptr(size), uintptr(unsafe.Pointer(&p)), 0); err != nil {
		return nil, err
	}
	s, err := c.mapHandle(h, size)
	if err != nil {
		_ = c.do(symMemRelease, "", uintptr(h))
		return nil, err
	}
	return s, nil
}

// mapHandle reserves a range for the allocation handle h of size bytes,
// maps h there and gives this context's device read-write access; the
// Shareable owns h from then on.
func (c *Context) mapHandle(h uint64, size int) (*Shareable, error) {
	detail := fmt.Sprintf("%d bytes on %s", size, c.dev)
	var ptr uintptr
	if err := c.do(symMemAddressReserve, detail, uintptr(unsafe.Pointer(&ptr)), uintptr(size), 0, 0, 0); err != nil {
		return nil, err
	}
	if err := c.do(symMemMap, detail, ptr, uintptr(size), 0, uintptr(h), 0); err != nil {
		_ = c.do(symMemAddressFree, detail, ptr, uintptr(size))
		return nil, err
	}
	acc := memAccessDesc{locType: memLocationTypeDevice, locID: c.dev.handle, flags: memAccessProtReadWrite}
	if err := c.do(symMemSetAccess, detail, ptr, uintptr(size), uintptr(unsafe.Pointer(&acc)), 1); err != nil {
		_ = c.do(symMemUnmap, detail, ptr, uintptr(size))
		_ = c.do(symMemAddressFree, detail, ptr, uintptr(size))
		return nil, err
	}
	s := &Shareable{Ptr: ptr, Size: size, handle: h}
	s.open(c)
	return s, nil
}

// ExportFD returns a new POSIX file descriptor of the allocation
// (cuMemExportToShareableHandle); the caller owns it.
func (s *Shareable) ExportFD() (int, error) {
	var fd int32 = -1
	if err := s.ctx.do(symMemExportToShareableHandle, fmt.Sprintf("%#x", s.Ptr), uintptr(unsafe.Pointer(&fd)), uintptr(s.handle), memHandleTypePOSIXFD, 0); err != nil {
		return -1, err
	}
	return int(fd), nil
}

// ImportShareable maps size bytes of another process's shareable
// allocation from its descriptor (cuMemImportFromShareableHandle), with
// read-write access for this context's device. fd stays the caller's.
func (c *Context) ImportShareable(fd int, size int) (*Shareable, error) {
	if fd < 0 || size <= 0 {
		return nil, fmt.Errorf("%w: import of descriptor %d, %d bytes", ErrBadArgument, fd, size)
	}
	var h uint64
	if err := c.do(symMemImportFromShareableHandle, fmt.Sprintf("descriptor %d on %s", fd, c.dev), uintptr(unsafe.Pointer(&h)), uintptr(fd), memHandleTypePOSIXFD); err != nil {
		return nil, err
	}
	s, err := c.mapHandle(h, size)
	if err != nil {
		_ = c.do(symMemRelease, "", uintptr(h))
		return nil, err
	}
	return s, nil
}

// Close unmaps the allocation, frees its address range and releases the
// handle (cuMemUnmap, cuMemAddressFree, cuMemRelease): the memory is freed
// once no process maps it. Idempotent.
func (s *Shareable) Close() error {
	return s.close(func() error {
		detail := fmt.Sprintf("%#x", s.Ptr)
		err := s.ctx.do(symMemUnmap, detail, s.Ptr, uintptr(s.Size))
		if e := s.ctx.do(symMemAddressFree, detail, s.Ptr, uintptr(s.Size)); err == nil {
			err = e
		}
		if e := s.ctx.do(symMemRelease, detail, uintptr(s.handle)); err == nil {
			err = e
		}
		return err
	})
}

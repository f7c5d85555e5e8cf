package cuda

import (
	"errors"
	"fmt"
	"runtime"
	"unsafe"
)

// MemoryType is what kind of memory an address is, as the driver sees it.
type MemoryType int

// Memory types. MemoryPageable is host memory the driver does not know
// (cuPointerGetAttribute fails with CUDA_ERROR_INVALID_VALUE for it).
const (
	MemoryPageable MemoryType = iota
	MemoryHost                // CU_MEMORYTYPE_HOST: pinned or registered host memory
	MemoryDevice              // CU_MEMORYTYPE_DEVICE
	MemoryArray               // CU_MEMORYTYPE_ARRAY
	MemoryUnified             // CU_MEMORYTYPE_UNIFIED (managed)
)

// String names the memory type.
func (m MemoryType) String() string {
	switch m {
	case MemoryPageable:
		return "pageable host"
	case MemoryHost:
		return "pinned host"
	case MemoryDevice:
		return "device"
	case MemoryArray:
		return "array"
	case MemoryUnified:
		return "managed"
	}
	return fmt.Sprintf("MemoryType(%d)", int(m))
}

// Pointer attributes (CUpointer_attribute).
const (
	pointerAttrContext       = 1
	pointerAttrMemoryType    = 2
	pointerAttrSyncMemops    = 6
	pointerAttrIsManaged     = 8
	pointerAttrDeviceOrdinal = 9
)

// MemoryType asks the driver what ptr is (cuPointerGetAttribute with
// CU_POINTER_ATTRIBUTE_MEMORY_TYPE). Host memory the driver does not know is
// MemoryPageable.
func (c *Context) MemoryType(ptr uintptr) (MemoryType, error) {
	var t uint32
	err := c.do(symPointerGetAttribute, fmt.Sprintf("memory type of %#x", ptr), uintptr(unsafe.Pointer(&t)), pointerAttrMemoryType, ptr)
	if errors.Is(err, ErrInvalidValue) {
		return MemoryPageable, nil
	}
	if err != nil {
		return 0, err
	}
	var managed uint32
	if err := c.do(symPointerGetAttribute, fmt.Sprintf("is-managed of %#x", ptr), uintptr(unsafe.Pointer(&managed)), pointerAttrIsManaged, ptr); err == nil && managed != 0 {
		return MemoryUnified, nil
	}
	switch t {
	case 1:
		return MemoryHost, nil
	case 2:
		return MemoryDevice, nil
	case 3:
		return MemoryArray, nil
	case 4:
		return MemoryUnified, nil
	}
	return 0, fmt.Errorf("cuda: %#x has unknown memory type %d", ptr, t)
}

// DeviceOrdinal is the ordinal of the device an allocation belongs to
// (CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL).
func (c *Context) DeviceOrdinal(ptr uintptr) (int, error) {
	var o int32
	if err := c.do(symPointerGetAttribute, fmt.Sprintf("device ordinal of %#x", ptr), uintptr(unsafe.Pointer(&o)), pointerAttrDeviceOrdinal, ptr); err != nil {
		return 0, err
	}
	return int(o), nil
}

// SetSyncMemops sets CU_POINTER_ATTRIBUTE_SYNC_MEMOPS on the allocation
// holding ptr: synchronous memory operations on it then complete before
// returning, which GPUDirect RDMA needs on memory that a NIC writes (the
// driver otherwise may reorder them with the NIC's writes).
func (c *Context) SetSyncMemops(ptr uintptr, on bool) error {
	v := uint32(0)
	if on {
		v = 1
	}
	return c.do(symPointerSetAttribute, fmt.Sprintf("sync-memops=%d on %#x", v, ptr), uintptr(unsafe.Pointer(&v)), pointerAttrSyncMemops, ptr)
}

// SyncMemops reads CU_POINTER_ATTRIBUTE_SYNC_MEMOPS of the allocation holding ptr.
func (c *Context) SyncMemops(ptr uintptr) (bool, error) {
	var v uint32
	if err := c.do(symPointerGetAttribute, fmt.Sprintf("sync-memops of %#x", ptr), uintptr(unsafe.Pointer(&v)), pointerAttrSyncMemops, ptr); err != nil {
		return false, err
	}
	return v != 0, nil
}

// withCurrent runs f with the context current on the calling thread.
func (c *Context) withCurrent(f func() Result) Result {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := c.drv.call(symCtxSetCurrent, "", c.ctx); err != nil {
		var ce *Error
		if errors.As(err, &ce) {
			return ce.Code
		}
		return ErrorUnknown
	}
	return f()
}

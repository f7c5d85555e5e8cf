package cuda

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/ebitengine/purego"
)

// DefaultLibrary is the file name Open loads: the driver's ABI-stable name,
// which the NVIDIA driver installs on every GPU node (the unversioned
// libcuda.so comes only with development packages).
const DefaultLibrary = "libcuda.so.1"

// sym indexes the driver symbols this package resolves.
type sym int

const (
	symInit sym = iota
	symDriverGetVersion
	symGetErrorName
	symDeviceGetCount
	symDeviceGet
	symDeviceGetName
	symDeviceGetAttribute
	symDeviceGetPCIBusID
	symDeviceTotalMem
	symPrimaryCtxRetain
	symPrimaryCtxRelease
	symCtxSetCurrent
	symCtxSynchronize
	symMemGetInfo
	symMemAlloc
	symMemFree
	symMemHostAlloc
	symMemFreeHost
	symMemHostRegister
	symMemHostUnregister
	symMemHostGetDevicePointer
	symStreamCreate
	symStreamDestroy
	symStreamSynchronize
	symStreamQuery
	symEventCreate
	symEventRecord
	symEventQuery
	symEventSynchronize
	symEventDestroy
	symEventElapsedTime
	symMemcpyHtoD
	symMemcpyDtoH
	symMemcpyHtoDAsync
	symMemcpyDtoHAsync
	symMemsetD8
	symPointerGetAttribute
	symPointerSetAttribute
	symMemGetHandleForAddressRange
	symIpcGetMemHandle
	symIpcOpenMemHandle
	symIpcCloseMemHandle
	symFlushGPUDirectRDMAWrites
	symMemcpyDtoDAsync
	symDeviceCanAccessPeer
	symMemGetAllocationGranularity
	symMemCreate
	symMemRelease
	symMemAddressReserve
	symMemAddressFree
	symMemMap
	symMemUnmap
	symMemSetAccess
	symMemExportToShareableHandle
	symMemImportFromShareableHandle
	numSyms
)

// symbolNames are the exported names, with the version suffix that cuda.h's
// macros select for the API this package was written against (CUDA 12 and
// 13). Symbols marked optional may be missing on old drivers; calls to them
// fail with ErrNoDriver naming the symbol.
var symbolNames = [numSyms]struct {
	name     string
	optional bool
}{
	symInit:                        {"cuInit", false},
	symDriverGetVersion:            {"cuDriverGetVersion", false},
	symGetErrorName:                {"cuGetErrorName", false},
	symDeviceGetCount:              {"cuDeviceGetCount", false},
	symDeviceGet:                   {"cuDeviceGet", false},
	symDeviceGetName:               {"cuDeviceGetName", false},
	symDeviceGetAttribute:          {"cuDeviceGetAttribute", false},
	symDeviceGetPCIBusID:           {"cuDeviceGetPCIBusId", false},
	symDeviceTotalMem:              {"cuDeviceTotalMem_v2", false},
	symPrimaryCtxRetain:            {"cuDevicePrimaryCtxRetain", false},
	symPrimaryCtxRelease:           {"cuDevicePrimaryCtxRelease_v2", false},
	symCtxSetCurrent:               {"cuCtxSetCurrent", false},
	symCtxSynchronize:              {"cuCtxSynchronize", false},
	symMemGetInfo:                  {"cuMemGetInfo_v2", false},
	symMemAlloc:                    {"cuMemAlloc_v2", false},
	symMemFree:                     {"cuMemFree_v2", false},
	symMemHostAlloc:                {"cuMemHostAlloc", false},
	symMemFreeHost:                 {"cuMemFreeHost", false},
	symMemHostRegister:             {"cuMemHostRegister_v2", false},
	symMemHostUnregister:           {"cuMemHostUnregister", false},
	symMemHostGetDevicePointer:     {"cuMemHostGetDevicePointer_v2", false},
	symStreamCreate:                {"cuStreamCreate", false},
	symStreamDestroy:               {"cuStreamDestroy_v2", false},
	symStreamSynchronize:           {"cuStreamSynchronize", false},
	symStreamQuery:                 {"cuStreamQuery", false},
	symEventCreate:                 {"cuEventCreate", false},
	symEventRecord:                 {"cuEventRecord", false},
	symEventQuery:                  {"cuEventQuery", false},
	symEventSynchronize:            {"cuEventSynchronize", false},
	symEventDestroy:                {"cuEventDestroy_v2", false},
	symEventElapsedTime:            {"cuEventElapsedTime_v2", true},
	symMemcpyHtoD:                  {"cuMemcpyHtoD_v2", false},
	symMemcpyDtoH:                  {"cuMemcpyDtoH_v2", false},
	symMemcpyHtoDAsync:             {"cuMemcpyHtoDAsync_v2", false},
	symMemcpyDtoHAsync:             {"cuMemcpyDtoHAsync_v2", false},
	symMemsetD8:                    {"cuMemsetD8_v2", false},
	symPointerGetAttribute:         {"cuPointerGetAttribute", false},
	symPointerSetAttribute:         {"cuPointerSetAttribute", false},
	symMemGetHandleForAddressRange: {"cuMemGetHandleForAddressRange", true},
	symIpcGetMemHandle:             {"cuIpcGetMemHandle", false},
	symIpcOpenMemHandle:            {"cuIpcOpenMemHandle_v2", false},
	symIpcCloseMemHandle:           {"cuIpcCloseMemHandle", false},
	symFlushGPUDirectRDMAWrites:    {"cuFlushGPUDirectRDMAWrites", true},
	symMemcpyDtoDAsync:             {"cuMemcpyDtoDAsync_v2", true},
	symDeviceCanAccessPeer:         {"cuDeviceCanAccessPeer", true},
	// The virtual memory management API (CUDA 10.2+), for allocations
	// shared by POSIX descriptor (vmm.go).
	symMemGetAllocationGranularity:  {"cuMemGetAllocationGranularity", true},
	symMemCreate:                    {"cuMemCreate", true},
	symMemRelease:                   {"cuMemRelease", true},
	symMemAddressReserve:            {"cuMemAddressReserve", true},
	symMemAddressFree:               {"cuMemAddressFree", true},
	symMemMap:                       {"cuMemMap", true},
	symMemUnmap:                     {"cuMemUnmap", true},
	symMemSetAccess:                 {"cuMemSetAccess", true},
	symMemExportToShareableHandle:   {"cuMemExportToShareableHandle", true},
	symMemImportFromShareableHandle: {"cuMemImportFromShareableHandle", true},
}

// Driver is a loaded CUDA driver. Open it once per program (or per
// component). The library under it is loaded once per process and stays
// loaded (see libraries); Close only ends this handle.
type Driver struct {
	path    string
	lib     uintptr
	fns     [numSyms]uintptr
	version int

	// ipcOpen is cuIpcOpenMemHandle_v2, whose handle argument is a 64-byte
	// struct passed by value; purego lays it out per the platform's ABI.
	ipcOpen func(dptr *uintptr, h IPCHandle, flags uint32) Result

	mu     sync.Mutex
	closed bool
	gone   atomic.Bool // set by Close: no call may reach the library after it
}

// Open loads the CUDA driver from path ("" means $GDRLINK_LIBCUDA, or
// DefaultLibrary when that is unset), resolves
// its symbols and calls cuInit. Without the driver it returns an error
// wrapping ErrNoDriver with the loader's message; with a driver that finds no
// GPU, an error matching both ErrNoDriver and ErrNoDevice.
func Open(path string) (*Driver, error) {
	if path == "" {
		path = os.Getenv("GDRLINK_LIBCUDA")
	}
	if path == "" {
		path = DefaultLibrary
	}
	lib, err := loadLibrary(path)
	if err != nil {
		return nil, err
	}
	d := &Driver{path: path, lib: lib}
	var missing []string
	for i, s := range symbolNames {
		p, err := purego.Dlsym(lib, s.name)
		if err != nil || p == 0 {
			if !s.optional {
				missing = append(missing, s.name)
			}
			continue
		}
		d.fns[i] = p
	}
	if d.fns[symEventElapsedTime] == 0 { // drivers before CUDA 12.8
		d.fns[symEventElapsedTime], _ = purego.Dlsym(lib, "cuEventElapsedTime")
	}
	if len(missing) > 0 {
		return nil, fmt.Errorf("%w: %s lacks %v (driver too old?)", ErrNoDriver, path, missing)
	}
	purego.RegisterFunc(&d.ipcOpen, d.fns[symIpcOpenMemHandle])
	if err := d.call(symInit, "", 0); err != nil {
		var ce *Error
		if errors.As(err, &ce) && (ce.Code == ErrorNoDevice || ce.Code == ErrorStubLibrary || ce.Code == ErrorInsufficientDriver) {
			return nil, fmt.Errorf("%w: %w", ErrNoDriver, err)
		}
		return nil, err
	}
	var v int32
	if err := d.call(symDriverGetVersion, "", uintptr(unsafe.Pointer(&v))); err != nil {
		return nil, err
	}
	d.version = int(v)
	return d, nil
}

// Path is the library the driver was loaded from.
func (d *Driver) Path() string { return d.path }

// Version is the driver's CUDA version as cuDriverGetVersion reports it
// (1000*major + 10*minor, e.g. 13000 for CUDA 13.0).
func (d *Driver) Version() int { return d.version }

// Close ends this handle: no call reaches the driver through it afterwards.
// The library stays loaded for the life of the process (unloading libcuda
// after cuInit is not safe: it keeps threads and device state). Handles made
// through the driver must be closed first. Idempotent.
func (d *Driver) Close() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.closed = true
	d.gone.Store(true)
	return nil
}

func (d *Driver) isClosed() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.closed
}

// call calls a driver function with integer and pointer arguments and maps
// its CUresult. A CUresult is a 32-bit enum: the upper half of the return
// register is not defined, so only the low 32 bits are read.
//
// Pointers to Go variables are passed as uintptr(unsafe.Pointer(&v)) written
// in the call's argument list: go:uintptrescapes then keeps the variable on
// the heap and alive until the call returns.
//
//go:uintptrescapes
func (d *Driver) call(s sym, detail string, args ...uintptr) error {
	if d.gone.Load() {
		return fmt.Errorf("%w: driver %s (calling %s)", ErrClosed, d.path, symbolNames[s].name)
	}
	fn := d.fns[s]
	if fn == 0 {
		return fmt.Errorf("%w: %s has no %s", ErrNoDriver, d.path, symbolNames[s].name)
	}
	r1, _, _ := purego.SyscallN(fn, args...)
	return check(symbolNames[s].name, Result(int32(uint32(r1))), detail)
}

// callIn calls a driver function with ctx current on the calling thread.
//
//go:uintptrescapes
func (d *Driver) callIn(ctx uintptr, s sym, detail string, args ...uintptr) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := d.call(symCtxSetCurrent, "", ctx); err != nil {
		return err
	}
	return d.call(s, detail, args...)
}

// DeviceCount is the number of CUDA devices visible to this process.
func (d *Driver) DeviceCount() (int, error) {
	var n int32
	if err := d.call(symDeviceGetCount, "", uintptr(unsafe.Pointer(&n))); err != nil {
		return 0, err
	}
	return int(n), nil
}

// ErrorName asks the driver for a code's name (cuGetErrorName); codes it
// does not know get Result.Name's spelling.
func (d *Driver) ErrorName(r Result) string {
	var p uintptr
	if err := d.call(symGetErrorName, "", uintptr(r), uintptr(unsafe.Pointer(&p))); err != nil || p == 0 {
		return r.Name()
	}
	return goString(p)
}

// libraries holds the driver libraries this process has loaded, by path. A
// driver library, once loaded, stays loaded for the life of the process
// (as libibverbs does in internal/ibv): this is the package's one piece of
// process-wide state, and it only grows by the paths Open is given.
var libraries struct {
	mu  sync.Mutex
	lib map[string]uintptr
}

// loadLibrary returns the handle of the library at path, loading it on the
// first call for that path and never unloading it.
func loadLibrary(path string) (uintptr, error) {
	libraries.mu.Lock()
	defer libraries.mu.Unlock()
	if h, ok := libraries.lib[path]; ok {
		return h, nil
	}
	h, err := dlopen(path)
	if err != nil {
		return 0, fmt.Errorf("%w: dlopen %s: %v", ErrNoDriver, path, err)
	}
	if libraries.lib == nil {
		libraries.lib = make(map[string]uintptr)
	}
	libraries.lib[path] = h
	return h, nil
}

// dlopen loads a library on one OS thread: dlerror's message is per thread,
// so a goroutine that moved between dlopen and dlerror would read an empty
// one. An empty message is still replaced by one that says what happened.
func dlopen(path string) (uintptr, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	lib, err := purego.Dlopen(path, purego.RTLD_NOW|purego.RTLD_LOCAL)
	if err != nil && err.Error() == "" {
		err = errors.New("not found in the loader's search path, or not loadable")
	}
	return lib, err
}

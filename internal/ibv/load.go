package ibv

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"unsafe"

	"github.com/ebitengine/purego"
)

// DefaultLibrary is the file Load opens: libibverbs' ABI-stable name, which
// rdma-core (Debian's libibverbs1) installs on every RDMA node. The
// unversioned libibverbs.so comes only with the development package.
const DefaultLibrary = "libibverbs.so.1"

// LibraryEnv names a variable that overrides DefaultLibrary (a path or a
// file name the loader searches for).
const LibraryEnv = "GDRLINK_LIBIBVERBS"

// sym indexes the exported libibverbs functions the package calls. The
// data-path verbs are not among them: libibverbs defines them inline over the
// context's ops table, and the package calls them the same way (opsOff*).
type sym int

const (
	symGetDeviceList sym = iota
	symFreeDeviceList
	symGetDeviceName
	symGetDeviceGUID
	symOpenDevice
	symCloseDevice
	symQueryDevice
	symQueryPort
	symQueryGID
	symAllocPD
	symDeallocPD
	symRegMR
	symDeregMR
	symCreateCompChannel
	symDestroyCompChannel
	symCreateCQ
	symDestroyCQ
	symGetCQEvent
	symAckCQEvents
	symCreateQP
	symModifyQP
	symQueryQP
	symDestroyQP
	// Optional: newer than the oldest rdma-core the package runs on.
	symQueryGIDEx    // rdma-core 32
	symQueryGIDTable // rdma-core 32
	symRegDMABufMR   // rdma-core 34
	numSyms
)

// symbols are the names, and whether a library without them is still used
// (the verbs that need them then fail with EOPNOTSUPP).
var symbols = [numSyms]struct {
	name     string
	optional bool
}{
	symGetDeviceList:      {"ibv_get_device_list", false},
	symFreeDeviceList:     {"ibv_free_device_list", false},
	symGetDeviceName:      {"ibv_get_device_name", false},
	symGetDeviceGUID:      {"ibv_get_device_guid", false},
	symOpenDevice:         {"ibv_open_device", false},
	symCloseDevice:        {"ibv_close_device", false},
	symQueryDevice:        {"ibv_query_device", false},
	symQueryPort:          {"ibv_query_port", false},
	symQueryGID:           {"ibv_query_gid", false},
	symAllocPD:            {"ibv_alloc_pd", false},
	symDeallocPD:          {"ibv_dealloc_pd", false},
	symRegMR:              {"ibv_reg_mr", false},
	symDeregMR:            {"ibv_dereg_mr", false},
	symCreateCompChannel:  {"ibv_create_comp_channel", false},
	symDestroyCompChannel: {"ibv_destroy_comp_channel", false},
	symCreateCQ:           {"ibv_create_cq", false},
	symDestroyCQ:          {"ibv_destroy_cq", false},
	symGetCQEvent:         {"ibv_get_cq_event", false},
	symAckCQEvents:        {"ibv_ack_cq_events", false},
	symCreateQP:           {"ibv_create_qp", false},
	symModifyQP:           {"ibv_modify_qp", false},
	symQueryQP:            {"ibv_query_qp", false},
	symDestroyQP:          {"ibv_destroy_qp", false},
	symQueryGIDEx:         {"_ibv_query_gid_ex", true},
	symQueryGIDTable:      {"_ibv_query_gid_table", true},
	symRegDMABufMR:        {"ibv_reg_dmabuf_mr", true},
}

// library is libibverbs loaded into the process, with the functions the
// package calls resolved.
type library struct {
	path string
	fn   [numSyms]uintptr
	// errnoLocation is libc's __errno_location: the verbs that return NULL
	// or -1 leave their reason in the calling thread's errno.
	errnoLocation uintptr
	missing       []string // optional symbols the library lacks
}

// loaded is the process's one libibverbs. A driver library, once loaded,
// stays loaded for the life of the process (libibverbs keeps provider
// libraries and device state that must outlive any handle), so this is the
// package's one piece of process-wide state, set once.
var loaded struct {
	once sync.Once
	lib  *library
	err  error
}

// Load loads libibverbs ($GDRLINK_LIBIBVERBS, or DefaultLibrary) once per
// process and resolves its functions. It returns nil when the library is
// usable, or an error wrapping ErrUnavailable that says why (not installed,
// or too old: the missing functions are named). Every verb calls it; callers
// use it to ask whether RDMA is possible at all.
func Load() error {
	_, err := lib()
	return err
}

// LibraryInfo reports the library Load loaded and the optional functions it
// lacks (each such verb fails with EOPNOTSUPP), or Load's error.
func LibraryInfo() (path string, missing []string, err error) {
	l, err := lib()
	if err != nil {
		return "", nil, err
	}
	return l.path, append([]string(nil), l.missing...), nil
}

func lib() (*library, error) {
	loaded.once.Do(func() {
		path := os.Getenv(LibraryEnv)
		if path == "" {
			path = DefaultLibrary
		}
		loaded.lib, loaded.err = open(path)
	})
	return loaded.lib, loaded.err
}

// open loads the library at path and resolves its symbols. It never
// unloads a library it loaded, even a too-old one: dlclose of a library that
// started provider threads is not safe.
func open(path string) (*library, error) {
	h, err := dlopen(path)
	if err != nil {
		return nil, fmt.Errorf("%w: dlopen %s: %v (install rdma-core's libibverbs: Debian's libibverbs1 and ibverbs-providers)", ErrUnavailable, path, err)
	}
	l := &library{path: path}
	var required []string
	for i, s := range symbols {
		p, err := purego.Dlsym(h, s.name)
		if err != nil || p == 0 {
			if s.optional {
				l.missing = append(l.missing, s.name)
			} else {
				required = append(required, s.name)
			}
			continue
		}
		l.fn[i] = p
	}
	if len(required) > 0 {
		return nil, fmt.Errorf("%w: %s lacks %s (libibverbs older than 1.1?)", ErrUnavailable, path, strings.Join(required, ", "))
	}
	l.errnoLocation, err = purego.Dlsym(purego.RTLD_DEFAULT, "__errno_location")
	if err != nil || l.errnoLocation == 0 {
		return nil, fmt.Errorf("%w: no __errno_location in the process (not a glibc or musl system?): %v", ErrUnavailable, err)
	}
	return l, nil
}

// dlopen loads a library on one OS thread, since dlerror's message is per
// thread.
func dlopen(path string) (uintptr, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	h, err := purego.Dlopen(path, purego.RTLD_NOW|purego.RTLD_LOCAL)
	if err != nil && err.Error() == "" {
		err = errors.New("not found in the loader's search path, or not loadable")
	}
	return h, err
}

// call calls function s with integer and pointer arguments and returns its
// first result register. Pointers to Go variables passed as
// uintptr(unsafe.Pointer(&v)) in the argument list stay alive and in place
// until the call returns (go:uintptrescapes moves them to the heap).
//
//go:uintptrescapes
func (l *library) call(s sym, args ...uintptr) uintptr {
	r1, _, _ := purego.SyscallN(l.fn[s], args...)
	return r1
}

// callErrno is call for the verbs that report failure through errno: it
// clears errno, calls, and reads errno on the same OS thread.
//
//go:uintptrescapes
func (l *library) callErrno(s sym, args ...uintptr) (uintptr, syscall.Errno) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	loc, _, _ := purego.SyscallN(l.errnoLocation)
	ep := (*int32)(ptrAt(loc, 0))
	*ep = 0
	r1, _, _ := purego.SyscallN(l.fn[s], args...)
	return r1, syscall.Errno(*ep)
}

// callFnErrno is callErrno for a function found at run time (an entry of
// a context's ops table) rather than by name.
//
//go:uintptrescapes
func (l *library) callFnErrno(fn uintptr, args ...uintptr) (uintptr, syscall.Errno) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	loc, _, _ := purego.SyscallN(l.errnoLocation)
	ep := (*int32)(ptrAt(loc, 0))
	*ep = 0
	r1, _, _ := purego.SyscallN(fn, args...)
	return r1, syscall.Errno(*ep)
}

// has reports whether the optional function s was found.
func (l *library) has(s sym) bool { return l.fn[s] != 0 }

// ptrAt is p+off as a pointer to memory libibverbs owns (off the Go heap).
func ptrAt(p uintptr, off int) unsafe.Pointer {
	return unsafe.Add(*(*unsafe.Pointer)(unsafe.Pointer(&p)), off)
}

// cString copies the NUL-terminated string at p, owned by libibverbs.
func cString(p uintptr, max int) string {
	if p == 0 {
		return ""
	}
	n := 0
	for n < max && *(*byte)(ptrAt(p, n)) != 0 {
		n++
	}
	return string(unsafe.Slice((*byte)(ptrAt(p, 0)), n))
}

// Field readers of C structures at an address.
func u8At(p uintptr, off int) uint8   { return *(*uint8)(ptrAt(p, off)) }
func u16At(p uintptr, off int) uint16 { return *(*uint16)(ptrAt(p, off)) }
func u32At(p uintptr, off int) uint32 { return *(*uint32)(ptrAt(p, off)) }
func u64At(p uintptr, off int) uint64 { return *(*uint64)(ptrAt(p, off)) }
func ptrField(p uintptr, off int) uintptr {
	return *(*uintptr)(ptrAt(p, off))
}

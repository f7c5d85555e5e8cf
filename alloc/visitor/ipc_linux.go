package visitor

import (
	"fmt"
	"strconv"
	"strings"
	"sync"
	"unsafe"

	"github.com/gdrlink/gdrlink/alloc"
	"golang.org/x/sys/unix"
)

// ipcExporter is the visitor NewIPCExport returns.
type ipcExporter struct{}

// IPCExport is the handle the IPC-export visitor attaches to an arena. The visitor owns
// FD and closes it when the arena is released: a user that keeps it longer
// duplicates it.
type IPCExport struct {
	// FD maps the arena's memory from offset 0 (close-on-exec).
	FD int
	// Size is the arena's size in bytes.
	Size int
	// Name is the memfd's name ("gdrlink.3"), for logs and peers.
	Name string
	// Base is the arena's address in this process: an address addr of the
	// arena is at offset addr-Base of the exported memory.
	Base uintptr
	// ArenaID is the arena's ID in its pool.
	ArenaID int
}

type ipcKey struct{}

// NewIPCExport returns a visitor for arenas of a memfd source
// (alloc.NewMemfdSource): it duplicates each arena's file descriptor and
// attaches an IPCExport (IPCExportOf), which an on-node peer uses to map the
// same memory with MapExport (the descriptor travels over a unix socket with
// SCM_RIGHTS, or is opened as /proc/PID/fd/N). Arenas with no descriptor
// fail.
func NewIPCExport() alloc.Visitor { return &ipcExporter{} }

// Name is "ipc-export".
func (*ipcExporter) Name() string { return "ipc-export" }

// Visit duplicates the arena's descriptor and attaches an IPCExport.
func (*ipcExporter) Visit(a *alloc.Arena) error {
	if _, ok := a.Handle(ipcKey{}); ok {
		return fmt.Errorf("%w: ipc export of %s", errAlreadyVisited, a)
	}
	r := a.Region()
	if r.FD < 0 || r.Device.IsGPU() {
		return fmt.Errorf("%w: %s comes from a source without a memfd (use alloc.NewMemfdSource)", errNotShareable, a)
	}
	fd, err := unix.FcntlInt(uintptr(r.FD), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("%w: dup of fd %d of %s: %w", errExport, r.FD, a, err)
	}
	a.SetHandle(ipcKey{}, IPCExport{FD: fd, Size: a.Size(), Name: memfdName(fd, a.ID), Base: a.Base(), ArenaID: a.ID})
	return nil
}

// Release closes the duplicated descriptor.
func (*ipcExporter) Release(a *alloc.Arena) error {
	e, ok := IPCExportOf(a)
	if !ok {
		return fmt.Errorf("%w: ipc export of %s", errNotVisited, a)
	}
	a.DeleteHandle(ipcKey{})
	if err := unix.Close(e.FD); err != nil {
		return fmt.Errorf("%w: close of fd %d of %s: %w", errExport, e.FD, a, err)
	}
	return nil
}

// IPCExportOf returns the IPCExport of an arena, if the IPC-export visitor
// visited it.
func IPCExportOf(a *alloc.Arena) (IPCExport, bool) {
	h, ok := a.Handle(ipcKey{})
	if !ok {
		return IPCExport{}, false
	}
	e, ok := h.(IPCExport)
	return e, ok
}

// offset is the offset of [addr, addr+n) in the exported memory, false when
// the range is not inside the arena.
func (e IPCExport) offset(addr uintptr, n int) (int64, bool) {
	if addr < e.Base || n < 0 || uint64(addr-e.Base)+uint64(n) > uint64(e.Size) {
		return 0, false
	}
	return int64(addr - e.Base), true
}

// memfdName reads the memfd's name back from /proc/self/fd ("/memfd:NAME
// (deleted)"); it falls back to "arena-ID".
func memfdName(fd, id int) string {
	buf := make([]byte, 256)
	n, err := unix.Readlink("/proc/self/fd/"+strconv.Itoa(fd), buf)
	if err != nil {
		return "arena-" + strconv.Itoa(id)
	}
	name := strings.TrimSuffix(string(buf[:n]), " (deleted)")
	return strings.TrimPrefix(name, "/memfd:")
}

// Mapped is a peer's mapping of an exported arena.
type Mapped struct {
	mu  sync.Mutex
	mem []byte
}

// MapExport maps size bytes of an exported descriptor (received from the
// exporting process) read-write and shared, so that writes on either side
// are seen by the other. The caller still owns fd and may close it once the
// mapping exists.
func MapExport(fd, size int) (*Mapped, error) {
	if fd < 0 || size <= 0 {
		return nil, fmt.Errorf("%w: map of fd %d, %d bytes", errExport, fd, size)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("%w: fstat of fd %d: %w", errExport, fd, err)
	}
	if st.Size < int64(size) {
		return nil, fmt.Errorf("%w: fd %d holds %d bytes, %d asked", errExport, fd, st.Size, size)
	}
	p, err := unix.MmapPtr(fd, 0, nil, uintptr(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("%w: mmap of fd %d, %d bytes: %w", errExport, fd, size, err)
	}
	return &Mapped{mem: unsafe.Slice((*byte)(p), size)}, nil
}

// Bytes is the mapped memory; nil after Close.
func (m *Mapped) Bytes() []byte {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.mem
}

// Close unmaps the memory. It is idempotent.
func (m *Mapped) Close() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.mem == nil {
		return nil
	}
	mem := m.mem
	m.mem = nil
	if err := unix.MunmapPtr(unsafe.Pointer(&mem[0]), uintptr(len(mem))); err != nil {
		return fmt.Errorf("%w: munmap: %w", errExport, err)
	}
	return nil
}

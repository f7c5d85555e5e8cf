package alloc

import (
	"errors"
	"fmt"
	"sync/atomic"
	"unsafe"

	"github.com/gdrlink/gdrlink/tensor"
	"golang.org/x/sys/unix"
)

// hugePageSize is the size of a transparent huge page on x86-64 and arm64
// with 4 KiB pages; regions asked to use huge pages are aligned to it.
const hugePageSize = 2 << 20

// MmapOptions are the best-effort settings of the mmap and memfd sources.
// What the kernel refuses is recorded in Region.Notes; the region is still
// made.
type MmapOptions struct {
	// HugePages rounds regions to 2 MiB, aligns them to 2 MiB and advises
	// transparent huge pages (MADV_HUGEPAGE).
	HugePages bool
	// Populate faults every page in when the region is made
	// (MADV_POPULATE_WRITE, or touching each page on kernels without it), so
	// that the first tensor does not pay for page faults.
	Populate bool
	// BindNUMA binds the region's pages to NUMANode (mbind MPOL_BIND). The
	// zero value leaves the memory policy alone.
	BindNUMA bool
	// NUMANode is the node BindNUMA binds to; a negative node leaves the
	// policy alone even when BindNUMA is set.
	NUMANode int
}

// mapping is a region's bookkeeping in Region.Private.
type mapping struct {
	src   *mmapSource
	fd    int
	freed atomic.Bool
}

// mmapSource makes anonymous or memfd-backed regions.
type mmapSource struct {
	opts  MmapOptions
	memfd bool
	name  string
	seq   atomic.Uint64
}

// NewMmapSource returns a source of anonymous private mappings off the Go
// heap (mmap MAP_PRIVATE|MAP_ANONYMOUS). Regions are page-aligned.
func NewMmapSource(opts MmapOptions) Source {
	return &mmapSource{opts: opts, name: "mmap"}
}

// NewMemfdSource returns a source of shared mappings of memfds (memfd_create
// then mmap MAP_SHARED). Each region's FD maps the same memory, so an on-node
// peer given the descriptor (over a unix socket, or through /proc/PID/fd)
// maps the arena too. The memfds are sealed against shrinking and growing,
// so a peer cannot truncate them under the pool. Each memfd is named
// "name.N" (visible in /proc/PID/fd).
func NewMemfdSource(name string, opts MmapOptions) Source {
	if name == "" {
		name = "gdrlink"
	}
	return &mmapSource{opts: opts, memfd: true, name: name}
}

// Name is "mmap" or "memfd:NAME".
func (s *mmapSource) Name() string {
	if s.memfd {
		return "memfd:" + s.name
	}
	return "mmap"
}

// Device is the host.
func (s *mmapSource) Device() tensor.Device { return tensor.Host }

// Alloc maps a region of at least size bytes, rounded up to the page size
// (2 MiB with HugePages).
func (s *mmapSource) Alloc(size int) (*Region, error) {
	page := unix.Getpagesize()
	align := page
	if s.opts.HugePages {
		align = max(page, hugePageSize)
	}
	if size <= 0 || size > maxAlloc {
		return nil, fmt.Errorf("%w: %s region of %d bytes", ErrBadSize, s.Name(), size)
	}
	size = alignUp(size, align)
	fd := -1
	r := &Region{Size: size, Device: tensor.Host, FD: -1}
	if s.memfd {
		var err error
		fdName := fmt.Sprintf("%s.%d", s.name, s.seq.Add(1))
		if fd, err = unix.MemfdCreate(fdName, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING); err != nil {
			return nil, fmt.Errorf("%s: memfd_create %q: %w", s.Name(), fdName, err)
		}
		if err := unix.Ftruncate(fd, int64(size)); err != nil {
			unix.Close(fd)
			return nil, fmt.Errorf("%s: ftruncate memfd to %d bytes: %w", s.Name(), size, err)
		}
		if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW); err != nil {
			r.Notes = append(r.Notes, fmt.Sprintf("F_SEAL_SHRINK|F_SEAL_GROW refused: %v", err))
		}
		r.FD = fd
	}
	base, err := mapAligned(size, align, fd)
	if err != nil {
		if fd >= 0 {
			unix.Close(fd)
		}
		return nil, fmt.Errorf("%s: mmap of %d bytes: %w", s.Name(), size, err)
	}
	r.Base = base
	r.Private = &mapping{src: s, fd: fd}
	mem := r.hostBytes()
	if s.opts.BindNUMA && s.opts.NUMANode >= 0 {
		if err := bindNode(base, size, s.opts.NUMANode); err != nil {
			r.Notes = append(r.Notes, fmt.Sprintf("mbind MPOL_BIND to NUMA node %d refused: %v", s.opts.NUMANode, err))
		}
	}
	if s.opts.HugePages {
		if err := unix.Madvise(mem, unix.MADV_HUGEPAGE); err != nil {
			r.Notes = append(r.Notes, fmt.Sprintf("MADV_HUGEPAGE refused: %v", err))
		}
	}
	if s.opts.Populate {
		if err := unix.Madvise(mem, unix.MADV_POPULATE_WRITE); err != nil {
			if !errors.Is(err, unix.EINVAL) {
				r.Notes = append(r.Notes, fmt.Sprintf("MADV_POPULATE_WRITE refused: %v; pages fault in on first use", err))
			} else {
				r.Notes = append(r.Notes, "MADV_POPULATE_WRITE not supported by this kernel: pages touched one by one")
				for i := 0; i < len(mem); i += page {
					mem[i] = 0
				}
			}
		}
	}
	return r, nil
}

// Free unmaps the region and closes its memfd. A second Free of the same
// region does nothing; a region of another source fails with ErrNotOwned.
func (s *mmapSource) Free(r *Region) error {
	if r == nil {
		return fmt.Errorf("%w: nil region", ErrNotOwned)
	}
	m, ok := r.Private.(*mapping)
	if !ok || m.src != s {
		return fmt.Errorf("%w: region [%#x+%d] was not made by source %s", ErrNotOwned, r.Base, r.Size, s.Name())
	}
	if m.freed.Swap(true) {
		return nil
	}
	var errs []error
	if err := unix.MunmapPtr(pointer(r.Base), uintptr(r.Size)); err != nil {
		errs = append(errs, fmt.Errorf("%s: munmap [%#x+%d]: %w", s.Name(), r.Base, r.Size, err))
	}
	if m.fd >= 0 {
		if err := unix.Close(m.fd); err != nil {
			errs = append(errs, fmt.Errorf("%s: close memfd %d: %w", s.Name(), m.fd, err))
		}
	}
	return errors.Join(errs...)
}

// Close implements Source. The mmap and memfd sources hold nothing between
// regions: the pool frees each region it took, so Close has nothing to do.
func (s *mmapSource) Close() error { return nil }

// mapAligned maps size bytes read-write at an address aligned to align: of
// fd (MAP_SHARED) when fd >= 0, anonymous and private otherwise. For an
// alignment above the page size it reserves size+align bytes of address
// space, maps over the aligned part and unmaps the slack.
func mapAligned(size, align, fd int) (uintptr, error) {
	flags := unix.MAP_PRIVATE | unix.MAP_ANONYMOUS
	if fd >= 0 {
		flags = unix.MAP_SHARED
	}
	prot := unix.PROT_READ | unix.PROT_WRITE
	if align <= unix.Getpagesize() {
		p, err := unix.MmapPtr(fd, 0, nil, uintptr(size), prot, flags)
		return uintptr(p), err
	}
	total := uintptr(size + align)
	raw, err := unix.MmapPtr(-1, 0, nil, total, unix.PROT_NONE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_NORESERVE)
	if err != nil {
		return 0, err
	}
	start := uintptr(raw)
	base := (start + uintptr(align) - 1) &^ (uintptr(align) - 1)
	if _, err := unix.MmapPtr(fd, 0, pointer(base), uintptr(size), prot, flags|unix.MAP_FIXED); err != nil {
		unix.MunmapPtr(raw, total)
		return 0, err
	}
	if head := base - start; head > 0 {
		unix.MunmapPtr(raw, head)
	}
	if tail := start + total - (base + uintptr(size)); tail > 0 {
		unix.MunmapPtr(pointer(base+uintptr(size)), tail)
	}
	return base, nil
}

// bindNode sets the MPOL_BIND policy of [base, base+size) to one node.
func bindNode(base uintptr, size, node int) error {
	if node >= 1<<16 {
		return fmt.Errorf("node %d out of range: %w", node, unix.EINVAL)
	}
	mask := make([]uint64, node/64+1)
	mask[node/64] = 1 << (node % 64)
	// The kernel reads maxnode-1 bits of the mask.
	_, _, errno := unix.Syscall6(unix.SYS_MBIND, base, uintptr(size), unix.MPOL_BIND,
		uintptr(unsafe.Pointer(&mask[0])), uintptr(len(mask)*64+1), 0)
	if errno != 0 {
		return errno
	}
	return nil
}

package main

import (
	"fmt"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// xferHugePage is the x86-64 transparent huge page size buffers align to.
const xferHugePage = 2 << 20

// xferMemKind is the kind of memory a transfer's buffer lives in.
type xferMemKind string

const (
	memAnon4K xferMemKind = "anon-4k" // anonymous, huge pages refused
	memTHP    xferMemKind = "anon-thp"
	memMemfd  xferMemKind = "memfd" // a shared file: what peers can map
)

// xferMem is size bytes off the Go heap.
type xferMem struct {
	b    []byte
	raw  []byte
	fd   int
	kind xferMemKind
}

// newXferMem maps size bytes of kind and touches every page, so no first
// touch is timed.
func newXferMem(kind xferMemKind, size int) (*xferMem, error) {
	m := &xferMem{fd: -1, kind: kind}
	switch kind {
	case memAnon4K, memTHP:
		raw, err := unix.Mmap(-1, 0, size+xferHugePage, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
		if err != nil {
			return nil, fmt.Errorf("mmap %d bytes: %w", size, err)
		}
		off := int((xferHugePage - uintptr(unsafe.Pointer(&raw[0]))%xferHugePage) % xferHugePage)
		m.raw, m.b = raw, raw[off:off+size:off+size]
		advice := unix.MADV_NOHUGEPAGE
		if kind == memTHP {
			advice = unix.MADV_HUGEPAGE
		}
		_ = unix.Madvise(m.b, advice) // best effort: the note says what we got
	case memMemfd:
		fd, err := unix.MemfdCreate("gdrlink-bench-xfer", unix.MFD_CLOEXEC)
		if err != nil {
			return nil, fmt.Errorf("memfd_create: %w", err)
		}
		if err := unix.Ftruncate(fd, int64(size)); err != nil {
			unix.Close(fd)
			return nil, fmt.Errorf("ftruncate memfd: %w", err)
		}
		b, err := unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
		if err != nil {
			unix.Close(fd)
			return nil, fmt.Errorf("mmap memfd: %w", err)
		}
		m.raw, m.b, m.fd = b, b, fd
	default:
		return nil, fmt.Errorf("memory kind %q", kind)
	}
	for i := 0; i < len(m.b); i += 4096 {
		m.b[i] = byte(i >> 12)
	}
	return m, nil
}

func (m *xferMem) addr() uintptr { return uintptr(unsafe.Pointer(&m.b[0])) }

// Close unmaps the memory; idempotent.
func (m *xferMem) Close() error {
	if m.raw == nil {
		return nil
	}
	err := unix.Munmap(m.raw)
	if m.fd >= 0 {
		unix.Close(m.fd)
	}
	m.raw, m.b, m.fd = nil, nil, -1
	return err
}

// memcpyBaseline is the single-thread copy that a same-host transfer is held
// against: from the transfer's own source buffer into memory like the
// receiver's target, the same bytes over and over as the transfer does.
type memcpyBaseline struct {
	src *xferMem // borrowed
	dst *xferMem
}

func newMemcpyBaseline(src *xferMem, dst xferMemKind) (*memcpyBaseline, error) {
	d, err := newXferMem(dst, len(src.b))
	if err != nil {
		return nil, err
	}
	return &memcpyBaseline{src: src, dst: d}, nil
}

func (b *memcpyBaseline) name() string {
	return fmt.Sprintf("memcpy %s→%s", b.src.kind, b.dst.kind)
}

// copies copies size bytes iters times.
func (b *memcpyBaseline) copies(size, iters int) {
	for range iters {
		copy(b.dst.b[:size], b.src.b[:size])
	}
}

// Close frees the target buffer; idempotent.
func (b *memcpyBaseline) Close() error { return b.dst.Close() }

func joinErr(errs ...error) error {
	for _, e := range errs {
		if e != nil {
			return e
		}
	}
	return nil
}

// sinceUS is the time since t in microseconds.
func sinceUS(t time.Time) float64 { return float64(time.Since(t).Nanoseconds()) / 1e3 }

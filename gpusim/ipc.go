package gpusim

import (
	"fmt"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/gdrlink/gdrlink/proxy"
)

// What a simulated device offers in place of CUDA IPC, reached by a type
// assertion on the Device that New returns (the methods below): an
// allocation of a shareable device (Config.Shareable) exported as a memfd
// descriptor (the simulated counterpart of cuIpcGetMemHandle or
// cuMemExportToShareableHandle), opened by another process's simulated
// device as device memory of its own (cuIpcOpenMemHandle), and
// device-to-device copies between the two (cuMemcpyDtoDAsync).
type simulatedIPC interface {
	ExportSimulatedHandle(p proxy.DevicePtr) (fd int, size int, err error)
	OpenSimulatedHandle(fd int, size int) (proxy.DevicePtr, error)
	CopyDtoDAsync(dst, src proxy.DevicePtr, n int, st proxy.Stream) error
}

var _ simulatedIPC = (*device)(nil)

// shareableMem makes a sealed memfd of n bytes and maps it shared.
func shareableMem(name string, n int) (int, []byte, error) {
	fd, err := unix.MemfdCreate("gpusim:"+name, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return -1, nil, err
	}
	if err := unix.Ftruncate(fd, int64(n)); err != nil {
		unix.Close(fd)
		return -1, nil, err
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW|unix.F_SEAL_SEAL); err != nil {
		unix.Close(fd)
		return -1, nil, err
	}
	mem, err := unix.Mmap(fd, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		unix.Close(fd)
		return -1, nil, err
	}
	return fd, mem, nil
}

// Shareable reports whether the device was made with Config.Shareable:
// its allocations can be exported (ExportSimulatedHandle).
func (d *device) Shareable() bool { return d.cfg.Shareable }

// ExportSimulatedHandle returns a new close-on-exec descriptor of the
// allocation that starts at p, and its size; the caller owns the
// descriptor. It fails with proxy.ErrWrongMemory when p does not start an
// allocation of this device or the device is not shareable.
func (d *device) ExportSimulatedHandle(p proxy.DevicePtr) (int, int, error) {
	if err := d.usable(); err != nil {
		return -1, 0, err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	fd, ok := d.fds[uintptr(p)]
	if !ok {
		return -1, 0, fmt.Errorf("%w: %#x does not start a shareable allocation of simulated device %s", proxy.ErrWrongMemory, p, d.cfg.Name)
	}
	nfd, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return -1, 0, fmt.Errorf("simulated export of %#x: %w", p, err)
	}
	return nfd, len(d.mems[uintptr(p)]), nil
}

// OpenSimulatedHandle maps size bytes of a descriptor another process's
// device exported, as device memory of this device, and returns its
// address; the caller still owns fd. Free unmaps it. The descriptor must be
// a memfd sealed against shrinking and hold at least size bytes.
func (d *device) OpenSimulatedHandle(fd int, size int) (proxy.DevicePtr, error) {
	if err := d.usable(); err != nil {
		return 0, err
	}
	if fd < 0 || size <= 0 {
		return 0, fmt.Errorf("%w: simulated handle fd %d, %d bytes", proxy.ErrOutOfRange, fd, size)
	}
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil || seals&unix.F_SEAL_SHRINK == 0 {
		return 0, fmt.Errorf("%w: simulated handle fd %d is not a memfd sealed against shrinking", proxy.ErrWrongMemory, fd)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || st.Size < int64(size) {
		return 0, fmt.Errorf("%w: simulated handle fd %d holds %d bytes, %d asked", proxy.ErrOutOfRange, fd, st.Size, size)
	}
	mem, err := unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return 0, fmt.Errorf("%w: mmap of simulated handle: %w", proxy.ErrDeviceMemory, err)
	}
	base := uintptr(unsafe.Pointer(&mem[0]))
	d.mu.Lock()
	defer d.mu.Unlock()
	d.allocs = d.allocs.insert(span{base, size})
	d.mems[base] = mem
	d.opened[base] = true
	return proxy.DevicePtr(base), nil
}

// CopyDtoDAsync queues a copy of n bytes between two device ranges of this
// device (either may be an opened handle) on st.
func (d *device) CopyDtoDAsync(dst, src proxy.DevicePtr, n int, st proxy.Stream) error {
	if err := d.usable(); err != nil {
		return err
	}
	s, err := d.streamOf(st)
	if err != nil {
		return err
	}
	if n <= 0 {
		return fmt.Errorf("%w: copy of %d bytes", proxy.ErrOutOfRange, n)
	}
	d.mu.Lock()
	okDst, okSrc := d.allocs.find(uintptr(dst), n) >= 0, d.allocs.find(uintptr(src), n) >= 0
	d.mu.Unlock()
	if !okDst || !okSrc {
		return fmt.Errorf("%w: DtoD copy of %d bytes %#x -> %#x is outside the allocations of %s", proxy.ErrOutOfRange, n, src, dst, d.cfg.Name)
	}
	return s.push(op{info: CopyInfo{Dir: deviceToDevice, Dst: uintptr(dst), Src: uintptr(src), N: n, Seq: d.seq.Add(1) - 1}})
}

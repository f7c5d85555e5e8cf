package ibv

import (
	"context"
	"errors"
	"fmt"
	"math/bits"
	"os"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"github.com/ebitengine/purego"
	"golang.org/x/sys/unix"
)

// be32 and be64 convert between host and network byte order; the package
// runs on little-endian 64-bit Linux (amd64, arm64).
func be32(v uint32) uint32 { return bits.ReverseBytes32(v) }
func be64(v uint64) uint64 { return bits.ReverseBytes64(v) }

// errnoOf turns a verb's return value (an errno, or its negation) into an
// Errno; EIO when the verb gave none.
func errnoOf(rc int32) syscall.Errno {
	if rc < 0 {
		rc = -rc
	}
	if rc == 0 {
		return syscall.EIO
	}
	return syscall.Errno(rc)
}

// orEIO is e, or EIO when a verb failed without setting errno.
func orEIO(e syscall.Errno) syscall.Errno {
	if e == 0 {
		return syscall.EIO
	}
	return e
}

// verbErr is the errno of a verb that returned rc != 0: rc itself when
// positive (libibverbs returns errnos), else the errno it left, else EIO.
func verbErr(rc int32, e syscall.Errno) syscall.Errno {
	if rc > 0 {
		return syscall.Errno(rc)
	}
	return orEIO(e)
}

// rc32 reads a C int result.
func rc32(r uintptr) int32 { return int32(uint32(r)) }

// Devices lists the RDMA devices libibverbs sees. An empty list with a nil
// error means libibverbs works but found none.
func Devices() ([]DeviceInfo, error) {
	var out []DeviceInfo
	err := eachDevice(func(l *library, d uintptr, name string) bool {
		out = append(out, DeviceInfo{
			Name:      name,
			NodeGUID:  be64(uint64(l.call(symGetDeviceGUID, d))),
			Transport: int(int32(u32At(d, offDeviceTransport))),
		})
		return true
	})
	return out, err
}

// eachDevice calls fn with every struct ibv_device of libibverbs' device
// list and its name, until fn returns false; the list is freed after.
func eachDevice(fn func(l *library, d uintptr, name string) bool) error {
	l, err := lib()
	if err != nil {
		return err
	}
	var n int32
	list, e := l.callErrno(symGetDeviceList, uintptr(unsafe.Pointer(&n)))
	if list == 0 {
		return &Error{Op: "ibv_get_device_list", Errno: orEIO(e)}
	}
	defer l.call(symFreeDeviceList, list)
	for i := 0; i < int(n); i++ {
		d := ptrField(list, i*8)
		if !fn(l, d, cString(l.call(symGetDeviceName, d), 64)) {
			break
		}
	}
	return nil
}

// Context is an open device.
type Context struct {
	name string
	cnt  *Counters
	l    *library
	// The context's data-path entries (its ops table), read once at Open.
	pollCQ, reqNotifyCQ, postSend, postRecv uintptr
	// The memory-window entries of the ops table; 0 where the provider
	// has none (ibv_alloc_mw then fails with EOPNOTSUPP, as the inline
	// verb does).
	allocMW, deallocMW uintptr

	mu  sync.Mutex
	ctx uintptr
}

// Open opens the device called name.
func Open(name string) (*Context, error) {
	var c *Context
	var oerr error
	err := eachDevice(func(l *library, d uintptr, dn string) bool {
		if dn != name {
			return true
		}
		c, oerr = openDevice(l, d, name)
		return false
	})
	switch {
	case err != nil:
		return nil, err
	case oerr != nil:
		return nil, oerr
	case c == nil:
		return nil, &Error{Op: "ibv_open_device", Device: name, Errno: syscall.ENODEV}
	}
	return c, nil
}

// openDevice opens device d and reads its context's data-path entries.
func openDevice(l *library, d uintptr, name string) (*Context, error) {
	ctx, e := l.callErrno(symOpenDevice, d)
	if ctx == 0 {
		return nil, &Error{Op: "ibv_open_device", Device: name, Errno: orEIO(e)}
	}
	c := &Context{name: name, cnt: new(Counters), l: l, ctx: ctx}
	ops := offContextOps
	c.pollCQ = ptrField(ctx, ops+offOpsPollCQ)
	c.reqNotifyCQ = ptrField(ctx, ops+offOpsReqNotifyCQ)
	c.postSend = ptrField(ctx, ops+offOpsPostSend)
	c.postRecv = ptrField(ctx, ops+offOpsPostRecv)
	c.allocMW = ptrField(ctx, ops+offOpsAllocMW)
	c.deallocMW = ptrField(ctx, ops+offOpsDeallocMW)
	if c.pollCQ == 0 || c.reqNotifyCQ == 0 || c.postSend == 0 || c.postRecv == 0 {
		l.call(symCloseDevice, ctx)
		return nil, &Error{Op: "ibv_open_device", Device: name, Errno: syscall.EOPNOTSUPP, Detail: "the provider fills no data-path entry in the context's ops table"}
	}
	return c, nil
}

// Name is the device's name.
func (c *Context) Name() string { return c.name }

// Counters are the context's crossing counters, shared by everything made
// from it.
func (c *Context) Counters() *Counters { return c.cnt }

func (c *Context) errf(op string, e syscall.Errno, format string, args ...any) error {
	return &Error{Op: op, Device: c.name, Errno: e, Detail: fmt.Sprintf(format, args...)}
}

// live returns the C context or an EBADF error once closed.
func (c *Context) live(op string) (uintptr, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.ctx == 0 {
		return 0, &Error{Op: op, Device: c.name, Errno: syscall.EBADF, Detail: "device closed"}
	}
	return c.ctx, nil
}

// Close closes the device. Idempotent. It fails (EBUSY) while resources
// made from it live.
func (c *Context) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.ctx == 0 {
		return nil
	}
	c.cnt.control.Add(1)
	if rc := rc32(c.l.call(symCloseDevice, c.ctx)); rc != 0 {
		return c.errf("ibv_close_device", errnoOf(rc), "")
	}
	c.ctx = 0
	return nil
}

// QueryDevice reads the device's limits.
func (c *Context) QueryDevice() (DeviceAttr, error) {
	ctx, err := c.live("ibv_query_device")
	if err != nil {
		return DeviceAttr{}, err
	}
	var a [sizeDeviceAttr]byte
	c.cnt.control.Add(1)
	if rc := rc32(c.l.call(symQueryDevice, ctx, uintptr(unsafe.Pointer(&a[0])))); rc != 0 {
		return DeviceAttr{}, c.errf("ibv_query_device", errnoOf(rc), "")
	}
	p := uintptr(unsafe.Pointer(&a[0]))
	i32 := func(off int) int { return int(int32(u32At(p, off))) }
	attr := DeviceAttr{
		FWVersion:       cString(p, 64),
		NodeGUID:        be64(u64At(p, offDevAttrNodeGUID)),
		VendorID:        u32At(p, offDevAttrVendorID),
		VendorPartID:    u32At(p, offDevAttrVendorPartID),
		MaxMRSize:       u64At(p, offDevAttrMaxMRSize),
		MaxQP:           i32(offDevAttrMaxQP),
		MaxQPWR:         i32(offDevAttrMaxQPWR),
		MaxSGE:          i32(offDevAttrMaxSGE),
		MaxCQ:           i32(offDevAttrMaxCQ),
		MaxCQE:          i32(offDevAttrMaxCQE),
		MaxMR:           i32(offDevAttrMaxMR),
		MaxPD:           i32(offDevAttrMaxPD),
		MaxQPRdAtom:     i32(offDevAttrMaxQPRdAtom),
		MaxQPInitRdAtom: i32(offDevAttrMaxQPInitRdAtom),
		PhysPortCount:   int(u8At(p, offDevAttrPhysPortCnt)),
		CapFlags:        u32At(p, offDevAttrDeviceCapFlags),
		MaxMW:           i32(offDevAttrMaxMW),
	}
	return attr, nil
}

// QueryPort reads a port's state (ports count from 1).
func (c *Context) QueryPort(port int) (PortAttr, error) {
	ctx, err := c.live("ibv_query_port")
	if err != nil {
		return PortAttr{}, err
	}
	if port < 1 || port > 255 {
		return PortAttr{}, c.errf("ibv_query_port", syscall.EINVAL, "port %d", port)
	}
	var a [portAttrBuf]byte
	c.cnt.control.Add(1)
	if rc := rc32(c.l.call(symQueryPort, ctx, uintptr(port), uintptr(unsafe.Pointer(&a[0])))); rc != 0 {
		return PortAttr{}, c.errf("ibv_query_port", errnoOf(rc), "port %d", port)
	}
	p := uintptr(unsafe.Pointer(&a[0]))
	return PortAttr{
		State:      int(u32At(p, offPortState)),
		MaxMTU:     MTUBytes(int(u32At(p, offPortMaxMTU))),
		ActiveMTU:  MTUBytes(int(u32At(p, offPortActiveMTU))),
		GIDTblLen:  int(int32(u32At(p, offPortGIDTblLen))),
		PKeyTblLen: int(u16At(p, offPortPKeyTblLen)),
		MaxMsgSize: uint64(u32At(p, offPortMaxMsgSz)),
		LID:        u16At(p, offPortLID),
		SMLID:      u16At(p, offPortSMLID),
		LinkLayer:  int(u8At(p, offPortLinkLayer)),
	}, nil
}

// QueryGID reads one GID table entry with its type (ibv_query_gid_ex).
// Where that verb is not supported (or libibverbs predates it), it reads the
// GID with ibv_query_gid and leaves the type GIDTypeUnknown for the caller
// to find in sysfs. Unused entries fail with ENODATA (or come back all zeros
// from the old verb).
func (c *Context) QueryGID(port, index int) (GIDEntry, error) {
	ctx, err := c.live("ibv_query_gid_ex")
	if err != nil {
		return GIDEntry{}, err
	}
	e := GIDEntry{Index: index, Port: port, Type: GIDTypeUnknown}
	if c.l.has(symQueryGIDEx) {
		var ge gidEntryC
		c.cnt.control.Add(1)
		r, en := c.l.callErrno(symQueryGIDEx, ctx, uintptr(uint32(port)), uintptr(uint32(index)), uintptr(unsafe.Pointer(&ge)), 0, sizeGIDEntry)
		rc := rc32(r)
		if rc == 0 {
			e.GID = ge.GID
			if ge.Type <= 2 { // enum ibv_gid_type: IB, RoCE v1, RoCE v2
				e.Type = GIDType(ge.Type)
			}
			return e, nil
		}
		if en = verbErr(rc, en); en != syscall.EOPNOTSUPP && en != syscall.ENOSYS {
			return e, c.errf("ibv_query_gid_ex", en, "port %d index %d", port, index)
		}
	}
	var g GID
	c.cnt.control.Add(1)
	if r, en := c.l.callErrno(symQueryGID, ctx, uintptr(port), uintptr(index), uintptr(unsafe.Pointer(&g[0]))); rc32(r) != 0 {
		return e, c.errf("ibv_query_gid", orEIO(en), "port %d index %d", port, index)
	}
	e.GID = g
	return e, nil
}

// GIDTable reads every valid GID entry of every port in one call
// (ibv_query_gid_table); max is the total size of the ports' tables. Where
// the verb is not supported, or libibverbs predates it, it fails with
// EOPNOTSUPP, and callers read entries one by one with QueryGID.
func (c *Context) GIDTable(max int) ([]GIDEntry, error) {
	ctx, err := c.live("ibv_query_gid_table")
	if err != nil {
		return nil, err
	}
	if max <= 0 {
		return nil, nil
	}
	if !c.l.has(symQueryGIDTable) {
		return nil, c.errf("ibv_query_gid_table", syscall.EOPNOTSUPP, "%s predates it (rdma-core 32)", c.l.path)
	}
	buf := make([]gidEntryC, max)
	c.cnt.control.Add(1)
	r, en := c.l.callErrno(symQueryGIDTable, ctx, uintptr(unsafe.Pointer(&buf[0])), uintptr(max), 0, sizeGIDEntry)
	n := int64(r)
	if n < 0 {
		if en == 0 && n < -1 {
			en = syscall.Errno(-n)
		}
		return nil, c.errf("ibv_query_gid_table", orEIO(en), "%d entries", max)
	}
	if n > int64(max) {
		n = int64(max)
	}
	out := make([]GIDEntry, 0, int(n))
	for _, e := range buf[:int(n)] {
		t := GIDTypeUnknown
		if e.Type <= 2 {
			t = GIDType(e.Type)
		}
		out = append(out, GIDEntry{Index: int(e.Index), Port: int(e.Port), GID: e.GID, Type: t})
	}
	return out, nil
}

// PD is a protection domain.
type PD struct {
	c  *Context
	mu sync.Mutex
	pd uintptr
}

// AllocPD makes a protection domain.
func (c *Context) AllocPD() (*PD, error) {
	ctx, err := c.live("ibv_alloc_pd")
	if err != nil {
		return nil, err
	}
	c.cnt.control.Add(1)
	pd, e := c.l.callErrno(symAllocPD, ctx)
	if pd == 0 {
		return nil, c.errf("ibv_alloc_pd", orEIO(e), "")
	}
	return &PD{c: c, pd: pd}, nil
}

// Close deallocates the domain. Idempotent; EBUSY while regions or queue
// pairs use it.
func (p *PD) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.pd == 0 {
		return nil
	}
	p.c.cnt.control.Add(1)
	if rc := rc32(p.c.l.call(symDeallocPD, p.pd)); rc != 0 {
		return p.c.errf("ibv_dealloc_pd", errnoOf(rc), "")
	}
	p.pd = 0
	return nil
}

func (p *PD) live(op string) (uintptr, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.pd == 0 {
		return 0, p.c.errf(op, syscall.EBADF, "protection domain closed")
	}
	return p.pd, nil
}

// MR is a registered memory region.
type MR struct {
	c    *Context
	mu   sync.Mutex
	mr   uintptr
	addr uintptr
	n    int
	lkey uint32
	rkey uint32
}

// Addr is the region's first address (its iova for dma-buf regions).
func (m *MR) Addr() uintptr { return m.addr }

// Len is the region's length.
func (m *MR) Len() int { return m.n }

// LKey is the local key.
func (m *MR) LKey() uint32 { return m.lkey }

// RKey is the remote key.
func (m *MR) RKey() uint32 { return m.rkey }

// Close deregisters the region. Idempotent.
func (m *MR) Close() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.mr == 0 {
		return nil
	}
	m.c.cnt.control.Add(1)
	if rc := rc32(m.c.l.call(symDeregMR, m.mr)); rc != 0 {
		return m.c.errf("ibv_dereg_mr", errnoOf(rc), "%#x+%d", m.addr, m.n)
	}
	m.mr = 0
	return nil
}

func (c *Context) newMR(mr, addr uintptr, n int) *MR {
	return &MR{c: c, mr: mr, addr: addr, n: n, lkey: u32At(mr, offMRLKey), rkey: u32At(mr, offMRRKey)}
}

// RegMR registers [addr, addr+length) of this process's memory, which must
// stay mapped (and off the Go heap) until the region is closed.
func (p *PD) RegMR(addr uintptr, length int, access int) (*MR, error) {
	pd, err := p.live("ibv_reg_mr")
	if err != nil {
		return nil, err
	}
	if length <= 0 {
		return nil, p.c.errf("ibv_reg_mr", syscall.EINVAL, "length %d", length)
	}
	p.c.cnt.control.Add(1)
	mr, e := p.c.l.callErrno(symRegMR, pd, addr, uintptr(length), uintptr(access))
	if mr == 0 {
		return nil, p.c.errf("ibv_reg_mr", orEIO(e), "%#x+%d access %#x", addr, length, access)
	}
	return p.c.newMR(mr, addr, length), nil
}

// RegDMABufMR registers length bytes at offset of the dma-buf fd, addressed
// as iova in work requests. Devices without dma-buf support, and libibverbs
// older than rdma-core 34, fail with EOPNOTSUPP.
func (p *PD) RegDMABufMR(offset uint64, length int, iova uint64, fd int, access int) (*MR, error) {
	pd, err := p.live("ibv_reg_dmabuf_mr")
	if err != nil {
		return nil, err
	}
	if length <= 0 {
		return nil, p.c.errf("ibv_reg_dmabuf_mr", syscall.EINVAL, "length %d", length)
	}
	if !p.c.l.has(symRegDMABufMR) {
		return nil, p.c.errf("ibv_reg_dmabuf_mr", syscall.EOPNOTSUPP, "%s predates it (rdma-core 34)", p.c.l.path)
	}
	p.c.cnt.control.Add(1)
	mr, e := p.c.l.callErrno(symRegDMABufMR, pd, uintptr(offset), uintptr(length), uintptr(iova), uintptr(fd), uintptr(access))
	if mr == 0 {
		return nil, p.c.errf("ibv_reg_dmabuf_mr", orEIO(e), "fd %d offset %d len %d", fd, offset, length)
	}
	return p.c.newMR(mr, uintptr(iova), length), nil
}

// scratch is memory off the Go heap that work requests and completions are
// built in, so libibverbs never holds a pointer into Go memory.
type scratch []byte

func newScratch(n int) (scratch, error) {
	n = (n + os.Getpagesize() - 1) &^ (os.Getpagesize() - 1)
	b, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	return scratch(b), err
}

func (s scratch) addr() uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(s))) }

func (s scratch) free() {
	if s != nil {
		_ = unix.Munmap(s)
	}
}

// pollBatch is the most completions one Poll moves in one crossing.
const pollBatch = 256

// CQ is a completion queue with its own completion channel, whose file
// descriptor is non-blocking and waits in Go's network poller.
type CQ struct {
	c *Context

	// mu guards the C objects: users hold it shared, Close exclusively.
	mu   sync.RWMutex
	cq   uintptr
	ch   uintptr
	file *os.File // a dup of the channel's fd, registered with the poller
	raw  syscall.RawConn
	cqe  int
	// pollMu serialises Polls over wcs, pollBatch struct ibv_wc off the heap.
	pollMu sync.Mutex
	// pollArgs are ibv_poll_cq's arguments (under pollMu): a call with a
	// slice of its own would allocate one per poll.
	pollArgs [3]uintptr
	wcs      scratch
	// waitSem admits one waiter at a time on the channel.
	waitSem chan struct{}
}

// CreateCQ makes a completion queue of at least depth entries with a
// completion channel.
func (c *Context) CreateCQ(depth int) (*CQ, error) {
	ctx, err := c.live("ibv_create_cq")
	if err != nil {
		return nil, err
	}
	wcs, err := newScratch(pollBatch * int(unsafe.Sizeof(cWC{})))
	if err != nil {
		return nil, c.errf("mmap", lastErrno(err), "completion batch")
	}
	c.cnt.control.Add(1)
	ch, e := c.l.callErrno(symCreateCompChannel, ctx)
	if ch == 0 {
		wcs.free()
		return nil, c.errf("ibv_create_comp_channel", orEIO(e), "")
	}
	fail := func(err error) (*CQ, error) {
		c.cnt.control.Add(1)
		c.l.call(symDestroyCompChannel, ch)
		wcs.free()
		return nil, err
	}
	fd := int(int32(u32At(ch, offCompChannelFD)))
	if err := unix.SetNonblock(fd, true); err != nil {
		return fail(c.errf("fcntl(O_NONBLOCK)", lastErrno(err), "completion channel fd %d", fd))
	}
	dup, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return fail(c.errf("fcntl(F_DUPFD)", lastErrno(err), "completion channel fd %d", fd))
	}
	f := os.NewFile(uintptr(dup), fmt.Sprintf("ibv-comp-channel-%s", c.name))
	raw, err := f.SyscallConn()
	if err != nil {
		f.Close()
		return fail(c.errf("completion channel", syscall.EIO, "%v", err))
	}
	c.cnt.control.Add(1)
	cq, e := c.l.callErrno(symCreateCQ, ctx, uintptr(depth), 0, ch, 0)
	if cq == 0 {
		f.Close()
		return fail(c.errf("ibv_create_cq", orEIO(e), "depth %d", depth))
	}
	return &CQ{c: c, cq: cq, ch: ch, file: f, raw: raw, cqe: int(int32(u32At(cq, offCQCQE))), wcs: wcs, waitSem: make(chan struct{}, 1)}, nil
}

// lastErrno turns a syscall error into an Errno.
func lastErrno(err error) syscall.Errno {
	var e syscall.Errno
	if errors.As(err, &e) && e != 0 {
		return e
	}
	return syscall.EIO
}

// Depth is the number of entries the queue holds.
func (q *CQ) Depth() int { return q.cqe }

// Close destroys the queue and its channel. Idempotent; EBUSY while queue
// pairs use it (the queue then stays usable).
func (q *CQ) Close() error {
	q.mu.RLock()
	closed := q.cq == 0
	q.mu.RUnlock()
	if closed {
		return nil
	}
	// Closing the poller's file wakes a waiter blocked on the channel, so
	// the exclusive lock below cannot wait on an idle wait forever.
	q.file.Close()
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.cq == 0 {
		return nil
	}
	q.c.cnt.control.Add(1)
	if rc := rc32(q.c.l.call(symDestroyCQ, q.cq)); rc != 0 {
		// Still in use: give the queue a fresh poller file so it stays usable.
		fd := int(int32(u32At(q.ch, offCompChannelFD)))
		if dup, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0); err == nil {
			q.file = os.NewFile(uintptr(dup), q.file.Name())
			q.raw, _ = q.file.SyscallConn()
		}
		return q.c.errf("ibv_destroy_cq", errnoOf(rc), "")
	}
	q.c.cnt.control.Add(1)
	q.c.l.call(symDestroyCompChannel, q.ch)
	q.cq, q.ch = 0, 0
	q.pollMu.Lock()
	q.wcs.free()
	q.wcs = nil
	q.pollMu.Unlock()
	return nil
}

// Poll moves up to len(out) completions (at most 256) into out in one
// crossing into libibverbs.
func (q *CQ) Poll(out []WC) (int, error) {
	if len(out) == 0 {
		return 0, nil
	}
	q.mu.RLock()
	defer q.mu.RUnlock()
	if q.cq == 0 {
		return 0, q.c.errf("ibv_poll_cq", syscall.EBADF, "completion queue closed")
	}
	k := min(len(out), pollBatch)
	q.pollMu.Lock()
	defer q.pollMu.Unlock()
	q.c.cnt.poll.Add(1)
	q.pollArgs = [3]uintptr{q.cq, uintptr(k), q.wcs.addr()}
	r, _, _ := purego.SyscallN(q.c.pollCQ, q.pollArgs[:]...)
	n := rc32(r)
	if n < 0 {
		return 0, q.c.errf("ibv_poll_cq", errnoOf(n), "")
	}
	n = min(n, int32(k))
	wcs := unsafe.Slice((*cWC)(unsafe.Pointer(unsafe.SliceData(q.wcs))), n)
	for i := range wcs {
		w := &wcs[i]
		o := &out[i]
		*o = WC{WRID: w.wrID, Status: w.status, Opcode: w.opcode, VendorErr: w.vendorErr, ByteLen: w.byteLen,
			QPNum: w.qpNum, Flags: w.wcFlags}
		if w.wcFlags&WCWithImm != 0 {
			o.Imm = be32(w.immData)
		}
	}
	q.c.cnt.completions.Add(uint64(n))
	return int(n), nil
}

// Arm asks for a completion event on the channel at the next completion
// (ibv_req_notify_cq).
func (q *CQ) Arm() error {
	q.mu.RLock()
	defer q.mu.RUnlock()
	if q.cq == 0 {
		return q.c.errf("ibv_req_notify_cq", syscall.EBADF, "completion queue closed")
	}
	q.c.cnt.notify.Add(1)
	r, _, _ := purego.SyscallN(q.c.reqNotifyCQ, q.cq, 0)
	if rc := rc32(r); rc != 0 {
		return q.c.errf("ibv_req_notify_cq", errnoOf(rc), "")
	}
	return nil
}

// WaitEvent blocks, in Go's poller and without burning CPU, until the
// channel delivers an event for this queue (after Arm) or ctx ends, then
// acknowledges it. It returns ctx.Err() when ctx ends first.
func (q *CQ) WaitEvent(ctx context.Context) error {
	select {
	case q.waitSem <- struct{}{}:
	case <-ctx.Done():
		return ctx.Err()
	}
	defer func() { <-q.waitSem }()
	q.mu.RLock()
	defer q.mu.RUnlock()
	if q.cq == 0 {
		return q.c.errf("ibv_get_cq_event", syscall.EBADF, "completion queue closed")
	}
	dl, _ := ctx.Deadline()
	if err := q.file.SetReadDeadline(dl); err != nil {
		return q.c.errf("ibv_get_cq_event", syscall.EIO, "%v", err)
	}
	stop := context.AfterFunc(ctx, func() { q.file.SetReadDeadline(time.Unix(1, 0)) })
	defer stop()
	var verr syscall.Errno
	err := q.raw.Read(func(uintptr) bool {
		var got, cqctx uintptr
		q.c.cnt.notify.Add(1)
		r, e := q.c.l.callErrno(symGetCQEvent, q.ch, uintptr(unsafe.Pointer(&got)), uintptr(unsafe.Pointer(&cqctx)))
		if rc32(r) != 0 {
			if e == syscall.EAGAIN {
				return false
			}
			verr = orEIO(e)
			return true
		}
		verr = 0
		q.c.cnt.notify.Add(1)
		q.c.l.call(symAckCQEvents, got, 1)
		return true
	})
	if err != nil {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return context.DeadlineExceeded
		}
		return q.c.errf("ibv_get_cq_event", syscall.EBADF, "%v", err)
	}
	if verr != 0 {
		return q.c.errf("ibv_get_cq_event", verr, "")
	}
	return nil
}

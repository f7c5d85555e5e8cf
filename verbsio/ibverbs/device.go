package ibverbs

import (
	"context"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"errors"

	"github.com/gdrlink/gdrlink/internal/adaptspin"
	"github.com/gdrlink/gdrlink/internal/hostid"
	"github.com/gdrlink/gdrlink/internal/ibv"
	"github.com/gdrlink/gdrlink/internal/ibvdiag"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

// Device is an open RDMA device, one port and one GID of it.
type device struct {
	p    *provider
	c    *ibv.Context
	ch   choice
	cfg  verbsio.Config
	attr ibv.DeviceAttr
	caps verbsio.Caps
	info verbsio.DeviceInfo
	host string
	// dmabufWhy says why dma-buf registration is unavailable ("" if it
	// is); gpuWhy why GPU memory is not among the memory types.
	dmabufWhy, gpuWhy string
	// grants says whether regions give grants through type 2 memory
	// windows (Caps.Grants); grantsWhy why not, or, where windows were
	// forced on a device that does not prove it bounds them, that.
	grants    bool
	grantsWhy string
	// noRelaxed is set when a registration with relaxed ordering was
	// refused (a kernel that predates optional access flags): later
	// registrations ask without it.
	noRelaxed atomic.Bool
	// dmabufRefused is the reason, once a real dma-buf registration was
	// refused as unsupported, that Caps().DMABuf is false after all.
	dmabufRefused atomic.Pointer[string]

	// wake is what a wake-up through the network poller costs here
	// (wakeCost), measured once.
	wakeOnce sync.Once
	wake     time.Duration

	mu       sync.Mutex
	children int
	closed   bool
}

func newDevice(p *provider, c *ibv.Context, ch choice, cfg verbsio.Config) (*device, error) {
	attr, err := c.QueryDevice()
	if err != nil {
		return nil, wrap(err)
	}
	host, _ := hostid.Get()
	d := &device{p: p, c: c, ch: ch, cfg: cfg, attr: attr, host: host, info: p.info(ch.Device, ch.Port.Num)}
	if cfg.QueueDepth > attr.MaxQPWR {
		return nil, fmt.Errorf("%w: RDMA_QP_QUEUE_DEPTH=%d exceeds %s's limit of %d work requests", verbsio.ErrBadConfig, cfg.QueueDepth, ch.Device, attr.MaxQPWR)
	}
	inline, dmabuf, why := d.probe()
	d.dmabufWhy = why
	kinds, gpuWhy := p.memoryTypes(ch.Device, d.info.PCIAddress)
	d.gpuWhy = gpuWhy
	d.grants, d.grantsWhy = decideGrants(d.windowFacts(p.o.windows), p.o.windows)
	d.caps = verbsio.Caps{
		Provider:           Name,
		MemoryTypes:        kinds,
		DMABuf:             dmabuf,
		WriteWithImmediate: true,
		MaxInline:          inline,
		MaxSGE:             attr.MaxSGE,
		MaxQPDepth:         attr.MaxQPWR,
		MaxMessage:         int64(ch.Port.Attr.MaxMsgSize),
		Grants:             d.grants,
	}
	return d, nil
}

// probe learns what the device grants: the largest inline payload a queue
// pair gets, and whether ibv_reg_dmabuf_mr exists (asked with fd -1: a
// device without it answers EOPNOTSUPP before looking at the fd; see
// dmabufProbeVerdict). The first real dma-buf registration settles it
// (RegisterDMABuf).
func (d *device) probe() (inline int, dmabuf bool, why string) {
	pd, err := d.c.AllocPD()
	if err != nil {
		return 0, false, "probe failed: " + err.Error()
	}
	defer pd.Close()
	m, err := pd.RegDMABufMR(0, 4096, 0, -1, ibv.AccessLocalWrite)
	if err == nil {
		m.Close()
	}
	dmabuf, why = dmabufProbeVerdict(d.ch.Device, err)
	cq, err := d.c.CreateCQ(2)
	if err != nil {
		return 0, dmabuf, why
	}
	defer cq.Close()
	for _, want := range []int{512, 256, 128, 64} {
		qp, err := pd.CreateQP(cq, cq, ibv.QPCaps{MaxSendWR: 1, MaxRecvWR: 1, MaxSendSGE: 1, MaxRecvSGE: 1, MaxInline: want})
		if err == nil {
			inline = qp.Caps().MaxInline
			qp.Close()
			break
		}
	}
	return inline, dmabuf, why
}

// dmabufProbeVerdict reads the answer of the probe registration of fd -1.
// Only EBADF, the kernel having looked at the descriptor, counts as dma-buf
// support, and only until the first real registration says otherwise;
// EOPNOTSUPP and ENOSYS say the device has none, and any other answer is
// not counted as support, with the reason.
func dmabufProbeVerdict(dev string, err error) (bool, string) {
	switch {
	case err == nil || errors.Is(err, syscall.EBADF):
		return true, ""
	case errors.Is(err, syscall.EOPNOTSUPP) || errors.Is(err, syscall.ENOSYS):
		return false, fmt.Sprintf("%s has no dma-buf registration (ibv_reg_dmabuf_mr: %v)", dev, err)
	}
	return false, fmt.Sprintf("%s: the dma-buf probe got %v, not the EBADF of a device that has the verb; not counted as support", dev, err)
}

// dmabufRefusal reads the outcome of a real dma-buf registration: a
// non-empty reason when it shows the device has no dma-buf registration
// after all (EOPNOTSUPP or ENOSYS), "" otherwise.
func dmabufRefusal(dev string, err error) string {
	if err != nil && (errors.Is(err, syscall.EOPNOTSUPP) || errors.Is(err, syscall.ENOSYS)) {
		return fmt.Sprintf("%s refused a dma-buf registration (ibv_reg_dmabuf_mr: %v)", dev, err)
	}
	return ""
}

// rxeVendorID is the vendor ID Soft-RoCE (rdma_rxe) reports.
const rxeVendorID = 0xffffff

// retryCount is the transport retry count queue pairs get. The verbs
// specification makes 7 a count of seven retries (only the RNR retry count
// uses 7 for "forever"), but Soft-RoCE takes a retry count of 7 as
// unlimited, so a dead peer would never be reported: there it becomes 6.
func (d *device) retryCount() int {
	if d.cfg.RetryCount == 7 && d.attr.VendorID == rxeVendorID {
		return 6
	}
	return d.cfg.RetryCount
}

// Info implements verbsio.Device.
func (d *device) Info() verbsio.DeviceInfo { return d.info }

// Caps implements verbsio.Device.
func (d *device) Caps() verbsio.Caps {
	c := d.caps
	if d.dmabufRefused.Load() != nil {
		c.DMABuf = false
	}
	c.MemoryTypes = append([]tensor.DeviceKind(nil), c.MemoryTypes...)
	return c
}

// GPUMemoryReason says why Caps().MemoryTypes lacks GPU memory: no GPU
// peer-memory module loaded, or sysfs could not tell; "" when it lists it.
// It implements ibvdiag.Device.
func (d *device) GPUMemoryReason() string { return d.gpuWhy }

// DMABufReason says why Caps().DMABuf is false ("" when it is true): the
// device has no dma-buf registration (Soft-RoCE), or the probe failed. It
// implements ibvdiag.Device.
func (d *device) DMABufReason() string {
	if why := d.dmabufRefused.Load(); why != nil {
		return *why
	}
	return d.dmabufWhy
}

// GrantsReason says why Caps().Grants is false: the device has no type 2
// memory windows, it does not enforce a window's bounds (Soft-RoCE), the
// probe could not tell, or grants were turned off; where windows were
// forced on a device that does not prove it bounds them, it says so although
// Grants is true. "" when grants are on and bounded. It implements
// ibvdiag.Device.
func (d *device) GrantsReason() string { return d.grantsWhy }

// GIDIndex is the GID table index in use (-1 on InfiniBand routes by LID).
// It implements ibvdiag.Device.
func (d *device) GIDIndex() int {
	if !d.ch.Global {
		return -1
	}
	return d.ch.GID.Index
}

// gid is the GID in use and its type.
func (d *device) gid() (string, string) { return d.ch.GID.GID.String(), d.ch.GID.Type.String() }

// mtu is the path MTU this side asks for, in bytes.
func (d *device) mtu() int { return d.ch.MTU }

// String describes the device for people.
func (d *device) String() string {
	return fmt.Sprintf("ibverbs %s port %d gid[%d] %s (%s) mtu %d", d.ch.Device, d.ch.Port.Num, d.ch.GID.Index, d.ch.GID.GID, d.ch.GID.Type, d.ch.MTU)
}

// Stats reads the device's crossing counters (calls into libibverbs). It implements
// ibvdiag.Device.
func (d *device) Stats() ibvdiag.Stats {
	s := d.c.Counters().Snapshot()
	return ibvdiag.Stats{Crossings: s.Crossings(), PostSend: s.PostSend, PostRecv: s.PostRecv, Poll: s.Poll, Notify: s.Notify,
		Control: s.Control, SendWRs: s.SendWRs, RecvWRs: s.RecvWRs, Completions: s.Completions}
}

var _ ibvdiag.Device = (*device)(nil)

var _ verbsio.Granter = (*granterMR)(nil)

func (d *device) addChild() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return fmt.Errorf("%w: device %s", verbsio.ErrClosed, d.ch.Device)
	}
	d.children++
	return nil
}

func (d *device) dropChild() {
	d.mu.Lock()
	d.children--
	d.mu.Unlock()
}

// Close implements verbsio.Device. Idempotent; ErrBusy while protection
// domains or completion queues live.
func (d *device) Close() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil
	}
	if d.children > 0 {
		return fmt.Errorf("%w: device %s has %d live protection domains or completion queues", verbsio.ErrBusy, d.ch.Device, d.children)
	}
	if err := d.c.Close(); err != nil {
		return wrap(err)
	}
	d.closed = true
	return nil
}

// AllocPD implements verbsio.Device.
func (d *device) AllocPD() (verbsio.ProtectionDomain, error) {
	if err := d.addChild(); err != nil {
		return nil, err
	}
	p, err := d.c.AllocPD()
	if err != nil {
		d.dropChild()
		return nil, wrap(err)
	}
	return &pd{d: d, pd: p}, nil
}

// CreateCQ implements verbsio.Device.
func (d *device) CreateCQ(depth int) (verbsio.CompletionQueue, error) {
	if depth < 1 {
		return nil, fmt.Errorf("%w: completion queue depth %d", verbsio.ErrBadConfig, depth)
	}
	if depth > d.attr.MaxCQE {
		return nil, fmt.Errorf("%w: completion queue depth %d exceeds %s's limit of %d", verbsio.ErrBadConfig, depth, d.ch.Device, d.attr.MaxCQE)
	}
	if err := d.addChild(); err != nil {
		return nil, err
	}
	q, err := d.c.CreateCQ(depth)
	if err != nil {
		d.dropChild()
		return nil, wrap(err)
	}
	spin := max(d.p.o.spin, 0)
	policy := adaptspin.New(adaptspin.Bounds{Max: spin, Min: min(spin, adaptspin.DefaultMin), Yield: d.cfg.Yield})
	if w := d.wakeCost(); w > 0 {
		policy.Woke(w)
	}
	return &cq{d: d, q: q, qps: map[uint32]*qpRef{}, scratch: make([]ibv.WC, 64), spin: policy}, nil
}

// wakeProbes is how many wake-ups wakeCost measures (the median counts).
const wakeProbes = 5

// wakeCost is what a wake-up through the network poller costs on this
// host, as a completion channel's waiter pays it: measured at the first
// call (adaptspin.ProbeWake), 0 where it could not be, which leaves the
// queues' polls capped by WithSpin alone.
func (d *device) wakeCost() time.Duration {
	d.wakeOnce.Do(func() {
		if d.p.o.spin <= 0 {
			return // the queues never poll
		}
		// A probe that fails (no pipe to be had) leaves the cap to
		// WithSpin, as before the probe existed.
		if w, err := adaptspin.ProbeWake(wakeProbes); err == nil {
			d.wake = w
		}
	})
	return d.wake
}

type pd struct {
	d  *device
	pd *ibv.PD

	mu       sync.Mutex
	children int
	closed   bool

	// wmu guards the domain's memory windows (grant.go): free are those
	// whose last grant was invalidated, ready for another bind; windows
	// counts every window allocated and not yet deallocated.
	wmu     sync.Mutex
	free    []*ibv.MW
	windows int
}

func (p *pd) addChild() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return fmt.Errorf("%w: protection domain", verbsio.ErrClosed)
	}
	p.children++
	return nil
}

func (p *pd) dropChild() {
	p.mu.Lock()
	p.children--
	p.mu.Unlock()
}

func (p *pd) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil
	}
	if p.children > 0 {
		return fmt.Errorf("%w: protection domain has %d live memory regions or queue pairs", verbsio.ErrBusy, p.children)
	}
	if err := p.closeWindows(); err != nil {
		return err
	}
	if err := p.pd.Close(); err != nil {
		return wrap(err)
	}
	p.closed = true
	p.d.dropChild()
	return nil
}

const knownAccess = verbsio.AccessLocalWrite | verbsio.AccessRemoteWrite | verbsio.AccessRemoteRead

// ibvAccess converts access flags. Verbs require local write with remote
// write, so remote write implies it.
func ibvAccess(a verbsio.Access) (verbsio.Access, int) {
	if a&verbsio.AccessRemoteWrite != 0 {
		a |= verbsio.AccessLocalWrite
	}
	f := 0
	if a&verbsio.AccessLocalWrite != 0 {
		f |= ibv.AccessLocalWrite
	}
	if a&verbsio.AccessRemoteWrite != 0 {
		f |= ibv.AccessRemoteWrite
	}
	if a&verbsio.AccessRemoteRead != 0 {
		f |= ibv.AccessRemoteRead
	}
	return a, f
}

func (p *pd) RegisterMemory(addr uintptr, length int, access verbsio.Access) (verbsio.MemoryRegion, error) {
	if access&^knownAccess != 0 {
		return nil, fmt.Errorf("%w: unknown access flags %#x", verbsio.ErrBadConfig, uint32(access&^knownAccess))
	}
	if addr == 0 || length <= 0 {
		return nil, fmt.Errorf("%w: register %#x+%d: empty or null range", verbsio.ErrBadConfig, addr, length)
	}
	if uint64(length) > p.d.attr.MaxMRSize {
		return nil, fmt.Errorf("%w: register %d bytes: %s registers at most %d", verbsio.ErrNotSupported, length, p.d.ch.Device, p.d.attr.MaxMRSize)
	}
	if err := p.addChild(); err != nil {
		return nil, err
	}
	eff, flags := ibvAccess(access)
	if p.d.grants {
		flags |= ibv.AccessMWBind
	}
	m, err := p.pd.RegMR(addr, length, flags)
	if err != nil {
		p.dropChild()
		if errors.Is(err, syscall.EFAULT) {
			return nil, fmt.Errorf("%w: %w (range not mapped)", verbsio.ErrBadConfig, err)
		}
		if errors.Is(err, syscall.ENOMEM) {
			return nil, fmt.Errorf("%w: %w (locked-memory limit too low? ulimit -l)", verbsio.ErrNotSupported, err)
		}
		return nil, wrap(err)
	}
	return p.newMR(m, eff), nil
}

// newMR wraps a registered region: one that gives grants where the device
// does (Caps.Grants), so that a region implements verbsio.Granter exactly
// when the device advertises it.
func (p *pd) newMR(m *ibv.MR, access verbsio.Access) verbsio.MemoryRegion {
	r := &mr{p: p, m: m, access: access, grants: map[*grant]struct{}{}}
	if p.d.grants {
		return &granterMR{r}
	}
	return r
}

func (p *pd) RegisterDMABuf(fd int, offset uint64, length int, iova uint64, access verbsio.Access) (verbsio.MemoryRegion, error) {
	if access&^knownAccess != 0 {
		return nil, fmt.Errorf("%w: unknown access flags %#x", verbsio.ErrBadConfig, uint32(access&^knownAccess))
	}
	if length <= 0 {
		return nil, fmt.Errorf("%w: dma-buf registration of %d bytes", verbsio.ErrBadConfig, length)
	}
	if err := p.addChild(); err != nil {
		return nil, err
	}
	eff, flags := ibvAccess(access)
	if p.d.grants {
		flags |= ibv.AccessMWBind
	}
	// A dma-buf is GPU memory: the NIC writes it with PCIe relaxed ordering
	// where the device allows it, as NCCL does.
	m, err := p.pd.RegDMABufMR(offset, length, iova, fd, dmabufFlags(flags, !p.d.noRelaxed.Load()))
	if err != nil && !p.d.noRelaxed.Load() && (errors.Is(err, syscall.EINVAL) || errors.Is(err, syscall.EOPNOTSUPP)) {
		if m2, err2 := p.pd.RegDMABufMR(offset, length, iova, fd, flags); err2 == nil {
			p.d.noRelaxed.Store(true)
			m, err = m2, nil
		}
	}
	if why := dmabufRefusal(p.d.ch.Device, err); why != "" {
		p.d.dmabufRefused.CompareAndSwap(nil, &why)
	}
	if err != nil {
		p.dropChild()
		if errors.Is(err, syscall.EOPNOTSUPP) || errors.Is(err, syscall.ENOSYS) {
			return nil, fmt.Errorf("%w: %s cannot register dma-buf memory: %w", verbsio.ErrNotSupported, p.d.ch.Device, err)
		}
		if errors.Is(err, syscall.EBADF) {
			return nil, fmt.Errorf("%w: %w (not a dma-buf file descriptor)", verbsio.ErrBadConfig, err)
		}
		return nil, wrap(err)
	}
	return p.newMR(m, eff), nil
}

// dmabufFlags adds relaxed ordering to a dma-buf registration's flags when
// relaxed is true.
func dmabufFlags(flags int, relaxed bool) int {
	if relaxed {
		flags |= ibv.AccessRelaxedOrdering
	}
	return flags
}

type mr struct {
	p      *pd
	m      *ibv.MR
	access verbsio.Access

	mu     sync.Mutex
	closed bool

	// gmu is held shared by a Grant from start to end, and exclusively by
	// Close while it marks the region closing, so that no bind is under
	// way when the region is deregistered. gl guards grants, the region's
	// live grants.
	gmu     sync.RWMutex
	closing bool
	gl      sync.Mutex
	grants  map[*grant]struct{}
}

func (m *mr) Addr() uintptr          { return m.m.Addr() }
func (m *mr) Len() int               { return m.m.Len() }
func (m *mr) LKey() uint32           { return m.m.LKey() }
func (m *mr) RKey() uint32           { return m.m.RKey() }
func (m *mr) Access() verbsio.Access { return m.access }

func (m *mr) Close() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return nil
	}
	// Its grants end first: a region with windows bound to it cannot be
	// deregistered.
	m.gmu.Lock()
	m.closing = true
	m.gmu.Unlock()
	if err := m.revokeAll(); err != nil {
		return err
	}
	if err := m.m.Close(); err != nil {
		return wrap(err)
	}
	m.closed = true
	m.p.dropChild()
	return nil
}

// qpRef is a queue pair attached to a completion queue, and in which role.
type qpRef struct {
	q          *qp
	send, recv bool
}

type cq struct {
	d *device
	q *ibv.CQ

	qmu sync.RWMutex
	qps map[uint32]*qpRef

	pmu     sync.Mutex
	scratch []ibv.WC
	// stash holds the caller's completions that a wait for one of the
	// provider's own binds or invalidations polled (drive); Poll returns
	// them first.
	stash []verbsio.Completion
	dbuf  []verbsio.Completion

	cmu    sync.Mutex
	closed bool

	// spin is how long a Wait polls before it sleeps, learned from the
	// queue's waits within WithSpin.
	spin *adaptspin.Policy
}

func (c *cq) attach(q *qp, send, recv bool) {
	c.qmu.Lock()
	defer c.qmu.Unlock()
	r := c.qps[q.q.QPN()]
	if r == nil {
		r = &qpRef{q: q}
		c.qps[q.q.QPN()] = r
	}
	r.send = r.send || send
	r.recv = r.recv || recv
}

func (c *cq) detach(qpn uint32) {
	c.qmu.Lock()
	delete(c.qps, qpn)
	c.qmu.Unlock()
}

func (c *cq) Poll(out []verbsio.Completion) (int, error) {
	if len(out) == 0 {
		return 0, nil
	}
	c.pmu.Lock()
	defer c.pmu.Unlock()
	if len(c.stash) > 0 {
		n := copy(out, c.stash)
		c.stash = c.stash[:copy(c.stash, c.stash[n:])]
		return n, nil
	}
	return c.pollLocked(out)
}

// pollLocked polls the device once into out, leaving out the completions
// of the provider's own requests (which it hands to their waiters).
// Callers hold pmu.
func (c *cq) pollLocked(out []verbsio.Completion) (int, error) {
	wc := c.scratch
	if len(out) < len(wc) {
		wc = wc[:len(out)]
	}
	n, err := c.q.Poll(wc)
	if err != nil {
		return 0, wrap(err)
	}
	c.qmu.RLock()
	defer c.qmu.RUnlock()
	k := 0
	for i := 0; i < n; i++ {
		if comp, mine := c.convert(&wc[i]); !mine {
			out[k] = comp
			k++
		}
	}
	return k, nil
}

// drive polls the device once for a goroutine that waits for one of the
// provider's own requests (grant.go), keeping the caller's completions it
// finds for the caller's next Poll. A caller asleep in Wait is not left
// asleep: a completion that arrives after its Arm raises the channel's
// event whoever polls it, and one that came before is in the stash its
// next Poll reads.
func (c *cq) drive() error {
	c.pmu.Lock()
	defer c.pmu.Unlock()
	if c.dbuf == nil {
		c.dbuf = make([]verbsio.Completion, len(c.scratch))
	}
	n, err := c.pollLocked(c.dbuf)
	c.stash = append(c.stash, c.dbuf[:n]...)
	clear(c.dbuf[:n])
	return err
}

// convert turns a device completion into the caller's, and reports whether
// it was one of the provider's own requests instead (the caller never sees
// those).
func (c *cq) convert(w *ibv.WC) (verbsio.Completion, bool) {
	comp := verbsio.Completion{WRID: w.WRID, Status: statusOf(w.Status), ByteLen: w.ByteLen}
	if w.Flags&ibv.WCWithImm != 0 {
		comp.Imm, comp.HasImm = w.Imm, true
	}
	r := c.qps[w.QPNum]
	recv := w.Opcode&ibv.WCRecv != 0
	if r == nil {
		comp.Op = opOfWC(w.Opcode)
		// A closed queue pair's last bind or invalidation.
		mine := !recv && (w.Opcode == ibv.WCBindMW || w.Opcode == ibv.WCLocalInv || w.WRID&windowWRIDMask == windowWRIDTag)
		return comp, mine
	}
	comp.QP = r.q
	switch {
	case r.send && !r.recv:
		recv = false
	case r.recv && !r.send:
		recv = true
	case comp.Status != verbsio.StatusSuccess:
		// The opcode of a failed completion is undefined: the queue whose
		// oldest outstanding request has this ID is the one that completed.
		recv = !r.q.sendHeadIs(w.WRID) && r.q.recvHeadIs(w.WRID)
	}
	if recv && w.Status == ibv.WCLocQPOpErr {
		// Soft-RoCE reports a message longer than the receive buffer as a
		// local QP operation error (a malformed receive request); on a
		// receive queue that is the buffer's length, as other devices
		// report with a local length error.
		comp.Status = verbsio.StatusLocalLength
	}
	comp.Op = r.q.complete(w, recv, comp.Status)
	if comp.Op == opWindow {
		return comp, true
	}
	if !recv {
		comp.ByteLen = 0
	}
	return comp, false
}

func opOfWC(op uint32) verbsio.Opcode {
	switch op {
	case ibv.WCSend:
		return verbsio.OpSend
	case ibv.WCRDMAWrite:
		return verbsio.OpWrite
	case ibv.WCRDMARead:
		return verbsio.OpRead
	case ibv.WCRecvRDMAImm:
		return verbsio.OpRecvImm
	}
	return verbsio.OpRecv
}

// Wait polls for as long as the queue's spin policy says, then sleeps on
// the completion channel (spinWait).
func (c *cq) Wait(ctx context.Context, out []verbsio.Completion) (int, error) {
	if len(out) == 0 {
		return 0, nil
	}
	return spinWait(ctx, c.spin, cqWaiter{c}, out)
}

// spinCheck is how many polls a spinning Wait makes between readings of
// the clock.
const spinCheck = 8

// waiter is what spinWait needs of a completion queue: Poll, and the
// completion channel's arm and wait.
type waiter interface {
	Poll(out []verbsio.Completion) (int, error)
	Arm() error
	WaitEvent(ctx context.Context) error
}

type cqWaiter struct{ c *cq }

func (w cqWaiter) Poll(out []verbsio.Completion) (int, error) { return w.c.Poll(out) }
func (w cqWaiter) Arm() error                                 { return wrap(w.c.q.Arm()) }
func (w cqWaiter) WaitEvent(ctx context.Context) error        { return w.c.q.WaitEvent(ctx) }

// spinWait is a Wait: it polls w for as long as p's budget, then arms the
// completion channel and sleeps on it. Between polls it yields the CPU
// where verbsio.Config.Yield says to; every spinCheck polls it reads the
// clock and lets the goroutines of its processor run. Polls follow each
// other with no pause: a pause would let a completion due within the
// poll, a ping-pong's answer, wait up to its length, and on an emulated
// CPU (a Soft-RoCE guest) a reading of the clock costs about what a poll
// does, so reading it at every turn would halve the polls. What each wait
// took teaches p.
func spinWait(ctx context.Context, p *adaptspin.Policy, w waiter, out []verbsio.Completion) (int, error) {
	start := time.Now()
	budget := p.Budget()
	for i := 1; ; i++ {
		n, err := w.Poll(out)
		if n > 0 || err != nil {
			if n > 0 {
				p.Polled(time.Since(start))
			}
			return n, err
		}
		if budget <= 0 {
			break
		}
		if p.Yields() {
			p.Yield()
		}
		if i%spinCheck == 0 {
			if time.Since(start) >= budget {
				break
			}
			if !p.Yields() {
				runtime.Gosched()
			}
		}
	}
	for {
		if err := ctx.Err(); err != nil {
			return 0, fmt.Errorf("%w: waiting for completions: %w", verbsio.ErrTimeout, err)
		}
		if err := w.Arm(); err != nil {
			return 0, err
		}
		// A completion that arrived before the arm raises no event.
		if n, err := w.Poll(out); n > 0 || err != nil {
			if n > 0 {
				p.Slept(time.Since(start))
			}
			return n, err
		}
		if err := w.WaitEvent(ctx); err != nil {
			if ctx.Err() != nil || errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
				return 0, fmt.Errorf("%w: waiting for completions: %w", verbsio.ErrTimeout, err)
			}
			return 0, wrap(err)
		}
		// An event can be for the provider's own requests only (grant.go):
		// then arm and sleep again.
		if n, err := w.Poll(out); n > 0 || err != nil {
			if n > 0 {
				p.Slept(time.Since(start))
			}
			return n, err
		}
	}
}

func (c *cq) Close() error {
	c.cmu.Lock()
	defer c.cmu.Unlock()
	if c.closed {
		return nil
	}
	c.qmu.RLock()
	n := len(c.qps)
	c.qmu.RUnlock()
	if n > 0 {
		return fmt.Errorf("%w: completion queue has %d live queue pairs", verbsio.ErrBusy, n)
	}
	if err := c.q.Close(); err != nil {
		return wrap(err)
	}
	c.closed = true
	c.d.dropChild()
	return nil
}

// Package ibv is gdrlink's one door to rdma-core's libibverbs: devices,
// ports, GID tables, protection domains, memory regions (ibv_reg_mr and
// ibv_reg_dmabuf_mr), type 2 memory windows (bound and invalidated by
// work requests), completion queues with their completion channels, and
// reliable-connected queue pairs with their state transitions.
//
// The package loads libibverbs.so.1 at run time (Load), as NCCL, UCX and
// libfabric do, so building needs no C toolchain and no rdma-core headers
// (CGO_ENABLED=0 works), and one binary runs on RDMA and non-RDMA nodes:
// where the library is missing or too old, every entry point returns an
// error wrapping ErrUnavailable that says why. The exported functions are
// resolved by name, the optional ones (ibv_reg_dmabuf_mr,
// ibv_query_gid_ex, ibv_query_gid_table) separately, so an older rdma-core
// still works without them. The data-path verbs, which verbs.h defines as
// static inline functions (ibv_post_send, ibv_post_recv, ibv_poll_cq,
// ibv_req_notify_cq, and ibv_alloc_mw and ibv_dealloc_mw), are called
// through the device context's ops table, as the inline functions do. Work requests and completions are built in
// memory off the Go heap, so libibverbs never holds a Go pointer, and a whole
// chain of work requests, or a whole batch of completions, takes one
// crossing. Every crossing is counted per device context (Counters), so
// callers can report crossings per transfer. The C structures the package
// touches are declared once (layout.go) and checked against the installed
// headers by a test.
//
// Errors of failed verbs are *Error values: they name the verb and the
// device, and match their errno with errors.Is (unix.EOPNOTSUPP,
// unix.ENOMEM...). The package knows nothing of verbsio; the provider in
// verbsio/ibverbs maps errnos and statuses to verbsio's sentinels.
package ibv

import (
	"errors"
	"fmt"
	"net"
	"sync/atomic"
	"syscall"
)

// ErrUnavailable: libibverbs could not be loaded (not installed, or too old);
// the error that wraps it says which.
var ErrUnavailable = errors.New("libibverbs unavailable")

// Error is a failed verb.
type Error struct {
	// Op is the verb ("ibv_reg_mr").
	Op string
	// Device is the device's name, "" before one is open.
	Device string
	// Errno is what the verb returned or left in errno.
	Errno syscall.Errno
	// Detail is extra context (sizes, indices), may be "".
	Detail string
}

// Error prints "ibv_reg_mr rxe0 (len 4096): Operation not supported".
func (e *Error) Error() string {
	s := e.Op
	if e.Device != "" {
		s += " " + e.Device
	}
	if e.Detail != "" {
		s += " (" + e.Detail + ")"
	}
	return s + ": " + e.Errno.Error()
}

// Unwrap returns the errno, so errors.Is(err, unix.EOPNOTSUPP) works.
func (e *Error) Unwrap() error { return e.Errno }

// Link layers of a port.
const (
	LinkLayerUnspecified = 0
	LinkLayerInfiniBand  = 1
	LinkLayerEthernet    = 2
)

// Port states, as enum ibv_port_state.
const (
	PortNop         = 0
	PortDown        = 1
	PortInit        = 2
	PortArmed       = 3
	PortActive      = 4
	PortActiveDefer = 5
)

// PortStateName names a port state as ibv_devinfo does.
func PortStateName(s int) string {
	switch s {
	case PortDown:
		return "DOWN"
	case PortInit:
		return "INIT"
	case PortArmed:
		return "ARMED"
	case PortActive:
		return "ACTIVE"
	case PortActiveDefer:
		return "ACTIVE_DEFER"
	}
	return fmt.Sprintf("state(%d)", s)
}

// MTUBytes converts an enum ibv_mtu (1..5) to bytes (256..4096); 0 if out of range.
func MTUBytes(enum int) int {
	if enum < 1 || enum > 5 {
		return 0
	}
	return 128 << enum
}

// MTUEnum converts bytes (256..4096, a power of two) to enum ibv_mtu; 0 if
// not one of them.
func MTUEnum(bytes int) int {
	for e := 1; e <= 5; e++ {
		if 128<<e == bytes {
			return e
		}
	}
	return 0
}

// DeviceInfo is an entry of the device list.
type DeviceInfo struct {
	Name     string
	NodeGUID uint64
	// Transport is ibv_transport_type: 0 InfiniBand (also RoCE), 1 iWARP,
	// 4 unspecified.
	Transport int
}

// DeviceAttr holds the limits of an open device (ibv_query_device).
type DeviceAttr struct {
	FWVersion       string
	NodeGUID        uint64
	VendorID        uint32
	VendorPartID    uint32
	MaxMRSize       uint64
	MaxQP           int
	MaxQPWR         int
	MaxSGE          int
	MaxCQ           int
	MaxCQE          int
	MaxMR           int
	MaxPD           int
	MaxQPRdAtom     int
	MaxQPInitRdAtom int
	PhysPortCount   int
	// CapFlags are the device's IBV_DEVICE_* capability flags
	// (device_cap_flags); MaxMW the most memory windows it allocates.
	CapFlags uint32
	MaxMW    int
}

// Device capability flags of DeviceAttr.CapFlags, as enum
// ibv_device_cap_flags.
const (
	DeviceMemWindow       = 1 << 17
	DeviceMemWindowType2A = 1 << 23
	DeviceMemWindowType2B = 1 << 24
)

// MemoryWindowsType2 reports whether the device allocates type 2 memory
// windows (bound through a queue pair's send queue).
func (a DeviceAttr) MemoryWindowsType2() bool {
	return a.MaxMW > 0 && a.CapFlags&(DeviceMemWindowType2A|DeviceMemWindowType2B) != 0
}

// PortAttr holds a port's state (ibv_query_port).
type PortAttr struct {
	State      int
	MaxMTU     int // bytes
	ActiveMTU  int // bytes
	GIDTblLen  int
	PKeyTblLen int
	MaxMsgSize uint64
	LID        uint16
	SMLID      uint16
	LinkLayer  int
}

// GIDType is a GID's type: InfiniBand, RoCE v1 or RoCE v2.
type GIDType int

// GID types, as enum ibv_gid_type.
const (
	GIDTypeIB GIDType = iota
	GIDTypeRoCEv1
	GIDTypeRoCEv2
	// GIDTypeUnknown: neither the verb nor sysfs said.
	GIDTypeUnknown GIDType = -1
)

// String names the type as sysfs gid_attrs/types does.
func (t GIDType) String() string {
	switch t {
	case GIDTypeIB:
		return "IB"
	case GIDTypeRoCEv1:
		return "RoCE v1"
	case GIDTypeRoCEv2:
		return "RoCE v2"
	}
	return "unknown"
}

// ParseGIDType reads a sysfs gid_attrs/types entry ("IB/RoCE v1", "RoCE v2").
func ParseGIDType(s string) GIDType {
	for len(s) > 0 && (s[len(s)-1] == '\n' || s[len(s)-1] == ' ') {
		s = s[:len(s)-1]
	}
	switch s {
	case "RoCE v2":
		return GIDTypeRoCEv2
	case "IB/RoCE v1", "RoCE v1":
		return GIDTypeRoCEv1
	case "IB":
		return GIDTypeIB
	}
	return GIDTypeUnknown
}

// GID is a 128-bit global identifier (an IPv6 address for RoCE).
type GID [16]byte

// IsZero reports whether the GID is all zeros (an unused table entry).
func (g GID) IsZero() bool { return g == GID{} }

// String prints the GID as an IP address.
func (g GID) String() string { return net.IP(g[:]).String() }

// IsIPv4Mapped reports whether the GID is ::ffff:a.b.c.d.
func (g GID) IsIPv4Mapped() bool {
	for _, b := range g[:10] {
		if b != 0 {
			return false
		}
	}
	return g[10] == 0xff && g[11] == 0xff
}

// IsLinkLocal reports whether the GID is fe80::/10.
func (g GID) IsLinkLocal() bool { return g[0] == 0xfe && g[1]&0xc0 == 0x80 }

// GIDEntry is one valid entry of a port's GID table.
type GIDEntry struct {
	Index int
	// Port is the port the entry belongs to.
	Port int
	GID  GID
	Type GIDType
	// Netdev is the network interface the entry belongs to, "" if unknown.
	Netdev string
}

// Counters counts crossings into libibverbs of one device context, by kind. Its
// fields are updated atomically; read them with Snapshot.
type Counters struct {
	postSend, postRecv, poll, notify, control atomic.Uint64
	sendWRs, recvWRs, completions             atomic.Uint64
}

// CounterSnapshot is a copy of Counters at one moment.
type CounterSnapshot struct {
	// Crossings by kind: post-send chains, post-recv chains, poll batches,
	// notification arm/get/ack calls, and every other (control path) call.
	PostSend, PostRecv, Poll, Notify, Control uint64
	// SendWRs and RecvWRs are the work requests posted; Completions the
	// completions polled.
	SendWRs, RecvWRs, Completions uint64
}

// Crossings is the total number of calls into libibverbs.
func (s CounterSnapshot) Crossings() uint64 {
	return s.PostSend + s.PostRecv + s.Poll + s.Notify + s.Control
}

// Sub returns s - o, field by field.
func (s CounterSnapshot) Sub(o CounterSnapshot) CounterSnapshot {
	return CounterSnapshot{
		PostSend: s.PostSend - o.PostSend, PostRecv: s.PostRecv - o.PostRecv, Poll: s.Poll - o.Poll,
		Notify: s.Notify - o.Notify, Control: s.Control - o.Control,
		SendWRs: s.SendWRs - o.SendWRs, RecvWRs: s.RecvWRs - o.RecvWRs, Completions: s.Completions - o.Completions,
	}
}

// Snapshot reads the counters.
func (c *Counters) Snapshot() CounterSnapshot {
	return CounterSnapshot{
		PostSend: c.postSend.Load(), PostRecv: c.postRecv.Load(), Poll: c.poll.Load(),
		Notify: c.notify.Load(), Control: c.control.Load(),
		SendWRs: c.sendWRs.Load(), RecvWRs: c.recvWRs.Load(), Completions: c.completions.Load(),
	}
}

// Access flags of a memory region and of a queue pair, as IBV_ACCESS_*.
const (
	AccessLocalWrite  = 1
	AccessRemoteWrite = 2
	AccessRemoteRead  = 4
	// AccessMWBind lets memory windows be bound to a region.
	AccessMWBind = 16
	// AccessRelaxedOrdering (IBV_ACCESS_RELAXED_ORDERING, the first of
	// IBV_ACCESS_OPTIONAL_RANGE) lets the NIC write the region with PCIe
	// relaxed ordering where the device allows it; kernels that know
	// optional flags drop it silently where the device does not.
	AccessRelaxedOrdering = 1 << 20
)

// Send opcodes, as enum ibv_wr_opcode.
const (
	WRWrite    = 0
	WRWriteImm = 1
	WRSend     = 2
	WRSendImm  = 3
	WRRead     = 4
	// WRLocalInv invalidates the memory window SendWR.InvRKey names.
	WRLocalInv = 7
	// WRBindMW binds a type 2 memory window as SendWR.Bind says.
	WRBindMW = 8
)

// Send flags, as enum ibv_send_flags.
const (
	SendFence     = 1
	SendSignaled  = 2
	SendSolicited = 4
	SendInline    = 8
)

// Completion opcodes, as enum ibv_wc_opcode.
const (
	WCSend        = 0
	WCRDMAWrite   = 1
	WCRDMARead    = 2
	WCBindMW      = 5
	WCLocalInv    = 6
	WCRecv        = 1 << 7
	WCRecvRDMAImm = WCRecv + 1
)

// Completion flags.
const (
	WCWithImm = 1 << 1
)

// Completion statuses, as enum ibv_wc_status.
const (
	WCSuccess      = 0
	WCLocLenErr    = 1
	WCLocQPOpErr   = 2
	WCLocProtErr   = 4
	WCFlushErr     = 5
	WCBadRespErr   = 7
	WCLocAccessErr = 8
	WCRemInvReqErr = 9
	WCRemAccessErr = 10
	WCRemOpErr     = 11
	WCRetryExcErr  = 12
	WCRNRRetryExc  = 13
	WCRemAbortErr  = 16
	WCFatalErr     = 19
	WCRespTimeout  = 20
	WCGeneralErr   = 21
)

// SendWR is one work request of a send chain, flat (no pointers into C
// memory): its scatter/gather entries are SGEs[SGEOff : SGEOff+NumSGE] of
// the chain's SGE slice. PostSend builds struct ibv_send_wr from it.
type SendWR struct {
	WRID       uint64
	RemoteAddr uint64
	RKey       uint32
	Imm        uint32 // host byte order
	Opcode     uint32 // WR*
	Flags      uint32 // Send*
	NumSGE     uint32
	SGEOff     uint32
	// InvRKey is the rkey a WRLocalInv invalidates.
	InvRKey uint32
	// Bind is what a WRBindMW binds; other opcodes leave it zero.
	Bind Bind
}

// Bind binds a type 2 memory window to [Addr, Addr+Length) of a region
// with the given access (AccessRemoteWrite, AccessRemoteRead) and the
// window's new rkey, RKey (MW.NextRKey). A type 2 bind posted this way
// leaves the window's recorded rkey to the caller: after its successful
// completion, call MW.SetRKey(RKey), or the next bind fails.
type Bind struct {
	MW     *MW
	MR     *MR
	RKey   uint32
	Addr   uint64
	Length uint64
	Access int
}

// RecvWR is one work request of a receive chain.
type RecvWR struct {
	WRID   uint64
	NumSGE uint32
	SGEOff uint32
}

// SGE is a scatter/gather entry, the layout of struct ibv_sge.
type SGE struct {
	Addr   uint64
	Length uint32
	LKey   uint32
}

// WC is a completion, flat, its immediate in host byte order.
type WC struct {
	WRID      uint64
	Status    uint32
	Opcode    uint32
	VendorErr uint32
	ByteLen   uint32
	Imm       uint32 // host byte order, valid when Flags&WCWithImm
	QPNum     uint32
	Flags     uint32
	_         uint32
}

// QPCaps are the sizes of a queue pair, asked for and granted.
type QPCaps struct {
	MaxSendWR, MaxRecvWR, MaxSendSGE, MaxRecvSGE, MaxInline int
}

// RTRAttr moves a queue pair to ready-to-receive.
type RTRAttr struct {
	DestQPN uint32
	RQPSN   uint32
	MTU     int // bytes
	// Global routing (RoCE, or IB across subnets).
	Global    bool
	DGID      GID
	SGIDIndex int
	HopLimit  int
	TClass    int
	DLID      uint16
	SL        int
	Port      int
	// MaxDestRdAtomic is the number of RDMA reads the peer may have in flight
	// against us; MinRNRTimer the RNR NAK timer code.
	MaxDestRdAtomic int
	MinRNRTimer     int
}

// RTSAttr moves a queue pair to ready-to-send.
type RTSAttr struct {
	SQPSN       uint32
	Timeout     int
	RetryCount  int
	RNRRetry    int
	MaxRdAtomic int
}

// QP states, as enum ibv_qp_state.
const (
	QPSReset = 0
	QPSInit  = 1
	QPSRTR   = 2
	QPSRTS   = 3
	QPSSQD   = 4
	QPSSQE   = 5
	QPSErr   = 6
)

// checkSGEs verifies that every work request's entries lie inside the SGE
// slice, so a post never reads past it.
func checkSGEs(nsge int, span func(i int) (off, num uint32), nwr int) error {
	for i := 0; i < nwr; i++ {
		off, num := span(i)
		if uint64(off)+uint64(num) > uint64(nsge) {
			return fmt.Errorf("work request %d uses SGEs [%d, %d) of %d", i, off, uint64(off)+uint64(num), nsge)
		}
	}
	return nil
}

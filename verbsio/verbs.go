package verbsio

import (
	"context"
	"fmt"

	"github.com/gdrlink/gdrlink/tensor"
)

// Access is the set of operations a memory region allows.
type Access uint32

// Access flags, as ibverbs' IBV_ACCESS_*.
const (
	// AccessLocalWrite lets local operations (receives, reads landing here)
	// write the region.
	AccessLocalWrite Access = 1 << iota
	// AccessRemoteWrite lets peers RDMA-write the region.
	AccessRemoteWrite
	// AccessRemoteRead lets peers RDMA-read the region.
	AccessRemoteRead
)

// String prints the flags as "local-write|remote-write".
func (a Access) String() string {
	s := ""
	for _, f := range []struct {
		f Access
		n string
	}{{AccessLocalWrite, "local-write"}, {AccessRemoteWrite, "remote-write"}, {AccessRemoteRead, "remote-read"}} {
		if a&f.f != 0 {
			if s != "" {
				s += "|"
			}
			s += f.n
		}
	}
	if s == "" {
		return "none"
	}
	return s
}

// Caps is what a device advertises. A conformance test checks every field
// against what the provider implements.
type Caps struct {
	// Provider is the provider's registered name.
	Provider string
	// MemoryTypes are the kinds of memory RegisterMemory accepts.
	MemoryTypes []tensor.DeviceKind
	// DMABuf reports whether RegisterDMABuf can work on this device.
	DMABuf bool
	// WriteWithImmediate reports whether OpWriteImm is implemented.
	WriteWithImmediate bool
	// MaxInline is the largest payload a send may carry inline.
	MaxInline int
	// MaxSGE is the most scatter/gather entries a work request may carry.
	MaxSGE int
	// MaxQPDepth is the most outstanding work requests per queue.
	MaxQPDepth int
	// MaxMessage is the largest single write or send in bytes.
	MaxMessage int64
	// SameHostOnly is true for providers that reach only peers on this host.
	SameHostOnly bool
	// Grants reports whether the device's memory regions implement
	// Granter: per-buffer, per-queue-pair keys a peer can write through
	// instead of the region's rkey.
	Grants bool
}

// Opcode is what a work request or a completion does.
type Opcode uint8

// Opcodes.
const (
	// OpWrite is an RDMA WRITE: no completion at the target.
	OpWrite Opcode = iota + 1
	// OpWriteImm is an RDMA WRITE WITH IMMEDIATE: it consumes a posted receive
	// at the target, whose completion carries the immediate.
	OpWriteImm
	// OpSend is a SEND into a posted receive buffer of the peer.
	OpSend
	// OpRead is an RDMA READ from the peer's memory into a local region.
	OpRead
	// OpRecv completes a posted receive filled by a SEND.
	OpRecv
	// OpRecvImm completes a posted receive consumed by a WRITE WITH IMMEDIATE.
	OpRecvImm
)

var opcodeNames = [...]string{OpWrite: "write", OpWriteImm: "write-imm", OpSend: "send", OpRead: "read", OpRecv: "recv", OpRecvImm: "recv-imm"}

// String names the opcode.
func (o Opcode) String() string {
	if int(o) < len(opcodeNames) && opcodeNames[o] != "" {
		return opcodeNames[o]
	}
	return fmt.Sprintf("Opcode(%d)", uint8(o))
}

// Status is how a work request completed, as ibverbs' ibv_wc_status.
type Status uint8

// Completion statuses.
const (
	StatusSuccess Status = iota
	// StatusLocalLength: a receive buffer too small, or a bad local length.
	StatusLocalLength
	// StatusLocalProtection: a local key or access that does not allow it.
	StatusLocalProtection
	// StatusFlushed: the queue pair entered the error state before this work
	// request ran.
	StatusFlushed
	// StatusRemoteAccess: a wrong rkey, an address outside the region, or a
	// region without the needed remote access. The target's memory is untouched.
	StatusRemoteAccess
	// StatusRemoteOperation: the peer could not carry out the operation
	// (for example no receive posted for a write with immediate on providers
	// that fail rather than retry).
	StatusRemoteOperation
	// StatusRetryExceeded: the peer stopped answering (transport retries
	// exhausted): usually a dead peer.
	StatusRetryExceeded
	// StatusGeneral: any other failure.
	StatusGeneral
)

var statusNames = [...]string{"success", "local length error", "local protection error", "flushed", "remote access error", "remote operation error", "retry exceeded", "general error"}

// String names the status.
func (s Status) String() string {
	if int(s) < len(statusNames) {
		return statusNames[s]
	}
	return fmt.Sprintf("Status(%d)", uint8(s))
}

// Err returns nil for success and otherwise an error wrapping the sentinel for
// the status (ErrRemoteAccess, ErrFlushed, ...).
func (s Status) Err() error {
	switch s {
	case StatusSuccess:
		return nil
	case StatusRemoteAccess:
		return ErrRemoteAccess
	case StatusFlushed:
		return ErrFlushed
	case StatusRetryExceeded:
		return fmt.Errorf("%w: %s", ErrPeerLost, s)
	case StatusLocalProtection:
		return ErrLocalProtection
	case StatusLocalLength:
		return ErrLocalLength
	case StatusRemoteOperation:
		return ErrRemoteOperation
	}
	return fmt.Errorf("%w: %s", ErrCompletion, s)
}

// Completion is one entry of a completion queue.
type Completion struct {
	// WRID is the work request's ID as posted.
	WRID uint64
	// Status is how it ended.
	Status Status
	// Op is OpWrite/OpWriteImm/OpSend/OpRead for sends, OpRecv/OpRecvImm for
	// receives.
	Op Opcode
	// ByteLen is the number of bytes received (receives only).
	ByteLen uint32
	// Imm is the immediate of a write with immediate (valid when HasImm).
	Imm uint32
	// HasImm reports whether Imm is set.
	HasImm bool
	// Checksum is the CRC-32C of the ByteLen bytes a write with immediate
	// put into this side's memory, taken as they landed (valid when
	// HasChecksum; see WriteChecksummer).
	Checksum uint32
	// HasChecksum reports whether Checksum is set.
	HasChecksum bool
	// QP is the queue pair the work request belonged to.
	QP QueuePair
}

// SGE is one scatter/gather entry: a range of a registered region.
type SGE struct {
	Addr   uintptr
	Length uint32
	LKey   uint32
}

// SendWR is a work request on a send queue.
type SendWR struct {
	// WRID comes back in the completion.
	WRID uint64
	// Op is OpWrite, OpWriteImm, OpSend or OpRead.
	Op Opcode
	// SG is the local memory: the source of writes and sends, the
	// destination of reads.
	SG []SGE
	// RemoteAddr and RKey name the peer's memory for writes and reads.
	RemoteAddr uint64
	RKey       uint32
	// Imm is the immediate of OpWriteImm.
	Imm uint32
	// Signaled asks for a completion on success (errors always complete).
	Signaled bool
	// Inline copies the payload into the work request (at most Caps.MaxInline
	// bytes); the memory need not be registered.
	Inline bool
}

// RecvWR is a work request on a receive queue.
type RecvWR struct {
	WRID uint64
	SG   []SGE
}

// QPState is a queue pair's state.
type QPState uint8

// Queue pair states, as ibverbs' (RESET..RTS) collapsed to what callers see.
const (
	QPInit QPState = iota
	QPReady
	QPError
	QPClosed
)

// String names the state.
func (s QPState) String() string {
	switch s {
	case QPInit:
		return "init"
	case QPReady:
		return "ready"
	case QPError:
		return "error"
	case QPClosed:
		return "closed"
	}
	return fmt.Sprintf("QPState(%d)", uint8(s))
}

// Endpoint is what one side of a queue pair tells the other so they can
// connect: opaque to everyone but the provider (a QP number, PSN and GID for
// ibverbs; an address for TCP). It travels through the bootstrap.
type Endpoint struct {
	Provider string
	// Host identifies the machine (boot id), so peers can tell whether they
	// share a host.
	Host string
	Data []byte
}

// QPConfig sizes a queue pair.
type QPConfig struct {
	SendCQ, RecvCQ CompletionQueue
	// MaxSendWR and MaxRecvWR are queue depths; 0 means Config.QueueDepth.
	MaxSendWR, MaxRecvWR int
	// MaxSGE is the most SGEs per work request; 0 means 1.
	MaxSGE int
	// MaxInline is the largest inline payload asked for; 0 means none.
	MaxInline int
}

// Provider makes devices. Providers register themselves with Register from
// an init function and are found by name.
type Provider interface {
	// Name is the provider's registered name.
	Name() string
	// Devices lists the devices this provider can open here. A provider with
	// none returns an error wrapping ErrNoDevice that says what is missing.
	Devices() ([]DeviceInfo, error)
	// Open opens a device chosen by cfg (cfg.Device, or the best one).
	Open(cfg Config) (Device, error)
}

// DeviceInfo describes a device a provider can open.
type DeviceInfo struct {
	Provider string
	Name     string
	// NUMANode is the device's NUMA node, -1 when unknown.
	NUMANode int
	// PCIAddress is the device's PCI address, "" when it has none.
	PCIAddress string
	// Netdev is the network interface behind the device's first port, if any.
	Netdev string
	// Address is where peers reach this device ("host:port" for tcp), ""
	// for providers that have none. Provider.Devices lists devices that are
	// not open yet, so it leaves Address empty; Device.Info fills it.
	Address string
}

// Device is an open device of a provider.
type Device interface {
	// Info describes the device.
	Info() DeviceInfo
	// Caps is what the device can do.
	Caps() Caps
	// AllocPD makes a protection domain.
	AllocPD() (ProtectionDomain, error)
	// CreateCQ makes a completion queue of at least depth entries.
	CreateCQ(depth int) (CompletionQueue, error)
	// Close releases the device. Closing a device with live children fails
	// with ErrBusy.
	Close() error
}

// ProtectionDomain groups memory regions and the queue pairs that may use them.
type ProtectionDomain interface {
	// RegisterMemory registers [addr, addr+length) with the given access.
	// The memory must be off the Go heap and stay mapped until the region is
	// closed.
	RegisterMemory(addr uintptr, length int, access Access) (MemoryRegion, error)
	// RegisterDMABuf registers length bytes at offset of a dma-buf file (GPU
	// memory exported by its driver), mapped at iova for work requests. Where
	// the device cannot, it returns an error wrapping ErrNotSupported.
	RegisterDMABuf(fd int, offset uint64, length int, iova uint64, access Access) (MemoryRegion, error)
	// CreateQP makes a reliable-connected queue pair.
	CreateQP(cfg QPConfig) (QueuePair, error)
	// Close releases the domain; ErrBusy while regions or queue pairs live.
	Close() error
}

// MemoryRegion is registered memory with its keys.
type MemoryRegion interface {
	Addr() uintptr
	Len() int
	// LKey names the region in local work requests.
	LKey() uint32
	// RKey names the region in a peer's writes and reads.
	RKey() uint32
	Access() Access
	// Close deregisters the region. Idempotent.
	Close() error
}

// CompletionQueue collects completions of work requests.
type CompletionQueue interface {
	// Poll moves up to len(out) completions into out without blocking.
	Poll(out []Completion) (int, error)
	// Wait blocks until at least one completion is ready or ctx ends, then
	// polls like Poll. An idle wait burns no CPU (after a short spin).
	Wait(ctx context.Context, out []Completion) (int, error)
	// Close releases the queue. Idempotent.
	Close() error
}

// QueuePair is a reliable-connected queue pair.
type QueuePair interface {
	// Endpoint is what the peer needs to connect to this queue pair.
	Endpoint() Endpoint
	// Connect connects to the peer's queue pair. Both sides call it with the
	// other's endpoint.
	Connect(ctx context.Context, remote Endpoint) error
	// PostSend posts a chain of work requests in one call. The provider
	// takes what it needs of wrs and their SG lists before it returns (as
	// ibv_post_send does): the caller may reuse them at once.
	PostSend(wrs []SendWR) error
	// PostRecv posts a chain of receive buffers in one call; wrs may be
	// reused once it returns, as for PostSend.
	PostRecv(wrs []RecvWR) error
	// State is the queue pair's state.
	State() QPState
	// Close destroys the queue pair; outstanding work requests complete as
	// flushed. Idempotent.
	Close() error
}

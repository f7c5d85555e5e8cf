//go:build !cgo || !gdrlink_ibverbs

package ibv

import "context"

// Available reports whether the package was built with libibverbs.
const Available = false

// Devices fails: built without libibverbs.
func Devices() ([]DeviceInfo, error) { return nil, ErrUnavailable }

// Context is an open device (never, in this build).
type Context struct{ cnt Counters }

// Open fails: built without libibverbs.
func Open(name string) (*Context, error) { return nil, ErrUnavailable }

// Name is the device's name.
func (c *Context) Name() string { return "" }

// Counters are the context's cgo crossing counters.
func (c *Context) Counters() *Counters { return &c.cnt }

// Close does nothing.
func (c *Context) Close() error { return nil }

// QueryDevice fails: built without libibverbs.
func (c *Context) QueryDevice() (DeviceAttr, error) { return DeviceAttr{}, ErrUnavailable }

// QueryPort fails: built without libibverbs.
func (c *Context) QueryPort(port int) (PortAttr, error) { return PortAttr{}, ErrUnavailable }

// QueryGID fails: built without libibverbs.
func (c *Context) QueryGID(port, index int) (GIDEntry, error) { return GIDEntry{}, ErrUnavailable }

// GIDTable fails: built without libibverbs.
func (c *Context) GIDTable(max int) ([]GIDEntry, error) { return nil, ErrUnavailable }

// AllocPD fails: built without libibverbs.
func (c *Context) AllocPD() (*PD, error) { return nil, ErrUnavailable }

// CreateCQ fails: built without libibverbs.
func (c *Context) CreateCQ(depth int) (*CQ, error) { return nil, ErrUnavailable }

// PD is a protection domain.
type PD struct{}

// Close does nothing.
func (p *PD) Close() error { return nil }

// RegMR fails: built without libibverbs.
func (p *PD) RegMR(addr uintptr, length int, access int) (*MR, error) { return nil, ErrUnavailable }

// RegDMABufMR fails: built without libibverbs.
func (p *PD) RegDMABufMR(offset uint64, length int, iova uint64, fd int, access int) (*MR, error) {
	return nil, ErrUnavailable
}

// CreateQP fails: built without libibverbs.
func (p *PD) CreateQP(send, recv *CQ, want QPCaps) (*QP, error) { return nil, ErrUnavailable }

// MR is a registered memory region.
type MR struct{}

// Addr is the region's first address.
func (m *MR) Addr() uintptr { return 0 }

// Len is the region's length.
func (m *MR) Len() int { return 0 }

// LKey is the local key.
func (m *MR) LKey() uint32 { return 0 }

// RKey is the remote key.
func (m *MR) RKey() uint32 { return 0 }

// Close does nothing.
func (m *MR) Close() error { return nil }

// CQ is a completion queue.
type CQ struct{}

// Depth is the number of entries the queue holds.
func (q *CQ) Depth() int { return 0 }

// Close does nothing.
func (q *CQ) Close() error { return nil }

// Poll fails: built without libibverbs.
func (q *CQ) Poll(out []WC) (int, error) { return 0, ErrUnavailable }

// Arm fails: built without libibverbs.
func (q *CQ) Arm() error { return ErrUnavailable }

// WaitEvent fails: built without libibverbs.
func (q *CQ) WaitEvent(ctx context.Context) error { return ErrUnavailable }

// QP is a reliable-connected queue pair.
type QP struct{}

// QPN is the queue pair number.
func (q *QP) QPN() uint32 { return 0 }

// Caps are the sizes the device granted.
func (q *QP) Caps() QPCaps { return QPCaps{} }

// Close does nothing.
func (q *QP) Close() error { return nil }

// ToInit fails: built without libibverbs.
func (q *QP) ToInit(port, pkeyIndex, access int) error { return ErrUnavailable }

// ToRTR fails: built without libibverbs.
func (q *QP) ToRTR(a RTRAttr) error { return ErrUnavailable }

// ToRTS fails: built without libibverbs.
func (q *QP) ToRTS(a RTSAttr) error { return ErrUnavailable }

// ToError fails: built without libibverbs.
func (q *QP) ToError() error { return ErrUnavailable }

// State fails: built without libibverbs.
func (q *QP) State() (int, error) { return 0, ErrUnavailable }

// PostSend fails: built without libibverbs.
func (q *QP) PostSend(wrs []SendWR, sges []SGE) (int, error) { return 0, ErrUnavailable }

// PostRecv fails: built without libibverbs.
func (q *QP) PostRecv(wrs []RecvWR, sges []SGE) (int, error) { return 0, ErrUnavailable }

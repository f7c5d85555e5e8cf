// Package ibvdiag reads what an open device of the ibverbs provider knows
// beyond verbsio.Device, for the module's own benchmarks and tools: its
// counters of crossings into libibverbs, the GID index it routes with, and why it lacks GPU
// memory, dma-buf registration or grants (memory windows). The provider's device type is unexported;
// its devices implement Device.
package ibvdiag

import "github.com/gdrlink/gdrlink/verbsio"

// Stats are a device's crossings into libibverbs and work counts.
type Stats struct {
	// Crossings is the number of calls into libibverbs.
	Crossings uint64
	// PostSend, PostRecv, Poll and Notify are crossings by kind (chains
	// posted, batches polled, notification calls); Control is the rest.
	PostSend, PostRecv, Poll, Notify, Control uint64
	// SendWRs, RecvWRs and Completions are work requests posted and
	// completions polled.
	SendWRs, RecvWRs, Completions uint64
}

// Device is what a device of the ibverbs provider tells beyond
// verbsio.Device.
type Device interface {
	verbsio.Device
	// Stats reads the device's counters.
	Stats() Stats
	// GIDIndex is the GID table index in use (-1 on InfiniBand routes by
	// LID).
	GIDIndex() int
	// GPUMemoryReason says why Caps().MemoryTypes lacks GPU memory ("" when
	// it lists it).
	GPUMemoryReason() string
	// DMABufReason says why Caps().DMABuf is false ("" when it is true).
	DMABufReason() string
	// GrantsReason says why Caps().Grants is false: no type 2 memory
	// windows, or a device that does not enforce a window's bounds
	// (Soft-RoCE), or a probe that could not tell. Where windows were
	// forced for testing on such a device, Grants is true and the reason
	// says that the bounds are not enforced. "" when grants are on and the
	// device bounds its windows.
	GrantsReason() string
}

// Of returns dev as a device of the ibverbs provider, or false for a
// device of another provider.
func Of(dev verbsio.Device) (Device, bool) {
	d, ok := dev.(Device)
	return d, ok
}

// StatsOf returns the counters of a device of the ibverbs provider, or
// false for a device of another provider.
func StatsOf(dev verbsio.Device) (Stats, bool) {
	d, ok := Of(dev)
	if !ok {
		return Stats{}, false
	}
	return d.Stats(), true
}

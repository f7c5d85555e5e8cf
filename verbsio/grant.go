package verbsio

// Granter is implemented by the memory regions of providers that can hand
// a peer a key to one range of a region, for one queue pair, for a bounded
// number of writes: what ibverbs calls a type 2 memory window. Find it with
// a type assertion on a MemoryRegion; Caps.Grants says whether a device's
// regions implement it.
//
// With grants, a receiver never gives a peer the rkey of a whole region
// (which would let the peer write every buffer in it, those of other queue
// pairs included): each buffer a peer may fill gets a grant of its own,
// revoked when the buffer is done with.
//
// A provider may stop admitting remote access through the region's own
// rkey once the region has given a grant (the tcp provider does): a region
// whose buffers are handed out as grants must not stay open to whoever
// holds the region's rkey.
type Granter interface {
	// Grant lets the peer of qp (a queue pair of the region's protection
	// domain) RDMA-write [addr, addr+length), which must lie in the
	// region, with the returned grant's rkey: writes and writes with
	// immediate, from that queue pair only, until imms writes with
	// immediate targeting the grant have completed at this side (the
	// grant is then revoked by the provider, before the receive
	// completion is delivered) or until Revoke. With imms 0 the grant
	// admits plain writes only, until Revoke. A write through the grant
	// outside the range, from another queue pair, after revocation, or a
	// read, completes at the writer with StatusRemoteAccess and leaves
	// this side's memory unchanged.
	//
	// The region needs AccessLocalWrite; it need not have been
	// registered with AccessRemoteWrite. Closing the region, or the queue
	// pair, revokes its grants.
	Grant(addr uintptr, length int, qp QueuePair, imms int) (Grant, error)
}

// Grant is a peer's right to write one range of a memory region, given by
// Granter.Grant.
type Grant interface {
	// RKey names the grant in the peer's writes. It differs from the rkey
	// of every region and of every other live grant of the protection
	// domain.
	RKey() uint32
	// Revoke ends the grant: once it returns, no write through the grant
	// lands (one under way is cut short and fails at the writer with
	// StatusRemoteAccess; it may have placed part of its bytes in the
	// range, as an interrupted RDMA write does). Idempotent, and a no-op
	// on a grant the provider has revoked already.
	Revoke() error
}

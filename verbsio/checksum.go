package verbsio

// WriteChecksummer is implemented by the queue pairs of providers that can
// take the CRC-32C (Castagnoli) of what a peer's write with immediate put
// into this side's memory as the bytes land: the tcp provider, which
// copies every payload from its socket and takes the checksum of each
// piece while it is still in the cache. A NIC writes memory without the
// CPU and cannot; find it with a type assertion on a QueuePair.
//
// A protocol that checks every tensor against its sender's checksum (the
// rendezvous channel's checksum mode) then reads the checksum from the
// receive completion instead of reading the whole result again once it
// has landed, which on a large tensor is a pass over memory after the
// transfer, on its critical path.
type WriteChecksummer interface {
	// ChecksumWrites turns the checksums on or off for the writes with
	// immediate that arrive from now on. With it on, the receive
	// completion of a write with immediate whose payload came whole in
	// one piece (not striped over several lanes) has HasChecksum set and
	// Checksum the CRC-32C of its ByteLen bytes as they landed.
	ChecksumWrites(on bool)
}

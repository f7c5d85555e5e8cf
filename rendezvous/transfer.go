package rendezvous

import (
	"fmt"
	"log/slog"
	"time"

	"github.com/gdrlink/gdrlink/tensor"
)

// Path is how a tensor's bytes reached the result.
type Path uint8

// Paths.
const (
	// PathNone: no bytes moved (dead or empty tensor, or the transfer failed).
	PathNone Path = iota
	// PathDirect: one RDMA write from the source tensor into the result
	// tensor in host memory.
	PathDirect
	// PathDirectGPU: one RDMA write into GPU memory registered with the NIC
	// (GPUDirect RDMA, dma-buf or peer memory).
	PathDirectGPU
	// PathProxy: the write landed in a host proxy tensor and was copied to
	// the GPU by the proxy path.
	PathProxy
	// PathSerialized: a non-DMAable (string) tensor, written in its wire
	// encoding and decoded on arrival.
	PathSerialized
	// PathPull: the receiver copied the tensor itself, device to device,
	// from the sender's device memory mapped into its process (WithPull:
	// CUDA IPC on one node).
	PathPull
	// PathEager: the sender sent the tensor before the Recv asked, its
	// bytes in a control message (WithEager), copied from the receive
	// buffer into the result.
	PathEager
)

var pathNames = [...]string{"none", "direct", "direct-gpu", "proxy", "serialized", "cuda-ipc", "eager"}

// String names the path.
func (p Path) String() string {
	if int(p) < len(pathNames) {
		return pathNames[p]
	}
	return fmt.Sprintf("Path(%d)", uint8(p))
}

// Transfer is what one completed Recv did.
type Transfer struct {
	Key  string
	Step int64
	// Peer is the sending peer's name.
	Peer string
	// Path is how the bytes arrived.
	Path Path
	// Provider and Device name the verbs provider and device that carried it.
	Provider string
	Device   string
	// Meta is the received tensor's meta-data.
	Meta tensor.Meta
	// Bytes is the number of bytes written into this process.
	Bytes int64
	// MetaRoundTrip reports that the meta-data cache was stale or empty, so a
	// META_DATA_RESPONSE and a TENSOR_RE_REQUEST were needed.
	MetaRoundTrip bool
	// MetaChanged reports that the cached meta-data did not describe the
	// tensor. Without MetaRoundTrip, the tensor still fit the result buffer
	// and was written at once (META_DATA_RESPONSE with write-follows).
	MetaChanged bool
	// Checksummed reports that the bytes were verified against the sender's
	// CRC-32C.
	Checksummed bool
	// Placed reports that the peer wrote the tensor given with Into
	// itself (the result shares its memory).
	Placed bool
	// Chunks is the number of writes a pipelined proxy result came in
	// (WithProxyChunk), each handed to the proxy as it landed; 0 when the
	// result came in one write.
	Chunks int
	// Took is the time from the request to the completion.
	Took time.Duration
}

// logValue is a Transfer as a group of a structured log record.
func (t Transfer) logValue() slog.Value {
	return slog.GroupValue(
		slog.String("key", t.Key), slog.Int64("step", t.Step), slog.String("peer", t.Peer),
		slog.String("path", t.Path.String()), slog.String("provider", t.Provider), slog.String("device", t.Device),
		slog.String("meta", t.Meta.String()), slog.Int64("bytes", t.Bytes),
		slog.Bool("meta_round_trip", t.MetaRoundTrip), slog.Bool("meta_changed", t.MetaChanged), slog.Bool("checksummed", t.Checksummed), slog.Bool("placed", t.Placed), slog.Int("chunks", t.Chunks),
		slog.Duration("took", t.Took))
}

// Stats counts what a channel did. Read it with Channel.Stats.
type Stats struct {
	// Requests is the number of TENSOR_REQUESTs sent.
	Requests uint64
	// MetaResponses is the number of META_DATA_RESPONSEs received that asked
	// for a re-request (stale or empty cache).
	MetaResponses uint64
	// MetaInPlace is the number of META_DATA_RESPONSEs received that
	// announced a changed tensor written into the buffer already offered.
	MetaInPlace uint64
	// ReRequests is the number of TENSOR_RE_REQUESTs sent.
	ReRequests uint64
	// Finals is the number of requests completed by a control message alone
	// (dead and empty tensors).
	Finals uint64
	// WritesIn is the number of writes with immediate that completed a
	// request here; WritesOut the number this side posted.
	WritesIn, WritesOut uint64
	// BytesIn and BytesOut are the tensor bytes written into and out of this
	// process.
	BytesIn, BytesOut uint64
	// Errors is the number of ERROR_STATUS received.
	Errors uint64
	// ControlOut is the number of control SENDs posted (each may carry
	// several messages); CreditsOnly of them carried nothing but credits.
	ControlOut, CreditsOnly uint64
	// NameDefs is the number of requests that carried a full name.
	NameDefs uint64
	// ChecksumFailures is the number of arrivals that failed verification.
	ChecksumFailures uint64
	// ChecksumRetries is the number of those this side asked for again
	// (a TENSOR_RE_REQUEST to the same buffer; with a peer that confirms,
	// at most MaxChecksumRetries per Recv); Rewrites the number of writes
	// this side made again on the peer's asking.
	ChecksumRetries, Rewrites uint64
	// ConfirmsOut is the number of CONFIRMs this side sent, one per write
	// it took in with confirmations on (checksum mode, see WithChecksum);
	// ConfirmsIn the number it received. With confirmations, WritesOut
	// and BytesOut count a write once confirmed.
	ConfirmsOut, ConfirmsIn uint64
	// Staged is the number of sends whose source was not in registered memory
	// and was copied into a registered block first.
	Staged uint64
	// Striped is the number of writes this side striped over its rails.
	Striped uint64
	// Keepalives is the number of CREDIT frames sent as keepalives to a
	// silent peer while work was pending (WithKeepalive), the frames of
	// heartbeats included (WithPeerTimeout). They count in ControlOut, not
	// in CreditsOnly.
	Keepalives uint64
	// ChunksIn is the number of chunk writes with immediate received for
	// pipelined proxy results (WithProxyChunk), the last of each included;
	// ChunksOut the number this side posted for the peer's.
	ChunksIn, ChunksOut uint64
	// CreditStalls is the number of times this side's queue of control
	// messages and writes had to wait for credits (the peer's posted
	// receives): a flush of the queue that leaves work queued with at most
	// the one credit kept in reserve for a CREDIT message counts once.
	// Later flushes that find the queue still stuck do not count again;
	// the wait counts anew once the queue has moved (something was posted)
	// or emptied and then runs out of credits again. A high rate means the
	// peer's ring (WithRing) is too small for the traffic.
	CreditStalls uint64

	// What the sending side did: RequestsIn is the number of the peer's
	// TENSOR_REQUESTs received, ReRequestsIn the number of its
	// TENSOR_RE_REQUESTs answered (with the write, or an error when the
	// offered buffer is too small).
	RequestsIn, ReRequestsIn uint64
	// PendingRefused is the number of the peer's requests for tensors not
	// sent yet that this side refused because WithMaxPendingRequests of
	// them were parked already; NamesRefused the number it refused because
	// they defined a name beyond WithMaxNames, or used the index of a name
	// so refused. Each went back to the peer as ERROR_STATUS (its Recv
	// fails with ErrLimit) and was logged; both count in RequestsIn.
	PendingRefused, NamesRefused uint64
	// PullsIn is the number of tensors this side pulled from the peer's
	// device memory (WithPull); PullsOut the number the peer was offered
	// to pull. A pulled tensor counts in BytesIn (and, once confirmed,
	// in WritesOut and BytesOut) as a written one does.
	PullsIn, PullsOut uint64
	// EagerOut is the number of tensors this side sent eagerly (WithEager);
	// EagerIn the number the peer sent it so. Their bytes count in BytesOut
	// and BytesIn, not in WritesOut and WritesIn. EagerCrossed is the number
	// of the peer's requests dropped here because they crossed the EAGER
	// that answered them.
	EagerOut, EagerIn, EagerCrossed uint64
	// ResultsRefused is the number of this side's Recvs whose result could
	// not be allocated for want of memory: the pool's limit reached
	// (alloc.ErrPoolExhausted) or a tensor larger than WithMaxTensorBytes
	// (ErrTooLarge). Each Recv failed with that error, naming the peer and
	// the size, and was logged; the peer's Send was refused with the
	// reason (it counts it in SendsRefused).
	ResultsRefused uint64
	// SendsRefused is the number of this side's Sends the peer refused,
	// having no room for the tensor: each failed with a RefusedError and
	// its tensor was given back.
	SendsRefused uint64
	// SendsPending is the number of Sends (and SendErrors) the peer has not
	// requested yet, at the time of the call.
	SendsPending int
	// Kept is the number of tensors kept for the peer's re-request
	// (answered with META_DATA_RESPONSE, not written yet), at the time of
	// the call.
	Kept int
	// WritesInFlight is the number of writes posted and not completed yet,
	// striped writes included, at the time of the call.
	WritesInFlight int
	// Unconfirmed is the number of writes completed whose CONFIRM has not
	// come yet (their sources kept), at the time of the call.
	Unconfirmed int
	// RequestsParked is the number of the peer's requests waiting here for
	// a Send, at the time of the call: at most WithMaxPendingRequests.
	RequestsParked int
	// Names is the number of names the peer has defined on the channel, at
	// the time of the call: at most WithMaxNames.
	Names int
}

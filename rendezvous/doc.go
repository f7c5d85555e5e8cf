// Package rendezvous is gdrlink's zero-copy tensor protocol and the
// rendezvous API Go code uses to move tensors between two peers.
//
// A Channel joins this process to one peer over one queue pair of any verbs
// provider. The protocol is receiver-driven, as TensorFlow's verbs transport
// with zero copies: Recv allocates the result tensor from registered memory
// using a per-name meta-data cache and sends TENSOR_REQUEST with the result's
// address and rkey; the sender matches it with Send (either may come first)
// and answers with one RDMA write with immediate straight from the source
// tensor into the result, the immediate being the request index. When the
// cached meta-data is stale, the sender answers META_DATA_RESPONSE and keeps
// the tensor; the receiver reallocates and sends TENSOR_RE_REQUEST. Dead and
// empty tensors complete with a control message and no write; string tensors
// travel in tensor's wire encoding from a registered staging block.
//
// Beyond TensorFlow's transport: many control messages in flight per channel,
// paced by credits over a ring of posted receive buffers (credits ride back
// in every header, or in a CREDIT message when there is nothing else to
// send); names mapped to small indexes after first use; an optional checksum
// mode (CRC-32C of the source, verified on arrival); cancellation and
// deadlines on Recv; and every completed transfer says which path it took in
// a Transfer and in a debug log record.
//
// Results for a GPU land in GPU memory the NIC can write (PathDirectGPU),
// or, through a Proxy (ProxyPath adapts package proxy), in a pinned host
// tensor that the proxy copies to the device (PathProxy). A proxied result
// larger than the proxy chunk (WithProxyChunk, 4 MiB by default) is
// pipelined: the request carries the chunk size, the sender writes one
// write with immediate per chunk (each taking a credit, as each consumes a
// posted receive), and the receiver counts the chunks of each request (they
// arrive in order on the channel's own queue pair, never striped) and hands
// each to the proxy as it lands, so the copy to the GPU overlaps the
// network; the last chunk completes the request. Hosts with several
// NICs may give a channel extra rails (WithRail): large writes are then
// striped over all of them, the immediate following once every rail's part
// has landed.
//
// A peer that goes away fails every pending request and send of its channel
// with an error wrapping verbsio.ErrPeerLost that names the peer. A channel
// with pending work sends a keepalive to a peer silent for a keepalive
// interval (WithKeepalive), so that this holds on RDMA too, where a queue
// pair learns of a dead peer only by sending to it.
package rendezvous

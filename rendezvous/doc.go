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
// send); names mapped to small indexes after first use; checksum mode
// (CRC-32C of the source, verified on arrival; see Checksums); cancellation and
// deadlines on Recv; and every completed transfer says which path it took in
// a Transfer and in a debug log record.
//
// Small tensors (up to 4 KiB, WithEager) whose Send comes before the Recv
// asks go at once in a control message of their own, EAGER, as MPI's and
// UCX's eager protocols send small messages: the receiver keeps the bytes
// until the Recv, which then makes no round trip (PathEager), at the cost
// of a copy on each side; a Recv already waiting, whose TENSOR_REQUEST
// crossed the EAGER, takes it, and the sender drops that request. A
// window of 32 such tensors per channel bounds what the receiver keeps;
// TAKEN messages move it. Both peers must offer it (a channel whose Recvs
// may want device memory does not). In checksum mode each EAGER carries
// the CRC-32C of its bytes, the receiver checks them on arrival and its
// TAKENs count every tensor a Recv takes (riding with the next control
// frame, as CONFIRMs do, or alone within 200 µs), and the Send ends at
// the TAKEN that counts it (the bytes arrived intact) rather than when
// its SEND completes; an
// EAGER whose bytes do not match fails the channel (*ChecksumError),
// nothing of it delivered.
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
// pair learns of a dead peer only by sending to it. A NIC or kernel answers
// for a stopped process, though, so the keepalive is a heartbeat that the
// peer's process answers through the credit scheme, and a peer silent for
// the peer timeout (WithPeerTimeout, 30s by default) with work pending
// fails the channel with ErrPeerTimeout, which wraps verbsio.ErrPeerLost.
// A pause shorter than that, of either side, is survived.
//
// # Refusals
//
// A receiver that has no room for a tensor (larger than WithMaxTensorBytes,
// or its pool at its limit) fails its Recv with ErrTooLarge or
// alloc.ErrPoolExhausted naming the sender, and withdraws the request with
// the reason: CANCEL carrying wire.CodeTooLarge or wire.CodeNoMemory. The
// sender then fails that Send at once with a *RefusedError naming the
// receiver and the reason (it matches ErrRemote and the reason's
// sentinel), gives the tensor back (Send releases it), and counts it in
// Stats.SendsRefused; the channel goes on. A Recv whose cached meta-data
// is too large to allocate asks without it, so that the sender hears of
// the refusal too (or the tensor, changed since, fits). A Recv withdrawn
// for any other reason (its context ended, no path to its device) leaves
// the Send waiting for the next request of its key and step, as before.
//
// # Checksums
//
// In checksum mode the sender takes the CRC-32C (Castagnoli) of the source
// and sends it ahead of the write (CHECKSUM, or in META_DATA_RESPONSE), and
// the receiver checks the bytes that arrived. It is on by default where
// bytes cross a network that may change them unnoticed (tcp: a veth pair
// does not check TCP checksums, and some NIC offloads miss errors) and off
// elsewhere (DefaultChecksum, WithChecksum). Neither side's checksum
// need lie between a request and its result: a Send takes a large host
// tensor's as it is offered (a source changed after Send, against its
// contract, then arrives as corrupted), and where the queue pair takes
// the checksum of a write with immediate as its bytes land
// (verbsio.WriteChecksummer: tcp, reading its socket), the receiver
// checks that one instead of reading the result again. Peers that both offer it in
// their HELLO (wire.HelloConfirm) also confirm: the receiver answers every
// write it takes in with CONFIRM, and the sender keeps the source until
// then, so Send's done (and Stats.WritesOut) says delivered only once the
// receiver found the bytes intact. A write that arrived corrupted is asked
// for again with TENSOR_RE_REQUEST for the same request and buffer, and
// written again from the source kept; after MaxChecksumRetries such
// retries the receiver gives up with CONFIRM carrying wire.ConfirmBad:
// its Recv fails with a *ChecksumError naming the sender, the Send with
// one naming the receiver. Results taken in chunks (WithProxyChunk) are
// not asked for again (their chunks went on to the proxy as they landed):
// a corrupted one fails at once, both sides told. A clean transfer costs
// one CONFIRM frame more than checksum mode without confirmations, and no
// SEND more in a stream of Recvs: a CONFIRM waits up to 200 µs for another
// control frame to ride with (most often the next Recv's request), and
// goes alone only then.
//
// With a peer whose HELLO lacks HelloConfirm nothing changes: no CONFIRM,
// a corrupted write fails the Recv, and the Send is done when written. A
// peer of the first release refuses a HELLO that carries the flags of
// this one (wire.ErrFlags at Connect); a side that chose checksums off
// (WithChecksum(false)) sends none, the HELLO of the first release, and
// connects to such a peer in checksum mode off as before.
//
// Closing with confirmations outstanding: a side that closes posts the
// CONFIRMs still queued ahead of its BYE, in the same SEND (as many as fit
// one: some 300), and a sender takes CONFIRMs on a stopped channel too,
// so the CONFIRMs say which writes arrived intact before the BYE's count
// is read; a write the count covers but no CONFIRM does (it arrived
// corrupted, its retry cut short by the close) fails with ErrClosed, as
// its Recv did. If neither a CONFIRM nor the peer's BYE can come (the
// peer is gone, or its BYE does not come in time) a write is reported as
// without confirmations: delivered if its write completed while the
// channel was up.
//
// # Closing
//
// Close sends BYE, and BYE says what arrived: it carries (wire.ByeImms)
// the number of writes with immediate this side took in on the channel's
// queue pair, counted when each completion is handled, that is when the
// Recv it completes has its tensor. Every write with immediate a sender
// posts on the queue pair is numbered in the same order (each chunk of a
// chunked write has one; a striped write's comes on the queue pair once
// the rails' parts landed), and RC delivers them in that order, so the
// count names exactly the writes the peer took in. On the peer's BYE a
// sender ends each write in flight by the count, not by its completion,
// which may not have come yet when the BYE does (the completion needs the
// acknowledgement, the BYE comes after it on the other direction): a write
// the count covers is delivered (its done gets nil, its source goes back
// once no work request reads it), any other fails with ErrClosed, as do
// Sends not written. So a sender reports delivered exactly what the
// receiver got, and a Send that failed may be sent again without a
// duplicate.
//
// A side that is still open when the peer's BYE comes answers with its own
// BYE, so that a peer closing with its own writes in flight learns which
// arrived: Close waits for that answer when it had writes in flight, and
// for its own BYE to leave. Both waits end as soon as the peer's BYE
// comes, a completion in error or the completion goroutine's end says the
// peer is gone or closed, or at the latest after a second; two sides that
// close together cross their BYEs and neither waits for a timer. A write
// whose completion came back successful but whose fate no BYE told (the
// peer's answer did not come in time) is reported delivered when Close
// destroys the queue pair: it went out before this side's BYE, so the peer
// took it in before it heard of the close.
//
// What the count cannot settle: a receiver that closes with Recvs still
// pending while their writes land races with the sender's completions. The
// count then says those writes did not arrive (their Recvs failed with
// ErrClosed), but the sender may have handled a successful completion, and
// reported the Send delivered, before the BYE reached it. Closing once the
// Recvs one waits for have ended avoids it. A peer of the first release
// sends a BYE without a count (writes in flight then fail with ErrClosed
// as before), and refuses the longer BYE and CANCEL of this one.
package rendezvous

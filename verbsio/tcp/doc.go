// Package tcp is the verbs provider "tcp" for hosts without RDMA: reliable
// connected queue pairs over TCP with the semantics of ibverbs (rkeys and
// access flags checked at the target, remote-access errors completing the
// sender's work request, RDMA WRITE, WRITE WITH IMMEDIATE, SEND/RECV and
// READ), so code above verbsio runs unchanged on any host. Import it for
// its side effect of registering the provider:
//
//	import _ "github.com/gdrlink/gdrlink/verbsio/tcp"
//
// # Devices and queue pairs
//
// A device is a TCP listener (Config.ListenAddr, an ephemeral loopback
// port by default; beyond loopback only with a job key or
// Config.Insecure, see Authentication) and the tables of its protection domains, regions and
// queue pairs. A queue pair's endpoint carries the device's address, the
// queue pair's number and a random nonce; Connect dials Options.Lanes
// connections ("lanes") to the peer's listener and waits for the peer's
// lanes to arrive, so each side sends its requests on the lanes it dialed
// and answers the peer's on the lanes it accepted.
//
// # Authentication
//
// With a job key (Config.JobKey) every lane proves it before anything of
// the job crosses. The dialing side runs jobauth's mutual challenge-response
// (purpose "tcp-lane"; in place of a rank, which the provider does not
// have, the dialing queue pair's number) right after the TCP connect and
// before its hello; the accepting side reads nothing from a connection but
// that handshake until the key is proven, and then wants a hello from the
// queue pair the handshake named. A peer with another key, or with none,
// fails Connect on both sides at once (no wait for ConnectTimeout) with an
// error wrapping jobauth.ErrRefused, and its connections are closed before
// they reach a queue pair, so established queue pairs never notice them. A
// process without the key that opens with a hello is told, with an answer
// of its own to the hello, so that its Connect says why.
//
// An accepted connection has 10s for its handshake and hello together, and
// at most 64 accepted connections that have proven nothing yet wait at
// once: one more closes the oldest of them. Refusing the newest instead
// would let 64 idle connections keep the job's own lanes out for those
// 10s; this way the goroutines and sockets a stranger holds stay bounded
// and a lane of the job, which proves the key within a round trip or two,
// still gets through (only a stranger that keeps opening more than 64
// connections per handshake time can starve it). One address (IP) holds
// at most 16 of them: its 17th closes its own oldest, and when the 64 are
// taken, the address holding the most gives up its oldest, so a flood
// from one address never closes another's connections. Every connection
// refused is logged (Config.Logger, at most a line a second).
//
// The handshake binds both ends' addresses as each side sees the
// connection, so a lane through NAT or a port forward (an AdvertiseAddr
// that is not the listener's own address, a proxy) fails it.
//
// Without a key lanes are not authenticated: a hello need only name a
// queue pair and its endpoint's nonce. Open then refuses a ListenAddr that
// is not loopback, with an error wrapping verbsio.ErrBadConfig and
// jobauth.ErrInsecure, unless Config.Insecure is set.
//
// # Zero copies
//
// The sender writes each frame's header and payload with one vectored write
// (net.Buffers, writev) straight from the registered source memory; the
// target reads the header, checks the rkey, the address range and the
// region's access, and only then reads the payload straight into the
// destination region (io.ReadFull on the registered memory): no
// intermediate buffer on either side. A payload that fails the checks is
// read into a small scratch buffer and dropped, the target answers with a
// nak, and the sender's work request completes with StatusRemoteAccess.
// No lock is held while bytes move: a transfer under way is listed in its
// region, and the region's Close cuts it short (a past deadline on its
// connection) instead of waiting for the peer, so a peer that stalls in
// the middle of a payload never holds up Close (nor, above it, a pool's or
// an endpoint's). The write cut short fails at the writer with
// StatusRemoteAccess, the rest of its payload is skipped, and once Close
// returns no byte of any peer lands in the region. A peer that goes away
// in the middle of a payload may leave part of it in the region, as an
// interrupted RDMA write would, and a striped write whose last stripe
// fails the range check may have placed its other stripes (each stripe is
// checked on its own); never a byte outside the region.
//
// # Grants
//
// Regions implement verbsio.Granter (Caps.Grants): a grant lets the peer
// of one queue pair write one range of a region, for a given number of
// writes with immediate (the last of which revokes it as it arrives, before
// its receive completes), or plain writes only, until Revoke. Every write
// is checked against the domain's table of live grants: the rkey, the
// queue pair whose lane it came on, the range, and whether the grant is
// still live. A grant's rkey is random, with the top bit set (a region's
// keys have it clear, so the two never meet), and distinct from every other
// live grant of the domain. From its first grant on, a region's own rkey
// admits no remote access, neither writes nor reads: only grants let a peer
// in, and only to write. (A region that never gives a grant keeps the
// access it was registered with.) Revoke, like Close, cuts short a write
// under way through the grant; the region's Close and the queue pair's
// Close revoke their grants.
//
// # Ordering and completions
//
// One goroutine per queue pair sends work requests in post order; small
// ones are batched into one writev. A write of at least Options.StripeMin
// bytes is striped over all lanes, and the next work request (or, for a
// write with immediate, the zero-length frame carrying the immediate) goes
// out only when every stripe is acknowledged, so a completion at the target
// means every byte before it has landed. Completions come in post order; an
// unsignaled work request completes only when it fails. Of the unsignaled
// writes, writes with immediate and sends, only one in four asks the target
// for an acknowledgement (the others carry flagNoAck: the next response on
// the lane stands for them, and a failure is still answered). The target
// holds an acknowledgement back while the next request already waits in
// its socket and sends a burst's acknowledgements in one write (never
// across a wait for a posted receive); a completion queue's polling Wait
// holds back those of the requests it applies until its next look, the
// queue pair's next post or 200 us. As on a verbs queue
// pair, the first failure puts the queue pair in the error state: the work
// requests behind it complete flushed, later posts fail with ErrQPState,
// and the connections close, so the peer's queue pair fails too.
//
// A send, or a write with immediate, that finds no posted receive at the
// target waits there up to Options.RNRTimeout (5s by default) for one, like
// an ibverbs queue pair retrying receiver-not-ready; after that the sender's
// work request completes with StatusRemoteOperation. A send larger than the
// receive buffer completes the receive with StatusLocalLength and the send
// with StatusRemoteOperation.
//
// A dead peer (connection reset or closed, or TCP_USER_TIMEOUT expired,
// which follows Config.Timeout and RetryCount with a floor of 10s, and is
// never shorter than one and a half Config.PeerTimeout, so that a paused
// peer is judged by the channel's peer timeout rather than cut by the
// socket first; keepalive probes last as long) puts the
// queue pair in the error state: work requests already sent complete with
// StatusRetryExceeded, whose Err wraps verbsio.ErrPeerLost, the others and
// every posted receive with StatusFlushed.
//
// # Retransmits
//
// The device's Retransmits method (not part of verbsio.Device: find it
// with a type assertion to interface{ Retransmits() (uint64, error) }, as
// the gdrlink front door does for gdrlink_transport_retransmits_total)
// counts the TCP segments the kernel retransmitted on the lanes of the
// device's queue pairs, read with getsockopt(TCP_INFO) (tcpi_total_retrans).
// A lane's count is kept when it closes, so the figure never goes down.
//
// # Wire format
//
// Described in frame.go, version 2 (flagNoAck; peers of version 1 are
// refused at the hello): on each connection, jobauth's handshake when the
// job has a key, a hello, then 40-byte headers (version, opcode, flags,
// status, length, token, remote address, rkey, immediate, total) each
// followed by its payload. Decoding is strict: an
// unknown opcode, a length over 1 GiB, a set reserved field or a field the
// opcode does not use is a malformed frame, which closes that connection
// and, for a connected peer, fails the queue pair with verbsio.ErrBadFrame.
//
// # Lanes
//
// Measured with BenchmarkWrite on a loaded two-core host (loopback, both
// devices in one process, eight writes in flight; wall-clock rates varied
// twofold between runs, so the CPU cost per byte is the steadier figure):
// 16 MiB writes moved 98-104% of a raw TCP stream's bytes per CPU second
// with one lane and 85-105% with two or four; 1 MiB writes gained from
// striping (two lanes about 1.3 to 1.8 times one). With no lane count
// clearly ahead for large writes, the default is 1 lane, the simplest (no
// stripe round trip); more lanes (GDRLINK_TCP_LANES) are for links that one
// TCP stream cannot fill.
// Socket buffers are left to the kernel's automatic tuning by default:
// fixed 4 and 16 MiB buffers (GDRLINK_TCP_SOCKET_BUFFER) made no clear
// difference in the same measurements.
package tcp

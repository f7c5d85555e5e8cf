package rendezvous

import (
	"fmt"
	"log/slog"
	"math/bits"
	"time"

	"github.com/gdrlink/gdrlink/internal/wire"
	"github.com/gdrlink/gdrlink/tensor"
)

// Defaults of a channel; the options that change them say so.
const (
	defaultRing = 128
	// minRing is the smallest ring. Credits come back alone (CREDIT) once
	// at least max(2, ring/4) are owed, so a CREDIT received never makes
	// another by itself, and a peer short of credits always has enough
	// owed to it to get some back.
	minRing               = 4
	defaultSendSlots      = 64
	defaultMaxStringBytes = 1 << 30
	defaultMaxTensorBytes = 64 << 30
	defaultKeepalive      = time.Second
	// defaultPeerTimeout is how long a channel with work pending waits for
	// a sign of life from its peer before it fails (WithPeerTimeout).
	defaultPeerTimeout = 30 * time.Second
	defaultProxyChunk  = 4 << 20
	// defaultEagerMax is the largest tensor sent eagerly (WithEager).
	defaultEagerMax  = 4 << 10
	defaultStripeMin = 4 << 20
	// defaultMaxPending and defaultMaxNames bound what a peer may make a
	// channel hold (WithMaxPendingRequests, WithMaxNames).
	defaultMaxPending = 4096
	defaultMaxNames   = 65536
)

// Proxy lands results on devices the NIC cannot write directly: the write
// lands in host memory the proxy provides (registered with the channel: the
// proxy's pool must be one of the channel's Memory), and the proxy copies it
// to the device. ProxyPath adapts the proxy package.
type Proxy interface {
	// Land prepares the landing of a result of meta's size for dev.
	Land(meta tensor.Meta, dev tensor.Device) (Landing, error)
}

// Landing is where a proxied result's bytes are written. Its Buffer is the
// host memory the NIC writes (Free abandons the landing); Landed is called
// once, when every byte is in, and done runs once with the tensor on the
// device or the error, from any goroutine.
//
// A landing with a method ChunkLanded(off, n int), as ProxyPath's have,
// takes its bytes as they land, so that the copy to the device overlaps the
// network. For a result larger than the channel's proxy chunk
// (WithProxyChunk) the channel asks the sender to write it in chunks, each
// a write with immediate, and calls ChunkLanded for every chunk but the
// last, in order, from its completion goroutine, as each completes; Landed
// follows the last chunk and covers the bytes not reported yet. ChunkLanded
// must not block. A landing that fails part-way keeps its memory until
// Landed or Free (the sender may still be writing) and reports the failure
// through Landed's done. A landing with a method Direct() bool that returns
// true (the NIC writes the device itself) gets one write, as any other
// result.
type Landing interface {
	tensor.Buffer
	Landed(done func(*tensor.Tensor, error))
}

// chunkedLanding is a Landing that takes its bytes as they land.
type chunkedLanding interface {
	Landing
	ChunkLanded(off, n int)
}

// stager is a Proxy that also stages tensors to be sent (see WithProxy).
type stager interface {
	Stage(src tensor.Buffer, n int, done func(tensor.Buffer, error))
}

type options struct {
	name       string
	ring       int
	sendSlots  int
	checksum   bool
	log        *slog.Logger
	proxy      Proxy
	stager     stager
	puller     Puller
	maxStrings int
	maxTensor  int64
	rails      []railConfig
	stripeMin  int64
	keepalive  time.Duration
	// peerTimeout fails a channel whose peer was silent that long with
	// work pending; 0: never (WithPeerTimeout).
	peerTimeout time.Duration
	chunkShift  uint8 // proxy results come in chunks of 1<<chunkShift; 0: one write
	maxPending  int   // the peer's requests parked for Sends not made yet; 0: the default
	maxNames    int   // the peer's name indexes; 0: the default
	// eagerMax is the largest tensor sent eagerly, 0: none (WithEager).
	eagerMax int
	// corrupt, when set, changes the bytes of a source after its checksum
	// is taken and before it is written (fault injection for tests).
	corrupt func(key string, step int64, b []byte)

	// checksumSet: WithChecksum chose the mode; otherwise it is the
	// provider's default (DefaultChecksum), which a peer's choice
	// overrides. firstRelease (tests): the HELLO a peer of the first
	// release sends, without the flags of confirmations
	// (checksumHello), to test the fallback with such a peer.
	checksumSet  bool
	firstRelease bool
}

// Option configures a channel made by New.
type Option func(*options) error

// WithEager sets the largest tensor, in bytes, that a Send made before the
// peer's Recv sends at once in a control message (EAGER) rather than
// waiting for the Recv's request: the receiver keeps it (up to 32 per
// channel) and its Recv takes it without a round trip, at the cost of a
// copy on each side. Default 4096; 0 turns it off, and makes the channel's
// receive buffers 4 KiB instead of 8. Only host tensors of fixed-size
// types go eagerly, only to a peer that takes them (its HELLO says so: a
// channel with a Proxy, a Puller, or memory on a device does not, since its
// Recvs may want their result there). In checksum mode the frame carries
// the CRC-32C of the bytes, which the receiver checks, and the Send ends
// when the receiver's TAKEN counts it, as a write's ends at its CONFIRM.
func WithEager(maxBytes int) Option {
	return func(o *options) error {
		if maxBytes < 0 || maxBytes > wire.MaxEager {
			return fmt.Errorf("%w: eager tensors of up to %d bytes, want 0..%d", ErrBadOption, maxBytes, wire.MaxEager)
		}
		o.eagerMax = maxBytes
		return nil
	}
}

// WithName is this side's name as the peer's errors and logs show it.
func WithName(name string) Option {
	return func(o *options) error { o.name = name; return nil }
}

// WithRing sets how many receive buffers the channel posts (default 128,
// at least 4, at most 65535): the credits the peer starts with, so the
// control messages and writes it may have in flight at once. Credits come
// back alone (CREDIT) once at least max(2, n/4) are owed, so at 4 and above
// a CREDIT received never makes another by itself, and a peer short of
// credits always has enough owed to it to get some back.
func WithRing(n int) Option {
	return func(o *options) error {
		if n < minRing || n > 65535 {
			return fmt.Errorf("%w: ring of %d buffers, want %d..65535", ErrBadOption, n, minRing)
		}
		o.ring = n
		return nil
	}
}

// WithChecksum turns checksum mode on or off: the sender sends the CRC-32C
// of every tensor it writes, and the receiver verifies it on arrival. With
// a peer that offers confirmations (every peer of this release), the
// sender keeps the source until the receiver confirms it, and a write that
// arrives corrupted is asked for again, up to MaxChecksumRetries times,
// before both sides fail it with a *ChecksumError (ErrChecksum). Without
// this option the mode is the provider's default (DefaultChecksum: on for
// tcp) and follows a peer that chose; peers that both chose must agree.
func WithChecksum(on bool) Option {
	return func(o *options) error { o.checksum, o.checksumSet = on, true; return nil }
}

// WithLogger sets the structured logger; transfers are logged at debug level.
func WithLogger(l *slog.Logger) Option {
	return func(o *options) error {
		if l == nil {
			return fmt.Errorf("%w: nil logger", ErrBadOption)
		}
		o.log = l
		return nil
	}
}

// WithProxy sets the proxy path for GPU results the NIC cannot write.
//
// When p also has a method Stage(src tensor.Buffer, n int, done
// func(tensor.Buffer, error)), as ProxyPath's has, GPU tensors the NIC
// cannot read are sent through it (the sending half of the proxy path): it
// copies the first n bytes of src to host memory registered with the
// channel and calls done once, from any goroutine, with that memory (whose
// Free gives it back) or the error; the write goes from there.
func WithProxy(p Proxy) Option {
	return func(o *options) error {
		o.proxy = p
		if s, ok := p.(stager); ok {
			o.stager = s
		}
		return nil
	}
}

// WithMaxTensorBytes caps the byte size of a tensor this side will allocate
// for a peer (default 64 GiB): a larger META_DATA_RESPONSE fails its Recv
// with ErrTooLarge instead of taking the memory. It also caps the decoded
// size of a received string tensor, which is 1 GiB by default and never
// more.
func WithMaxTensorBytes(n int64) Option {
	return func(o *options) error {
		if n <= 0 {
			return fmt.Errorf("%w: tensor limit %d", ErrBadOption, n)
		}
		o.maxTensor = n
		o.maxStrings = int(min(n, defaultMaxStringBytes))
		return nil
	}
}

// WithProxyChunk sets the chunk of pipelined proxy results (default 4 MiB,
// so a 64 MiB tensor comes in 16 writes, each copied to the GPU as soon as
// it lands; a power of two from 4 KiB to 1 GiB, or 0 for one write per
// result). A result that lands in a Landing with a ChunkLanded method
// (ProxyPath's) and is
// larger than n is asked for in chunks of n bytes: the request carries n
// (TENSOR_REQUEST with wire.ReqChunks, or TENSOR_RE_REQUEST's chunk size),
// so the sender needs no setting of its own, and the sender writes each
// chunk with an immediate naming the request. The chunks go in order over
// the channel's own queue pair, never striped over rails (WithRail), so
// the receiver counts them instead of reading offsets from immediates; each
// takes one of the receiver's posted receives, so each takes a credit, and
// a long tensor waits for credits as they come back. Direct results keep
// one write.
func WithProxyChunk(n int) Option {
	return func(o *options) error {
		if n == 0 {
			o.chunkShift = 0
			return nil
		}
		if n < 1<<wire.MinChunkShift || n > 1<<wire.MaxChunkShift || n&(n-1) != 0 {
			return fmt.Errorf("%w: proxy chunk of %d bytes, want a power of two from %d to %d, or 0", ErrBadOption, n, 1<<wire.MinChunkShift, 1<<wire.MaxChunkShift)
		}
		o.chunkShift = uint8(bits.TrailingZeros(uint(n)))
		return nil
	}
}

// WithKeepalive sets the keepalive interval (default 1s; 0
// turns keepalives off, but for the heartbeats of a peer timeout, which then
// go every quarter of it: see WithPeerTimeout). While the channel has pending work (a Recv not
// answered, a Send or a request of the peer not matched, a tensor kept for
// a re-request, a write in flight) and nothing has arrived from the peer for
// d, it sends a keepalive: a CREDIT frame, which the peer's NIC must
// acknowledge (with a peer timeout, WithPeerTimeout, it is a heartbeat the
// peer answers). A dead peer makes that send fail as soon as the transport
// gives up on it, and the channel fails every pending request with
// verbsio.ErrPeerLost; without it, a queue pair that has nothing to send
// never learns that its peer is gone. An idle channel sends nothing.
//
// A keepalive respects the credit scheme: it takes one of the peer's
// receive buffers like any SEND, and returns the credits this side owes.
// It is sent only when that leaves the reserve credit alone (two credits or
// more), or when it returns credits (the reserve is kept for exactly that);
// otherwise it waits for credits, and the peer, which then holds this
// side's credits, returns them unasked. At most one goes out per interval,
// and the peer never answers one (a CREDIT makes no CREDIT by itself), so
// the credits they take come back with the peer's next frames.
func WithKeepalive(d time.Duration) Option {
	return func(o *options) error {
		if d < 0 {
			return fmt.Errorf("%w: keepalive interval %v", ErrBadOption, d)
		}
		o.keepalive = d
		return nil
	}
}

// WithPeerTimeout sets how long the peer may stay silent while the
// channel has work pending (default 30s; 0: for ever,
// as before there was one). Past it, the channel fails every pending
// request with an error matching ErrPeerTimeout (and so
// verbsio.ErrPeerLost) that names the peer and how long it was silent.
//
// Silence is judged on what the peer's process does, not its NIC or
// kernel: a stopped process (SIGSTOP, a debugger) or one whose network is
// cut is silent; one that merely has nothing to send is not, because the
// keepalives become heartbeats that a live peer answers. A heartbeat is a
// run of CREDIT frames, sent when the peer was silent for a keepalive
// interval (WithKeepalive, or a quarter of d if that is shorter or off),
// that brings the credits the peer owes this side up to the point where
// the credit scheme makes the peer return them (max(2, ring/4) of its
// ring, see WithRing): the peer's answer is the CREDIT it sends back. So
// a peer of an earlier release, which knows nothing of heartbeats, answers
// them too, and no frame or flag is new on the wire. Heartbeats follow the
// credit scheme as keepalives do, and take no more than that quarter of
// the peer's ring: none goes out while the peer owes that many already.
//
// A pause shorter than d on either side is survived: the peer's frames wait
// in its receive queue and the stream resumes. Frames are delivered in
// order behind the writes on the queue pair, so a single write that takes
// longer than d to cross the link is silence to its receiver: d must
// exceed the longest write's time on the wire. A process that was itself
// stopped (its keepalive timer fired late) does not count the time it was
// stopped against its peer.
func WithPeerTimeout(d time.Duration) Option {
	return func(o *options) error {
		if d < 0 {
			return fmt.Errorf("%w: peer timeout %v", ErrBadOption, d)
		}
		o.peerTimeout = d
		return nil
	}
}

// WithMaxPendingRequests bounds the peer's requests that this side holds
// for tensors it has not sent yet (default 4096, at least 1). The receiver
// may ask before the sender sends, so such a request is parked until the
// matching Send, for as long as that takes: it has no age limit, only
// this count. Beyond it, the newest request is refused: the peer gets
// ERROR_STATUS (wire.CodeLimit) naming the bound and its Recv fails with
// ErrLimit; this side logs the refusal and counts it in
// Stats.PendingRefused. The channel and its other traffic go on. A parked
// request costs a few hundred bytes plus its name.
func WithMaxPendingRequests(n int) Option {
	return func(o *options) error {
		if n < 1 {
			return fmt.Errorf("%w: %d pending requests, want at least 1", ErrBadOption, n)
		}
		o.maxPending = n
		return nil
	}
}

// WithMaxNames bounds the names the peer may define on the channel
// (default 65536, 1 to 1<<32-1). A request carries a tensor's full name
// the first time and assigns it a name index for the later ones; this
// side keeps every index the peer defines for the life of the channel,
// at most n of them (up to n times wire.MaxName bytes). A request that
// defines a name beyond the bound, or later uses the index it tried to
// define, is refused: the peer gets ERROR_STATUS (wire.CodeLimit) naming
// the bound and its Recv fails with ErrLimit; this side logs the refusal
// and counts it in Stats.NamesRefused. The channel and the names defined
// so far go on working.
func WithMaxNames(n int) Option {
	return func(o *options) error {
		if n < 1 || uint64(n) > 1<<32-1 {
			return fmt.Errorf("%w: %d names, want 1..%d", ErrBadOption, n, uint64(1<<32-1))
		}
		o.maxNames = n
		return nil
	}
}

// pendingLimit and namesLimit are the bounds in force.
func (o *options) pendingLimit() int {
	if o.maxPending > 0 {
		return o.maxPending
	}
	return defaultMaxPending
}

func (o *options) namesLimit() int {
	if o.maxNames > 0 {
		return o.maxNames
	}
	return defaultMaxNames
}

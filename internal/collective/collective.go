package collective

import (
	"context"
	"fmt"
	"strconv"
	"strings"

	"github.com/gdrlink/gdrlink/collective"
	"github.com/gdrlink/gdrlink/rendezvous"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

// Op is a reduction.
type Op uint8

// Reductions.
const (
	// Sum adds the ranks' elements.
	Sum Op = iota + 1
	// Average is Sum divided by the number of ranks: rounded to the
	// element type for floats, truncated toward zero for integers.
	Average
)

// String names the reduction.
func (o Op) String() string {
	switch o {
	case Sum:
		return "sum"
	case Average:
		return "average"
	}
	return "Op(" + strconv.Itoa(int(o)) + ")"
}

// ErrBadArgument: a nil, released, GPU or string tensor, an unknown
// reduction, a type it does not apply to, a root out of range, or shapes
// that do not fit. It wraps verbsio.ErrBadConfig, the front door's error
// for bad input.
var ErrBadArgument = fmt.Errorf("collective: invalid argument: %w", verbsio.ErrBadConfig)

// abortMarker begins the text a rank sends its ring successor when its
// collective fails, followed by the failed rank and a colon.
const abortMarker = "gdrlink collective aborted, failed rank "

// abortText is what a rank tells its successor when rank failed with err.
func abortText(rank int, err error) error {
	return fmt.Errorf("%s%d: %w", abortMarker, rank, err)
}

// parseAbort finds the failed rank in an error text a neighbour sent
// (abortText), for a job of size ranks. ok is false when the text holds no
// such marker or the rank is out of range.
func parseAbort(text string, size int) (rank int, ok bool) {
	i := strings.Index(text, abortMarker)
	if i < 0 {
		return -1, false
	}
	rest := text[i+len(abortMarker):]
	j := strings.IndexByte(rest, ':')
	if j <= 0 || j > 10 {
		return -1, false
	}
	n, err := strconv.Atoi(rest[:j])
	if err != nil || n < 0 || n >= size || rest[0] == '+' || rest[0] == '-' {
		return -1, false
	}
	return n, true
}

// Backend runs collectives for one rank of a job. Every rank calls the
// same collectives in the same order, one at a time, with the same seq:
// the number of collectives the job ran before this one.
type Backend interface {
	// Name names the backend in reports and metrics.
	Name() string
	// AllReduce reduces t over every rank, in place: t holds the result
	// on every rank afterwards.
	AllReduce(ctx context.Context, seq uint64, t *tensor.Tensor, op Op) (collective.Report, error)
	// Broadcast copies root's t into every other rank's t.
	Broadcast(ctx context.Context, seq uint64, t *tensor.Tensor, root int) (collective.Report, error)
	// AllGather writes every rank's in into out: rank i's in lands at
	// out's i-th slot of in's byte size.
	AllGather(ctx context.Context, seq uint64, in, out *tensor.Tensor) (collective.Report, error)
}

// Transport is what the ring needs of a job: its rank and size, and a link
// to a peer.
type Transport interface {
	Rank() int
	Size() int
	// Link returns the connection to peer, made on first use.
	Link(ctx context.Context, peer int) (Link, error)
}

// Link is a zero-copy connection to one peer: rendezvous.Channel's
// SendFunc, SendError and RecvFunc, and a way to end it.
type Link interface {
	// SendFunc offers t under key and step; done runs once it has been
	// written or dropped, and t must not change until then.
	SendFunc(key string, step int64, t *tensor.Tensor, done func(error)) error
	// SendError answers the peer's receive of key and step with err.
	SendError(key string, step int64, err error) error
	// RecvFunc receives what the peer sends under key and step into a new
	// registered tensor (or, with rendezvous.Into, where it says, when the
	// link can), and calls cb once with it.
	RecvFunc(ctx context.Context, key string, step int64, cb func(*tensor.Tensor, rendezvous.Transfer, error), opts ...rendezvous.RecvOption)
	// Abort closes the connection: sends not written yet are dropped,
	// and their done runs before Abort returns.
	Abort() error
	// ConfirmNow sends at once what the link holds back for the peer's
	// writes it took (rendezvous.Channel.ConfirmNow): a rank about to
	// wait for its own sends to complete calls it, as its peers do, so
	// that none waits for another's hold to run out.
	ConfirmNow()
}

// addLink counts in rep a transfer that peer made into this rank.
func addLink(rep *collective.Report, peer int, tr rendezvous.Transfer) {
	rep.Received += tr.Bytes
	for i := range rep.Links {
		l := &rep.Links[i]
		if l.Peer == peer && l.Provider == tr.Provider && l.Device == tr.Device && l.Path == tr.Path {
			l.Transfers++
			l.Bytes += tr.Bytes
			return
		}
	}
	rep.Links = append(rep.Links, collective.LinkUse{Peer: peer, Provider: tr.Provider, Device: tr.Device, Path: tr.Path, Transfers: 1, Bytes: tr.Bytes})
}

// checkHost checks that t is a host tensor a collective can work on.
func checkHost(what string, t *tensor.Tensor) error {
	if t == nil {
		return fmt.Errorf("%w: nil %s tensor", ErrBadArgument, what)
	}
	m := t.Meta()
	if m.IsDead || !m.DType.DMAable() {
		return fmt.Errorf("%w: %s tensor %s: dead or not a numeric type", ErrBadArgument, what, m)
	}
	if t.Device().IsGPU() {
		return fmt.Errorf("%w: %s tensor on %s: collectives work on host tensors", ErrBadArgument, what, t.Device())
	}
	if _, err := t.Bytes(); err != nil {
		return fmt.Errorf("%w: %s tensor: %w", ErrBadArgument, what, err)
	}
	return nil
}

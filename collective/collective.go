// Package collective is the results and errors of gdrlink's collectives
// (gdrlink.Group's AllReduce, Broadcast and AllGather): what a call did
// (Report) and which rank ended it when it failed (RankError).
package collective

import (
	"errors"
	"fmt"
	"time"

	"github.com/gdrlink/gdrlink/rendezvous"
)

// ErrBroken: an earlier collective of the group failed; its ranks no
// longer agree on where they are, and its links to its ring neighbours
// are closed, so no other collective can run. Close the group.
var ErrBroken = errors.New("collective: an earlier collective failed")

// RankError is the error of a collective that ended because of one rank:
// a rank lost (its process died, its connection failed) or one whose own
// call failed (its context ended, it sent what the others did not
// expect). Every rank whose call ends because of it gets a RankError
// naming that rank, whether it saw the failure itself or heard of it
// along the ring. (A rank that closes its group at once after its own
// call failed may be named instead by its successor, if that one had not
// heard the news yet.)
type RankError struct {
	// Op is the collective: allreduce, broadcast or allgather.
	Op string
	// Rank is the rank that failed or was lost; -1 where that could not be
	// told.
	Rank int
	// Err is what happened: wraps verbsio.ErrPeerLost for a lost rank,
	// context.DeadlineExceeded for this rank's deadline, rendezvous.ErrRemote
	// for a failure heard of from a neighbour.
	Err error
}

// Error names the collective, the rank and what happened.
func (e *RankError) Error() string {
	if e.Rank < 0 {
		return fmt.Sprintf("collective: %s failed: %v", e.Op, e.Err)
	}
	return fmt.Sprintf("collective: %s failed at rank %d: %v", e.Op, e.Rank, e.Err)
}

// Unwrap returns Err.
func (e *RankError) Unwrap() error { return e.Err }

// Report is what one collective did on this rank: the backend that ran
// it, the bytes it moved and the paths they took. A backend fills it in.
type Report struct {
	// Op is the collective: allreduce, broadcast or allgather.
	Op string
	// Reduce is the reduction of an allreduce (sum, average); empty for
	// the others.
	Reduce string
	// Backend names the algorithm and transport that ran it: ring.
	Backend string
	// Ranks is the number of ranks that took part.
	Ranks int
	// Bytes is the size of the result tensor.
	Bytes int64
	// Sent and Received count the bytes this rank put on the wire and
	// took in.
	Sent, Received int64
	// Placed counts the received bytes the sender wrote straight into
	// the call's tensor, where the link could grant it (the ring's
	// all-gather steps, a Broadcast's, an AllGather's); the rest of
	// Received landed in tensors of their own and was added or copied
	// from there.
	Placed int64
	// Segments is the number of pieces each ring step was cut into, sent
	// and reduced concurrently.
	Segments int
	// Algorithm is how the ring backend's AllReduce went: "ring" round
	// the ring, or "halving" (recursive halving, then doubling, between
	// partners); empty for the other calls and backends, and for a job
	// of one rank.
	Algorithm string
	// Links says how the received bytes came, by neighbour, provider,
	// device and path (as Transfer reports a Recv).
	Links []LinkUse
	// Resent counts the messages this rank sent again because no answer
	// came within their timeout, and StaleReplies the replies it dropped
	// (for a message already answered, out of order, or corrupted): the
	// switchml backend's recovery from loss, whose result is the same
	// bits as without it. The ring, on reliable links, leaves them 0.
	Resent, StaleReplies int64
	// Staged counts the bytes copied between GPU tensors of the call and
	// their pinned host copies, which the collective ran on, and StageTook
	// the time the call spent on those copies outside the collective's
	// own steps (in Took too); 0 for host tensors. The ring's AllReduce
	// overlaps the copies with its steps, so StageTook is only the
	// queuing of the loads before them and the wait for the last stores
	// after them; the other calls copy whole tensors before and after.
	Staged    int64
	StageTook time.Duration
	// Took is the time the call took.
	Took time.Duration
}

// LinkUse counts the transfers one neighbour made into this rank over one
// provider, device and path.
type LinkUse struct {
	Peer             int
	Provider, Device string
	Path             rendezvous.Path
	Transfers        int
	Bytes            int64
}

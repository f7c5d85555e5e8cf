package rendezvous

import (
	"errors"
	"fmt"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/internal/closed"
	"github.com/gdrlink/gdrlink/internal/wire"
	"github.com/gdrlink/gdrlink/tensor"
)

// Errors of the rendezvous, one per condition; they are wrapped with the
// peer, key and step concerned. A lost peer is reported with
// verbsio.ErrPeerLost.
// ErrPullFailed: the receiver's copy of a pulled tensor failed (WithPull).
// The sender keeps the tensor: a Recv made again gets it, written through
// host memory once the Puller stopped offering pulls.
var ErrPullFailed = errors.New("rendezvous: pull failed")

var (
	// ErrClosed: the channel was closed, by this side or (BYE) by the peer. It is the one closed error of every layer
	// (the same value as gdrlink.ErrClosed and verbsio.ErrClosed), so
	// errors.Is matches it whichever layer noticed.
	ErrClosed = closed.Err
	// ErrNotConnected: Send or Recv before Connect.
	ErrNotConnected = errors.New("rendezvous: channel not connected")
	// ErrDuplicate: a second Send, or a second pending Recv, for one key and
	// step.
	ErrDuplicate = errors.New("rendezvous: duplicate key and step")
	// ErrBadKey: an empty key or one longer than wire.MaxName bytes.
	ErrBadKey = errors.New("rendezvous: invalid key")
	// ErrBadTensor: a nil or released tensor, or one whose bytes cannot be
	// read for sending.
	ErrBadTensor = errors.New("rendezvous: invalid tensor")
	// ErrRemote: the sender answered ERROR_STATUS; the message carries its
	// code and text.
	ErrRemote = errors.New("rendezvous: error from peer")
	// ErrCancelled: the receiver withdrew the request (its context ended).
	ErrCancelled = errors.New("rendezvous: request cancelled")
	// ErrChecksum: in checksum mode, the bytes that arrived do not match the
	// sender's CRC-32C.
	ErrChecksum = errors.New("rendezvous: checksum mismatch")
	// ErrProtocol: the peer sent something the protocol does not allow at
	// this point (an unknown request index, a frame that does not decode).
	ErrProtocol = errors.New("rendezvous: protocol violation")
	// ErrMismatch: the peers' HELLOs disagree (checksum mode, provider).
	ErrMismatch = errors.New("rendezvous: peers disagree")
	// ErrTooLarge: a tensor larger than the channel accepts
	// (WithMaxTensorBytes).
	ErrTooLarge = errors.New("rendezvous: tensor too large")
	// ErrNoPath: no way to land a result on the asked device (GPU memory the
	// NIC cannot reach and no proxy).
	ErrNoPath = errors.New("rendezvous: no path to device")
	// ErrLimit: a request refused because serving it would take a side
	// beyond a bound on what a peer may make it hold: requests for tensors
	// not sent yet (WithMaxPendingRequests) or names (WithMaxNames). The
	// refusing side logs it and counts it in Stats; the requesting side's
	// Recv fails with an error matching both ErrLimit and ErrRemote, whose
	// text names the bound and its value. The channel goes on.
	ErrLimit = errors.New("rendezvous: limit reached")
)

// remoteErr is the sentinel of an ERROR_STATUS with code: ErrRemote, which
// a refusal for a bound (wire.CodeLimit) joins with ErrLimit.
func remoteErr(code wire.Code) error {
	if code == wire.CodeLimit {
		return remoteLimit{}
	}
	return ErrRemote
}

// remoteLimit is ErrRemote and ErrLimit at once: the peer refused a
// request for one of its bounds.
type remoteLimit struct{}

func (remoteLimit) Error() string   { return ErrRemote.Error() }
func (remoteLimit) Unwrap() []error { return []error{ErrRemote, ErrLimit} }

// RefusedError is the error of a Send whose tensor the receiver refused
// (CANCEL with a reason): it had no room for it. It matches ErrRemote and
// Reason: ErrTooLarge (beyond the receiver's WithMaxTensorBytes) or
// alloc.ErrPoolExhausted (the receiver's pool is at its limit); a reason
// code this side does not know leaves Reason nil. The tensor is given back
// (Send releases it, SendFunc's done gets this error); the channel goes
// on. (A receiver that cannot have the result for another reason, such as
// no path to the device it asked for, withdraws the request without a
// reason: the Send then waits for its next request, as for a cancelled
// Recv.)
type RefusedError struct {
	Peer   string      // the receiver
	Key    string      // the tensor's key and step
	Step   int64       //
	Meta   tensor.Meta // what was sent
	Reason error       // the condition, or nil
	code   wire.Code
}

func (e *RefusedError) Error() string {
	return fmt.Sprintf("rendezvous: %q step %d (%v) refused by peer %s: %s", e.Key, e.Step, e.Meta, e.Peer, e.code)
}

// Unwrap is ErrRemote and Reason.
func (e *RefusedError) Unwrap() []error {
	if e.Reason == nil {
		return []error{ErrRemote}
	}
	return []error{ErrRemote, e.Reason}
}

// refusalCode is the reason a CANCEL carries when the receiver cannot
// have a result for want of room (the error of allocResultLocked), 0 when
// it is not such a refusal.
func refusalCode(err error) wire.Code {
	switch {
	case errors.Is(err, ErrTooLarge):
		return wire.CodeTooLarge
	case errors.Is(err, alloc.ErrPoolExhausted):
		return wire.CodeNoMemory
	}
	return 0
}

// refusalReason is the sentinel of a refusal's code, nil for a code that
// has none.
func refusalReason(code wire.Code) error {
	switch code {
	case wire.CodeTooLarge:
		return ErrTooLarge
	case wire.CodeNoMemory:
		return alloc.ErrPoolExhausted
	}
	return nil
}

// ErrBadOption: an option out of its range.
var ErrBadOption = errors.New("rendezvous: invalid option")

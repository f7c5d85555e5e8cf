package rendezvous

import (
	"fmt"

	"github.com/gdrlink/gdrlink/internal/wire"
)

// MaxChecksumRetries is how many times a receiver asks again for a tensor
// whose write arrived corrupted (checksum mode, with a peer that offers
// confirmations) before its Recv, and the peer's Send, fail with a
// *ChecksumError: a tensor is written at most 1+MaxChecksumRetries times.
// A sender refuses (as a protocol error) a peer that asks more often.
const MaxChecksumRetries = 2

// DefaultChecksum reports whether checksum mode is on by default for a
// channel of provider, that is without WithChecksum on either side:
//
//   - tcp: on. Bytes rewritten between the two hosts' memories (a veth
//     pair does not check TCP checksums, some NIC offloads miss errors)
//     otherwise arrive as good tensors; the CRC-32C catches them and the
//     tensor is sent again. Its cost is the README's ("Checksum mode").
//   - onnode: off. The bytes go from one process's memory to the other's
//     on the same host, with no wire to corrupt them; and the CRC-32C of
//     both sides halves the throughput there (README).
//   - ibverbs and any other: off. RDMA links carry an end-to-end CRC of
//     their own (the ICRC of InfiniBand and RoCE packets), and the cost of
//     ours on a real NIC is not measured.
func DefaultChecksum(provider string) bool { return provider == "tcp" }

// ChecksumError is the error of a Recv whose tensor arrived corrupted on
// every try, and of the peer's Send (its done) for that tensor. It matches
// ErrChecksum.
type ChecksumError struct {
	// Peer names the other side: the sender for a Recv, the receiver for a
	// Send.
	Peer string
	Key  string
	Step int64
	// Tries is how many writes of the tensor arrived corrupted.
	Tries int
	// Got and Want are the CRC-32C of the bytes that arrived last and the
	// sender's (the receiver's side only).
	Got, Want uint32
	// Sending: the error of a Send, whose receiver found the tensor
	// corrupted on every try.
	Sending bool
}

func (e *ChecksumError) Error() string {
	if e.Sending {
		return fmt.Sprintf("rendezvous: checksum mismatch: %q step %d to %s: the receiver found each of its %d writes corrupted", e.Key, e.Step, e.Peer, e.Tries)
	}
	return fmt.Sprintf("rendezvous: checksum mismatch: %q step %d from %s: CRC-32C %#08x, sender's %#08x, on each of %d tries", e.Key, e.Step, e.Peer, e.Got, e.Want, e.Tries)
}

// Is makes a ChecksumError match ErrChecksum.
func (e *ChecksumError) Is(target error) bool { return target == ErrChecksum }

// checksumHello is the HELLO flags that say this side's checksum mode.
func (o *options) checksumHello(provider string) uint8 {
	on := o.checksum
	var f uint8
	if !o.checksumSet {
		on = DefaultChecksum(provider)
		f |= wire.HelloChecksumAuto
	}
	if on {
		f |= wire.HelloChecksum
	}
	if on || !o.checksumSet {
		f |= wire.HelloConfirm
	}
	if o.firstRelease {
		f &= wire.HelloChecksum
	}
	return f
}

// negotiateChecksum decides a channel's checksum mode from this side's
// HELLO flags and the peer's: a mode chosen (WithChecksum, or any mode of
// a first-release peer, which has no HelloChecksumAuto) wins over a
// default; two chosen modes must agree (ErrMismatch); two defaults (the
// same provider) agree, or if they do not (releases with other defaults)
// checksum mode is on. confirm: both offer HelloConfirm, and the mode is
// on.
func negotiateChecksum(ours, theirs uint8, peer string) (on, confirm bool, err error) {
	oOn, tOn := ours&wire.HelloChecksum != 0, theirs&wire.HelloChecksum != 0
	oAuto, tAuto := ours&wire.HelloChecksumAuto != 0, theirs&wire.HelloChecksumAuto != 0
	switch {
	case !oAuto && !tAuto:
		if oOn != tOn {
			return false, false, fmt.Errorf("%w: peer %s checksum mode %v, ours %v", ErrMismatch, peer, tOn, oOn)
		}
		on = oOn
	case oAuto && tAuto:
		on = oOn || tOn
	case oAuto:
		on = tOn
	default:
		on = oOn
	}
	confirm = on && ours&wire.HelloConfirm != 0 && theirs&wire.HelloConfirm != 0
	return on, confirm, nil
}

package wire

import "github.com/gdrlink/gdrlink/verbsio"

// Errors of the decoder, one per condition. Each wraps verbsio.ErrBadFrame as
// well, so callers that only care that a peer sent garbage can match that.
var (
	// ErrTruncated: the input ends before the frame or a field does.
	ErrTruncated = wrapBad("wire: truncated frame")
	// ErrVersion: a frame of a protocol version this package does not speak.
	ErrVersion = wrapBad("wire: unknown version")
	// ErrType: a message type that does not exist.
	ErrType = wrapBad("wire: unknown message type")
	// ErrLength: a length field that disagrees with the frame, or a frame or
	// field longer than its limit.
	ErrLength = wrapBad("wire: bad length")
	// ErrFlags: flag bits that are unknown or not allowed for the type.
	ErrFlags = wrapBad("wire: bad flags")
	// ErrMeta: tensor meta-data that is not self-consistent (bad dtype,
	// shape or byte size).
	ErrMeta = wrapBad("wire: bad tensor meta-data")
	// ErrField: any other field out of its range (an empty name, a value that
	// does not fit an int64).
	ErrField = wrapBad("wire: field out of range")
)

type badFrame struct{ msg string }

func (e *badFrame) Error() string { return e.msg }
func (e *badFrame) Unwrap() error { return verbsio.ErrBadFrame }

func wrapBad(msg string) error { return &badFrame{msg} }

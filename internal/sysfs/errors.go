package sysfs

import (
	"errors"

	"github.com/gdrlink/gdrlink/internal/closed"
)

// Errors of the readers. Package gdr shares ErrNotSupported and ErrMalformed
// (the same values), so their messages say "gdr". Each is wrapped with the
// file, device or value concerned; match them with errors.Is.
var (
	// ErrNotSupported: a probe found that something is missing on this node
	// (a module, a kernel option, a device attribute); the wrapping message
	// says what. Any other probe error means "could not tell".
	ErrNotSupported = errors.New("gdr: not supported")
	// ErrBadPCIAddress: a PCI address that is not domain:bus:device.function.
	ErrBadPCIAddress = errors.New("gdr: bad PCI address")
	// ErrMalformed: a sysfs, procfs or snapshot file whose content does not
	// parse.
	ErrMalformed = errors.New("gdr: malformed input")
	// ErrOutsideRoot: a path or symbolic link that leads outside the root
	// being read.
	ErrOutsideRoot = errors.New("gdr: path outside root")
	// ErrClosed: use of a closed Root; the one closed error of every layer.
	ErrClosed = closed.Err
)

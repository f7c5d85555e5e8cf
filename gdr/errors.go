package gdr

import (
	"errors"

	"github.com/gdrlink/gdrlink/internal/sysfs"
)

// ErrNotSupported: a probe found that something is missing on this node (a
// module, a kernel option, a device attribute); the wrapping message says
// what. Any other probe error means "could not tell". A Check keeps the
// outcome without the error: StatusNotSupported.
var ErrNotSupported = sysfs.ErrNotSupported

// errBadLevel: a policy level that is neither a path type name nor one of
// NCCL's integers.
var errBadLevel = errors.New("gdr: bad policy level")

// Package closed holds the one error every layer returns for use of a
// closed thing (a pool, a device, a channel, a proxy, the front door), so
// errors.Is(err, gdrlink.ErrClosed) holds whichever layer noticed it, as
// net.ErrClosed does for every net type. Each public package re-exports it
// under its own ErrClosed name; all are this one value.
package closed

import "errors"

// Err is the shared closed-error sentinel.
var Err = errors.New("gdrlink: use of a closed resource")

// Package ctxerr picks the sentinel for an operation that failed while a
// context bounded it: a timeout when the context ended, the caller's
// sentinel otherwise.
package ctxerr

import (
	"context"

	"github.com/gdrlink/gdrlink/verbsio"
)

// Sentinel is verbsio.ErrTimeout when ctx has ended and otherwise
// otherwise (verbsio.ErrPeerLost for a peer that could not be reached).
func Sentinel(ctx context.Context, otherwise error) error {
	if ctx.Err() != nil {
		return verbsio.ErrTimeout
	}
	return otherwise
}

package ctxerr

import (
	"context"
	"errors"
	"testing"

	"github.com/gdrlink/gdrlink/verbsio"
)

func TestSentinel(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	if got := Sentinel(ctx, verbsio.ErrPeerLost); !errors.Is(got, verbsio.ErrPeerLost) {
		t.Fatalf("live context: %v, want ErrPeerLost", got)
	}
	cancel()
	if got := Sentinel(ctx, verbsio.ErrPeerLost); !errors.Is(got, verbsio.ErrTimeout) {
		t.Fatalf("ended context: %v, want ErrTimeout", got)
	}
}

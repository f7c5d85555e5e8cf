package rendezvous

import (
	"context"
	"fmt"
)

// ConnectVia trades Hellos with peer through x and connects. x trades one
// message with a peer of a job, as internal/bootstrap's Group does.
func (c *Channel) ConnectVia(ctx context.Context, x interface {
	Exchange(ctx context.Context, peer int, data []byte) ([]byte, error)
}, peer int) error {
	ph, err := x.Exchange(ctx, peer, c.Hello())
	if err != nil {
		return fmt.Errorf("rendezvous: trading hellos with rank %d: %w", peer, err)
	}
	return c.Connect(ctx, ph)
}

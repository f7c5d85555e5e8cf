package rendezvous

import (
	"context"
	"fmt"
)

// Exchanger trades one message with a peer of a job: internal/bootstrap's
// Group implements it.
type Exchanger interface {
	Exchange(ctx context.Context, peer int, data []byte) ([]byte, error)
}

// ConnectVia trades Hellos with peer through x and connects.
func (c *Channel) ConnectVia(ctx context.Context, x Exchanger, peer int) error {
	ph, err := x.Exchange(ctx, peer, c.Hello())
	if err != nil {
		return fmt.Errorf("rendezvous: trading hellos with rank %d: %w", peer, err)
	}
	return c.Connect(ctx, ph)
}

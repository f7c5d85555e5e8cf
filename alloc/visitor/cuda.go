package visitor

import (
	"errors"
	"sync"

	"github.com/gdrlink/gdrlink/internal/cuda"
)

// primaryContext is the primary context of one GPU, chosen by its CUDA
// ordinal. The visitors that need the driver retain it while something they
// made through it is alive (a host registration, a dma-buf export), so no
// caller hands them a context and none stays retained once their arenas are
// released.
type primaryContext struct {
	ordinal int

	mu    sync.Mutex
	users int
	drv   *cuda.Driver
	ctx   *cuda.Context
}

func newPrimaryContext(ordinal int) *primaryContext {
	return &primaryContext{ordinal: ordinal}
}

// acquire opens the driver and retains the primary context for the first
// user; each acquire is paired with a release.
func (p *primaryContext) acquire() (*cuda.Context, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.users == 0 {
		drv, _, ctx, err := cuda.OpenPrimary(p.ordinal)
		if err != nil {
			return nil, err
		}
		p.drv, p.ctx = drv, ctx
	}
	p.users++
	return p.ctx, nil
}

// release lets go of what acquire took: the last user releases the context
// and the driver.
func (p *primaryContext) release() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.users--
	if p.users > 0 {
		return nil
	}
	err := errors.Join(p.ctx.Close(), p.drv.Close())
	p.drv, p.ctx = nil, nil
	return err
}

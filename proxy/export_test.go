package proxy

import "context"

// What the tests of package proxy_test reach that is not part of the API.
var (
	ErrBadChunk        = errBadChunk
	ErrBadFlushSetting = errBadFlushSetting
	ParseFlushMode     = parseFlushMode
	WithFlush          = withFlush
)

type FlushMode = flushMode

const (
	FlushAuto = flushAuto
	FlushOn   = flushOn
	FlushOff  = flushOff
)

func (p *Proxy) NeedsFlush() bool {
	m, err := p.flushPlan()
	return err != nil || m != flushNone
}
func (p *Proxy) Stats() proxyStats { return p.stats() }

func (r *Receiver) Done() <-chan struct{} { return r.fin }
func (r *Receiver) Err() error            { return r.outcome() }

func (s *Staged) Wait(ctx context.Context) error { return s.wait(ctx) }

package main

import (
	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/verbsio"
)

// registration is the pool visitor that registers each arena with the
// protection domain once, for local and remote access, and finds the region
// again for the channel.
type registration struct {
	pd verbsio.ProtectionDomain
}

func newRegistration(pd verbsio.ProtectionDomain) *registration { return &registration{pd: pd} }

func (r *registration) Name() string { return "verbs-mr" }

func (r *registration) Visit(a *alloc.Arena) error {
	mr, err := r.pd.RegisterMemory(a.Base(), a.Size(), verbsio.AccessLocalWrite|verbsio.AccessRemoteWrite|verbsio.AccessRemoteRead)
	if err != nil {
		return err
	}
	a.SetHandle(r, mr)
	return nil
}

func (r *registration) Release(a *alloc.Arena) error {
	v, ok := a.Handle(r)
	if !ok {
		return nil
	}
	a.DeleteHandle(r)
	return v.(verbsio.MemoryRegion).Close()
}

func (r *registration) regionOf(a *alloc.Arena) (verbsio.MemoryRegion, bool) {
	v, ok := a.Handle(r)
	if !ok {
		return nil, false
	}
	return v.(verbsio.MemoryRegion), true
}

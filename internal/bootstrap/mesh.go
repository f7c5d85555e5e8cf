package bootstrap

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/gdrlink/gdrlink/verbsio"
)

// Mesh is one reliable-connected queue pair to every other rank of a
// group, all in one protection domain and sharing two completion queues.
type Mesh struct {
	// PD is the protection domain of the queue pairs; register the memory
	// they use in it.
	PD verbsio.ProtectionDomain
	// SendCQ and RecvCQ collect the completions of every queue pair.
	SendCQ, RecvCQ verbsio.CompletionQueue
	// QPs holds the queue pair to each rank, by rank; nil at this rank.
	QPs []verbsio.QueuePair
}

// MeshOptions size a mesh; zero values take the device's defaults.
type MeshOptions struct {
	// CQDepth is the depth of each completion queue (default 4096).
	CQDepth int
	// QP sizes each queue pair; its completion queues are filled in.
	QP verbsio.QPConfig
	// BeforeConnect, when set, is called with each queue pair before it
	// connects (to post receives that the first messages need).
	BeforeConnect func(peer int, qp verbsio.QueuePair) error
}

// ConnectAll makes a protection domain, two completion queues and one
// queue pair per peer on dev, trades endpoints with every peer through
// Exchange, and connects every pair concurrently. On failure everything it
// made is closed.
func ConnectAll(ctx context.Context, g *Group, dev verbsio.Device, opt MeshOptions) (*Mesh, error) {
	m := &Mesh{QPs: make([]verbsio.QueuePair, g.Size())}
	fail := func(err error) (*Mesh, error) {
		m.Close()
		return nil, err
	}
	var err error
	if m.PD, err = dev.AllocPD(); err != nil {
		return fail(err)
	}
	depth := opt.CQDepth
	if depth == 0 {
		depth = 4096
	}
	if m.SendCQ, err = dev.CreateCQ(depth); err != nil {
		return fail(err)
	}
	if m.RecvCQ, err = dev.CreateCQ(depth); err != nil {
		return fail(err)
	}
	qc := opt.QP
	qc.SendCQ, qc.RecvCQ = m.SendCQ, m.RecvCQ
	for r := range m.QPs {
		if r == g.Rank() {
			continue
		}
		if m.QPs[r], err = m.PD.CreateQP(qc); err != nil {
			return fail(err)
		}
		if opt.BeforeConnect != nil {
			if err := opt.BeforeConnect(r, m.QPs[r]); err != nil {
				return fail(err)
			}
		}
	}
	var wg sync.WaitGroup
	errs := make([]error, g.Size())
	for r, qp := range m.QPs {
		if qp == nil {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			b, err := g.Exchange(ctx, r, EncodeEndpoint(nil, qp.Endpoint()))
			if err == nil {
				var ep verbsio.Endpoint
				if ep, err = DecodeEndpoint(b); err == nil {
					err = qp.Connect(ctx, ep)
				}
			}
			if err != nil {
				errs[r] = fmt.Errorf("rank %d to rank %d: %w", g.Rank(), r, err)
			}
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return fail(err)
	}
	return m, nil
}

// Close closes the queue pairs, the completion queues and the protection
// domain. Regions registered in the domain must be closed first.
// Idempotent.
func (m *Mesh) Close() error {
	var errs []error
	for i, qp := range m.QPs {
		if qp != nil {
			errs = append(errs, qp.Close())
			m.QPs[i] = nil
		}
	}
	for _, c := range []*verbsio.CompletionQueue{&m.SendCQ, &m.RecvCQ} {
		if *c != nil {
			errs = append(errs, (*c).Close())
			*c = nil
		}
	}
	if m.PD != nil {
		err := m.PD.Close()
		errs = append(errs, err)
		if err == nil {
			m.PD = nil
		}
	}
	return errors.Join(errs...)
}

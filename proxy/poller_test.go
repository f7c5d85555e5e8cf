package proxy

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"
)

// gateEvent completes when its gate closes; with sync set it can be waited
// on like a driver event (Synchronize), and counts how it was waited on.
type gateEvent struct {
	gate    chan struct{}
	err     error
	queries atomic.Int32
	syncs   atomic.Int32
}

func (e *gateEvent) Query() (bool, error) {
	e.queries.Add(1)
	select {
	case <-e.gate:
		return true, e.err
	default:
		return false, nil
	}
}

func (e *gateEvent) Wait(ctx context.Context) error {
	select {
	case <-e.gate:
		return e.err
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (e *gateEvent) Close() error { return nil }

type syncGateEvent struct{ *gateEvent }

func (e syncGateEvent) Synchronize() error {
	e.syncs.Add(1)
	<-e.gate
	return e.err
}

// The poller waits for an event it can wait on in the driver there, once
// polling has not answered, and for other events by polling; either way
// every completion runs, in order, with the event's error.
func TestPollerWaitsInDriverOrPolls(t *testing.T) {
	for _, sync := range []bool{true, false} {
		p := newPoller()
		boom := errors.New("copy failed")
		evs := []*gateEvent{{gate: make(chan struct{})}, {gate: make(chan struct{}), err: boom}}
		got := make(chan error, len(evs))
		for _, e := range evs {
			var ev Event = e
			if sync {
				ev = syncGateEvent{e}
			}
			p.add(ev, func(err error) { got <- err })
		}
		// Past the poll budget (at most adaptspin.DefaultMax).
		time.Sleep(20 * time.Millisecond)
		if n := len(got); n != 0 {
			t.Fatalf("sync=%v: %d completions before any event completed", sync, n)
		}
		for _, e := range evs {
			close(e.gate)
		}
		for i, want := range []error{nil, boom} {
			select {
			case err := <-got:
				if !errors.Is(err, want) && !(err == nil && want == nil) {
					t.Errorf("sync=%v: completion %d: %v, want %v", sync, i, err, want)
				}
			case <-time.After(5 * time.Second):
				t.Fatalf("sync=%v: completion %d never ran", sync, i)
			}
		}
		p.close()
		if sync && evs[0].syncs.Load() != 1 {
			t.Errorf("the first event was waited on in the driver %d times, want 1", evs[0].syncs.Load())
		}
		if !sync && evs[0].queries.Load() < 3 {
			t.Errorf("the first event was queried %d times while pending, want it polled", evs[0].queries.Load())
		}
	}
}

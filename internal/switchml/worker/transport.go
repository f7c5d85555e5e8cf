package worker

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/gdrlink/gdrlink/internal/switchml/aggsrv"
)

// transport carries a worker's messages to the aggregator and the
// aggregator's results back: the UDP socket (udpLink) or a verbs device's
// UC queue pairs (verbsLink). Everything else (the schedule, sets,
// exponents, timeouts and resends) is the worker's, the same for both.
type transport interface {
	// name is "udp" or "verbs".
	name() string
	// announce fills in what the aggregator needs to reach the worker:
	// the rkey of its result region and, for each queue pair, its number
	// (q.qpn) and first PSN (q.psn, which it may choose).
	announce(a *aggsrv.Announce, qps []*qp) error
	// connect pairs the queue pairs with the aggregator's (q.aqpn and
	// q.rpsn are set) and starts receiving.
	connect(as aggsrv.Assignment) error
	// replyVA is where the result of q's message number count, whose
	// first slot is slot, lands.
	replyVA(q *qp, count uint64, slot int) uint64
	// expect readies q's receive side for message m, before it is sent
	// the first time; w.mu is held.
	expect(q *qp, m *message)
	// send sends m once, whole.
	send(q *qp, m *message) error
	// close stops receiving and releases what the transport holds.
	close() error
}

// errNoPlace means a transport did not resend a message: every place a
// reply to the resend could land in may still receive a reply to another
// message's send (verbsLink.place). The message waits one more timeout.
var errNoPlace = errors.New("switchml: every result place awaits a reply")

// message is one message of a queue pair, as sent.
type message struct {
	slot, set int    // its first slot (job-relative) and set
	n         int    // packets (slots)
	va        uint64 // where its result lands
	rkey      uint32 // the pool index of its first slot: poolRKey
	payload   []byte // n slots, or nil: exponent-only
	imm       uint32
}

// poolRKey is the rkey of a request: its low 16 bits are the pool index of
// the message's first slot, 2*(base+slot)+set (base being the job's first
// slot at the aggregator).
func poolRKey(base, slot, set int) uint32 { return uint32(2*(base+slot) + set) }

// exchange sends one message on q (payload of msgB bytes, immediate imm)
// and returns the result, resending on timeout. A nil payload sends an
// exponent-only message (no payload) on q's exponent slot; its result is
// empty.
func (w *Worker) exchange(ctx context.Context, q *qp, payload []byte, imm uint32) ([]byte, uint32, error) {
	m := message{slot: q.first, set: q.set, n: w.cfg.MsgSlots, payload: payload, imm: imm}
	if payload == nil {
		m.slot, m.set, m.n = q.eslot, q.eset, 1
		q.eset ^= 1
	} else {
		q.set ^= 1
	}
	q.count++
	m.va = w.tr.replyVA(q, q.count, m.slot)
	m.rkey = poolRKey(w.base, m.slot, m.set)
	w.mu.Lock()
	q.want, q.wantSize = m.va, len(payload)
	w.tr.expect(q, &m)
	w.mu.Unlock()
	select {
	case <-q.result: // a result that lost the race with a timeout
	default:
	}
	t := time.NewTimer(0)
	defer t.Stop()
	<-t.C
	start := time.Now()
	for try := 0; ; try++ {
		if try > w.cfg.Retries || try > 0 && time.Since(start) > w.cfg.GiveUp {
			return nil, 0, fmt.Errorf("%w: aggregator %s (%s): no result after %d timeouts of a message (%v)", ErrAggregator, w.cfg.Control, w.tr.name(), try, time.Since(start).Round(time.Millisecond))
		}
		// errNoPlace: other messages' sends are still unanswered;
		// wait for them.
		err := w.tr.send(q, &m)
		if err != nil && !errors.Is(err, errNoPlace) {
			return nil, 0, err
		}
		w.mu.Lock()
		if err == nil && try > 0 {
			w.stats.Resent++
		}
		wait := w.resend.wait(try)
		w.mu.Unlock()
		t.Reset(wait)
		select {
		case r := <-q.result:
			if r.va != m.va {
				continue
			}
			w.mu.Lock()
			if try == 0 {
				w.resend.sample(time.Since(start))
			}
			w.stats.Messages++
			w.stats.BytesReceived += uint64(len(r.buf))
			w.mu.Unlock()
			return r.buf, r.imm, nil
		case <-t.C:
			w.mu.Lock()
			w.resend.timedOut(time.Now())
			w.mu.Unlock()
		case <-ctx.Done():
			return nil, 0, fmt.Errorf("switchml: AllReduce through aggregator %s: %w", w.cfg.Control, context.Cause(ctx))
		case <-w.dead:
			w.mu.Lock()
			err := w.deadErr
			w.mu.Unlock()
			return nil, 0, err
		}
	}
}

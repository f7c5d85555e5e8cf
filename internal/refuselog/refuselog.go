// Package refuselog logs the connections a listener turns away: a line at
// Warn per refusal, with the peer's address and the reason, but at most one
// line a second per listener, so that a flood of strangers cannot fill the
// logs. The next line written says how many refusals went unlogged since
// the one before, and every line carries the listener's total.
package refuselog

import (
	"log/slog"
	"sync"
	"time"
)

// Every is the shortest time between two lines of one Log.
const Every = time.Second

// Log is the refusal log of one listener. Its methods are safe for
// concurrent use; the zero Log is not usable: make one with New.
type Log struct {
	log      *slog.Logger
	msg      string
	listener string
	now      func() time.Time

	mu         sync.Mutex
	last       time.Time // of the last line written; zero before the first
	total      uint64
	suppressed uint64 // refusals since the last line, not logged
}

// New returns the refusal log of the listener named listener (its address,
// or a socket name) for the component (such as "bootstrap" or "tcp"),
// writing to l; a nil l writes to slog.Default().
func New(l *slog.Logger, component, listener string) *Log {
	if l == nil {
		l = slog.Default()
	}
	return &Log{log: l, msg: component + ": connection refused", listener: listener, now: time.Now}
}

// Refused records one refused connection from peer, for reason, and logs
// it unless a line was written less than Every ago.
func (l *Log) Refused(peer string, reason error) {
	l.mu.Lock()
	l.total++
	now := l.now()
	if !l.last.IsZero() && now.Sub(l.last) < Every {
		l.suppressed++
		l.mu.Unlock()
		return
	}
	l.last = now
	total, suppressed := l.total, l.suppressed
	l.suppressed = 0
	l.mu.Unlock()
	l.log.Warn(l.msg, "listener", l.listener, "peer", peer, "reason", reason, "suppressed", suppressed, "refused_total", total)
}

// Total is how many refusals were recorded, logged or not.
func (l *Log) Total() uint64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.total
}

package visitor

import (
	"context"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/dustin/go-humanize"
	"github.com/gdrlink/gdrlink/alloc"
)

// Stats is a visitor that counts arenas and their bytes and logs each visit
// and release at debug level. It attaches an ArenaRecord. One Stats may serve
// several pools.
type Stats struct {
	log                         *slog.Logger
	visits, releases            atomic.Int64
	bytesVisited, bytesReleased atomic.Int64
}

// ArenaRecord is the handle Stats attaches to an arena.
type ArenaRecord struct {
	// Seq numbers the arenas this Stats visited, from 1.
	Seq int64
	// Visited is when the arena was visited.
	Visited time.Time
}

// StatsSnapshot is what a Stats counted so far.
type StatsSnapshot struct {
	Visits, Releases            int64
	BytesVisited, BytesReleased int64
}

type statsKey struct{}

// NewStats returns a counting visitor that logs to log (slog.Default() when
// nil) at debug level.
func NewStats(log *slog.Logger) *Stats {
	if log == nil {
		log = slog.Default()
	}
	return &Stats{log: log}
}

// Name is "stats".
func (*Stats) Name() string { return "stats" }

// Visit counts and logs the arena.
func (s *Stats) Visit(a *alloc.Arena) error {
	if _, ok := a.Handle(statsKey{}); ok {
		return fmt.Errorf("%w: stats of %s", ErrAlreadyVisited, a)
	}
	seq := s.visits.Add(1)
	s.bytesVisited.Add(int64(a.Size()))
	a.SetHandle(statsKey{}, ArenaRecord{Seq: seq, Visited: time.Now()})
	if s.log.Enabled(context.Background(), slog.LevelDebug) {
		s.log.Debug("arena visited", "arena", a.ID, "seq", seq, "base", fmt.Sprintf("%#x", a.Base()),
			"size", humanize.IBytes(uint64(a.Size())), "device", a.Device().String(), "notes", a.Region().Notes)
	}
	return nil
}

// Release counts and logs the release, with how long the arena lived.
func (s *Stats) Release(a *alloc.Arena) error {
	rec, ok := StatsOf(a)
	if !ok {
		return fmt.Errorf("%w: stats of %s", ErrNotVisited, a)
	}
	a.DeleteHandle(statsKey{})
	s.releases.Add(1)
	s.bytesReleased.Add(int64(a.Size()))
	s.log.Debug("arena released", "arena", a.ID, "seq", rec.Seq, "size", humanize.IBytes(uint64(a.Size())),
		"lived", time.Since(rec.Visited).Round(time.Microsecond))
	return nil
}

// Snapshot returns the counts so far.
func (s *Stats) Snapshot() StatsSnapshot {
	return StatsSnapshot{
		Visits: s.visits.Load(), Releases: s.releases.Load(),
		BytesVisited: s.bytesVisited.Load(), BytesReleased: s.bytesReleased.Load(),
	}
}

// Live is the number of arenas visited and not yet released.
func (s StatsSnapshot) Live() int64 { return s.Visits - s.Releases }

// LiveBytes is the bytes of the arenas visited and not yet released.
func (s StatsSnapshot) LiveBytes() int64 { return s.BytesVisited - s.BytesReleased }

// String prints the counts for people.
func (s StatsSnapshot) String() string {
	return fmt.Sprintf("%d arenas visited (%s), %d released (%s), %d live (%s)",
		s.Visits, humanize.IBytes(uint64(s.BytesVisited)), s.Releases, humanize.IBytes(uint64(s.BytesReleased)),
		s.Live(), humanize.IBytes(uint64(s.LiveBytes())))
}

// StatsOf returns the Stats record of an arena, if a Stats visited it.
func StatsOf(a *alloc.Arena) (ArenaRecord, bool) {
	h, ok := a.Handle(statsKey{})
	if !ok {
		return ArenaRecord{}, false
	}
	r, ok := h.(ArenaRecord)
	return r, ok
}

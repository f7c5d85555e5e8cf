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
// and release at debug level, with how long each arena lived. One Stats may
// serve several pools; its String prints the counts.
type Stats struct {
	log                         *slog.Logger
	visits, releases            atomic.Int64
	bytesVisited, bytesReleased atomic.Int64
}

// arenaRecord is the handle Stats attaches to an arena.
type arenaRecord struct {
	// Seq numbers the arenas this Stats visited, from 1.
	Seq int64
	// Visited is when the arena was visited.
	Visited time.Time
}

// statsSnapshot is what a Stats counted so far.
type statsSnapshot struct {
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
		return fmt.Errorf("%w: stats of %s", errAlreadyVisited, a)
	}
	seq := s.visits.Add(1)
	s.bytesVisited.Add(int64(a.Size()))
	a.SetHandle(statsKey{}, arenaRecord{Seq: seq, Visited: time.Now()})
	if s.log.Enabled(context.Background(), slog.LevelDebug) {
		s.log.Debug("arena visited", "arena", a.ID, "seq", seq, "base", fmt.Sprintf("%#x", a.Base()),
			"size", humanize.IBytes(uint64(a.Size())), "device", a.Device().String(), "notes", a.Region().Notes)
	}
	return nil
}

// Release counts and logs the release, with how long the arena lived.
func (s *Stats) Release(a *alloc.Arena) error {
	rec, ok := statsOf(a)
	if !ok {
		return fmt.Errorf("%w: stats of %s", errNotVisited, a)
	}
	a.DeleteHandle(statsKey{})
	s.releases.Add(1)
	s.bytesReleased.Add(int64(a.Size()))
	s.log.Debug("arena released", "arena", a.ID, "seq", rec.Seq, "size", humanize.IBytes(uint64(a.Size())),
		"lived", time.Since(rec.Visited).Round(time.Microsecond))
	return nil
}

// String prints the counts so far for people: arenas visited, released and
// live, with their bytes.
func (s *Stats) String() string { return s.snapshot().String() }

// snapshot returns the counts so far.
func (s *Stats) snapshot() statsSnapshot {
	return statsSnapshot{
		Visits: s.visits.Load(), Releases: s.releases.Load(),
		BytesVisited: s.bytesVisited.Load(), BytesReleased: s.bytesReleased.Load(),
	}
}

// live is the number of arenas visited and not yet released.
func (s statsSnapshot) live() int64 { return s.Visits - s.Releases }

// liveBytes is the bytes of the arenas visited and not yet released.
func (s statsSnapshot) liveBytes() int64 { return s.BytesVisited - s.BytesReleased }

// String prints the counts for people.
func (s statsSnapshot) String() string {
	return fmt.Sprintf("%d arenas visited (%s), %d released (%s), %d live (%s)",
		s.Visits, humanize.IBytes(uint64(s.BytesVisited)), s.Releases, humanize.IBytes(uint64(s.BytesReleased)),
		s.live(), humanize.IBytes(uint64(s.liveBytes())))
}

// statsOf returns the Stats record of an arena, if a Stats visited it.
func statsOf(a *alloc.Arena) (arenaRecord, bool) {
	h, ok := a.Handle(statsKey{})
	if !ok {
		return arenaRecord{}, false
	}
	r, ok := h.(arenaRecord)
	return r, ok
}

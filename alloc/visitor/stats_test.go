package visitor

import (
	"bytes"
	"errors"
	"log/slog"
	"strings"
	"testing"

	"github.com/gdrlink/gdrlink/alloc"
)

func TestStatsVisitor(t *testing.T) {
	var logs bytes.Buffer
	s := NewStats(slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug})))
	p, err := alloc.New(alloc.NewMmapSource(alloc.MmapOptions{}),
		alloc.WithVisitors(s), alloc.WithInitialArena(1<<20), alloc.WithMaxArena(1<<20))
	if err != nil {
		t.Fatal(err)
	}
	var blocks []alloc.Block
	for range 3 * 4 { // four 256 KiB blocks per 1 MiB arena
		b, err := p.Alloc(256 << 10)
		if err != nil {
			t.Fatal(err)
		}
		blocks = append(blocks, b)
	}
	snap := s.snapshot()
	if snap.Visits != 3 || snap.BytesVisited != 3<<20 || snap.Releases != 0 || snap.live() != 3 {
		t.Errorf("after 3 arenas: %v", snap)
	}
	for i, a := range ArenasOf(p, blocks) {
		rec, ok := statsOf(a)
		if !ok || rec.Seq < 1 || rec.Seq > 3 || rec.Visited.IsZero() {
			t.Errorf("arena %d record %+v, %v", i, rec, ok)
		}
	}
	for _, b := range blocks {
		if err := b.Free(); err != nil {
			t.Fatal(err)
		}
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	snap = s.snapshot()
	if snap.Releases != 3 || snap.liveBytes() != 0 {
		t.Errorf("after Close: %v", snap)
	}
	if got := snap.String(); got != "3 arenas visited (3.0 MiB), 3 released (3.0 MiB), 0 live (0 B)" {
		t.Errorf("String = %q", got)
	}
	out := logs.String()
	if strings.Count(out, "arena visited") != 3 || strings.Count(out, "arena released") != 3 || !strings.Contains(out, "level=DEBUG") {
		t.Errorf("debug log:\n%s", out)
	}
}

func TestStatsQuietAboveDebug(t *testing.T) {
	var logs bytes.Buffer
	s := NewStats(slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelInfo})))
	a := testArena(t, 0, &alloc.Region{Base: 1 << 30, Size: 4096, FD: -1})
	if err := s.Visit(a); err != nil {
		t.Fatal(err)
	}
	if err := s.Visit(a); !errors.Is(err, errAlreadyVisited) {
		t.Errorf("second Visit = %v", err)
	}
	if err := s.Release(a); err != nil {
		t.Fatal(err)
	}
	if err := s.Release(a); !errors.Is(err, errNotVisited) {
		t.Errorf("second Release = %v", err)
	}
	if logs.Len() != 0 {
		t.Errorf("logged above debug level: %s", logs.String())
	}
}

package logcapture

import (
	"strings"
	"sync"
	"testing"
)

// Writers from many goroutines all land, a line each, and WaitLine finds
// the line that has every part.
func TestBuffer(t *testing.T) {
	var b Buffer
	log := b.Logger()
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Add(1)
		go func() { defer wg.Done(); log.Warn("refused", "n", i) }()
	}
	wg.Wait()
	if n := len(b.Lines()); n != 8 {
		t.Fatalf("%d lines, want 8: %q", n, b.Lines())
	}
	if l := b.WaitLine(t, "level=WARN", "n=7"); !strings.Contains(l, "msg=refused") {
		t.Fatalf("line %q", l)
	}
}

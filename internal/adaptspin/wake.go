package adaptspin

import (
	"fmt"
	"os"
	"slices"
	"time"
)

// ProbeWake measures what a wake-up through the runtime's network poller
// costs on this host now: the median of n rounds in which a goroutine
// asleep on a pipe's read end is woken by a one-byte write, from the write
// to the reader running. A queue that sleeps on a file descriptor but
// cannot time its own wake-ups (an ibverbs completion channel raises an
// event that says nothing of when the completion came) seeds its policy
// with it (Policy.Woke), so that its poll cap is sixteen wake-ups of this
// host rather than the caller's bound alone. Each round lets the reader
// fall asleep first (Pause), so a probe takes about n times (a pause of
// 100 us plus a wake-up).
func ProbeWake(n int) (time.Duration, error) {
	if n < 1 {
		return 0, fmt.Errorf("adaptspin: %d wake-up probes, want at least 1", n)
	}
	r, w, err := os.Pipe()
	if err != nil {
		return 0, fmt.Errorf("adaptspin: wake-up probe: %w", err)
	}
	defer w.Close()
	woke := make(chan time.Time, 1)
	go func() {
		defer r.Close()
		var b [1]byte
		for {
			if _, err := r.Read(b[:]); err != nil {
				close(woke)
				return
			}
			woke <- time.Now()
		}
	}()
	ds := make([]time.Duration, 0, n)
	for range n {
		Pause(100 * time.Microsecond) // the reader is asleep in the poller
		start := time.Now()
		if _, err := w.Write([]byte{1}); err != nil {
			return 0, fmt.Errorf("adaptspin: wake-up probe: %w", err)
		}
		t, ok := <-woke
		if !ok {
			return 0, fmt.Errorf("adaptspin: wake-up probe: the pipe's reader ended")
		}
		ds = append(ds, max(t.Sub(start), time.Nanosecond))
	}
	slices.Sort(ds)
	return ds[len(ds)/2], nil
}

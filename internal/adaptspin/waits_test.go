package adaptspin

import (
	"runtime"
	"testing"
	"time"
)

// Enter gives long polls only where polls yield, the spin bound is above 0
// and the waits in progress are at most GOMAXPROCS.
func TestWaitsLongPolls(t *testing.T) {
	const spin = 200 * time.Microsecond
	long := LongFactor * spin
	var w Waits
	if got := w.Enter(false, spin); got != 0 {
		t.Fatalf("a wait that does not yield polls %s long, want its own budget", got)
	}
	w.Leave()
	procs := runtime.GOMAXPROCS(0)
	for i := range procs {
		if got := w.Enter(true, spin); got != long {
			t.Fatalf("wait %d of %d (GOMAXPROCS %d) polls %s, want %s", i+1, procs, procs, got, long)
		}
	}
	if got := w.Enter(true, spin); got != 0 {
		t.Fatalf("wait %d with GOMAXPROCS %d polls %s long, want its own budget", procs+1, procs, got)
	}
	for range procs + 1 {
		w.Leave()
	}
	if n := w.InProgress(); n != 0 {
		t.Fatalf("%d waits counted after all left", n)
	}
	if got := w.Enter(true, spin); got != long {
		t.Fatalf("after the others left, a wait polls %s, want %s", got, long)
	}
	w.Leave()
	if got := w.Enter(true, 0); got != 0 {
		t.Fatalf("spin bound 0 (never poll): a wait polls %s", got)
	}
	w.Leave()
}

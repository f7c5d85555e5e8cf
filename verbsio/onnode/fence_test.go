package onnode

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/verbsio"
)

// fenceBound is the deregistration bound of the fence tests, and slack what
// Close may take beyond it on a loaded machine.
const (
	fenceBound = 300 * time.Millisecond
	fenceSlack = 2 * time.Second
)

// fencePair connects a local node, whose regions wait fenceBound for peers'
// writes, with a helper process.
func fencePair(t *testing.T) (*node, *peer) {
	t.Helper()
	n, err := newNodeConfig(verbsio.Config{}, Options{Mechanism: MechVM, Spin: defaultSpin, DeregTimeout: fenceBound})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(n.close)
	p := startPeer(t, MechVM)
	connect(t, n, p, p.one("ep", "ep"))
	return n, p
}

// stopPeer stops the helper process (SIGSTOP) until the returned resume
// is called (SIGCONT), or the test ends.
func stopPeer(t *testing.T, p *peer) (resume func()) {
	t.Helper()
	proc := p.cmd.Process
	if err := proc.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	// The signal stops each of the process's threads as it next runs:
	// wait until the kernel says every one has (state T), so that nothing
	// of the peer answers after this returns.
	for deadline := time.Now().Add(5 * time.Second); !allStopped(t, proc.Pid); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("helper pid %d not stopped 5 s after SIGSTOP", proc.Pid)
		}
	}
	resumed := false
	t.Cleanup(func() {
		if !resumed {
			proc.Signal(syscall.SIGCONT)
		}
	})
	return func() {
		t.Helper()
		if err := proc.Signal(syscall.SIGCONT); err != nil {
			t.Fatal(err)
		}
		resumed = true
	}
}

// allStopped reports whether every thread of process pid is stopped
// (state T in /proc/pid/task/*/stat).
func allStopped(t *testing.T, pid int) bool {
	t.Helper()
	stats, err := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/stat", pid))
	if err != nil || len(stats) == 0 {
		t.Fatalf("threads of pid %d: %v", pid, err)
	}
	for _, st := range stats {
		b, err := os.ReadFile(st)
		if err != nil {
			return false // a thread that ended
		}
		// The state follows the command's closing parenthesis.
		if i := bytes.LastIndexByte(b, ')'); i < 0 || i+2 >= len(b) || b[i+2] != 'T' {
			return false
		}
	}
	return true
}

func slotOf(mr verbsio.MemoryRegion) int { return int(mr.RKey() & (tableSlots - 1)) }

// closeWithin closes mr and fails the test unless it returns within the
// bound (and slack).
func closeWithin(t *testing.T, mr verbsio.MemoryRegion) time.Duration {
	t.Helper()
	start := time.Now()
	done := make(chan struct{})
	go func() { mr.Close(); close(done) }()
	select {
	case <-done:
	case <-time.After(fenceBound + fenceSlack):
		t.Fatalf("region Close still waiting %s after it was called (bound %s)", fenceBound+fenceSlack, fenceBound)
	}
	return time.Since(start)
}

// untouched fails unless every byte of the node's region rkey is fill.
func untouched(t *testing.T, n *node, rkey uint32, fill byte, what string) {
	t.Helper()
	for i, c := range n.mems[rkey].b {
		if c != fill {
			t.Fatalf("%s: byte %d is %#x, want %#x", what, i, c, fill)
		}
	}
}

// TestDeregisterFencesStoppedPeer: a peer stopped (SIGSTOP) in the middle
// of a write it announced does not hold deregistration past the bound; the
// region's slot is not used again until the peer's queue pair is fenced,
// and the peer's late write, when it runs again, does not land in the
// region that then takes the slot.
func TestDeregisterFencesStoppedPeer(t *testing.T) {
	n, p := fencePair(t)
	pd := n.pd.(*pd)
	old, err := n.register("anon", 4096, rw, 0)
	if err != nil {
		t.Fatal(err)
	}
	p.one("held", "stall %d %d %d %d", old.RKey(), old.Addr(), 4096, 0xab)
	resume := stopPeer(t, p)

	closed := make(chan time.Duration, 1)
	go func() { closed <- closeWithin(t, old) }()
	// While Close waits, the slot stays taken.
	time.Sleep(fenceBound / 4)
	during, err := n.register("anon", 4096, rw, 0)
	if err != nil {
		t.Fatal(err)
	}
	if slotOf(during) == slotOf(old) {
		t.Fatalf("slot %d used again while its deregistration waits for the stopped peer", slotOf(old))
	}
	if st := n.qp.State(); st != verbsio.QPReady {
		t.Fatalf("queue pair %s before the bound, want ready", st)
	}
	took := <-closed
	if took < fenceBound {
		t.Fatalf("Close returned after %s, before the bound %s, with a write announced", took, fenceBound)
	}
	if got := pd.fences.Load(); got != 1 {
		t.Fatalf("%d queue pairs fenced, want 1", got)
	}
	if st := n.qp.State(); st != verbsio.QPError {
		t.Fatalf("queue pair %s after the fence, want error", st)
	}
	if err := lastError(n.qp); !errors.Is(err, verbsio.ErrPeerLost) {
		t.Fatalf("queue pair error %v, want ErrPeerLost", err)
	}
	// Fenced: the slot is free again, and a new region (new key) takes it.
	fresh, err := n.register("anon", 4096, rw, 0)
	if err != nil {
		t.Fatal(err)
	}
	if slotOf(fresh) != slotOf(old) || fresh.RKey() == old.RKey() {
		t.Fatalf("new region key %#x, old %#x: want the old slot with a new key", fresh.RKey(), old.RKey())
	}

	// The peer runs again and finishes its copy.
	resume()
	p.one("wrote", "go")
	untouched(t, n, fresh.RKey(), 0, "the region that took the slot after the fence")
	untouched(t, n, during.RKey(), 0, "the region registered during the wait")
}

// TestDeregisterFencesGarbageCounter: a peer that sets its write counter to
// a huge value cannot hold deregistration past the bound, and is fenced.
func TestDeregisterFencesGarbageCounter(t *testing.T) {
	n, p := fencePair(t)
	pd := n.pd.(*pd)
	mr, err := n.register("anon", 4096, rw, 0)
	if err != nil {
		t.Fatal(err)
	}
	p.ok("poke %d %d", slotOf(mr), uint64(1)<<62)
	took := closeWithin(t, mr)
	if took < fenceBound {
		t.Fatalf("Close returned after %s, before the bound %s", took, fenceBound)
	}
	if got := pd.fences.Load(); got != 1 {
		t.Fatalf("%d queue pairs fenced, want 1", got)
	}
	if st := n.qp.State(); st != verbsio.QPError {
		t.Fatalf("queue pair %s after the fence, want error", st)
	}
	// Its counters are no longer read: the next Close does not wait.
	next, err := n.register("anon", 4096, rw, 0)
	if err != nil {
		t.Fatal(err)
	}
	if took := closeWithin(t, next); took >= fenceBound {
		t.Fatalf("Close after the fence took %s: the fenced peer's counters still count", took)
	}
}

// TestDeregisterIgnoresGonePeer: the writes announced by a peer that is
// gone cannot land, and are not waited for.
func TestDeregisterIgnoresGonePeer(t *testing.T) {
	n, p := fencePair(t)
	pd := n.pd.(*pd)
	mr, err := n.register("anon", 4096, rw, 0)
	if err != nil {
		t.Fatal(err)
	}
	p.one("held", "stall %d %d %d %d", mr.RKey(), mr.Addr(), 4096, 0xab)
	p.dead = true
	if err := p.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for !n.qp.(*qp).lost.Load() {
		if time.Now().After(deadline) {
			t.Fatal("the peer's death went unnoticed for 10s")
		}
		time.Sleep(time.Millisecond)
	}
	if took := closeWithin(t, mr); took >= fenceBound {
		t.Fatalf("Close took %s waiting for a dead peer's write", took)
	}
	if got := pd.fences.Load(); got != 0 {
		t.Fatalf("%d queue pairs fenced, want none", got)
	}
}

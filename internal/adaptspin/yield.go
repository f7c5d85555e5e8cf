package adaptspin

import (
	"runtime"

	"golang.org/x/sys/unix"
)

// YieldCPU gives the calling thread's CPU to any other thread of the host
// that is ready to run on it (sched_yield(2)), then its processor to any
// other goroutine of this process (runtime.Gosched). It is what a polling
// wait does between polls where the host has more runnable threads than
// CPUs (Bounds.Yield), as an MPI rank does when its host is
// oversubscribed: there the thread a completion needs (the peer that
// writes it, or this process's own thread that delivers it) may be
// waiting for this very CPU, and runtime.Gosched alone hands over only
// this process's processor, never the CPU, until the kernel preempts the
// poller at the end of its time slice (milliseconds).
func YieldCPU() {
	_, _, _ = unix.Syscall(unix.SYS_SCHED_YIELD, 0, 0, 0)
	runtime.Gosched()
}

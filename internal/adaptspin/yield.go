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
//
// The yield is a raw system call: the runtime does not see this thread
// leave, so it does not hand the processor to another thread (which it
// would wake, one more runnable thread on a host that has too many) when
// the kernel runs others for longer than the runtime's 20 µs (four ranks
// on two cores took half as long over a 1 MiB AllReduce as with a
// plain system call: README, Collectives).
func YieldCPU() {
	_, _, _ = unix.RawSyscall(unix.SYS_SCHED_YIELD, 0, 0, 0)
	runtime.Gosched()
}

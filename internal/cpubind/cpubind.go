// Package cpubind binds a process, every thread of it, to a share of the
// CPUs it may run on, as MPI launchers bind each rank of a node to cores
// of its own when there are enough of them.
//
// On a host whose ranks fill the cores, a rank whose threads float meets
// its peers' threads on the same core now and then: a completion the peer
// wrote waits for a time slice while the core runs the peer's poller. A
// rank bound to cores of its own polls without taking them from the
// others.
package cpubind

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"

	"golang.org/x/sys/unix"
)

// ErrTooFew means there are fewer allowed CPUs than ranks to share them:
// no rank is bound (as MPI leaves oversubscribed ranks unbound).
var ErrTooFew = errors.New("cpubind: fewer CPUs than ranks on this host")

// Allowed returns the CPUs this process may run on (its affinity mask,
// which a launcher, taskset or a cgroup's cpuset may have narrowed), in
// increasing order.
func Allowed() ([]int, error) {
	var set unix.CPUSet
	if err := unix.SchedGetaffinity(0, &set); err != nil {
		return nil, fmt.Errorf("cpubind: reading the affinity mask: %w", err)
	}
	return cpus(&set), nil
}

// Share returns the CPUs of index (0-based) among count ranks sharing
// allowed: allowed cut into count contiguous runs of equal length (the
// remainder left unused, so every rank gets as many), or ErrTooFew.
func Share(allowed []int, index, count int) ([]int, error) {
	if count <= 0 || index < 0 || index >= count {
		return nil, fmt.Errorf("cpubind: rank %d of %d on this host", index, count)
	}
	per := len(allowed) / count
	if per == 0 {
		return nil, fmt.Errorf("%w: %d ranks, %d CPUs", ErrTooFew, count, len(allowed))
	}
	return slices.Clone(allowed[index*per : (index+1)*per]), nil
}

// Bind sets the affinity mask of every thread of this process to cpus. A
// thread inherits its creator's mask, so it goes over the threads until a
// pass finds none it has not set. It returns how many threads it set.
func Bind(cpus []int) (int, error) {
	if len(cpus) == 0 {
		return 0, errors.New("cpubind: no CPUs to bind to")
	}
	var set unix.CPUSet
	for _, c := range cpus {
		set.Set(c)
	}
	done := map[int]bool{}
	for range 8 {
		tids, err := threads()
		if err != nil {
			return len(done), err
		}
		fresh := 0
		for _, tid := range tids {
			if done[tid] {
				continue
			}
			if err := unix.SchedSetaffinity(tid, &set); err != nil {
				if errors.Is(err, unix.ESRCH) {
					continue // the thread ended
				}
				return len(done), fmt.Errorf("cpubind: binding thread %d to CPUs %v: %w", tid, cpus, err)
			}
			done[tid] = true
			fresh++
		}
		if fresh == 0 {
			return len(done), nil
		}
	}
	return len(done), fmt.Errorf("cpubind: threads kept appearing while binding to CPUs %v", cpus)
}

// ThreadMasks returns each thread's affinity mask, by thread ID.
func ThreadMasks() (map[int][]int, error) {
	tids, err := threads()
	if err != nil {
		return nil, err
	}
	m := map[int][]int{}
	for _, tid := range tids {
		var set unix.CPUSet
		if err := unix.SchedGetaffinity(tid, &set); err != nil {
			if errors.Is(err, unix.ESRCH) {
				continue
			}
			return nil, fmt.Errorf("cpubind: reading thread %d's mask: %w", tid, err)
		}
		m[tid] = cpus(&set)
	}
	return m, nil
}

// threads lists this process's thread IDs.
func threads() ([]int, error) {
	ents, err := os.ReadDir("/proc/self/task")
	if err != nil {
		return nil, fmt.Errorf("cpubind: listing threads: %w", err)
	}
	var tids []int
	for _, e := range ents {
		if tid, err := strconv.Atoi(e.Name()); err == nil {
			tids = append(tids, tid)
		}
	}
	return tids, nil
}

// maxCPUs is the number of CPUs a unix.CPUSet holds.
const maxCPUs = 1024

// cpus lists the CPUs in set, in increasing order.
func cpus(set *unix.CPUSet) []int {
	var out []int
	for c := range maxCPUs {
		if set.IsSet(c) {
			out = append(out, c)
		}
	}
	return out
}

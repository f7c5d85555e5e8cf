package main

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"sync"
	"time"

	"github.com/dustin/go-humanize"
	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/alloc/visitor"
	"golang.org/x/sys/unix"
)

// The alloc scenario measures what a tensor's memory costs: an alloc+free
// pair from the pool (arenas locked once by the mlock visitor) against the
// two ways around it, measured in the same run: plain make([]byte), and
// locking pages per tensor (mmap+mlock, munlock+munmap), which is what
// registering each tensor on its own costs before the NIC is even involved.
func init() {
	register(Scenario{
		Name: "alloc",
		Doc:  "pool alloc+free pair (ns/op) vs make([]byte) and vs mmap+mlock per tensor: fixed sizes 256 B..4 MiB, mixed sizes, one and all goroutines",
		Run:  runAlloc,
		Plots: []Plot{
			{File: "alloc-vs-make.svg", Title: "pool alloc+free vs make([]byte), one goroutine", Unit: "ns/op", CasePrefix: "fixed/vs-make"},
			{File: "alloc-vs-lock-pages.svg", Title: "pool alloc+free vs mmap+mlock per tensor, one goroutine", Unit: "ns/op", CasePrefix: "fixed/vs-lock-pages"},
		},
	})
}

const (
	allocMinSize = 256
	allocMaxSize = 4 << 20
	// allocMixedLive is the working set of the mixed case: each operation
	// frees the oldest of this many live tensors and allocates a new one.
	allocMixedLive = 16
	// allocMixedSizes is the length of the mixed case's size sequence.
	allocMixedSizes = 256
)

// allocator is one way of getting and giving back tensor memory.
type allocator struct {
	name string
	// ring returns a ring of live slots for one goroutine; each slot keeps
	// its allocation in the allocator's own type, so nothing is boxed.
	ring func(live int) allocRing
}

// allocRing holds one goroutine's live allocations.
type allocRing interface {
	// alloc fills empty slot k with n bytes and returns them.
	alloc(k, n int) ([]byte, error)
	// free empties slot k; an empty slot is left alone.
	free(k int) error
}

// poolRing keeps pool blocks.
type poolRing struct {
	pool *alloc.Pool
	b    []alloc.Block
	used []bool
}

func (r *poolRing) alloc(k, n int) ([]byte, error) {
	b, err := r.pool.Alloc(n)
	if err != nil {
		return nil, err
	}
	r.b[k], r.used[k] = b, true
	return b.Bytes(), nil
}

func (r *poolRing) free(k int) error {
	if !r.used[k] {
		return nil
	}
	r.used[k] = false
	return r.b[k].Free()
}

// makeRing keeps Go slices; freeing drops them for the garbage collector.
type makeRing [][]byte

func (r makeRing) alloc(k, n int) ([]byte, error) {
	r[k] = make([]byte, n)
	return r[k], nil
}

func (r makeRing) free(k int) error {
	r[k] = nil
	return nil
}

// lockRing keeps locked mappings, one per tensor.
type lockRing [][]byte

func (r lockRing) alloc(k, n int) ([]byte, error) {
	mem, err := lockPages(n)
	r[k] = mem
	return mem, err
}

func (r lockRing) free(k int) error {
	if r[k] == nil {
		return nil
	}
	mem := r[k]
	r[k] = nil
	return unlockPages(mem)
}

func runAlloc(ctx context.Context, env *Env) error {
	var note string
	pool, err := alloc.New(alloc.NewMmapSource(alloc.MmapOptions{}),
		alloc.WithName("bench"), alloc.WithVisitors(visitor.NewMlock()))
	if err != nil {
		return err
	}
	if b, err := pool.Alloc(allocMaxSize); err != nil {
		// No locked memory here: measure the pool without the visitor.
		if !errors.Is(err, visitor.ErrMemlockLimit) {
			return errors.Join(err, pool.Close())
		}
		note = "pool arenas not locked: " + err.Error()
		if err := pool.Close(); err != nil {
			return err
		}
		if pool, err = alloc.New(alloc.NewMmapSource(alloc.MmapOptions{}), alloc.WithName("bench")); err != nil {
			return err
		}
	} else if err := b.Free(); err != nil {
		return err
	}
	defer pool.Close()

	subject := allocator{name: "pool", ring: func(live int) allocRing {
		return &poolRing{pool: pool, b: make([]alloc.Block, live), used: make([]bool, live)}
	}}
	baselines := []allocator{
		{name: "make", ring: func(live int) allocRing { return make(makeRing, live) }},
		{name: "lock-pages", ring: func(live int) allocRing { return make(lockRing, live) }},
	}
	// The lock-per-tensor baseline needs locked memory too.
	if mem, err := lockPages(allocMaxSize); err != nil {
		env.Log.Info("lock-pages baseline skipped", "err", err)
		baselines = baselines[:1]
	} else if err := unlockPages(mem); err != nil {
		return err
	}

	// Each timed run lasts about target and holds at least minIters pairs
	// per goroutine, so slow baselines are not judged on a handful of calls.
	target, minIters := 2*time.Millisecond, 32
	if env.Quick {
		target, minIters = 200*time.Microsecond, 2
	}
	measure := func(a allocator, sizes []int, goroutines int) (float64, error) {
		if err := ctx.Err(); err != nil {
			return 0, err
		}
		return allocPairNs(a, sizes, goroutines, env.Reps, target, minIters)
	}
	emit := func(caseName string, size int64, sizes []int, goroutines int, caseNote string) error {
		// Subject and baselines measured back to back, so noise hits both.
		v, err := measure(subject, sizes, goroutines)
		if err != nil {
			return fmt.Errorf("%s pool: %w", caseName, err)
		}
		for _, b := range baselines {
			base, err := measure(b, sizes, goroutines)
			if err != nil {
				return fmt.Errorf("%s %s: %w", caseName, b.name, err)
			}
			r := newResult("alloc", caseName+"/vs-"+b.name, size, v, "ns/op", base, b.name)
			r.Note = joinNote(note, caseNote)
			if b.name == "make" {
				r.Note = joinNote(r.Note, "make zeroes its memory and leaves it to the garbage collector; the pool does neither")
			}
			env.Emit(r)
		}
		return nil
	}

	procs := runtime.GOMAXPROCS(0)
	for _, size := range env.sizes(allocMinSize, allocMaxSize) {
		if err := emit("fixed", size, []int{int(size)}, 1, ""); err != nil {
			return err
		}
	}
	if err := emit(fmt.Sprintf("parallel-%d-fixed-4KiB", procs), 4096, []int{4096}, procs, ""); err != nil {
		return err
	}
	maxMixed := int64(allocMaxSize)
	if env.Quick {
		maxMixed = 256 << 10
	}
	if env.MaxSize > 0 {
		maxMixed = min(maxMixed, env.MaxSize)
	}
	mixed := mixedSizes(allocMixedSizes, allocMinSize, int(maxMixed))
	mean := 0
	for _, n := range mixed {
		mean += n
	}
	mean /= len(mixed)
	caseMixed := "mixed-256B-" + humanize.IBytes(uint64(maxMixed))
	mixedNote := fmt.Sprintf("size is the mean of %d log-uniform sizes, %d live per goroutine", len(mixed), allocMixedLive)
	if err := emit(caseMixed, int64(mean), mixed, 1, mixedNote); err != nil {
		return err
	}
	if err := emit(fmt.Sprintf("parallel-%d-", procs)+caseMixed, int64(mean), mixed, procs, mixedNote); err != nil {
		return err
	}
	env.Log.Debug("pool after the alloc scenario", "stats", pool.Stats().String())
	return nil
}

func joinNote(a, b string) string {
	if a == "" {
		return b
	}
	return a + "; " + b
}

// mixedSizes is a fixed sequence of n sizes in [lo, hi], log-uniform: a
// power of two from lo up to hi picked uniformly, plus up to as much again.
func mixedSizes(n, lo, hi int) []int {
	rng := rand.New(rand.NewPCG(1, 2))
	steps := 0
	for s := lo; s*2 <= hi; s *= 2 {
		steps++
	}
	out := make([]int, n)
	for i := range out {
		s := lo << rng.IntN(steps+1)
		out[i] = min(s+rng.IntN(s), hi)
	}
	return out
}

// allocPairNs measures one alloc+free pair of a, in ns, on each of
// goroutines goroutines: the wall time of all pairs divided by their number
// (for one goroutine, the time of one pair). Each goroutine keeps a ring of
// live allocations (one for a single size, allocMixedLive for mixed sizes),
// freeing the oldest before each allocation, and writes the first and last
// byte of what it gets. Each of reps timed runs makes about target's worth
// of pairs, at least minIters per goroutine; the median is returned.
func allocPairNs(a allocator, sizes []int, goroutines, reps int, target time.Duration, minIters int) (float64, error) {
	live := 1
	if len(sizes) > 1 {
		live = allocMixedLive
	}
	worker := func(seed, iters int) (err error) {
		ring := a.ring(live)
		defer func() {
			for k := range live {
				err = errors.Join(err, ring.free(k))
			}
		}()
		for i := range iters {
			k := i % live
			if err := ring.free(k); err != nil {
				return err
			}
			mem, err := ring.alloc(k, sizes[(seed+i)%len(sizes)])
			if err != nil {
				return err
			}
			mem[0], mem[len(mem)-1] = 1, 1
		}
		return nil
	}
	run := func(iters int) (time.Duration, error) {
		start := time.Now()
		if goroutines == 1 {
			err := worker(0, iters)
			return time.Since(start), err
		}
		var wg sync.WaitGroup
		errs := make([]error, goroutines)
		for g := range goroutines {
			wg.Go(func() { errs[g] = worker(g*7, iters) })
		}
		wg.Wait()
		return time.Since(start), errors.Join(errs...)
	}
	// Calibrate: enough pairs per run to last about target.
	iters := 16
	for {
		d, err := run(iters)
		if err != nil {
			return 0, err
		}
		if d >= target/4 || iters >= 1<<24 {
			iters = max(minIters, int(float64(iters)*float64(target)/float64(max(d, 1))))
			break
		}
		iters *= 4
	}
	var per []float64
	for range max(reps, 1) {
		d, err := run(iters)
		if err != nil {
			return 0, err
		}
		per = append(per, float64(d.Nanoseconds())/float64(iters*goroutines))
	}
	return median(per), nil
}

// lockPages maps n bytes and locks them: the cost of registering memory
// tensor by tensor, before any NIC work.
func lockPages(n int) ([]byte, error) {
	mem, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return nil, fmt.Errorf("mmap %d bytes: %w", n, err)
	}
	if err := unix.Mlock(mem); err != nil {
		unix.Munmap(mem)
		return nil, fmt.Errorf("mlock %d bytes: %w", n, err)
	}
	return mem, nil
}

// unlockPages undoes lockPages.
func unlockPages(mem []byte) error {
	if err := unix.Munlock(mem); err != nil {
		return fmt.Errorf("munlock: %w", err)
	}
	return unix.Munmap(mem)
}

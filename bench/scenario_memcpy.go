package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"unsafe"

	"github.com/dustin/go-humanize"
	"golang.org/x/sys/unix"
)

// The memcpy scenario measures the single-thread bandwidth of Go's copy on
// this machine, the ceiling that every transfer scenario is held against.
func init() {
	register(Scenario{
		Name: "memcpy",
		Doc:  "single-thread Go copy bandwidth (GB/s) over anonymous mmap, 4 KiB pages and transparent huge pages, 64 KiB..256 MiB",
		Run:  runMemcpy,
		Plots: []Plot{{
			File:       "memcpy-bandwidth.svg",
			Title:      "memcpy (Go copy) bandwidth, one thread",
			Unit:       "GB/s",
			CasePrefix: "memcpy-",
		}},
	})
}

const (
	memcpyMinSize = 64 << 10
	memcpyMaxSize = 256 << 20
	// hugePageSize is the size of an x86-64 and arm64 (4 KiB granule)
	// transparent huge page; buffers are aligned to it so THP can back them.
	hugePageSize = 2 << 20
	// minWorkingSet is the smallest working set per buffer, whatever the
	// cache: enough that a pass takes milliseconds, not microseconds.
	minWorkingSet = 64 << 20
)

// memcpySettings are the memcpy scenario's -set keys.
const setWorkingSet = "memcpy.working-set" // bytes per buffer, e.g. 1MiB to measure cache

func runMemcpy(ctx context.Context, env *Env) error {
	sizes := env.sizes(memcpyMinSize, memcpyMaxSize)
	llc, llcErr := lastLevelCache("/sys")
	if llcErr != nil {
		env.Log.Debug("no cache size", "err", llcErr)
	}
	ws := memcpyWorkingSet(sizes[len(sizes)-1], llc)
	if v, ok := env.Args[setWorkingSet]; ok {
		n, err := parseSize(v)
		if err != nil || n < sizes[len(sizes)-1] {
			return fmt.Errorf("-set %s=%s: want a size of at least %d bytes (the largest copy)", setWorkingSet, v, sizes[len(sizes)-1])
		}
		ws = n
	}
	mode := thpMode("/sys")
	cases := []struct {
		name string
		huge bool
		bufs *copyBuffers
		note string
	}{{name: "memcpy-4k"}, {name: "memcpy-thp", huge: true}}
	defer func() {
		for _, c := range cases {
			if c.bufs != nil {
				c.bufs.Close()
			}
		}
	}()
	for i := range cases {
		c := &cases[i]
		b, err := newCopyBuffers(ws, c.huge)
		if err != nil {
			return fmt.Errorf("%s: %w", c.name, err)
		}
		c.bufs = b
		c.note = memcpyNote(b, ws, llc, mode)
		env.Log.Debug("buffers ready", "case", c.name, "working_set", ws, "note", c.note)
	}

	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	// Sizes outside, cases inside: both cases of a size are measured close
	// together in time, so the ratio between them is fair under noise.
	for _, size := range sizes {
		var base float64
		for _, c := range cases {
			gbs, err := c.bufs.measure(ctx, size, env.Reps)
			if err != nil {
				return fmt.Errorf("%s at %s: %w", c.name, humanize.IBytes(uint64(size)), err)
			}
			r := newResult("memcpy", c.name, size, gbs, "GB/s", 0, "")
			if c.huge {
				// Huge pages are compared with 4 KiB pages measured just before.
				r = newResult("memcpy", c.name, size, gbs, "GB/s", base, "memcpy-4k")
			} else {
				base = gbs
			}
			r.Note = c.note
			env.Emit(r)
		}
	}
	return nil
}

// memcpyWorkingSet is the size of each of the two buffers for copies of up
// to largest bytes on a machine whose last-level cache is llc bytes (0 when
// unknown): at least twice the cache, so source plus destination are four
// times it and a pass over them leaves nothing useful in the cache; small
// copies then measure memory, not cache.
//
// Scenarios that hold a transfer against memcpy measure their ceiling with
// the same buffers:
//
//	b, err := newCopyBuffers(memcpyWorkingSet(largest, llc), true)
//	...
//	defer b.Close()
//	gbs, err := b.measure(ctx, size, env.Reps)
func memcpyWorkingSet(largest, llc int64) int64 {
	return max(largest, 2*max(llc, 32<<20), minWorkingSet)
}

// memcpyNote says what a case measured, for readers of its results.
func memcpyNote(b *copyBuffers, ws, llc int64, mode string) string {
	var s strings.Builder
	s.WriteString("Go copy, one thread, anonymous mmap ")
	if b.huge {
		fmt.Fprintf(&s, "with MADV_HUGEPAGE (THP %s)", mode)
	} else {
		s.WriteString("with MADV_NOHUGEPAGE")
	}
	if huge, err := b.hugeBytes("/proc"); err == nil {
		fmt.Fprintf(&s, ", %s of %s in huge pages", humanize.IBytes(uint64(huge)), humanize.IBytes(uint64(2*ws)))
	} else {
		fmt.Fprintf(&s, ", huge pages unknown (%v)", err)
	}
	fmt.Fprintf(&s, "; each rep streams 2x%s", humanize.IBytes(uint64(ws)))
	switch {
	case llc <= 0:
		s.WriteString(" (cache size unknown)")
	case 2*ws >= 4*llc:
		fmt.Fprintf(&s, ", %dx the %s last-level cache, so every size measures memory, not cache", 2*ws/llc, humanize.IBytes(uint64(llc)))
	default:
		fmt.Fprintf(&s, " against a %s last-level cache, so small sizes measure partly cache", humanize.IBytes(uint64(llc)))
	}
	for _, n := range b.notes {
		s.WriteString("; ")
		s.WriteString(n)
	}
	if runtime.GOARCH == "amd64" {
		// runtime/memmove_amd64.s: "gobble_big_data_fwd" from 0x100000 bytes.
		s.WriteString("; from 1 MiB on, Go's amd64 copy streams with non-temporal stores")
	}
	s.WriteString("; GB/s = 1e9 bytes copied per second")
	return s.String()
}

// copyBuffers is a source and a destination buffer of anonymous mmap memory
// (never the Go heap), aligned to huge pages and touched, for measuring
// copies. Close unmaps them.
type copyBuffers struct {
	src, dst mapping
	huge     bool
	// notes are what could not be done as asked (a refused madvise).
	notes []string
}

// mapping is a buffer b inside the mmap whole it was carved from.
type mapping struct {
	whole, b []byte
}

// newCopyBuffers maps two buffers of size bytes each, advises the kernel to
// back them with huge pages (huge) or never to (!huge), and writes every
// byte, so no page fault falls into a measurement.
func newCopyBuffers(size int64, huge bool) (*copyBuffers, error) {
	if size <= 0 || size > 1<<40 {
		return nil, fmt.Errorf("copy buffers of %d bytes", size)
	}
	c := &copyBuffers{huge: huge}
	for _, m := range []*mapping{&c.src, &c.dst} {
		mm, note, err := mapAligned(int(size), huge)
		if err != nil {
			c.Close()
			return nil, err
		}
		*m = mm
		if note != "" {
			c.notes = append(c.notes, note)
		}
	}
	fill(c.src.b)
	clear(c.dst.b)
	return c, nil
}

// mapAligned maps size bytes aligned to hugePageSize, with at least one
// unadvised huge page's worth of slack on each side, so the buffer is a
// mapping of its own in /proc/self/smaps.
func mapAligned(size int, huge bool) (mapping, string, error) {
	whole, err := unix.Mmap(-1, 0, size+2*hugePageSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return mapping{}, "", fmt.Errorf("mmap %d bytes: %w", size+2*hugePageSize, err)
	}
	addr := uintptr(unsafe.Pointer(unsafe.SliceData(whole)))
	off := hugePageSize - int(addr%hugePageSize)
	m := mapping{whole: whole, b: whole[off : off+size : off+size]}
	advice, name := unix.MADV_NOHUGEPAGE, "MADV_NOHUGEPAGE"
	if huge {
		advice, name = unix.MADV_HUGEPAGE, "MADV_HUGEPAGE"
	}
	note := ""
	if err := unix.Madvise(m.b, advice); err != nil {
		note = fmt.Sprintf("%s refused: %v", name, err)
	}
	return m, note, nil
}

// fill writes a non-zero pattern into every byte of b.
func fill(b []byte) {
	n := min(len(b), 4096)
	for i := range n {
		b[i] = byte(i*7 + 1)
	}
	for n < len(b) {
		n += copy(b[n:], b[:n])
	}
}

// measure times passes that copy the source to the destination in pieces
// of size bytes, walking the whole buffers, and returns the median rate in
// GB/s over reps passes (after one untimed pass).
func (c *copyBuffers) measure(ctx context.Context, size int64, reps int) (float64, error) {
	if c.src.b == nil {
		return 0, errors.New("copy buffers closed")
	}
	n := int64(len(c.src.b)) / size
	if n == 0 {
		return 0, fmt.Errorf("size %d exceeds the %d-byte buffers", size, len(c.src.b))
	}
	src, dst, sz := c.src.b, c.dst.b, int(size)
	d, err := timeIt(reps, func() error {
		if err := ctx.Err(); err != nil {
			return err
		}
		for off := 0; off+sz <= len(src); off += sz {
			copy(dst[off:off+sz], src[off:off+sz])
		}
		return nil
	})
	if err != nil {
		return 0, err
	}
	return rateGBs(n*size, d), nil
}

// hugeBytes is how much of both buffers is backed by transparent huge pages,
// from the AnonHugePages lines of procRoot/self/smaps.
func (c *copyBuffers) hugeBytes(procRoot string) (int64, error) {
	f, err := os.Open(filepath.Join(procRoot, "self", "smaps"))
	if err != nil {
		return 0, err
	}
	defer f.Close()
	var ranges [][2]uint64
	for _, m := range []mapping{c.src, c.dst} {
		lo := uint64(uintptr(unsafe.Pointer(unsafe.SliceData(m.b))))
		ranges = append(ranges, [2]uint64{lo, lo + uint64(len(m.b))})
	}
	return anonHugeBytes(f, ranges)
}

// Close unmaps the buffers. It is idempotent.
func (c *copyBuffers) Close() error {
	var errs []error
	for _, m := range []*mapping{&c.src, &c.dst} {
		if m.whole != nil {
			errs = append(errs, unix.Munmap(m.whole))
			*m = mapping{}
		}
	}
	return errors.Join(errs...)
}

// anonHugeBytes parses smaps and adds up the AnonHugePages of the mappings
// that lie inside one of ranges ([start, end) addresses). It fails when a
// range is not covered by such mappings, so a wrong answer never reads as
// "no huge pages".
func anonHugeBytes(r io.Reader, ranges [][2]uint64) (int64, error) {
	covered := make([]uint64, len(ranges))
	var total int64
	inside := false
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		line := sc.Text()
		fields := strings.Fields(line)
		if len(fields) == 0 {
			continue
		}
		if lo, hi, ok := parseVMA(fields[0]); ok {
			inside = false
			for i, rg := range ranges {
				if lo >= rg[0] && hi <= rg[1] {
					inside = true
					covered[i] += hi - lo
				}
			}
			continue
		}
		if inside && fields[0] == "AnonHugePages:" && len(fields) >= 2 {
			kb, err := strconv.ParseInt(fields[1], 10, 64)
			if err != nil {
				return 0, fmt.Errorf("smaps: %q: %w", line, err)
			}
			total += kb << 10
		}
	}
	if err := sc.Err(); err != nil {
		return 0, fmt.Errorf("smaps: %w", err)
	}
	for i, rg := range ranges {
		if covered[i] != rg[1]-rg[0] {
			return 0, fmt.Errorf("smaps: %#x-%#x covered by %d of %d bytes of mappings", rg[0], rg[1], covered[i], rg[1]-rg[0])
		}
	}
	return total, nil
}

// parseVMA parses the "start-end" address range that opens an smaps entry.
func parseVMA(s string) (lo, hi uint64, ok bool) {
	a, b, found := strings.Cut(s, "-")
	if !found {
		return 0, 0, false
	}
	lo, err1 := strconv.ParseUint(a, 16, 64)
	hi, err2 := strconv.ParseUint(b, 16, 64)
	if err1 != nil || err2 != nil || hi < lo {
		return 0, 0, false
	}
	return lo, hi, true
}

// thpMode is the selected transparent huge page mode ("always", "madvise",
// "never") from sysRoot/kernel/mm/transparent_hugepage/enabled, or
// "unknown".
func thpMode(sysRoot string) string {
	b, err := os.ReadFile(filepath.Join(sysRoot, "kernel", "mm", "transparent_hugepage", "enabled"))
	if err != nil {
		return "unknown"
	}
	return parseTHPMode(string(b))
}

// parseTHPMode picks the bracketed choice of "always [madvise] never".
func parseTHPMode(s string) string {
	_, rest, ok := strings.Cut(s, "[")
	if !ok {
		return "unknown"
	}
	mode, _, ok := strings.Cut(rest, "]")
	if !ok || mode == "" {
		return "unknown"
	}
	return mode
}

// lastLevelCache is the size in bytes of CPU 0's highest-level data or
// unified cache, from sysRoot/devices/system/cpu/cpu0/cache.
func lastLevelCache(sysRoot string) (int64, error) {
	dir := filepath.Join(sysRoot, "devices", "system", "cpu", "cpu0", "cache")
	ents, err := os.ReadDir(dir)
	if err != nil {
		return 0, err
	}
	best, bestLevel := int64(0), 0
	for _, e := range ents {
		if !strings.HasPrefix(e.Name(), "index") {
			continue
		}
		read := func(f string) string {
			b, _ := os.ReadFile(filepath.Join(dir, e.Name(), f))
			return strings.TrimSpace(string(b))
		}
		if read("type") == "Instruction" {
			continue
		}
		level, err := strconv.Atoi(read("level"))
		if err != nil {
			continue
		}
		size, err := parseCacheSize(read("size"))
		if err != nil {
			continue
		}
		if level > bestLevel || level == bestLevel && size > best {
			best, bestLevel = size, level
		}
	}
	if best == 0 {
		return 0, fmt.Errorf("no cache sizes under %s", dir)
	}
	return best, nil
}

// parseCacheSize parses sysfs cache sizes such as "32768K" or "2M".
func parseCacheSize(s string) (int64, error) {
	mult := int64(1)
	switch {
	case strings.HasSuffix(s, "K"):
		mult, s = 1<<10, strings.TrimSuffix(s, "K")
	case strings.HasSuffix(s, "M"):
		mult, s = 1<<20, strings.TrimSuffix(s, "M")
	case strings.HasSuffix(s, "G"):
		mult, s = 1<<30, strings.TrimSuffix(s, "G")
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n <= 0 || n > 1<<40/mult {
		return 0, fmt.Errorf("cache size %q", s)
	}
	return n * mult, nil
}

package alloc

import (
	"errors"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

func mustRegion(t *testing.T, s Source, size int) *Region {
	t.Helper()
	r, err := s.Alloc(size)
	if err != nil {
		t.Fatalf("%s.Alloc(%d): %v", s.Name(), size, err)
	}
	t.Cleanup(func() {
		if err := s.Free(r); err != nil {
			t.Errorf("Free: %v", err)
		}
	})
	return r
}

func TestMmapSource(t *testing.T) {
	s := NewMmapSource(MmapOptions{})
	page := unix.Getpagesize()
	r := mustRegion(t, s, 1000)
	if r.Size != page || r.Base%uintptr(page) != 0 || r.FD != -1 || len(r.Notes) != 0 {
		t.Fatalf("region %+v, want one page, aligned, no fd, no notes", r)
	}
	mem := r.hostBytes()
	mem[0], mem[page-1] = 1, 2
	if mem[0] != 1 || mem[page-1] != 2 {
		t.Fatal("region does not keep its bytes")
	}
	if _, err := s.Alloc(0); !errors.Is(err, ErrBadSize) {
		t.Errorf("Alloc(0) = %v", err)
	}
	if err := s.Free(&Region{Base: r.Base, Size: r.Size}); !errors.Is(err, ErrNotOwned) {
		t.Errorf("Free of a forged region = %v", err)
	}
	other := NewMmapSource(MmapOptions{})
	if err := other.Free(r); !errors.Is(err, ErrNotOwned) {
		t.Errorf("Free by another source = %v", err)
	}
	r2, err := s.Alloc(page)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Free(r2); err != nil {
		t.Fatal(err)
	}
	if err := s.Free(r2); err != nil {
		t.Errorf("second Free = %v, want nil (idempotent)", err)
	}
}

// TestHugePagesNotes checks that a huge-page region is 2 MiB aligned and
// that its notes say MADV_HUGEPAGE was refused exactly when this kernel
// refuses it.
func TestHugePagesNotes(t *testing.T) {
	s := NewMmapSource(MmapOptions{HugePages: true, Populate: true})
	r := mustRegion(t, s, 3<<20)
	if r.Size != 4<<20 || r.Base%(2<<20) != 0 {
		t.Fatalf("region [%#x+%d], want 4 MiB aligned to 2 MiB", r.Base, r.Size)
	}
	probe, err := unix.Mmap(-1, 0, 2<<20, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(probe)
	want := unix.Madvise(probe, unix.MADV_HUGEPAGE)
	got := strings.Join(r.Notes, "; ")
	if (want != nil) != strings.Contains(got, "MADV_HUGEPAGE refused") {
		t.Errorf("kernel answers MADV_HUGEPAGE with %v, notes say %q", want, got)
	}
	t.Logf("notes %q; AnonHugePages of the region: %s", r.Notes, smapsField(t, r.Base, "AnonHugePages"))
}

// TestPopulate checks with mincore that every page is resident at once.
func TestPopulate(t *testing.T) {
	for _, populate := range []bool{false, true} {
		s := NewMmapSource(MmapOptions{Populate: populate})
		r := mustRegion(t, s, 1<<20)
		resident := residentPages(t, r)
		pages := r.Size / unix.Getpagesize()
		if populate && resident != pages {
			t.Errorf("populated region has %d of %d pages resident (notes %q)", resident, pages, r.Notes)
		}
		if !populate && resident == pages {
			t.Errorf("unpopulated region has all %d pages resident", pages)
		}
	}
}

func residentPages(t *testing.T, r *Region) int {
	t.Helper()
	vec := make([]byte, r.Size/unix.Getpagesize())
	if _, _, errno := unix.Syscall(unix.SYS_MINCORE, r.Base, uintptr(r.Size), uintptr(unsafe.Pointer(&vec[0]))); errno != 0 {
		t.Fatalf("mincore: %v", errno)
	}
	n := 0
	for _, v := range vec {
		n += int(v & 1)
	}
	return n
}

func TestNUMANotes(t *testing.T) {
	t.Run("allowed node", func(t *testing.T) {
		// Bind to the lowest node this process may use (cpuset mems).
		allowed := make([]uint64, 16)
		if _, _, errno := unix.Syscall6(unix.SYS_GET_MEMPOLICY, 0, uintptr(unsafe.Pointer(&allowed[0])),
			uintptr(len(allowed)*64), 0, unix.MPOL_F_MEMS_ALLOWED, 0); errno != 0 {
			t.Skipf("get_mempolicy(MPOL_F_MEMS_ALLOWED): %v: no NUMA policy support", errno)
		}
		node := -1
		for i := 0; i < len(allowed)*64 && node < 0; i++ {
			if allowed[i/64]&(1<<(i%64)) != 0 {
				node = i
			}
		}
		if node < 0 {
			t.Fatal("no NUMA node allowed")
		}
		r := mustRegion(t, NewMmapSource(MmapOptions{BindNUMA: true, NUMANode: node, Populate: true}), 1<<20)
		if len(r.Notes) != 0 {
			t.Fatalf("binding to allowed node %d noted %q", node, r.Notes)
		}
		var mode int
		mask := make([]uint64, 16)
		if _, _, errno := unix.Syscall6(unix.SYS_GET_MEMPOLICY, uintptr(unsafe.Pointer(&mode)), uintptr(unsafe.Pointer(&mask[0])),
			uintptr(len(mask)*64), r.Base, unix.MPOL_F_ADDR, 0); errno != 0 {
			t.Fatalf("get_mempolicy: %v", errno)
		}
		want := make([]uint64, 16)
		want[node/64] = 1 << (node % 64)
		if mode != unix.MPOL_BIND || !slices.Equal(mask, want) {
			t.Errorf("policy of the region: mode %d mask %#x, want MPOL_BIND to node %d", mode, mask[:2], node)
		}
	})
	t.Run("missing node", func(t *testing.T) {
		r := mustRegion(t, NewMmapSource(MmapOptions{BindNUMA: true, NUMANode: 1000}), 1<<20)
		got := strings.Join(r.Notes, "; ")
		if !strings.Contains(got, "mbind MPOL_BIND to NUMA node 1000 refused") {
			t.Errorf("notes %q do not report the refused binding", got)
		}
		r.hostBytes()[0] = 1 // still usable
	})
}

func TestMemfdSource(t *testing.T) {
	s := NewMemfdSource("memfd-test", MmapOptions{})
	if s.Name() != "memfd:memfd-test" {
		t.Errorf("Name %q", s.Name())
	}
	r := mustRegion(t, s, 64<<10)
	if r.FD < 0 || len(r.Notes) != 0 {
		t.Fatalf("region %+v, want an fd and no notes", r)
	}
	link, err := os.Readlink("/proc/self/fd/" + strconv.Itoa(r.FD))
	if err != nil || !strings.Contains(link, "memfd:memfd-test.") {
		t.Errorf("fd links to %q (%v)", link, err)
	}
	mem := r.hostBytes()
	for i := range mem {
		mem[i] = byte(i * 7)
	}
	// A second, independent mapping of the fd sees the same bytes, both ways.
	again, err := unix.Mmap(r.FD, 0, r.Size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(again)
	for i := range again {
		if again[i] != byte(i*7) {
			t.Fatalf("second mapping byte %d = %d, want %d", i, again[i], byte(i*7))
		}
	}
	again[100] = 0xAB
	if mem[100] != 0xAB {
		t.Error("a write through the second mapping is not seen in the region")
	}
	// Sealed: nobody may shrink the memfd under the pool.
	if err := unix.Ftruncate(r.FD, 0); !errors.Is(err, unix.EPERM) {
		t.Errorf("ftruncate of the sealed memfd = %v, want EPERM", err)
	}
	// Free closes the fd.
	r2, err := s.Alloc(4096)
	if err != nil {
		t.Fatal(err)
	}
	fd := r2.FD
	if err := s.Free(r2); err != nil {
		t.Fatal(err)
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0); !errors.Is(err, unix.EBADF) {
		t.Errorf("fd %d still open after Free (%v)", fd, err)
	}
}

func TestMemfdHugeAligned(t *testing.T) {
	r := mustRegion(t, NewMemfdSource("huge", MmapOptions{HugePages: true}), 1<<20)
	if r.Size != 2<<20 || r.Base%(2<<20) != 0 {
		t.Fatalf("region [%#x+%d], want 2 MiB aligned to 2 MiB", r.Base, r.Size)
	}
	mem := r.hostBytes()
	mem[len(mem)-1] = 9
	t.Logf("notes %q", r.Notes)
}

// smapsField reads one field of the mapping (VMA) holding base from
// /proc/self/smaps.
func smapsField(t *testing.T, base uintptr, field string) string {
	t.Helper()
	data, err := os.ReadFile("/proc/self/smaps")
	if err != nil {
		return "unreadable: " + err.Error()
	}
	header := regexp.MustCompile(`^([0-9a-f]+)-([0-9a-f]+) `)
	in := false
	for _, line := range strings.Split(string(data), "\n") {
		if m := header.FindStringSubmatch(line); m != nil {
			lo, _ := strconv.ParseUint(m[1], 16, 64)
			hi, _ := strconv.ParseUint(m[2], 16, 64)
			in = uint64(base) >= lo && uint64(base) < hi
			continue
		}
		if in && strings.HasPrefix(line, field+":") {
			return strings.TrimSpace(strings.TrimPrefix(line, field+":"))
		}
	}
	return "not found"
}

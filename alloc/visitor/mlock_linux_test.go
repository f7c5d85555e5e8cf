package visitor

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"unsafe"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/tensor"
	"golang.org/x/sys/unix"
)

// vmLocked reads VmLck (kB) of this process from /proc/self/status.
func vmLocked(t *testing.T) int {
	t.Helper()
	data, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(data), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmLck:"); ok {
			n, err := strconv.Atoi(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")))
			if err != nil {
				t.Fatalf("VmLck %q: %v", rest, err)
			}
			return n
		}
	}
	t.Fatal("no VmLck in /proc/self/status")
	return 0
}

// TestMlockLocksPages locks a real arena and sees the kernel count it.
func TestMlockLocksPages(t *testing.T) {
	const arena = 1 << 20 // within the default 8 MiB RLIMIT_MEMLOCK
	before := vmLocked(t)
	p, err := alloc.New(alloc.NewMmapSource(alloc.MmapOptions{}),
		alloc.WithVisitors(NewMlock()), alloc.WithInitialArena(arena))
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	b, err := p.Alloc(4096)
	if errors.Is(err, ErrMemlockLimit) {
		skipUnlessRDMARequired(t, err)
	}
	if err != nil {
		t.Fatal(err)
	}
	a, _ := p.ArenaOf(b.Addr())
	l, ok := lockedOf(a)
	if !ok || l.Bytes != a.Size() {
		t.Errorf("LockedOf = %+v, %v; want %d bytes", l, ok, a.Size())
	}
	locked := vmLocked(t)
	if locked-before < arena/1024 {
		t.Errorf("VmLck grew by %d kB, want at least %d kB", locked-before, arena/1024)
	}
	// mlock faults every page in.
	vec := make([]byte, a.Size()/unix.Getpagesize())
	if _, _, errno := unix.Syscall(unix.SYS_MINCORE, a.Base(), uintptr(a.Size()), uintptr(unsafe.Pointer(&vec[0]))); errno != 0 {
		t.Fatal(errno)
	}
	for i, v := range vec {
		if v&1 == 0 {
			t.Fatalf("page %d of a locked arena is not resident", i)
		}
	}
	if err := b.Free(); err != nil {
		t.Fatal(err)
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if after := vmLocked(t); after > before {
		t.Errorf("VmLck %d kB after Close, %d kB before", after, before)
	}
	if _, ok := lockedOf(a); ok {
		t.Error("Locked handle left after release")
	}
}

// TestMlockLimitError lowers RLIMIT_MEMLOCK in a child process (and, as
// root, drops CAP_IPC_LOCK there) and checks the error it gets.
func TestMlockLimitError(t *testing.T) {
	cmd := helperCmd(t, "mlock-limit")
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("helper: %v\n%s", err, out)
	}
	var res mlockLimitResult
	if err := json.Unmarshal(out, &res); err != nil {
		t.Fatalf("helper output %q: %v", out, err)
	}
	if !res.IsLimit || !(res.IsENOMEM || res.IsEPERM) {
		t.Errorf("error %q: ErrMemlockLimit %v, ENOMEM %v, EPERM %v", res.Err, res.IsLimit, res.IsENOMEM, res.IsEPERM)
	}
	for _, want := range []string{"RLIMIT_MEMLOCK is soft 64 KiB (65536 bytes), hard 64 KiB (65536 bytes)", "(1.0 MiB)", "arena 7", "ulimit -l"} {
		if !strings.Contains(res.Err, want) {
			t.Errorf("error %q lacks %q", res.Err, want)
		}
	}
	t.Log(res.Err)
}

type mlockLimitResult struct {
	Err                        string
	IsLimit, IsENOMEM, IsEPERM bool
}

// helperMlockLimit runs in the child: with a 64 KiB limit and no
// CAP_IPC_LOCK on this thread, it locks a 1 MiB arena.
func helperMlockLimit() error {
	runtime.LockOSThread() // capabilities are per thread; mlock runs on this one
	lim := unix.Rlimit{Cur: 64 << 10, Max: 64 << 10}
	if err := unix.Setrlimit(unix.RLIMIT_MEMLOCK, &lim); err != nil {
		return fmt.Errorf("setrlimit: %w", err)
	}
	if err := dropIPCLock(); err != nil {
		return err
	}
	src := alloc.NewMmapSource(alloc.MmapOptions{})
	r, err := src.Alloc(1 << 20)
	if err != nil {
		return err
	}
	defer src.Free(r)
	a, done, err := loneArena(7, r)
	if err != nil {
		return err
	}
	defer done()
	verr := NewMlock().Visit(a)
	if verr == nil {
		return errors.New("mlock of 1 MiB succeeded under a 64 KiB limit")
	}
	if _, ok := lockedOf(a); ok {
		return errors.New("failed Visit left a handle")
	}
	return json.NewEncoder(os.Stdout).Encode(mlockLimitResult{
		Err: verr.Error(), IsLimit: errors.Is(verr, ErrMemlockLimit),
		IsENOMEM: errors.Is(verr, unix.ENOMEM), IsEPERM: errors.Is(verr, unix.EPERM),
	})
}

// dropIPCLock removes CAP_IPC_LOCK from the calling thread's effective set.
func dropIPCLock() error {
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return fmt.Errorf("capget: %w", err)
	}
	data[0].Effective &^= 1 << unix.CAP_IPC_LOCK
	if err := unix.Capset(&hdr, &data[0]); err != nil {
		return fmt.Errorf("capset: %w", err)
	}
	return nil
}

func TestMlockMisuse(t *testing.T) {
	m := NewMlock()
	gpu := testArena(t, 1, &alloc.Region{Base: 1 << 40, Size: 1 << 20, Device: tensor.GPUDevice(0), FD: -1})
	if err := m.Visit(gpu); !errors.Is(err, errNotHostMemory) {
		t.Errorf("Visit of a GPU arena = %v", err)
	}
	src := alloc.NewMmapSource(alloc.MmapOptions{})
	r, err := src.Alloc(64 << 10)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Free(r)
	a := testArena(t, 2, r)
	if err := m.Release(a); !errors.Is(err, errNotVisited) {
		t.Errorf("Release before Visit = %v", err)
	}
	if err := m.Visit(a); errors.Is(err, ErrMemlockLimit) {
		skipUnlessRDMARequired(t, err)
	} else if err != nil {
		t.Fatal(err)
	}
	if err := m.Visit(a); !errors.Is(err, errAlreadyVisited) {
		t.Errorf("second Visit = %v", err)
	}
	if err := m.Release(a); err != nil {
		t.Fatal(err)
	}
	if err := m.Release(a); !errors.Is(err, errNotVisited) {
		t.Errorf("second Release = %v", err)
	}
}

// skipUnlessRDMARequired skips a test that needs locked memory where the
// locked-memory limit forbids it, but fails it on a host declared fit for
// RDMA (GDRLINK_REQUIRE_RDMA=1), which must allow locking.
func skipUnlessRDMARequired(t *testing.T, err error) {
	t.Helper()
	if os.Getenv("GDRLINK_REQUIRE_RDMA") == "1" {
		t.Fatalf("GDRLINK_REQUIRE_RDMA=1 but memory cannot be locked: %v", err)
	}
	t.Skipf("memory cannot be locked here (raise RLIMIT_MEMLOCK or grant CAP_IPC_LOCK): %v", err)
}

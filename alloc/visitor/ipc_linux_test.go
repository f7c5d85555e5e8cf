package visitor

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/gdrlink/gdrlink/alloc"
	"golang.org/x/sys/unix"
)

func newIPCPool(t *testing.T) *alloc.Pool {
	t.Helper()
	p, err := alloc.New(alloc.NewMemfdSource("ipc-test", alloc.MmapOptions{}),
		alloc.WithVisitors(NewIPCExport()), alloc.WithInitialArena(1<<20))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := p.Check(); err != nil {
			t.Error(err)
		}
		if err := p.Close(); err != nil {
			t.Error(err)
		}
	})
	return p
}

func TestIPCExport(t *testing.T) {
	p := newIPCPool(t)
	b, err := p.Alloc(8192)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Free()
	a, _ := p.ArenaOf(b.Addr() + 100)
	e, ok := IPCExportOf(a)
	if !ok {
		t.Fatal("no IPCExport on the arena")
	}
	if e.FD < 0 || e.FD == a.Region().FD || e.Size != a.Size() || e.Base != a.Base() || e.ArenaID != a.ID {
		t.Errorf("export %+v of %v (region fd %d)", e, a, a.Region().FD)
	}
	if !strings.HasPrefix(e.Name, "ipc-test.") {
		t.Errorf("export name %q", e.Name)
	}
	off, ok := e.offset(b.Addr(), b.Len())
	if !ok || off != int64(b.Addr()-a.Base()) {
		t.Errorf("Offset = %d, %v", off, ok)
	}
	if _, ok := e.offset(a.Base()+uintptr(a.Size())-10, 11); ok {
		t.Error("Offset accepted a range past the arena")
	}
	mem := b.Bytes()
	for i := range mem {
		mem[i] = byte(i * 13)
	}
	m, err := MapExport(e.FD, e.Size)
	if err != nil {
		t.Fatal(err)
	}
	peer := m.Bytes()[off : off+int64(b.Len())]
	for i := range peer {
		if peer[i] != byte(i*13) {
			t.Fatalf("peer mapping byte %d = %d", i, peer[i])
		}
	}
	peer[0] = 0xEE
	if mem[0] != 0xEE {
		t.Error("a write through the peer mapping is not seen in the block")
	}
	if err := m.Close(); err != nil {
		t.Fatal(err)
	}
	if err := m.Close(); err != nil || m.Bytes() != nil {
		t.Errorf("second Close = %v", err)
	}
	if _, err := MapExport(e.FD, e.Size*2); !errors.Is(err, errExport) {
		t.Errorf("MapExport beyond the memfd = %v", err)
	}
}

// TestIPCExportOtherProcess hands the exported descriptor to a second
// process, both as an inherited descriptor and through /proc/PID/fd, which
// checks the bytes this process wrote and writes a reply into the block.
func TestIPCExportOtherProcess(t *testing.T) {
	for _, mode := range []string{"inherited", "procfs"} {
		t.Run(mode, func(t *testing.T) {
			p := newIPCPool(t)
			b, err := p.Alloc(100000)
			if err != nil {
				t.Fatal(err)
			}
			defer b.Free()
			a, _ := p.ArenaOf(b.Addr())
			e, _ := IPCExportOf(a)
			off, _ := e.offset(b.Addr(), b.Len())
			mem := b.Bytes()
			for i := range mem {
				mem[i] = byte(i * 13)
			}
			env := []string{
				"GDRLINK_EXPORT_SIZE=" + strconv.Itoa(e.Size),
				"GDRLINK_EXPORT_OFF=" + strconv.FormatInt(off, 10),
				"GDRLINK_EXPORT_LEN=" + strconv.Itoa(b.Len()),
			}
			cmd := helperCmd(t, "map-export")
			if mode == "inherited" {
				cmd.ExtraFiles = []*os.File{os.NewFile(uintptr(e.FD), e.Name)}
				env = append(env, "GDRLINK_EXPORT_FD=3")
			} else {
				env = append(env, fmt.Sprintf("GDRLINK_EXPORT_PATH=/proc/%d/fd/%d", os.Getpid(), e.FD))
			}
			cmd.Env = append(cmd.Env, env...)
			out, err := cmd.CombinedOutput()
			if err != nil {
				t.Fatalf("helper: %v\n%s", err, out)
			}
			if got := string(mem[:len(childReply)]); got != childReply {
				t.Errorf("block starts with %q after the child wrote, want %q", got, childReply)
			}
			if mem[len(mem)-1] != byte((len(mem)-1)*13) {
				t.Error("the child changed bytes it should not have")
			}
		})
	}
}

const childReply = "written by the peer process"

func helperMapExport() error {
	size, _ := strconv.Atoi(os.Getenv("GDRLINK_EXPORT_SIZE"))
	off, _ := strconv.Atoi(os.Getenv("GDRLINK_EXPORT_OFF"))
	n, _ := strconv.Atoi(os.Getenv("GDRLINK_EXPORT_LEN"))
	fd := 3
	if path := os.Getenv("GDRLINK_EXPORT_PATH"); path != "" {
		var err error
		if fd, err = unix.Open(path, unix.O_RDWR|unix.O_CLOEXEC, 0); err != nil {
			return fmt.Errorf("open %s: %w", path, err)
		}
	}
	m, err := MapExport(fd, size)
	if err != nil {
		return err
	}
	defer m.Close()
	if err := unix.Close(fd); err != nil { // the mapping outlives the fd
		return err
	}
	block := m.Bytes()[off : off+n]
	for i := range block {
		if block[i] != byte(i*13) {
			return fmt.Errorf("byte %d is %d, want %d", i, block[i], byte(i*13))
		}
	}
	copy(block, childReply)
	return nil
}

func TestIPCExportRefusesAnonymous(t *testing.T) {
	src := alloc.NewMmapSource(alloc.MmapOptions{})
	stats := NewStats(nil)
	p, err := alloc.New(src, alloc.WithVisitors(stats, NewIPCExport()))
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	_, err = p.Alloc(100)
	if !errors.Is(err, errNotShareable) || !errors.Is(err, alloc.ErrVisitor) || !strings.Contains(err.Error(), `"ipc-export"`) {
		t.Fatalf("Alloc = %v, want ErrVisitor wrapping ErrNotShareable", err)
	}
	if s := stats.snapshot(); s.Visits != 1 || s.Releases != 1 || s.live() != 0 {
		t.Errorf("stats visitor not rolled back: %v", s)
	}
	if st := p.Stats(); st.Arenas != 0 || st.Reserved != 0 {
		t.Errorf("arena left: %v", st)
	}
}

func TestIPCExportClosesFD(t *testing.T) {
	src := alloc.NewMemfdSource("close-test", alloc.MmapOptions{})
	r, err := src.Alloc(4096)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Free(r)
	a := testArena(t, 0, r)
	x := NewIPCExport()
	if err := x.Visit(a); err != nil {
		t.Fatal(err)
	}
	if err := x.Visit(a); !errors.Is(err, errAlreadyVisited) {
		t.Errorf("second Visit = %v", err)
	}
	e, _ := IPCExportOf(a)
	if err := x.Release(a); err != nil {
		t.Fatal(err)
	}
	if _, err := unix.FcntlInt(uintptr(e.FD), unix.F_GETFD, 0); !errors.Is(err, unix.EBADF) {
		t.Errorf("exported fd %d still open after Release (%v)", e.FD, err)
	}
	if err := x.Release(a); !errors.Is(err, errNotVisited) {
		t.Errorf("second Release = %v", err)
	}
}

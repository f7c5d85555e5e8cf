package ipc

import (
	"errors"
	"io"
	"net"
	"os"
	"testing"

	"golang.org/x/sys/unix"
)

func connPair(t *testing.T) (*Conn, *net.UnixConn) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	a, err := sockConn(os.NewFile(uintptr(fds[0]), "a"))
	if err != nil {
		t.Fatal(err)
	}
	f := os.NewFile(uintptr(fds[1]), "b")
	c, err := net.FileConn(f)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Close(); c.Close() })
	return a, c.(*net.UnixConn)
}

func newMemfd(t *testing.T, seal bool) int {
	t.Helper()
	fd, err := unix.MemfdCreate("ipc-conn-test", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		t.Fatal(err)
	}
	unix.Ftruncate(fd, 4096)
	if seal {
		if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW); err != nil {
			t.Fatal(err)
		}
	}
	return fd
}

// TestConnHostile: garbage, two descriptors at once and an unsealed memfd
// are refused with typed errors, and no descriptor is left open.
func TestConnHostile(t *testing.T) {
	before := memfdsNow(t)
	c, raw := connPair(t)
	f1, f2 := newMemfd(t, true), newMemfd(t, true)
	good := (Msg{Kind: KindExport, From: 1, Size: 4096}).Append(nil)
	if _, _, err := raw.WriteMsgUnix(good, unix.UnixRights(f1, f2), nil); err != nil {
		t.Fatal(err)
	}
	if _, _, err := c.Recv(); !errors.Is(err, ErrBadMessage) {
		t.Errorf("two descriptors: %v", err)
	}
	if _, _, err := raw.WriteMsgUnix([]byte("not a message"), unix.UnixRights(f1), nil); err != nil {
		t.Fatal(err)
	}
	if _, _, err := c.Recv(); !errors.Is(err, ErrBadMessage) {
		t.Errorf("garbage: %v", err)
	}
	unix.Close(f1)
	unix.Close(f2)
	if n := memfdsNow(t); n != before {
		t.Errorf("%d memfds open after refusing, %d before", n, before)
	}

	// An unsealed memfd (the peer could shrink it under the mapping).
	uf := newMemfd(t, false)
	if _, err := (MemfdOpener{}).Open(1, Msg{Kind: KindExport, Size: 4096}, uf); !errors.Is(err, ErrBadMessage) {
		t.Errorf("unsealed memfd: %v", err)
	}
	sf := newMemfd(t, true)
	if _, err := (MemfdOpener{}).Open(1, Msg{Kind: KindExport, Size: 8192}, sf); err == nil {
		t.Error("mapping past the end of the memfd succeeded")
	}
	if n := memfdsNow(t); n != before {
		t.Errorf("%d memfds open after failed opens, %d before", n, before)
	}
	raw.Close()
	if _, _, err := c.Recv(); !errors.Is(err, io.EOF) {
		t.Errorf("peer gone: %v", err)
	}
}

// TestPullRejects: a pull outside the mapping, into a result of the wrong
// size, or through a device mapping fails with a typed error.
func TestPullRejects(t *testing.T) {
	fd := newMemfd(t, true)
	mp, err := (MemfdOpener{}).Open(1, Msg{Kind: KindExport, Size: 4096}, fd)
	if err != nil {
		t.Fatal(err)
	}
	defer mp.Close()
	for _, m := range []Msg{{Offset: 4000, Size: 97}, {Offset: 1 << 40, Size: 1}} {
		if _, err := Pull(make([]byte, m.Size), mp, m); !errors.Is(err, ErrNotMapped) {
			t.Errorf("%+v: %v", m, err)
		}
	}
	if _, err := Pull(make([]byte, 10), mp, Msg{Size: 11}); !errors.Is(err, ErrBadMessage) {
		t.Errorf("result of the wrong size: %v", err)
	}
	if _, err := Pull(make([]byte, 1), &DeviceMapping{Size: 64}, Msg{Size: 1}); !errors.Is(err, ErrNotMapped) {
		t.Errorf("device mapping: %v", err)
	}
	mp.Close()
	if _, err := Pull(make([]byte, 1), mp, Msg{Size: 1}); !errors.Is(err, ErrNotMapped) {
		t.Errorf("closed mapping: %v", err)
	}
}

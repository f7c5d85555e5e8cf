package bootstrap

import (
	"io"
	"net"
	"syscall"
	"time"
	"unsafe"

	"github.com/gdrlink/gdrlink/internal/adaptspin"
	"golang.org/x/sys/unix"
)

// spinReader reads a connection that an all-gather (a barrier) waits on:
// the first Read polls the socket for as long as the group's spin policy
// says before it sleeps in the network poller. A rank that leaves a
// barrier a wake-up (100-300 µs on a busy virtual machine) after the
// root would start the collective that follows that late, and every
// other rank would wait for it; polling ranks leave together.
type spinReader struct {
	c     net.Conn
	spin  *adaptspin.Policy
	spun  bool
	n     int
	errno syscall.Errno
	p     []byte
	fn    func(fd uintptr) bool
}

func newSpinReader(c net.Conn, spin *adaptspin.Policy) *spinReader {
	r := &spinReader{c: c, spin: spin}
	r.fn = r.recv
	return r
}

// recv reads what is queued, without waiting.
func (r *spinReader) recv(fd uintptr) bool {
	n, _, errno := unix.Syscall6(unix.SYS_RECVFROM, fd, uintptr(unsafe.Pointer(unsafe.SliceData(r.p))), uintptr(len(r.p)), unix.MSG_DONTWAIT, 0, 0)
	r.n, r.errno = int(n), errno
	return true
}

func (r *spinReader) Read(p []byte) (int, error) {
	if r.spun || len(p) == 0 || r.spin == nil {
		return r.c.Read(p)
	}
	r.spun = true
	sc, ok := r.c.(syscall.Conn)
	if !ok {
		return r.c.Read(p)
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return r.c.Read(p)
	}
	start := time.Now()
	budget := r.spin.Budget()
	r.p = p
	defer func() { r.p = nil }()
	for {
		if err := rc.Read(r.fn); err != nil {
			return 0, err // a deadline passed, or the connection closed
		}
		switch {
		case r.errno == 0 && r.n > 0:
			r.spin.Polled(time.Since(start))
			return r.n, nil
		case r.errno == 0:
			return 0, io.EOF
		case r.errno != unix.EAGAIN && r.errno != unix.EINTR:
			return 0, r.errno
		}
		if time.Since(start) >= budget {
			break
		}
		r.spin.Relax()
	}
	n, err := r.c.Read(p)
	if n > 0 {
		r.spin.Slept(time.Since(start))
	}
	return n, err
}

package ipc

import (
	"context"
	"fmt"
	"io"
	"net"

	"golang.org/x/sys/unix"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/alloc/visitor"
)

// ExportOf returns the EXPORT message and the descriptor (owned by the
// arena's visitor: the caller must not close it) of an arena of a memfd
// pool built with visitor.NewIPCExport, the CPU analog of a device IPC
// handle.
func ExportOf(self uint32, a *alloc.Arena) (Msg, int, bool) {
	e, ok := visitor.IPCExportOf(a)
	if !ok {
		return Msg{}, -1, false
	}
	return Msg{Kind: KindExport, From: self, Arena: uint64(e.ArenaID), Size: uint64(e.Size), Device: "host"}, e.FD, true
}

// MemfdOpener opens memfd arenas a peer passed by descriptor: the CPU
// analog of opening a device IPC handle.
type MemfdOpener struct{}

// Open maps h.Size bytes of fd shared and read-write, then closes fd. The
// file must be sealed against shrinking.
func (MemfdOpener) Open(peer uint32, h Msg, fd int) (Mapping, error) {
	defer closeFD(fd)
	if h.Kind != KindExport || fd < 0 || h.Size == 0 || h.Size > 1<<40 {
		return nil, fmt.Errorf("%w: export of arena %d (%d bytes, fd %d)", ErrBadMessage, h.Arena, h.Size, fd)
	}
	// A peer that could shrink the file could make this process's next
	// access to the mapping a SIGBUS.
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil || seals&unix.F_SEAL_SHRINK == 0 {
		return nil, fmt.Errorf("%w: arena %d of rank %d is not a memfd sealed against shrinking (seals %#x, %v)", ErrBadMessage, h.Arena, peer, seals, err)
	}
	m, err := visitor.MapExport(fd, int(h.Size))
	if err != nil {
		return nil, err
	}
	return &HostMapping{m}, nil
}

// HostMapping is a peer's memfd arena mapped in this process.
type HostMapping struct{ *visitor.Mapped }

// Slice returns the n bytes at off of a mapping, or an error wrapping
// ErrNotMapped.
func Slice(mp Mapping, off, n uint64) ([]byte, error) {
	hm, ok := mp.(*HostMapping)
	if !ok {
		return nil, fmt.Errorf("%w: %T is not host memory", ErrNotMapped, mp)
	}
	b := hm.Bytes()
	if b == nil || off > uint64(len(b)) || n > uint64(len(b))-off {
		return nil, fmt.Errorf("%w: %d bytes at %d of a %d-byte mapping", ErrNotMapped, n, off, len(b))
	}
	return b[off : off+n], nil
}

// Event completes when a pull is done.
type Event struct {
	done chan struct{}
	err  error
}

// Wait blocks until the pull is done or ctx ends.
func (e *Event) Wait(ctx context.Context) error {
	select {
	case <-e.done:
		return e.err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Done is closed when the pull is done.
func (e *Event) Done() <-chan struct{} { return e.done }

// Pull copies the PULL message's tensor from the peer's mapped arena into
// dst, asynchronously (on the CPU analog, a memmove on its own goroutine;
// on a device, one device-to-device copy on a stream), and returns the
// event that completes with it. The mapping must stay open until then.
func Pull(dst []byte, mp Mapping, m Msg) (*Event, error) {
	src, err := Slice(mp, m.Offset, m.Size)
	if err != nil {
		return nil, err
	}
	if uint64(len(dst)) != m.Size {
		return nil, fmt.Errorf("%w: result holds %d bytes, tensor %d", ErrBadMessage, len(dst), m.Size)
	}
	e := &Event{done: make(chan struct{})}
	go func() {
		copy(dst, src)
		close(e.done)
	}()
	return e, nil
}

// Conn carries messages, and descriptors beside them, over a unix
// SOCK_SEQPACKET socket (one message a packet).
type Conn struct {
	c *net.UnixConn
}

// NewConn wraps c.
func NewConn(c *net.UnixConn) *Conn { return &Conn{c: c} }

// Send sends m, and fd beside it with SCM_RIGHTS unless fd < 0.
func (c *Conn) Send(m Msg, fd int) error {
	var oob []byte
	if fd >= 0 {
		oob = unix.UnixRights(fd)
	}
	if _, _, err := c.c.WriteMsgUnix(m.Append(nil), oob, nil); err != nil {
		return fmt.Errorf("ipc: send %s: %w", m.Kind, err)
	}
	return nil
}

// Recv receives one message and the descriptor that came with it (-1 if
// none; the caller owns it). A packet with more than one descriptor, or a
// truncated one, is an error wrapping ErrBadMessage and leaks nothing. A
// peer that left reads as io.EOF.
func (c *Conn) Recv() (Msg, int, error) {
	buf := make([]byte, msgHeader+MaxDevice+MaxHandle+1)
	oob := make([]byte, unix.CmsgSpace(4*4))
	n, oobn, flags, _, err := c.c.ReadMsgUnix(buf, oob)
	if err != nil {
		return Msg{}, -1, fmt.Errorf("ipc: receive: %w", err)
	}
	if n == 0 && oobn == 0 {
		return Msg{}, -1, io.EOF // a SOCK_SEQPACKET peer that left
	}
	fds := rightsOf(oob[:oobn])
	bad := func(err error) (Msg, int, error) {
		for _, f := range fds {
			unix.Close(f)
		}
		return Msg{}, -1, err
	}
	if flags&(unix.MSG_TRUNC|unix.MSG_CTRUNC) != 0 || len(fds) > 1 {
		return bad(fmt.Errorf("%w: truncated packet or %d descriptors", ErrBadMessage, len(fds)))
	}
	m, err := Decode(buf[:n])
	if err != nil {
		return bad(err)
	}
	fd := -1
	if len(fds) == 1 {
		fd = fds[0]
	}
	return m, fd, nil
}

// Close closes the socket.
func (c *Conn) Close() error { return c.c.Close() }

// rightsOf returns the descriptors that came in the control messages oob
// (SCM_RIGHTS); the caller owns them.
func rightsOf(oob []byte) []int {
	var fds []int
	cms, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil
	}
	for i := range cms {
		if f, err := unix.ParseUnixRights(&cms[i]); err == nil {
			fds = append(fds, f...)
		}
	}
	return fds
}

func closeFD(fd int) {
	if fd >= 0 {
		unix.Close(fd)
	}
}

// dupFD returns a close-on-exec duplicate of fd.
func dupFD(fd int) (int, error) {
	nfd, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("ipc: dup of fd %d: %w", fd, err)
	}
	return nfd, nil
}

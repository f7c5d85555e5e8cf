package ipc

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gdrlink/gdrlink/internal/jobauth"
)

// ErrRefused: the descriptor service would not hand out a descriptor (the
// peer is not one this side set the path up with, the arena is not
// exported, or the peer failed the job key or the user check).
var ErrRefused = errors.New("ipc: descriptor refused")

// fdPurpose binds the job-key handshake of the descriptor service.
const fdPurpose = "gdrlink ipc descriptors"

// fdTimeout bounds one exchange with the descriptor service, handshake
// included.
const fdTimeout = 10 * time.Second

// maxFDConns bounds the connections the service serves at once; more wait
// in the listen backlog.
const maxFDConns = 16

// Lookup finds the descriptor of the arena m names (m.Arena, with m.Handle
// as the exporter announced it) for rank peer: a new descriptor the
// service closes once sent, or an error (wrapped in ErrRefused when peer
// may not have it).
type Lookup func(peer uint32, m Msg) (fd int, err error)

// FDServer hands the descriptors of exported arenas (a memfd of the
// simulated GPU, a CUDA VMM allocation's POSIX descriptor) to the peers on
// this node that ask for them, one per connection, beside a reply Msg
// (SCM_RIGHTS). Only a process of this user gets an answer (SO_PEERCRED),
// and with a job key only one that proves it (jobauth, which binds the
// rank it claims); Lookup decides what that rank may have. The socket is
// abstract (no file to clean up), named at random.
type FDServer struct {
	ln     *net.UnixListener
	name   string
	key    jobauth.Key
	lookup Lookup
	log    *slog.Logger
	sem    chan struct{}
	wg     sync.WaitGroup
	once   sync.Once
}

// NewFDServer starts a descriptor service. key may be zero (no job key:
// the user check alone).
func NewFDServer(key jobauth.Key, lookup Lookup, log *slog.Logger) (*FDServer, error) {
	var r [12]byte
	if _, err := rand.Read(r[:]); err != nil {
		return nil, err
	}
	name := "@gdrlink-ipc-" + hex.EncodeToString(r[:])
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: name, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("ipc: descriptor service: %w", err)
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	s := &FDServer{ln: ln, name: name, key: key, lookup: lookup, log: log, sem: make(chan struct{}, maxFDConns)}
	s.wg.Add(1)
	go s.serve()
	return s, nil
}

// Name is the service's address, for FetchFD.
func (s *FDServer) Name() string { return s.name }

// Close stops the service and waits for the exchanges in progress.
func (s *FDServer) Close() error {
	var err error
	s.once.Do(func() { err = s.ln.Close() })
	s.wg.Wait()
	return err
}

func (s *FDServer) serve() {
	defer s.wg.Done()
	for {
		c, err := s.ln.AcceptUnix()
		if err != nil {
			return
		}
		s.sem <- struct{}{}
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			defer func() { <-s.sem }()
			defer c.Close()
			if err := s.answer(c); err != nil {
				s.log.Warn("ipc: descriptor request refused", "err", err)
			}
		}()
	}
}

// answer serves one connection: user check, handshake, request, reply.
func (s *FDServer) answer(c *net.UnixConn) error {
	_ = c.SetDeadline(time.Now().Add(fdTimeout))
	if err := sameUser(c); err != nil {
		return err
	}
	var rank uint32
	if !s.key.IsZero() {
		var err error
		if rank, err = jobauth.Accept(c, s.key, fdPurpose, jobauth.EndsOf(c, false)); err != nil {
			return fmt.Errorf("%w: %w", ErrRefused, err)
		}
	}
	req, err := readFrame(c)
	if err != nil {
		return err
	}
	m, err := Decode(req)
	if err != nil {
		return err
	}
	if m.Kind != KindExport {
		return fmt.Errorf("%w: %s asked of the descriptor service", ErrBadMessage, m.Kind)
	}
	if s.key.IsZero() {
		rank = m.From // no key: the user check is all there is
	} else if m.From != rank {
		return fmt.Errorf("%w: rank %d proved the key, asks as rank %d", ErrRefused, rank, m.From)
	}
	fd, lerr := s.lookup(rank, m)
	reply := Msg{Kind: KindExport, From: m.From, Arena: m.Arena}
	if lerr != nil {
		reply.Kind, reply.Device = KindRelease, truncate(lerr.Error(), MaxDevice)
		fd = -1
	}
	defer closeFD(fd)
	b := binary.BigEndian.AppendUint16(nil, uint16(len(reply.Append(nil))))
	b = reply.Append(b)
	var oob []byte
	if fd >= 0 {
		oob = unix.UnixRights(fd)
	}
	if _, _, err := c.WriteMsgUnix(b, oob, nil); err != nil {
		return fmt.Errorf("ipc: descriptor reply: %w", err)
	}
	return lerr
}

// FetchFD asks the descriptor service at name for the descriptor of the
// arena m names (m.From is this side's rank, which the job key proves when
// key is not zero) and returns it; the caller owns it.
func FetchFD(ctx context.Context, name string, key jobauth.Key, m Msg) (int, error) {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "unix", name)
	if err != nil {
		return -1, fmt.Errorf("ipc: descriptor service %s: %w", name, err)
	}
	c := conn.(*net.UnixConn)
	defer c.Close()
	deadline := time.Now().Add(fdTimeout)
	if dl, ok := ctx.Deadline(); ok && dl.Before(deadline) {
		deadline = dl
	}
	_ = c.SetDeadline(deadline)
	if err := sameUser(c); err != nil {
		return -1, err
	}
	if !key.IsZero() {
		if err := jobauth.Initiate(c, key, fdPurpose, m.From, jobauth.EndsOf(c, true)); err != nil {
			return -1, fmt.Errorf("%w: %w", ErrRefused, err)
		}
	}
	m.Kind = KindExport
	req := m.Append(binary.BigEndian.AppendUint16(nil, uint16(len(m.Append(nil)))))
	if _, err := c.Write(req); err != nil {
		return -1, fmt.Errorf("ipc: descriptor request: %w", err)
	}
	buf := make([]byte, 2+msgHeader+MaxDevice+MaxHandle)
	oob := make([]byte, unix.CmsgSpace(4*4))
	n, oobn, flags, _, err := c.ReadMsgUnix(buf, oob)
	if err != nil {
		return -1, fmt.Errorf("ipc: descriptor reply: %w", err)
	}
	fds := rightsOf(oob[:oobn])
	fail := func(err error) (int, error) {
		for _, f := range fds {
			unix.Close(f)
		}
		return -1, err
	}
	if flags&unix.MSG_CTRUNC != 0 || len(fds) > 1 {
		return fail(fmt.Errorf("%w: %d descriptors in the reply", ErrBadMessage, len(fds)))
	}
	// The reply may come in pieces on a stream socket; the descriptor
	// comes with its first byte.
	got := buf[:n]
	for len(got) < 2 || len(got) < 2+int(binary.BigEndian.Uint16(got)) {
		if len(got) >= 2 && 2+int(binary.BigEndian.Uint16(got)) > len(buf) {
			return fail(fmt.Errorf("%w: reply of %d bytes", ErrBadMessage, binary.BigEndian.Uint16(got)))
		}
		k, err := c.Read(buf[len(got):])
		if err != nil {
			return fail(fmt.Errorf("ipc: descriptor reply: %w", err))
		}
		got = buf[:len(got)+k]
	}
	rm, err := Decode(got[2 : 2+int(binary.BigEndian.Uint16(got))])
	if err != nil {
		return fail(err)
	}
	if rm.Kind != KindExport || rm.Arena != m.Arena {
		return fail(fmt.Errorf("%w: arena %d of %s: %s", ErrRefused, m.Arena, name, rm.Device))
	}
	if len(fds) != 1 {
		return fail(fmt.Errorf("%w: no descriptor beside the reply for arena %d", ErrBadMessage, m.Arena))
	}
	return fds[0], nil
}

// readFrame reads one length-prefixed frame of at most one message.
func readFrame(r io.Reader) ([]byte, error) {
	var h [2]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return nil, fmt.Errorf("ipc: descriptor request: %w", err)
	}
	n := int(binary.BigEndian.Uint16(h[:]))
	if n > msgHeader+MaxDevice+MaxHandle {
		return nil, fmt.Errorf("%w: request of %d bytes", ErrBadMessage, n)
	}
	b := make([]byte, n)
	if _, err := io.ReadFull(r, b); err != nil {
		return nil, fmt.Errorf("ipc: descriptor request: %w", err)
	}
	return b, nil
}

// sameUser refuses a peer process of another user (SO_PEERCRED).
func sameUser(c *net.UnixConn) error {
	raw, err := c.SyscallConn()
	if err != nil {
		return err
	}
	var cred *unix.Ucred
	var serr error
	if err := raw.Control(func(fd uintptr) {
		cred, serr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return err
	}
	if serr != nil {
		return fmt.Errorf("ipc: SO_PEERCRED: %w", serr)
	}
	if int(cred.Uid) != os.Geteuid() {
		return fmt.Errorf("%w: peer process %d runs as user %d, this one as %d", ErrRefused, cred.Pid, cred.Uid, os.Geteuid())
	}
	return nil
}

func truncate(s string, n int) string {
	if len(s) > n {
		return s[:n]
	}
	return s
}

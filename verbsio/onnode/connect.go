package onnode

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gdrlink/gdrlink/internal/jobauth"
	"github.com/gdrlink/gdrlink/internal/offheap"
	"github.com/gdrlink/gdrlink/verbsio"
)

// Connection set-up. The queue pair's socket is abstract: any process of
// the host can connect to it, whatever its user. Before anything of this
// process crosses, a connection must come from the peer's own process (the
// pid of its endpoint, as SO_PEERCRED says) running as this process's
// user, and, when the job has a key, prove the key (jobauth) as the first
// exchange. Then the dialler sends its hello and descriptors, and the
// acceptor answers with its own once it has checked the dialler's.
const (
	// acceptTimeout bounds the handshake of one accepted connection.
	acceptTimeout = 5 * time.Second
	// maxAccepting is the most handshakes of accepted connections in
	// progress at once; connections beyond it are closed unanswered.
	maxAccepting = 64
	// authPurpose names the onnode socket in the job-key handshake.
	authPurpose = "onnode"
	// helloFDs is how many descriptors a hello carries: the ring, the
	// eventfd, the region table and its write counters.
	helloFDs = 4
	// maxHello is the largest hello (two names of 255 bytes).
	maxHello = 2 + 4 + 8 + 4 + 1 + 255 + 1 + 255
)

// establish connects with the peer of ed: the queue pair with the smaller
// socket name dials, the other accepts.
func (q *qp) establish(ctx context.Context, ed endpointData) (*net.UnixConn, hello, []int, error) {
	if q.name < ed.Name {
		return q.dial(ctx, ed)
	}
	return q.accept(ctx, ed)
}

// peerCred is the process at the other end of a unix socket, as the kernel
// recorded it when the socket was connected (or listened on).
type peerCred struct {
	pid, uid int
}

func socketCred(conn *net.UnixConn) (peerCred, error) {
	raw, err := conn.SyscallConn()
	if err != nil {
		return peerCred{}, fmt.Errorf("%w: onnode SO_PEERCRED: %w", verbsio.ErrNotSupported, err)
	}
	var cred *unix.Ucred
	var cerr error
	if err := raw.Control(func(fd uintptr) { cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED) }); err != nil {
		cerr = err
	}
	if cerr != nil {
		return peerCred{}, fmt.Errorf("%w: onnode SO_PEERCRED: %w", verbsio.ErrNotSupported, cerr)
	}
	return peerCred{pid: int(cred.Pid), uid: int(cred.Uid)}, nil
}

// checkCred refuses a socket whose other end is not the peer's process
// (the pid of its endpoint) or runs as another user than this process.
func checkCred(c peerCred, ed endpointData) error {
	if c.pid != int(ed.PID) {
		return fmt.Errorf("%w: onnode refuses pid %d (uid %d) on the socket of @%s: the peer is pid %d", verbsio.ErrRemoteAccess, c.pid, c.uid, ed.Name, ed.PID)
	}
	if me := os.Geteuid(); c.uid != me {
		return fmt.Errorf("%w: onnode refuses peer pid %d of @%s: it runs as uid %d, this process as uid %d", verbsio.ErrRemoteAccess, c.pid, ed.Name, c.uid, me)
	}
	return nil
}

// dial connects to the peer's socket, checks who serves it, proves the
// job key and sends its hello before it reads the peer's.
func (q *qp) dial(ctx context.Context, ed endpointData) (*net.UnixConn, hello, []int, error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, "unixpacket", "@"+ed.Name)
	if err != nil {
		return nil, hello{}, nil, fmt.Errorf("%w: onnode dialing @%s: %w", verbsio.ErrTimeout, ed.Name, err)
	}
	conn := c.(*net.UnixConn)
	h, fds, err := q.dialled(ctx, conn, ed)
	if err != nil {
		conn.Close()
		return nil, hello{}, nil, err
	}
	return conn, h, fds, nil
}

func (q *qp) dialled(ctx context.Context, conn *net.UnixConn, ed endpointData) (hello, []int, error) {
	defer bound(ctx, conn, 0)()
	cred, err := socketCred(conn)
	if err != nil {
		return hello{}, nil, err
	}
	if err := checkCred(cred, ed); err != nil {
		return hello{}, nil, err
	}
	if err := q.authenticate(conn, ed, true, cred); err != nil {
		return hello{}, nil, err
	}
	if err := q.sendHello(conn, ed.Name); err != nil {
		return hello{}, nil, err
	}
	return q.recvHello(conn, ed, cred)
}

// acceptResult is the outcome of one accepted connection's handshake.
type acceptResult struct {
	conn *net.UnixConn
	h    hello
	fds  []int
	err  error
	peer peerCred
}

// accept waits for the peer on the queue pair's socket. Connections of
// other processes or users are closed as soon as they are accepted; the
// others are served concurrently (at most maxAccepting, each for at most
// acceptTimeout), so no connection can hold up the peer's. A handshake
// that the peer's process fails by refusing (wrong job key, bad hello,
// another user) ends the wait with its error; one it closes or lets stall
// does not.
func (q *qp) accept(ctx context.Context, ed endpointData) (*net.UnixConn, hello, []int, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	q.ln.SetDeadline(time.Time{})
	var (
		wg      sync.WaitGroup
		refused atomic.Pointer[error] // the last connection refused, for the timeout's error
		results = make(chan acceptResult)
		ended   = make(chan loopEnd, 1)
	)
	stopLn := abortOnDone(ctx, q.ln.SetDeadline)
	go func() { ended <- q.acceptLoop(ctx, ed, &wg, results, &refused) }()

	var win acceptResult
	var failed error
	loopDone := false
wait:
	for {
		select {
		case r := <-results:
			if r.err != nil {
				q.refused(r.peer, r.err)
			}
			switch {
			case r.err == nil:
				win = r
				break wait
			case conclusive(r.err):
				failed = r.err
				break wait
			}
			refused.Store(&r.err)
		case end := <-ended:
			loopDone = true
			switch err := end.err; {
			case end.refusal != nil:
				failed = end.refusal
			case ctx.Err() != nil:
				failed = fmt.Errorf("%w: onnode waiting for @%s (pid %d): %w", verbsio.ErrTimeout, ed.Name, ed.PID, ctx.Err())
				if last := refused.Load(); last != nil {
					// Text only: the timeout is not the refusal's condition.
					failed = fmt.Errorf("%w (last connection refused: %v)", failed, *last)
				}
			default:
				failed = fmt.Errorf("%w: onnode accept on @%s: %w", verbsio.ErrPeerLost, q.name, err)
			}
			break wait
		}
	}
	// Stop the loop and every handshake, and wait for them: they use this
	// queue pair's descriptors.
	cancel()
	if !loopDone {
		<-ended
	}
	stopLn()
	go func() { wg.Wait(); close(results) }()
	for r := range results {
		if r.err == nil {
			r.conn.Close()
			closeFDs(r.fds)
		}
	}
	if failed != nil {
		return nil, hello{}, nil, failed
	}
	return win.conn, win.h, win.fds, nil
}

// loopEnd is why acceptLoop ended: the listener's error (ctx ended, or
// the listener failed), or the refusal of the peer's process.
type loopEnd struct {
	err, refusal error
}

// acceptLoop accepts until the listener fails (as it does when ctx ends)
// or a connection of the peer's process is refused for its user. Refused
// connections of other processes are recorded in refused. Each handshake
// sends its outcome on results.
func (q *qp) acceptLoop(ctx context.Context, ed endpointData, wg *sync.WaitGroup, results chan<- acceptResult, refused *atomic.Pointer[error]) loopEnd {
	slots := make(chan struct{}, maxAccepting)
	for {
		conn, err := q.ln.AcceptUnix()
		if err != nil {
			return loopEnd{err: err}
		}
		cred, err := socketCred(conn)
		if err == nil {
			err = checkCred(cred, ed)
		}
		if err != nil {
			conn.Close()
			q.refused(cred, err)
			if cred.pid == int(ed.PID) {
				return loopEnd{refusal: err} // the peer's process, another user
			}
			refused.Store(&err)
			continue
		}
		select {
		case slots <- struct{}{}:
		default:
			conn.Close()
			err := fmt.Errorf("%w: onnode @%s already has %d connections in handshake", verbsio.ErrQueueFull, q.name, maxAccepting)
			q.refused(cred, err)
			refused.Store(&err)
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			h, fds, err := q.acceptHandshake(ctx, conn, ed, cred)
			<-slots
			if err != nil {
				conn.Close()
			}
			results <- acceptResult{conn: conn, h: h, fds: fds, err: err, peer: cred}
		}()
	}
}

// refused logs a connection to the queue pair's socket turned away, unless
// the wait for the peer ended (a handshake cut short by it is no refusal).
func (q *qp) refused(c peerCred, why error) {
	if errors.Is(why, context.Canceled) {
		return
	}
	q.pd.dev.refuseLog.Refused(fmt.Sprintf("pid %d uid %d", c.pid, c.uid), fmt.Errorf("on @%s: %w", q.name, why))
}

// acceptHandshake runs the acceptor's side of the handshake on a connection of
// the peer's process.
func (q *qp) acceptHandshake(ctx context.Context, conn *net.UnixConn, ed endpointData, cred peerCred) (hello, []int, error) {
	defer bound(ctx, conn, acceptTimeout)()
	if err := q.authenticate(conn, ed, false, cred); err != nil {
		return hello{}, nil, err
	}
	h, fds, err := q.recvHello(conn, ed, cred)
	if err != nil {
		return hello{}, nil, err
	}
	if err := q.sendHello(conn, ed.Name); err != nil {
		closeFDs(fds)
		return hello{}, nil, err
	}
	return h, fds, nil
}

// conclusive reports whether a handshake that the peer's own process
// failed ends Connect: a refusal does (wrong job key, malformed hello); a
// connection it closed or let stall does not, as it may be an attempt it
// gave up and is making again.
func conclusive(err error) bool {
	for _, e := range []error{io.EOF, io.ErrUnexpectedEOF, os.ErrDeadlineExceeded, syscall.ECONNRESET, syscall.EPIPE} {
		if errors.Is(err, e) {
			return false
		}
	}
	return true
}

// authenticate runs the job-key handshake as the first exchange on conn;
// without a key it does nothing. The dialler initiates and claims its
// process id as its rank (onnode has no ranks), which the acceptor checks
// against the socket's. Both ends are named by the queue pairs' sockets.
func (q *qp) authenticate(conn *net.UnixConn, ed endpointData, dialled bool, cred peerCred) error {
	k := q.pd.dev.key
	if k.IsZero() {
		return nil
	}
	rw := &packetRW{c: conn}
	var err error
	if dialled {
		e := jobauth.Ends{Initiator: sockAddr(q.name), Acceptor: sockAddr(ed.Name)}
		err = jobauth.Initiate(rw, k, authPurpose, uint32(os.Getpid()), e)
	} else {
		e := jobauth.Ends{Initiator: sockAddr(ed.Name), Acceptor: sockAddr(q.name)}
		var rank uint32
		rank, err = jobauth.Accept(rw, k, authPurpose, e)
		if err == nil && int(rank) != cred.pid {
			err = fmt.Errorf("%w: the peer proved the key claiming pid %d, its socket says pid %d", jobauth.ErrRefused, rank, cred.pid)
		}
	}
	if err == nil && rw.r != rw.n {
		err = fmt.Errorf("%w: %d bytes after the job-key handshake", verbsio.ErrBadFrame, rw.n-rw.r)
	}
	if err != nil {
		if !dialled && rw.packets == 1 && !rw.magic {
			// A peer without a key sent its hello: say why it gets none
			// back (it reads this as a job-key handshake it cannot do).
			conn.Write([]byte(authMagic + "\x01"))
		}
		return fmt.Errorf("onnode @%s (pid %d): %w", ed.Name, cred.pid, err)
	}
	return nil
}

// authMagic opens every message of the job-key handshake.
const authMagic = "GDRA"

// sockAddr names a queue pair's socket in the job-key handshake.
func sockAddr(name string) string { return "unixpacket:@" + name }

// packetRW reads a SOCK_SEQPACKET connection as a stream, for jobauth: it
// reads a whole packet when it has none left, so a short read never drops
// the rest of a packet, and never reads past what its caller asks for, so
// what follows the handshake stays on the socket. Descriptors sent with a
// packet are dropped by the kernel.
type packetRW struct {
	c       *net.UnixConn
	buf     [512]byte
	r, n    int
	packets int  // packets read
	magic   bool // the first began with authMagic
}

func (p *packetRW) Read(b []byte) (int, error) {
	if p.r == p.n {
		n, _, flags, _, err := p.c.ReadMsgUnix(p.buf[:], nil)
		if err != nil {
			return 0, err
		}
		if n == 0 {
			return 0, io.EOF
		}
		if flags&unix.MSG_TRUNC != 0 {
			return 0, fmt.Errorf("%w: onnode handshake packet over %d bytes", verbsio.ErrBadFrame, len(p.buf))
		}
		p.r, p.n = 0, n
		if p.packets++; p.packets == 1 {
			p.magic = n >= len(authMagic) && string(p.buf[:len(authMagic)]) == authMagic
		}
	}
	k := copy(b, p.buf[p.r:p.n])
	p.r += k
	return k, nil
}

func (p *packetRW) Write(b []byte) (int, error) { return p.c.Write(b) }

// sendHello sends this queue pair's hello and descriptors.
func (q *qp) sendHello(conn *net.UnixConn, peer string) error {
	mine := hello{PID: uint32(os.Getpid()), Probe: uint64(offheap.Addr(q.inMem[offProbe:])), RingSize: ringData, Name: q.name, PeerName: peer}
	oob := unix.UnixRights(q.inFD, q.efd, q.pd.tableFD, q.ctrFD)
	if _, _, err := conn.WriteMsgUnix(mine.Append(nil), oob, nil); err != nil {
		return fmt.Errorf("%w: onnode hello to @%s: %w", verbsio.ErrPeerLost, peer, err)
	}
	return nil
}

// recvHello reads the peer's hello and descriptors and checks them.
func (q *qp) recvHello(conn *net.UnixConn, ed endpointData, cred peerCred) (hello, []int, error) {
	buf := make([]byte, maxHello+1)
	oob := make([]byte, unix.CmsgSpace(helloFDs*4))
	n, oobn, _, _, err := conn.ReadMsgUnix(buf, oob)
	fds := parseRights(oob[:oobn])
	if err == nil && n == 0 {
		err = io.EOF
	}
	if err != nil {
		closeFDs(fds)
		return hello{}, nil, fmt.Errorf("%w: onnode hello from @%s: %w", verbsio.ErrPeerLost, ed.Name, err)
	}
	h, err := parseHello(buf[:n])
	switch {
	case err != nil && n >= len(authMagic) && string(buf[:len(authMagic)]) == authMagic:
		err = fmt.Errorf("%w: onnode peer @%s (pid %d) proves a job key; this process has none", jobauth.ErrRefused, ed.Name, cred.pid)
	case err != nil:
	case h.Name != ed.Name || h.PeerName != q.name || h.RingSize != ringData || len(fds) != helloFDs:
		err = fmt.Errorf("%w: onnode hello from %q for %q, ring %d, %d fds; want %q for %q", verbsio.ErrBadFrame, h.Name, h.PeerName, h.RingSize, len(fds), ed.Name, q.name)
	case int(h.PID) != cred.pid:
		err = fmt.Errorf("%w: onnode peer @%s claims pid %d; its socket says pid %d (uid %d)", verbsio.ErrRemoteAccess, ed.Name, h.PID, cred.pid, cred.uid)
	}
	if err != nil {
		closeFDs(fds)
		return hello{}, nil, err
	}
	return h, fds, nil
}

func parseRights(oob []byte) []int {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil
	}
	var fds []int
	for _, m := range msgs {
		if f, err := unix.ParseUnixRights(&m); err == nil {
			fds = append(fds, f...)
		}
	}
	return fds
}

func closeFDs(fds []int) {
	for _, fd := range fds {
		unix.Close(fd)
	}
}

// bound limits I/O on conn to ctx's deadline, or to d from now where that
// is sooner (d 0: no such limit), and cuts it short when ctx ends; the
// returned func lifts both.
func bound(ctx context.Context, conn *net.UnixConn, d time.Duration) (lift func()) {
	dl, ok := ctx.Deadline()
	if d > 0 && (!ok || time.Until(dl) > d) {
		dl, ok = time.Now().Add(d), true
	}
	if ok {
		conn.SetDeadline(dl)
	}
	stop := abortOnDone(ctx, conn.SetDeadline)
	return func() {
		stop()
		conn.SetDeadline(time.Time{})
	}
}

// abortOnDone calls set with a past time when ctx ends, until the returned
// func is called; once that returns, set is not called any more.
func abortOnDone(ctx context.Context, set func(time.Time) error) (stop func()) {
	var mu sync.Mutex
	stopped := false
	cancel := context.AfterFunc(ctx, func() {
		mu.Lock()
		defer mu.Unlock()
		if !stopped {
			set(time.Unix(1, 0))
		}
	})
	return func() {
		cancel()
		mu.Lock()
		stopped = true
		mu.Unlock()
	}
}

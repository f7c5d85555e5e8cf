package tcp

import (
	"bytes"
	"errors"
	"io"
	"net"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Who reads a connection. Each lane has a goroutine that sleeps in the
// runtime's network poller until the connection is readable, and a waiter
// in CompletionQueue.Wait that, while it polls, reads the lanes of its
// queue pairs itself: a frame it can finish without blocking (a write, a
// write with immediate or a send with a receive posted, an acknowledgement)
// is read, applied and completed by the waiter, with no hand-off to another
// goroutine on the way. Whoever holds a lane's rd mutex reads it; the
// waiter only tries, the goroutine waits its turn. A frame the waiter leaves
// (a read request, a write with immediate finding no receive posted, one not
// yet arrived whole) stays in the socket for the goroutine.
//
// While a waiter polls a lane, the lane's socket is quiet: its SO_RCVLOWAT
// is raised, so that the frames the waiter reads itself wake no thread
// (each would wake the runtime's epoll_wait, whose thread then takes a
// core from a polling waiter: on a 2-core host a quarter of the 4 KiB
// stream's throughput). The mark comes down as soon as the waiter leaves
// a frame to the goroutine or goes to sleep, and quietHold after the last
// Wait stopped polling (quietCheck).

// lane is what both readers of a connection share.
type lane struct {
	c  net.Conn
	rc syscall.RawConn // nil when c has no descriptor (tests): the goroutine alone reads
	rd sync.Mutex
	// err is why the waiter gave the lane up (under rd); the goroutine
	// reports it.
	err error
	// quiet says the socket's SO_RCVLOWAT is quietLowat (under rd): see
	// quietLocked.
	quiet   bool
	lowatFn func(fd uintptr)
	lowat   int
	hb      [headerLen]byte   // the waiter's header buffer (under rd)
	pb      [2 * peekMax]byte // the waiter's peek buffer (under rd)
	br      bytes.Reader      // reads a frame applied from pb (under rd)
	// applied counts the bytes at the head of an inbound lane that the
	// waiter has applied and not yet dropped (under rd): it drops them
	// when a look finds nothing new, so that the drop's system call is
	// not between a request's arrival and its completion. Whoever reads
	// the socket itself drops them first (skipApplied).
	applied int

	// The functions handed to rc.Control, made once in init so that a
	// poll allocates nothing (a closure passed to an interface method
	// escapes), and their arguments and results (all under rd).
	readyFn, peekFn, peekOutFn, dropFn func(fd uintptr)
	ok                                 bool
	n, queued                          int
	errno                              syscall.Errno

	// writeFn writes wbufs with writev(2) into wn and werr: writeRaw's
	// call, made once (used by one writer at a time, see writeRaw).
	writeFn func(fd uintptr)
	wbufs   net.Buffers
	wn      int
	werr    error
	iov     [maxIovecs]unix.Iovec
}

// maxIovecs is the most buffers one writev(2) of writeRaw takes; it
// writes the rest in the next.
const maxIovecs = 64

// writev writes a prefix of wbufs to fd, a non-blocking socket, into wn
// and werr. It is a raw system call, as recvPeek is: it cannot block, and
// the thread keeps its processor.
func (l *lane) writev(fd uintptr) {
	k := 0
	for _, b := range l.wbufs {
		if k == len(l.iov) {
			break
		}
		if len(b) > 0 {
			l.iov[k].Base = unsafe.SliceData(b)
			l.iov[k].SetLen(len(b))
			k++
		}
	}
	l.wn, l.werr = 0, nil
	if k == 0 {
		return
	}
	n, _, errno := unix.RawSyscall(unix.SYS_WRITEV, fd, uintptr(unsafe.Pointer(&l.iov[0])), uintptr(k))
	clear(l.iov[:k]) // no buffer stays reachable from the lane
	if errno != 0 {
		l.werr = errno
		return
	}
	l.wn = int(n)
}

func (l *lane) init(c net.Conn) {
	l.c = c
	if sc, ok := c.(syscall.Conn); ok {
		l.rc, _ = sc.SyscallConn()
	}
	l.readyFn = func(fd uintptr) { l.ok = readable(fd) }
	l.peekFn = func(fd uintptr) {
		l.queued = 0
		l.n, l.errno = recvPeek(fd, l.pb[:])
		if l.errno != 0 || l.n < l.applied+headerLen {
			l.n = 0
			return
		}
		if l.n == len(l.pb) {
			l.queued, _ = unix.IoctlGetInt(int(fd), unix.SIOCINQ)
		}
	}
	l.writeFn = l.writev
	l.lowatFn = func(fd uintptr) {
		_, _, l.errno = unix.RawSyscall6(unix.SYS_SETSOCKOPT, fd, unix.SOL_SOCKET, unix.SO_RCVLOWAT, uintptr(unsafe.Pointer(&l.lowat)), 4, 0)
	}
	l.peekOutFn = func(fd uintptr) {
		if l.n, l.errno = recvPeek(fd, l.pb[:]); l.errno != 0 {
			l.n = 0
		}
	}
	l.dropFn = func(fd uintptr) {
		k, _, errno := unix.RawSyscall6(unix.SYS_RECVFROM, fd, 0, uintptr(l.n), unix.MSG_TRUNC|unix.MSG_DONTWAIT, 0, 0)
		l.n, l.errno = int(k), errno
	}
}

// recvPeek copies the queued bytes of fd into b without taking them and
// without waiting. Unlike unix.Recvfrom it asks for no source address, so
// it allocates nothing. It is a raw system call, as are the other calls
// that cannot block (MSG_DONTWAIT): the runtime then does not hand this
// thread's processor to another thread while the call runs, a hand-off
// that on a host with few cores costs more than the call itself
// (adaptspin.YieldCPU says the same of sched_yield).
func recvPeek(fd uintptr, b []byte) (int, syscall.Errno) {
	n, _, errno := unix.RawSyscall6(unix.SYS_RECVFROM, fd, uintptr(unsafe.Pointer(unsafe.SliceData(b))), uintptr(len(b)), unix.MSG_PEEK|unix.MSG_DONTWAIT, 0, 0)
	return int(n), errno
}

// readable reports whether a read would not block: a byte is waiting, the
// peer closed, or the connection failed.
func readable(fd uintptr) bool {
	var b [1]byte
	_, errno := recvPeek(fd, b[:])
	return errno != unix.EAGAIN && errno != unix.EINTR
}

// waitReadable sleeps in the network poller until the connection is
// readable (or closed, or failed). A read deadline set to fence a transfer
// the waiter is making wakes it too; it then waits again.
func (l *lane) waitReadable(closing <-chan struct{}) error {
	for {
		err := l.rc.Read(readable)
		if err == nil || !errors.Is(err, os.ErrDeadlineExceeded) {
			return err
		}
		select {
		case <-closing:
			return err
		default:
		}
		runtime.Gosched()
	}
}

// ready reports whether a read of the lane would not block (always, for a
// lane the goroutine alone reads).
func (l *lane) ready() bool {
	if l.rc == nil {
		return true
	}
	l.ok = true
	l.rc.Control(l.readyFn)
	return l.ok
}

// take waits until the goroutine may read: the waiter holds rd only for a
// frame already in the socket.
func (l *lane) take() {
	for !l.rd.TryLock() {
		runtime.Gosched()
	}
}

// quietLowat is the SO_RCVLOWAT of a socket a waiter polls: TCP wakes
// the socket's sleepers (the runtime's epoll_wait, and through it the
// lane's goroutine) only once so many bytes are queued, so a frame the
// waiter reads itself wakes no thread. A non-blocking peek or read still
// returns what is queued.
const quietLowat = 1 << 20

// quietLocked sets the socket's SO_RCVLOWAT: quietLowat while a waiter
// polls the lane (on), 1 otherwise, and reports whether it changed.
// Lowering it wakes the socket's sleepers if bytes are queued (the kernel
// checks on the change). Callers hold l.rd.
func (l *lane) quietLocked(on bool) bool {
	if l.rc == nil || l.quiet == on {
		return false
	}
	l.lowat = 1
	if on {
		l.lowat = quietLowat
	}
	l.errno = 0
	if err := l.rc.Control(l.lowatFn); (err != nil || l.errno != 0) && on {
		return false
	}
	// A socket that refuses the lower mark is closed or failing: its
	// goroutine wakes on that, so nothing is left quiet.
	l.quiet = on
	return true
}

// peekMax is how much of the socket the waiter looks at in one peek: a
// header and a payload of up to 4 KiB. Such a small frame is applied from
// the peeked bytes (one more copy, cheaper than the read it saves) and
// then dropped from the socket with MSG_TRUNC, which copies nothing; a
// larger payload is read from the socket straight into its region.
const peekMax = headerLen + 4096

// peek looks at the next frame without taking it: the first after the
// bytes already applied, at pb[l.applied:]. ok is false when no whole
// header is queued; whole says the frame's payload is queued too, more
// that bytes of a following frame are.
func (l *lane) peek() (h header, whole, more, ok bool, err error) {
	l.n, l.queued = 0, 0
	l.rc.Control(l.peekFn)
	n, queued := l.n, l.queued
	if n == 0 {
		return header{}, false, false, false, nil
	}
	if h, err = parseHeader(l.pb[l.applied : l.applied+headerLen]); err != nil {
		return h, false, false, false, err
	}
	queued = max(queued, n)
	end := l.applied + headerLen + int(h.length)
	return h, queued >= end, queued > end, true, nil
}

// skipApplied drops the bytes the waiter applied and left in the socket.
// Callers hold l.rd.
func (l *lane) skipApplied() error {
	if l.applied == 0 {
		return nil
	}
	err := l.drop(l.applied)
	l.applied = 0
	return err
}

// drop takes n bytes already peeked off the socket without copying them.
func (l *lane) drop(n int) error {
	for n > 0 {
		l.n, l.errno = n, 0
		l.rc.Control(l.dropFn)
		k, errno := l.n, l.errno
		switch {
		case errno == unix.EINTR || errno == unix.EAGAIN:
			runtime.Gosched()
		case errno != 0:
			return errno
		case k == 0:
			return io.ErrUnexpectedEOF
		default:
			n -= k
		}
	}
	return nil
}

// rawReader reads bytes already queued in the socket with read(2), never
// waiting in the poller (the rest of a frame the waiter took is there).
type rawReader struct{ rc syscall.RawConn }

func (r rawReader) Read(b []byte) (int, error) {
	if len(b) == 0 {
		return 0, nil
	}
	for {
		var n int
		var err error
		r.rc.Control(func(fd uintptr) { n, err = unix.Read(int(fd), b) })
		switch {
		case n > 0:
			return n, nil
		case err == nil:
			return 0, io.ErrUnexpectedEOF
		case err == unix.EAGAIN || err == unix.EINTR:
			// Queued bytes are readable; a miss here is the peer's
			// connection failing under us. Try again.
			runtime.Gosched()
		default:
			return 0, err
		}
	}
}

// inLane is an accepted connection carrying the peer's requests.
type inLane struct {
	lane
	src  srcKey
	resp *responder
	t    *transfer // the lane goroutine's
	tw   *transfer // the waiter's
	// ackTimer sends the responses the waiter held back when nobody
	// else has within ackHold (armed says it is set). When it had to,
	// the waiter holds none back for the next ackPrompt requests
	// (prompt counts them down; under rd): the caller goes idle after
	// its completions, and a sender waiting for one would wait for the
	// timer, which the runtime may run a millisecond late.
	ackTimer *time.Timer
	armed    atomic.Bool
	prompt   int
	timed    atomic.Uint64 // flushes the timer made (tests)
}

// ackHold bounds how long a response the waiter held back waits for a
// write to carry it: a caller that neither waits nor posts again still
// acknowledges within it (or the runtime's timer resolution). ackPrompt
// is how many requests are then answered at once.
const (
	ackHold   = 200 * time.Microsecond
	ackPrompt = 256
)

func newInLane(c net.Conn, src srcKey) *inLane {
	l := &inLane{src: src, resp: newResponder(c), t: &transfer{c: c}, tw: &transfer{c: c, raw: true}}
	l.init(c)
	l.ackTimer = time.AfterFunc(time.Hour, l.flushHeld)
	l.ackTimer.Stop()
	return l
}

// sendHeld sends the responses held back, if the lane is up and holds
// any, and reports whether it tried; a failed write gives the lane up.
// Callers hold l.rd.
func (l *inLane) sendHeld() bool {
	if l.err != nil || len(l.resp.pending) == 0 {
		return false
	}
	if err := l.resp.flush(); err != nil {
		l.fail(err)
	}
	return true
}

// owe arms the lane's timer for the responses the waiter holds back.
// Callers hold l.rd.
func (l *inLane) owe() {
	if len(l.resp.pending) > 0 && !l.armed.Swap(true) {
		l.ackTimer.Reset(ackHold)
	}
}

// flushHeld is the timer's: it sends what is held back, or, when another
// reader holds the lane, looks again later (that reader's answers carry
// them sooner).
func (l *inLane) flushHeld() {
	if !l.rd.TryLock() {
		l.ackTimer.Reset(ackHold)
		return
	}
	defer l.rd.Unlock()
	l.armed.Store(false)
	if l.sendHeld() {
		l.prompt = ackPrompt
		l.timed.Add(1)
	}
}

// flushOwed sends the responses the waiter held back on q's inbound
// lanes that nobody reads now: PostSend's, after its own frames.
func (q *qp) flushOwed() {
	ls := q.inLanes.Load()
	if ls == nil {
		return
	}
	for _, l := range *ls {
		if l.rc == nil || !l.rd.TryLock() {
			continue
		}
		l.sendHeld()
		l.rd.Unlock()
	}
}

// pollIn applies the frames of l that are queued whole and need no wait;
// it reports whether it applied any.
func (q *qp) pollIn(l *inLane) bool {
	if l.rc == nil || !l.rd.TryLock() {
		return false
	}
	defer l.rd.Unlock()
	if l.quietLocked(true) {
		q.armQuiet(quietHold)
	}
	did, left := q.pollInLocked(l)
	if left {
		// For the lane's goroutine, which sleeps until the socket
		// is readable by its low-water mark.
		l.quietLocked(false)
	}
	return did
}

// pollInLocked is pollIn once the waiter holds the lane (l.rd); left
// says it left a frame in the socket for the lane's goroutine.
func (q *qp) pollInLocked(l *inLane) (did, left bool) {
	// Held back by the last look (answer): out now, as nothing of the
	// caller's waits on it.
	if l.sendHeld() && l.err != nil {
		return true, false
	}
	defer l.owe()
	for range 16 {
		if l.err != nil {
			return did, false
		}
		f, whole, more, ok, _ := l.peek()
		if !ok {
			// Nothing new: what was applied leaves the socket now,
			// while nobody waits on it.
			if err := l.skipApplied(); err != nil {
				l.fail(err)
			}
			return did, false
		}
		if !whole || !q.quick(f) {
			// For the lane's goroutine, which reads the socket.
			if err := l.skipApplied(); err != nil {
				l.fail(err)
			}
			return did, true
		}
		did = true
		q.polledFrames.Add(1)
		var err error
		if end := l.applied + headerLen + int(f.length); end <= len(l.pb) {
			// Applied from the peeked bytes and left in the socket
			// (applied): the responder holds its answer back or knows
			// from more whether a request follows, so it does not look
			// at the socket.
			l.resp.peeked, l.resp.more, l.resp.hold = true, more, l.prompt == 0
			l.prompt = max(l.prompt-1, 0)
			l.br.Reset(l.pb[l.applied+headerLen : end])
			err = q.serveFrame(l, &l.br, f, l.tw)
			l.resp.peeked, l.resp.hold = false, false
			l.applied = end
			if err == nil && !more {
				// Nothing behind it yet: the caller takes its
				// completion now; the next look drops it.
				return true, false
			}
		} else if err = l.skipApplied(); err == nil {
			r := rawReader{l.rc}
			if _, err = io.ReadFull(r, l.hb[:]); err == nil {
				err = q.serveFrame(l, r, f, l.tw)
			}
		}
		if err != nil {
			l.fail(err)
			return true, false
		}
	}
	return did, false
}

// fail gives the lane up: its goroutine, woken by the close, ends it with
// err. Callers hold l.rd.
func (l *lane) fail(err error) {
	l.err = err
	l.c.Close()
}

// quick reports whether the waiter can apply f without waiting: a write,
// or a write with immediate or send finding a receive posted.
func (q *qp) quick(f header) bool {
	switch f.op {
	case opWrite:
		return true
	case opWriteImm, opSend:
		q.mu.Lock()
		ok := len(q.rq) > 0 && !q.rqTaken
		q.mu.Unlock()
		return ok
	}
	return false
}

// pollOut takes the acknowledgements queued on an outbound lane: all that
// one peek sees, dropped from the socket together.
func (q *qp) pollOut(l *outLane) bool {
	if l.rc == nil || !l.rd.TryLock() {
		return false
	}
	defer l.rd.Unlock()
	if l.err != nil {
		return false
	}
	if l.quietLocked(true) {
		q.armQuiet(quietHold)
	}
	l.n = 0
	l.rc.Control(l.peekOutFn)
	n := l.n
	took := 0
	var err error
	for ; took+headerLen <= n; took += headerLen {
		var h header
		if h, err = parseHeader(l.pb[took : took+headerLen]); err != nil || (h.op != opAck && h.op != opNak) {
			err = nil // the lane's goroutine reads it, and fails it if it must
			l.quietLocked(false)
			break
		}
		if err = q.handleResponse(l, h); err != nil {
			took += headerLen
			break
		}
	}
	if took > 0 {
		if derr := l.drop(took); derr != nil && err == nil {
			err = derr
		}
	}
	if err != nil {
		l.fail(err)
	}
	return took > 0
}

// poll is the waiter's turn at the inbound lanes of q, and at its outbound
// lanes when out is set.
func (q *qp) poll(out bool) bool {
	did := false
	if ls := q.inLanes.Load(); ls != nil {
		for _, l := range *ls {
			if q.pollIn(l) {
				did = true
			}
		}
	}
	if ls := q.outLanes.Load(); out && ls != nil {
		for _, l := range *ls {
			if q.pollOut(l) {
				did = true
			}
		}
	}
	return did
}

// eachLane calls f with each of q's lanes, inbound then outbound.
func (q *qp) eachLane(f func(*lane)) {
	if ls := q.inLanes.Load(); ls != nil {
		for _, l := range *ls {
			f(&l.lane)
		}
	}
	if ls := q.outLanes.Load(); ls != nil {
		for _, l := range *ls {
			f(&l.lane)
		}
	}
}

// unquiet lowers the low-water mark of q's lanes that nobody reads now:
// a waiter that stops polling leaves them to their goroutines. It reports
// whether a lane stayed quiet (another reader held it).
func (q *qp) unquiet() bool {
	held := false
	q.eachLane(func(l *lane) {
		if l.rc == nil {
			return
		}
		if !l.rd.TryLock() {
			held = true
			return
		}
		l.quietLocked(false)
		l.rd.Unlock()
	})
	return held
}

// quietHold is how long after the last Wait of a queue pair's queues
// stopped polling its lanes stay quiet: a caller that waits again within
// it (a ping-pong, a stream) finds them quiet, and a frame that arrives
// after it wakes the lane's goroutine at once; one that arrives within
// it, with nobody polling, waits for the hold's end (or the runtime's
// timer resolution).
const quietHold = 200 * time.Microsecond

// armQuiet starts q's quiet timer to run in d, if it is not running (a
// lane just went quiet) and q is not closed.
func (q *qp) armQuiet(d time.Duration) {
	if q.quietArmed.Swap(true) {
		return
	}
	q.quietMu.Lock()
	defer q.quietMu.Unlock()
	switch {
	case q.quietDone:
	case q.quietTimer == nil:
		q.quietTimer = time.AfterFunc(d, q.quietCheck)
	default:
		q.quietTimer.Reset(d)
	}
}

// quietCheck is the quiet timer's: once no Wait of q's queues polls and
// the last stopped quietHold ago, it lowers the lanes' marks; until then,
// or while a lane is held, it looks again later. A lane that goes quiet
// after it disarmed arms the timer itself.
func (q *qp) quietCheck() {
	q.quietArmed.Store(false)
	now := time.Now().UnixNano()
	wait := time.Duration(0)
	for _, c := range [2]*cq{q.scq, q.rcq} {
		if c.polling.Load() > 0 {
			wait = quietHold
			break
		}
		wait = max(wait, time.Duration(c.polled.Load()+int64(quietHold)-now))
	}
	if wait <= 0 && !q.unquiet() {
		return
	}
	q.armQuiet(max(wait, 10*time.Microsecond))
}

// setInLanes replaces the snapshot of inbound lanes the waiter polls.
// Callers hold q.mu.
func (q *qp) setInLanesLocked() {
	ls := make([]*inLane, 0, len(q.in))
	for _, l := range q.in {
		ls = append(ls, l)
	}
	q.inLanes.Store(&ls)
}

// writeRaw writes bufs to l with writev(2) without waiting; it returns
// what is left when the socket took only part. One goroutine at a time
// calls it on a lane (the queue pair's sending flag says which).
func (l *lane) writeRaw(bufs net.Buffers) (net.Buffers, error) {
	defer func() { l.wbufs = nil }()
	for len(bufs) > 0 {
		l.wbufs = bufs
		cerr := l.rc.Control(l.writeFn)
		n, err := l.wn, l.werr
		if cerr != nil {
			return bufs, cerr
		}
		if err == unix.EINTR {
			continue
		}
		if err == unix.EAGAIN {
			return bufs, nil
		}
		if err != nil {
			return bufs, err
		}
		bufs = consumed(bufs, n)
		if n == 0 {
			return bufs, nil
		}
	}
	return nil, nil
}

// consumed drops the first n bytes of bufs.
func consumed(bufs net.Buffers, n int) net.Buffers {
	for len(bufs) > 0 && n >= len(bufs[0]) {
		n -= len(bufs[0])
		bufs = bufs[1:]
	}
	if n > 0 {
		bufs[0] = bufs[0][n:]
	}
	return bufs
}

package onnode

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gdrlink/gdrlink/internal/offheap"
	"github.com/gdrlink/gdrlink/verbsio"
)

// Bounds on waits that a peer could otherwise stretch.
const (
	fdRequestTimeout = 5 * time.Second
	ringFullTimeout  = 30 * time.Second
	maxBacklog       = 64 << 20 // bytes of SEND payload that may wait for receives
)

// postedRecv is a receive buffer waiting for a SEND or a write with immediate.
// Its first SGE is kept in place, so that posting the usual receive of one
// SGE allocates nothing; more are in rest.
type postedRecv struct {
	wrid uint64
	nsg  int
	sg0  verbsio.SGE
	rest []verbsio.SGE
}

func newPostedRecv(w verbsio.RecvWR) postedRecv {
	r := postedRecv{wrid: w.WRID, nsg: len(w.SG)}
	if len(w.SG) > 0 {
		r.sg0 = w.SG[0]
	}
	if len(w.SG) > 1 {
		r.rest = append([]verbsio.SGE(nil), w.SG[1:]...)
	}
	return r
}

// sge returns the receive's i-th SGE (i < nsg).
func (r *postedRecv) sge(i int) verbsio.SGE {
	if i == 0 {
		return r.sg0
	}
	return r.rest[i-1]
}

// popFront drops the first element of the queue s. A short queue moves its
// elements down instead of slicing past the first, so that its array keeps
// its room and a queue that stays short (a ping-pong) allocates nothing.
func popFront[T any](s []T) []T {
	var zero T
	if len(s) <= 8 {
		copy(s, s[1:])
		s[len(s)-1] = zero
		return s[:len(s)-1]
	}
	s[0] = zero
	return s[1:]
}

// arrival is a SEND or a write with immediate that no receive has taken yet.
type arrival struct {
	kind     uint8
	seq      uint32 // a SEND's sequence number, acknowledged to the sender
	imm      uint32
	n        uint32
	data     []byte
	complete bool
}

// fileMap is a peer's file-backed region mapped here.
type fileMap struct {
	mem   []byte
	delta int // offset of the region's first byte in mem
}

type qp struct {
	pd             *pd
	sendCQ, recvCQ *cq
	maxSend        int
	maxRecv        int
	maxSGE         int
	maxInline      int
	mech           Mechanism
	name           string
	host           string
	ln             *net.UnixListener

	// The ring this queue pair receives on, and the eventfd peers signal.
	inFD  int
	inMem []byte
	in    *ring
	efd   int
	efile *os.File
	// The write counters of the peer of this queue pair (for this
	// protection domain's regions); the connection's socket, which fence
	// closes.
	ctrFD   int
	ctrMem  []byte
	sock    atomic.Pointer[net.UnixConn]
	fenced  atomic.Bool
	fenceMu sync.Mutex

	state   atomic.Uint32 // verbsio.QPState
	lastErr atomic.Pointer[error]
	lost    atomic.Bool
	// lossReported: a send work request has completed with the peer's loss.
	lossReported atomic.Bool
	lostCh       chan struct{}
	lostOnce     sync.Once
	done         chan struct{}
	wg           sync.WaitGroup

	// Set by Connect.
	conn        *net.UnixConn
	writeMu     sync.Mutex // socket writes
	peerPID     int
	peerTok     uint64 // qpToken of the peer queue pair: grants to us carry it
	pidOverride int    // tests: pretend the peer is this process id
	out         *ring
	peerEFD     int
	peerTable   []byte
	peerCtr     []byte
	vmErr       error

	sendMu sync.Mutex // sends, the outgoing ring's tail, file maps
	tail   uint64
	// head is the peer's offHead as last read: the peer only moves it
	// forward, so the room it leaves is at least what it says, and the
	// ring's shared line is read again only when that room runs out.
	head     uint64
	fileMaps map[uint32]*fileMap
	fdResp   chan fdAnswer
	sendSeq  uint32

	compMu  sync.Mutex // pending send completions
	pending []pendingComp
	// lastAcked is the peer's offAcked last read (under compMu); waiting
	// counts the SENDs in pending that wait for their acknowledgement.
	lastAcked uint32
	waiting   atomic.Int32
	// signals and sockAcks count the eventfd signals sent to the peer and
	// the acknowledgements written to its socket (the tests' view of the
	// wake-ups a SEND costs).
	signals, sockAcks atomic.Uint64

	acks []uint32 // receiver side: SENDs to acknowledge (seq, top bit: failed)

	consMu   sync.Mutex // the incoming ring, receives, arrivals
	recvs    []postedRecv
	arrivals []arrival
	backlog  int
	compBuf  []verbsio.Completion
	// direct is where a polling Wait takes this queue pair's receive
	// completions without the completion queue (drainIfReady); directN
	// counts those put there.
	direct    []verbsio.Completion
	directN   int
	closeOnce sync.Once
	// connMu is held by Connect from start to end, so that Close (which
	// ends a Connect in progress through done) releases nothing a
	// handshake still uses.
	connMu sync.Mutex
}

// pendingComp is a send completion held back to keep completions in post
// order behind a SEND that the peer has not acknowledged yet.
type pendingComp struct {
	c        verbsio.Completion
	signaled bool
	waiting  bool // a SEND waiting for its acknowledgement
	seq      uint32
}

type fdAnswer struct {
	rkey uint32
	fd   int
}

func newQP(p *pd, cfg verbsio.QPConfig) (*qp, error) {
	scq, ok1 := cfg.SendCQ.(*cq)
	rcq, ok2 := cfg.RecvCQ.(*cq)
	if !ok1 || !ok2 || scq == nil || rcq == nil {
		return nil, fmt.Errorf("%w: onnode queue pairs need completion queues of the onnode device", verbsio.ErrBadConfig)
	}
	depth := p.dev.cfg.QueueDepth
	q := &qp{pd: p, sendCQ: scq, recvCQ: rcq, maxSend: cfg.MaxSendWR, maxRecv: cfg.MaxRecvWR, maxSGE: cfg.MaxSGE,
		maxInline: cfg.MaxInline, mech: p.dev.opts.Mechanism, host: p.dev.host, done: make(chan struct{}), lostCh: make(chan struct{}), inFD: -1, efd: -1, peerEFD: -1, ctrFD: -1,
		fileMaps: map[uint32]*fileMap{}, fdResp: make(chan fdAnswer, 1)}
	if q.maxSend == 0 {
		q.maxSend = depth
	}
	if q.maxRecv == 0 {
		q.maxRecv = depth
	}
	if q.maxSGE == 0 {
		q.maxSGE = 1
	}
	switch {
	case q.maxSend < 1 || q.maxSend > maxQPDepth || q.maxRecv < 1 || q.maxRecv > maxQPDepth:
		return nil, fmt.Errorf("%w: onnode queue depths %d/%d, want 1..%d", verbsio.ErrBadConfig, q.maxSend, q.maxRecv, maxQPDepth)
	case q.maxSGE < 1 || q.maxSGE > maxSGE:
		return nil, fmt.Errorf("%w: onnode MaxSGE %d, want 1..%d", verbsio.ErrBadConfig, q.maxSGE, maxSGE)
	case q.maxInline < 0 || q.maxInline > maxInline:
		return nil, fmt.Errorf("%w: onnode MaxInline %d, want 0..%d", verbsio.ErrBadConfig, q.maxInline, maxInline)
	}
	if err := p.addQP(); err != nil {
		return nil, err
	}
	if err := scq.ref(); err != nil {
		p.dropQP()
		return nil, err
	}
	if err := rcq.ref(); err != nil {
		scq.unref()
		p.dropQP()
		return nil, err
	}
	if err := q.setup(); err != nil {
		q.release()
		return nil, fmt.Errorf("%w: onnode: %w", verbsio.ErrNotSupported, err)
	}
	return q, nil
}

func (q *qp) setup() error {
	var rnd [12]byte
	if _, err := rand.Read(rnd[:]); err != nil {
		return err
	}
	q.name = fmt.Sprintf("gdrlink-onnode-%d-%s", os.Getpid(), hex.EncodeToString(rnd[:]))
	ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: "@" + q.name, Net: "unixpacket"})
	if err != nil {
		return fmt.Errorf("listening on @%s: %w", q.name, err)
	}
	q.ln = ln
	if q.inFD, q.inMem, err = newMemfd("gdrlink-onnode-ring", ringFile, sealsShared); err != nil {
		return err
	}
	q.in = newRing(q.inMem)
	if q.efd, err = unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK); err != nil {
		return fmt.Errorf("eventfd: %w", err)
	}
	q.efile = os.NewFile(uintptr(q.efd), "gdrlink-onnode-eventfd")
	if q.ctrFD, q.ctrMem, err = newMemfd("gdrlink-onnode-mrcounters", counterBytes, sealsShared); err != nil {
		return err
	}
	q.pd.addCounters(q)
	return nil
}

// fence cuts the peer off after it failed to finish a write it announced
// (pd.deregister): the queue pair fails with err, its connection closes
// (the peer's queue pair sees its peer gone and starts no other copy; the
// files the peer mapped cannot be taken back, see the package doc), and
// its counters are no longer read. It never waits on the peer.
func (q *qp) fence(err error) {
	q.fenceMu.Lock()
	defer q.fenceMu.Unlock()
	if q.fenced.Swap(true) {
		return
	}
	q.lastErr.CompareAndSwap(nil, &err)
	q.lost.Store(true)
	q.lostOnce.Do(func() { close(q.lostCh) })
	if c := q.sock.Load(); c != nil {
		// A write to the socket blocked on the stopped peer ends with
		// this, so consMu below is not held for long.
		c.Close()
	}
	q.consMu.Lock()
	q.failLocked(verbsio.StatusRetryExceeded, err)
	q.consMu.Unlock()
	q.sendCQ.wake()
}

// release frees what setup and Connect made; the queue pair is closed.
func (q *qp) release() {
	if q.ln != nil {
		q.ln.Close()
	}
	if q.conn != nil {
		q.conn.Close()
	}
	if q.efile != nil {
		q.efile.Close()
	} else {
		closeFD(q.efd)
	}
	q.wg.Wait()
	for k, m := range q.fileMaps {
		unix.Munmap(m.mem)
		delete(q.fileMaps, k)
	}
	closeFD(q.peerEFD)
	q.detachPeer()
	q.pd.revokeGrantsOf(q)
	q.pd.dropCounters(q)
	if q.ctrMem != nil {
		unix.Munmap(q.ctrMem)
		q.ctrMem = nil
	}
	closeFD(q.ctrFD)
	if q.inMem != nil {
		unix.Munmap(q.inMem)
		q.inMem, q.in = nil, nil
	}
	closeFD(q.inFD)
	q.sendCQ.unref()
	q.recvCQ.unref()
	q.pd.dropQP()
}

// Endpoint implements verbsio.QueuePair.
func (q *qp) Endpoint() verbsio.Endpoint {
	e := endpointData{PID: uint32(os.Getpid()), Name: q.name}
	return verbsio.Endpoint{Provider: Name, Host: q.host, Data: e.Append(nil)}
}

// State implements verbsio.QueuePair.
func (q *qp) State() verbsio.QPState { return verbsio.QPState(q.state.Load()) }

// lastError returns the error that moved a queue pair of this provider to the
// error state (it wraps the verbsio sentinel and, for refused cross-process
// copies, ErrCrossMemory and the errno), or nil.
func lastError(qpair verbsio.QueuePair) error {
	q, ok := qpair.(*qp)
	if !ok {
		return nil
	}
	if p := q.lastErr.Load(); p != nil {
		return *p
	}
	return nil
}

// Connect implements verbsio.QueuePair. Both sides call it with the other's
// endpoint; the one with the smaller socket name dials, the other accepts.
func (q *qp) Connect(ctx context.Context, remote verbsio.Endpoint) error {
	q.connMu.Lock()
	defer q.connMu.Unlock()
	select {
	case <-q.done:
		return fmt.Errorf("%w: Connect of a closed queue pair", verbsio.ErrQPState)
	default:
	}
	// Close ends the attempt: it closes done, and this context with it.
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	attempt := ctx // ctx is narrowed below; the watcher keeps its own
	go func() {
		select {
		case <-q.done:
			cancel()
		case <-attempt.Done():
		}
	}()
	if remote.Provider != Name {
		return fmt.Errorf("%w: onnode cannot connect to a %q endpoint", verbsio.ErrBadConfig, remote.Provider)
	}
	if remote.Host != q.host {
		return fmt.Errorf("%w: onnode peer is on host %q, this is %q", verbsio.ErrNotSupported, remote.Host, q.host)
	}
	ed, err := parseEndpointData(remote.Data)
	if err != nil {
		return err
	}
	if ed.Name == q.name {
		return fmt.Errorf("%w: onnode queue pair connected to itself", verbsio.ErrBadConfig)
	}
	if !q.state.CompareAndSwap(uint32(verbsio.QPInit), uint32(verbsio.QPInit)) || q.conn != nil {
		return fmt.Errorf("%w: Connect in state %s", verbsio.ErrQPState, q.State())
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, q.pd.dev.cfg.ConnectTimeout)
		defer cancel()
	}
	conn, h, fds, err := q.establish(ctx, ed)
	if err != nil {
		return err
	}
	if err := q.attachPeer(conn, h, fds); err != nil {
		conn.Close()
		return err
	}
	q.sock.Store(conn)
	if q.fenced.Load() {
		// Fenced during the handshake (the peer had our counters).
		conn.Close()
		return fmt.Errorf("%w: onnode queue pair fenced while connecting: %w", verbsio.ErrQPState, lastError(q))
	}
	q.conn = conn
	// Nobody else may connect any more: the name goes.
	q.ln.Close()
	q.ln = nil
	q.recvCQ.qps.Add(q)
	if q.recvCQ.sleepers.Load() > 0 {
		q.setSleep(1)
	}
	if q.recvCQ.pollers.Load() > 0 {
		q.setPoll(1)
	}
	// This side reads its acknowledgements from the peer's ring.
	atomic.StoreUint32(u32(q.out.mem, offFeatures), featAckWord)
	q.sendCQ.sendQPs.Add(q)
	if !q.state.CompareAndSwap(uint32(verbsio.QPInit), uint32(verbsio.QPReady)) {
		// Fenced (or closed) just now: the error state stays.
		return fmt.Errorf("%w: onnode queue pair failed while connecting: %w", verbsio.ErrQPState, lastError(q))
	}
	if q.sendCQ.sleepers.Load() > 0 {
		q.setAckWake(1)
	}
	q.wg.Add(2)
	go q.readLoop()
	go q.progressLoop()
	return nil
}

// attachPeer maps the peer's ring, region table (read-only) and write
// counters, and probes whether this process may write into the peer's
// memory. fds are the hello's: ring, eventfd, table, counters.
func (q *qp) attachPeer(conn *net.UnixConn, h hello, fds []int) error {
	defer func() {
		for i, fd := range fds {
			if i != 1 || q.peerEFD != fd {
				unix.Close(fd)
			}
		}
	}()
	ok := false
	defer func() {
		if !ok {
			q.detachPeer()
		}
	}()
	for _, f := range []struct {
		fd   int
		what string
		size int64
	}{{fds[0], "ring", ringFile}, {fds[2], "region table", tableBytes}, {fds[3], "write counters", counterBytes}} {
		if err := checkSealed(f.fd, f.what); err != nil {
			return err
		}
		var st unix.Stat_t
		if err := unix.Fstat(f.fd, &st); err != nil || st.Size < f.size {
			return fmt.Errorf("%w: onnode peer %s of %d bytes, want %d", verbsio.ErrBadFrame, f.what, st.Size, f.size)
		}
	}
	ringMem, err := unix.Mmap(fds[0], 0, ringFile, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return fmt.Errorf("%w: onnode mapping peer ring: %w", verbsio.ErrNotSupported, err)
	}
	q.out = newRing(ringMem)
	q.tail = load64(ringMem, offTail)
	q.head = load64(ringMem, offHead)
	if q.peerTable, err = unix.Mmap(fds[2], 0, tableBytes, unix.PROT_READ, unix.MAP_SHARED); err != nil {
		return fmt.Errorf("%w: onnode mapping peer region table: %w", verbsio.ErrNotSupported, err)
	}
	if q.peerCtr, err = unix.Mmap(fds[3], 0, counterBytes, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED); err != nil {
		return fmt.Errorf("%w: onnode mapping peer counters: %w", verbsio.ErrNotSupported, err)
	}
	q.peerEFD = fds[1]
	q.peerPID = int(h.PID)
	q.peerTok = qpToken(h.Name)
	if q.pidOverride != 0 {
		q.peerPID = q.pidOverride
	}
	var word [8]byte
	if err := q.vmCopy(true, [][]byte{word[:]}, h.Probe, 8); err != nil {
		q.vmErr = err
		if q.mech == MechVM {
			return err
		}
	}
	ok = true
	return nil
}

// detachPeer undoes attachPeer.
func (q *qp) detachPeer() {
	if q.out != nil {
		unix.Munmap(q.out.mem)
		q.out = nil
	}
	for _, m := range []*[]byte{&q.peerTable, &q.peerCtr} {
		if *m != nil {
			unix.Munmap(*m)
			*m = nil
		}
	}
	q.peerEFD = -1
	q.vmErr = nil
}

// vmCopy moves n bytes between local (in order) and the peer's addr with
// process_vm_writev (write) or process_vm_readv.
func (q *qp) vmCopy(write bool, local [][]byte, addr uint64, n int) error {
	var arr [maxSGE + 1]unix.Iovec
	done := 0
	for done < n {
		iov, skip := arr[:0], done
		for _, b := range local {
			if skip >= len(b) {
				skip -= len(b)
				continue
			}
			b, skip = b[skip:], 0
			v := unix.Iovec{Base: &b[0]}
			v.SetLen(len(b))
			iov = append(iov, v)
		}
		rv := []unix.RemoteIovec{{Base: uintptr(addr) + uintptr(done), Len: n - done}}
		var m int
		var err error
		op := "process_vm_readv"
		if write {
			op = "process_vm_writev"
			m, err = unix.ProcessVMWritev(q.peerPID, iov, rv, 0)
		} else {
			m, err = unix.ProcessVMReadv(q.peerPID, iov, rv, 0)
		}
		if err != nil {
			return fmt.Errorf("%w: %s pid %d at %#x+%d: %w", ErrCrossMemory, op, q.peerPID, addr, n, err)
		}
		if m <= 0 {
			return fmt.Errorf("%w: %s pid %d moved nothing", ErrCrossMemory, op, q.peerPID)
		}
		done += m
	}
	return nil
}

func (q *qp) setSleep(v uint32) {
	q.consMu.Lock()
	if q.State() != verbsio.QPClosed && q.in != nil {
		atomic.StoreUint32(u32(q.in.mem, offSleep), v)
	}
	q.consMu.Unlock()
}

// readLoop serves the control socket: requests for files of regions, and
// answers to ours. Its end is the peer's end.
func (q *qp) readLoop() {
	defer q.wg.Done()
	buf := make([]byte, 64)
	oob := make([]byte, unix.CmsgSpace(4*4))
	for {
		n, oobn, _, _, err := q.conn.ReadMsgUnix(buf, oob)
		fds := parseRights(oob[:oobn])
		if err == nil && n == 0 {
			err = errors.New("connection closed")
		}
		if err != nil {
			for _, fd := range fds {
				unix.Close(fd)
			}
			q.peerGone(err)
			return
		}
		c, perr := parseControl(buf[:n])
		switch {
		case perr == nil && c.Kind == msgFDReq && len(fds) == 0:
			fd := q.pd.fileOf(c.RKey)
			resp := control{Kind: msgFDResp, RKey: c.RKey, OK: fd >= 0}
			var rights []byte
			if fd >= 0 {
				rights = unix.UnixRights(fd)
			}
			q.writeMu.Lock()
			_, _, werr := q.conn.WriteMsgUnix(resp.Append(nil), rights, nil)
			q.writeMu.Unlock()
			if werr != nil {
				q.peerGone(werr)
				return
			}
		case perr == nil && c.Kind == msgAck && len(fds) == 0:
			st := verbsio.StatusSuccess
			if !c.OK {
				st = verbsio.StatusRemoteOperation
			}
			q.acked(c.RKey, st)
		case perr == nil && c.Kind == msgFDResp && len(fds) == 1 == c.OK:
			a := fdAnswer{rkey: c.RKey, fd: -1}
			if c.OK {
				a.fd = fds[0]
			}
			select {
			case q.fdResp <- a:
			default:
				closeFD(a.fd)
			}
		default:
			for _, fd := range fds {
				unix.Close(fd)
			}
			if perr == nil {
				perr = fmt.Errorf("%w: onnode control message kind %d with %d fds", verbsio.ErrBadFrame, c.Kind, len(fds))
			}
			q.peerGone(perr)
			return
		}
	}
}

// progressLoop drains the incoming ring when a sender signals: a sleeping
// Wait, or a sender waiting for room.
func (q *qp) progressLoop() {
	defer q.wg.Done()
	var b [8]byte
	for {
		if _, err := q.efile.Read(b[:]); err != nil {
			return
		}
		q.consMu.Lock()
		q.drainLocked()
		q.consMu.Unlock()
	}
}

// peerGone handles the end of the control connection.
func (q *qp) peerGone(err error) {
	select {
	case <-q.done:
		return // our own Close
	default:
	}
	q.lost.Store(true)
	q.lostOnce.Do(func() { close(q.lostCh) })
	q.consMu.Lock()
	q.drainLocked()
	q.failLocked(verbsio.StatusRetryExceeded, fmt.Errorf("%w: onnode peer pid %d: %w", verbsio.ErrPeerLost, q.peerPID, err))
	q.consMu.Unlock()
	q.sendCQ.wake()
}

// failLocked moves the queue pair to the error state (once) and completes
// its posted receives with st. The caller holds consMu.
func (q *qp) failLocked(st verbsio.Status, err error) {
	for {
		s := q.state.Load()
		if s == uint32(verbsio.QPClosed) {
			return
		}
		if s == uint32(verbsio.QPError) || q.state.CompareAndSwap(s, uint32(verbsio.QPError)) {
			break
		}
	}
	q.lastErr.CompareAndSwap(nil, &err)
	pst := st
	if pst == verbsio.StatusLocalLength {
		pst = verbsio.StatusFlushed
	}
	if q.flushPending(pst) && st == verbsio.StatusRetryExceeded {
		q.lossReported.Store(true)
	}
	cs := q.compBuf[:0]
	for _, r := range q.recvs {
		cs = append(cs, verbsio.Completion{WRID: r.wrid, Status: st, Op: verbsio.OpRecv, QP: q})
	}
	q.recvs = q.recvs[:0]
	q.arrivals, q.backlog = nil, 0
	if len(cs) > 0 {
		q.recvCQ.push(cs...)
	}
	q.compBuf = cs[:0]
}

// drainIfReady drains the incoming ring if it holds records and nobody else
// is draining it; it reports whether it did. The completions go into out
// (n of them) while the completion queue holds none, since none of this
// queue pair's can then be ahead of them; the rest to the queue.
func (q *qp) drainIfReady(out []verbsio.Completion) (n int, drained bool) {
	if !q.consMu.TryLock() {
		return 0, false
	}
	defer q.consMu.Unlock()
	if q.State() != verbsio.QPReady || load64(q.in.mem, offHead) == atomic.LoadUint64(u64(q.in.mem, offTail)) {
		return 0, false
	}
	q.direct, q.directN = out, 0
	q.drainLocked()
	n, q.direct = q.directN, nil
	return n, true
}

// ringReady says whether a record is published in q's notification
// ring (false while another goroutine drains it).
func (q *qp) ringReady() bool {
	if !q.consMu.TryLock() {
		return false
	}
	defer q.consMu.Unlock()
	return q.State() == verbsio.QPReady && load64(q.in.mem, offHead) != atomic.LoadUint64(u64(q.in.mem, offTail))
}

// acksReady says whether the peer acknowledged a SEND that waits for it
// since pollAcks last looked (false while another goroutine looks).
func (q *qp) acksReady() bool {
	if q.waiting.Load() == 0 || !q.compMu.TryLock() {
		return false
	}
	defer q.compMu.Unlock()
	if s := q.State(); s != verbsio.QPReady && s != verbsio.QPError {
		return false
	}
	return atomic.LoadUint32(u32(q.out.mem, offAcked)) != q.lastAcked
}

// drainLocked consumes every published record. The caller holds consMu.
func (q *qp) drainLocked() {
	r := q.in
	if r == nil || q.State() == verbsio.QPClosed {
		return
	}
	head := load64(r.mem, offHead)
	tail := atomic.LoadUint64(u64(r.mem, offTail))
	if tail-head > ringData {
		q.failLocked(verbsio.StatusRemoteOperation, fmt.Errorf("%w: onnode ring tail %d head %d", verbsio.ErrBadFrame, tail, head))
		return
	}
	cs := q.compBuf[:0]
	for head != tail {
		off := head & (ringData - 1)
		avail := min(tail-head, ringData-off)
		rec, err := parseRecord(r.data[off : off+avail])
		if err != nil {
			q.compBuf = cs
			q.flushComps()
			q.failLocked(verbsio.StatusRemoteOperation, err)
			return
		}
		cs = q.handleLocked(rec, cs)
		head += uint64(rec.Size)
		store64(r.mem, offHead, head)
		if q.State() == verbsio.QPError {
			break
		}
	}
	q.compBuf = cs
	q.flushComps()
}

func (q *qp) flushComps() {
	if cs := q.compBuf; len(cs) > 0 {
		if len(q.direct) > q.directN && !q.recvCQ.pending() {
			k := copy(q.direct[q.directN:], cs)
			q.directN += k
			cs = cs[k:]
		}
		if len(cs) > 0 {
			q.recvCQ.push(cs...)
		}
	}
	q.compBuf = q.compBuf[:0]
	if len(q.acks) == 0 {
		return
	}
	acks := q.acks
	if q.in != nil && atomic.LoadUint32(u32(q.in.mem, offFeatures))&featAckWord != 0 {
		// The peer reads offAcked: the last SEND taken acknowledges
		// those before it, and goes through the socket only to wake a
		// peer whose send queue sleeps. A refused SEND goes through the
		// socket as before, with those before it.
		last, failed := acks[len(acks)-1], false
		for _, a := range acks {
			failed = failed || a&(1<<31) != 0
		}
		if !failed {
			atomic.StoreUint32(u32(q.in.mem, offAcked), last)
			acks = acks[:0]
			if atomic.LoadUint32(u32(q.in.mem, offAckWake)) != 0 {
				acks = append(acks, last)
			}
		}
	}
	for _, a := range acks {
		m := control{Kind: msgAck, RKey: a &^ (1 << 31), OK: a&(1<<31) == 0}
		var b [controlLen]byte
		q.writeMu.Lock()
		_, _, err := q.conn.WriteMsgUnix(m.Append(b[:0]), nil, nil)
		q.writeMu.Unlock()
		if err != nil {
			break // the peer is gone; readLoop sees it
		}
		q.sockAcks.Add(1)
	}
	q.acks = q.acks[:0]
}

// enqueue adds send completions in post order: they reach the completion
// queue at once unless a SEND before them still waits for its
// acknowledgement.
func (q *qp) enqueue(ps []pendingComp) {
	if len(ps) == 0 {
		return
	}
	q.compMu.Lock()
	q.pending = append(q.pending, ps...)
	var few [4]verbsio.Completion // push copies them
	out := q.releaseLocked(few[:0])
	q.compMu.Unlock()
	if len(out) > 0 {
		q.sendCQ.push(out...)
	}
}

// releaseLocked moves the completions at the head of pending that no longer
// wait to out. The caller holds compMu.
func (q *qp) releaseLocked(out []verbsio.Completion) []verbsio.Completion {
	i := 0
	for ; i < len(q.pending) && !q.pending[i].waiting; i++ {
		if p := q.pending[i]; p.signaled || p.c.Status != verbsio.StatusSuccess {
			out = append(out, p.c)
		}
	}
	q.pending = append(q.pending[:0], q.pending[i:]...)
	return out
}

// acked completes the SEND with sequence number seq, and those before it
// when it was taken (SENDs are taken in order, and the first refused one
// fails the queue pair); a failed one moves the queue pair to the error
// state.
func (q *qp) acked(seq uint32, st verbsio.Status) {
	if st == verbsio.StatusSuccess {
		q.compMu.Lock()
		q.resolveUpToLocked(seq)
		q.compMu.Unlock()
		return
	}
	q.resolve(seq, st)
	if st != verbsio.StatusSuccess {
		q.consMu.Lock()
		q.failLocked(verbsio.StatusFlushed, fmt.Errorf("%w: the peer could not take SEND %d (receive too small or failed)", verbsio.ErrRemoteOperation, seq))
		q.consMu.Unlock()
	}
}

// resolve gives the waiting SEND seq its status and releases what can go.
func (q *qp) resolve(seq uint32, st verbsio.Status) {
	q.compMu.Lock()
	for i := range q.pending {
		if p := &q.pending[i]; p.waiting && p.seq == seq {
			p.waiting, p.c.Status = false, st
			q.waiting.Add(-1)
			break
		}
	}
	var few [4]verbsio.Completion // push copies them
	out := q.releaseLocked(few[:0])
	q.compMu.Unlock()
	if len(out) > 0 {
		q.sendCQ.push(out...)
	}
}

// resolveUpToLocked completes every waiting SEND up to sequence number seq
// (in the 31-bit sequence space, where fewer than 2^30 are ever in
// flight) as taken, and pushes what can go. The caller holds compMu.
func (q *qp) resolveUpToLocked(seq uint32) {
	const mask = 1<<31 - 1
	took := false
	for i := range q.pending {
		if p := &q.pending[i]; p.waiting && (seq-p.seq)&mask < 1<<30 {
			p.waiting = false
			q.waiting.Add(-1)
			took = true
		}
	}
	if !took {
		return
	}
	var few [4]verbsio.Completion // push copies them
	if out := q.releaseLocked(few[:0]); len(out) > 0 {
		q.sendCQ.push(out...)
	}
}

// pollAcks reads the acknowledgements the peer wrote into its ring
// (offAcked) and completes the SENDs they cover; it reports whether it
// did. It is the send queue's poll: cheap when no SEND waits.
func (q *qp) pollAcks() bool {
	if q.waiting.Load() == 0 {
		return false
	}
	q.compMu.Lock()
	defer q.compMu.Unlock()
	if s := q.State(); s != verbsio.QPReady && s != verbsio.QPError {
		return false // not connected yet, or closed: no ring mapped
	}
	a := atomic.LoadUint32(u32(q.out.mem, offAcked))
	if a == q.lastAcked {
		return false
	}
	q.lastAcked = a
	q.resolveUpToLocked(a)
	return true
}

// setAckWake says in the peer's ring whether a Wait of this queue pair's
// send queue sleeps: the peer then acknowledges SENDs through the socket
// too, which wakes it.
func (q *qp) setAckWake(v uint32) {
	q.compMu.Lock()
	if s := q.State(); s == verbsio.QPReady || s == verbsio.QPError {
		atomic.StoreUint32(u32(q.out.mem, offAckWake), v)
	}
	q.compMu.Unlock()
}

// setPoll says in this queue pair's ring whether a Wait of its receive
// queue polls. Turning it off, it takes what a sender did not signal
// meanwhile (the sender publishes, then reads the flag; this clears the
// flag, then reads the tail).
func (q *qp) setPoll(v uint32) {
	q.consMu.Lock()
	if q.State() == verbsio.QPClosed || q.in == nil {
		q.consMu.Unlock()
		return
	}
	atomic.StoreUint32(u32(q.in.mem, offPoll), v)
	if v == 0 && q.State() == verbsio.QPReady && load64(q.in.mem, offHead) != atomic.LoadUint64(u64(q.in.mem, offTail)) {
		q.drainLocked()
	}
	q.consMu.Unlock()
}

// flushPending completes every SEND still waiting with st and releases all;
// it reports whether any was waiting.
func (q *qp) flushPending(st verbsio.Status) (waited bool) {
	q.compMu.Lock()
	for i := range q.pending {
		if p := &q.pending[i]; p.waiting {
			p.waiting, p.c.Status, waited = false, st, true
			q.waiting.Add(-1)
		}
	}
	var few [4]verbsio.Completion // push copies them
	out := q.releaseLocked(few[:0])
	q.compMu.Unlock()
	if len(out) > 0 {
		q.sendCQ.push(out...)
	}
	return waited
}

// handleLocked takes one record: it completes a receive or keeps an arrival.
func (q *qp) handleLocked(rec record, cs []verbsio.Completion) []verbsio.Completion {
	switch rec.Kind {
	case recPad:
		return cs
	case recError:
		q.compBuf = cs
		q.flushComps()
		q.failLocked(verbsio.StatusFlushed, fmt.Errorf("%w: onnode peer queue pair failed (%s)", verbsio.ErrFlushed, verbsio.Status(rec.Imm)))
		return q.compBuf
	case recWriteImm:
		q.pd.immArrived(q, rec.RKey)
		if len(q.arrivals) == 0 && len(q.recvs) > 0 {
			r := q.recvs[0]
			q.recvs = popFront(q.recvs)
			return append(cs, verbsio.Completion{WRID: r.wrid, Op: verbsio.OpRecvImm, ByteLen: rec.N, Imm: rec.Imm, HasImm: true, QP: q})
		}
		q.arrivals = append(q.arrivals, arrival{kind: recWriteImm, imm: rec.Imm, n: rec.N, complete: true})
		return cs
	case recSend:
		if k := len(q.arrivals); k > 0 && !q.arrivals[k-1].complete {
			a := &q.arrivals[k-1]
			a.data = append(a.data, rec.Payload...)
			a.complete = rec.Flags&flagMore == 0
			a.seq = rec.Imm
		} else if k == 0 && len(q.recvs) > 0 && rec.Flags&flagMore == 0 {
			r := q.recvs[0]
			q.recvs = popFront(q.recvs)
			return append(cs, q.deliver(r, rec.Payload, rec.Imm))
		} else {
			q.arrivals = append(q.arrivals, arrival{kind: recSend, seq: rec.Imm, data: append([]byte(nil), rec.Payload...), complete: rec.Flags&flagMore == 0})
		}
		q.backlog += len(rec.Payload)
		if q.backlog > maxBacklog {
			q.compBuf = cs
			q.flushComps()
			q.failLocked(verbsio.StatusRemoteOperation, fmt.Errorf("%w: onnode peer sent %d bytes with no receive posted", verbsio.ErrRemoteOperation, q.backlog))
			return q.compBuf
		}
		return q.matchLocked(cs)
	}
	return cs
}

// matchLocked pairs complete arrivals with posted receives, in order.
func (q *qp) matchLocked(cs []verbsio.Completion) []verbsio.Completion {
	for len(q.arrivals) > 0 && len(q.recvs) > 0 && q.arrivals[0].complete {
		a := q.arrivals[0]
		q.arrivals = q.arrivals[1:]
		r := q.recvs[0]
		q.recvs = popFront(q.recvs)
		if a.kind == recWriteImm {
			cs = append(cs, verbsio.Completion{WRID: r.wrid, Op: verbsio.OpRecvImm, ByteLen: a.n, Imm: a.imm, HasImm: true, QP: q})
			continue
		}
		q.backlog -= len(a.data)
		cs = append(cs, q.deliver(r, a.data, a.seq))
	}
	if len(q.arrivals) == 0 {
		q.arrivals = q.arrivals[:0]
	}
	return cs
}

// deliver copies a SEND's payload into a receive's buffers and queues the
// SEND's acknowledgement.
func (q *qp) deliver(r postedRecv, data []byte, seq uint32) (c verbsio.Completion) {
	c = verbsio.Completion{WRID: r.wrid, Op: verbsio.OpRecv, ByteLen: uint32(len(data)), QP: q}
	defer func() {
		a := seq &^ (1 << 31)
		if c.Status != verbsio.StatusSuccess {
			a |= 1 << 31
		}
		q.acks = append(q.acks, a)
	}()
	q.pd.mu.RLock()
	defer q.pd.mu.RUnlock()
	room := 0
	for i := 0; i < r.nsg; i++ {
		s := r.sge(i)
		if _, st := q.pd.lookupLocal(s.LKey, s.Addr, s.Length, verbsio.AccessLocalWrite); st != verbsio.StatusSuccess {
			c.Status, c.ByteLen = st, 0
			return c
		}
		room += int(s.Length)
	}
	if len(data) > room {
		c.Status, c.ByteLen = verbsio.StatusLocalLength, 0
		return c
	}
	rest := data
	for i := 0; i < r.nsg; i++ {
		s := r.sge(i)
		if len(rest) == 0 {
			break
		}
		n := copy(offheap.Bytes(s.Addr, int(s.Length)), rest)
		rest = rest[n:]
	}
	return c
}

// PostRecv implements verbsio.QueuePair.
func (q *qp) PostRecv(wrs []verbsio.RecvWR) error {
	for _, w := range wrs {
		if len(w.SG) > q.maxSGE {
			return fmt.Errorf("%w: receive with %d SGEs, queue pair allows %d", verbsio.ErrLocalLength, len(w.SG), q.maxSGE)
		}
	}
	q.consMu.Lock()
	defer q.consMu.Unlock()
	switch q.State() {
	case verbsio.QPClosed:
		return fmt.Errorf("%w: queue pair", verbsio.ErrClosed)
	case verbsio.QPError:
		cs := make([]verbsio.Completion, 0, len(wrs))
		for _, w := range wrs {
			cs = append(cs, verbsio.Completion{WRID: w.WRID, Status: verbsio.StatusFlushed, Op: verbsio.OpRecv, QP: q})
		}
		q.recvCQ.push(cs...)
		return nil
	}
	if len(q.recvs)+len(wrs) > q.maxRecv {
		return fmt.Errorf("%w: %d receives posted, %d more asked, depth %d", verbsio.ErrQueueFull, len(q.recvs), len(wrs), q.maxRecv)
	}
	for _, w := range wrs {
		q.recvs = append(q.recvs, newPostedRecv(w))
	}
	if q.State() == verbsio.QPReady {
		q.drainLocked()
		q.compBuf = q.matchLocked(q.compBuf[:0])
		q.flushComps()
	}
	return nil
}

// Close implements verbsio.QueuePair: outstanding receives complete as
// flushed. Idempotent.
func (q *qp) Close() error {
	q.closeOnce.Do(func() {
		close(q.done)
		q.connMu.Lock() // a Connect in progress ends, its context cancelled
		defer q.connMu.Unlock()
		q.sendMu.Lock()
		q.consMu.Lock()
		q.failLocked(verbsio.StatusFlushed, fmt.Errorf("%w: queue pair closed", verbsio.ErrFlushed))
		q.state.Store(uint32(verbsio.QPClosed))
		q.consMu.Unlock()
		q.recvCQ.qps.Remove(q)
		q.sendCQ.sendQPs.Remove(q)
		// A pollAcks or setAckWake that saw the queue pair open is done
		// with the peer's ring before release unmaps it.
		q.compMu.Lock()
		q.compMu.Unlock()
		q.release()
		q.sendMu.Unlock()
	})
	return nil
}

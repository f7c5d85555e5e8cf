package onnode

import (
	"encoding/binary"
	"errors"
	"fmt"
	"runtime/debug"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gdrlink/gdrlink/internal/adaptspin"
	"github.com/gdrlink/gdrlink/internal/offheap"
	"github.com/gdrlink/gdrlink/verbsio"
)

// PostSend implements verbsio.QueuePair. Each work request is carried out
// before PostSend returns, in order; its completion (always for errors, on
// success when Signaled) goes to the send completion queue. The first
// failure moves the queue pair to the error state and flushes the rest of
// the chain, as on an RC queue pair.
func (q *qp) PostSend(wrs []verbsio.SendWR) error {
	if len(wrs) > q.maxSend {
		return fmt.Errorf("%w: %d work requests, send queue depth %d", verbsio.ErrQueueFull, len(wrs), q.maxSend)
	}
	for i := range wrs {
		w := &wrs[i]
		switch w.Op {
		case verbsio.OpWrite, verbsio.OpWriteImm, verbsio.OpSend, verbsio.OpRead:
		default:
			return fmt.Errorf("%w: onnode send queue opcode %s", verbsio.ErrNotSupported, w.Op)
		}
		if len(w.SG) > q.maxSGE {
			return fmt.Errorf("%w: work request %d has %d SGEs, queue pair allows %d", verbsio.ErrLocalLength, w.WRID, len(w.SG), q.maxSGE)
		}
		if w.Inline {
			if w.Op == verbsio.OpRead {
				return fmt.Errorf("%w: inline RDMA READ", verbsio.ErrNotSupported)
			}
			if n := sgLen(w.SG); n > uint64(q.maxInline) {
				return fmt.Errorf("%w: inline payload of %d bytes, queue pair allows %d", verbsio.ErrLocalLength, n, q.maxInline)
			}
		}
	}
	q.sendMu.Lock()
	defer q.sendMu.Unlock()
	switch q.State() {
	case verbsio.QPInit:
		return fmt.Errorf("%w: PostSend before Connect", verbsio.ErrQPState)
	case verbsio.QPClosed:
		return fmt.Errorf("%w: queue pair", verbsio.ErrClosed)
	case verbsio.QPError:
		if q.lost.Load() && !q.lossReported.Swap(true) {
			// The first work requests posted after the peer died are the
			// ones that find out, as an RC requester whose retries run
			// out: they complete with StatusRetryExceeded.
			ps := make([]pendingComp, 0, len(wrs))
			for _, w := range wrs {
				ps = append(ps, pendingComp{c: verbsio.Completion{WRID: w.WRID, Status: verbsio.StatusRetryExceeded, Op: w.Op, QP: q}})
			}
			q.enqueue(ps)
			return nil
		}
		if err := lastError(q); err != nil {
			return fmt.Errorf("%w: queue pair in error state: %w", verbsio.ErrQPState, err)
		}
		return fmt.Errorf("%w: queue pair in error state", verbsio.ErrQPState)
	}
	var buf [8]pendingComp
	ps := buf[:0]
	for i := range wrs {
		w := &wrs[i]
		if w.Op == verbsio.OpSend {
			// Its completion waits for the peer's acknowledgement, so it
			// must be queued before the peer can answer.
			q.sendSeq = (q.sendSeq + 1) &^ (1 << 31)
			q.waiting.Add(1)
			ps = append(ps, pendingComp{c: verbsio.Completion{WRID: w.WRID, Op: w.Op, QP: q}, signaled: w.Signaled, waiting: true, seq: q.sendSeq})
			q.enqueue(ps)
			ps = ps[:0]
		}
		st, err := q.exec(w)
		if st != verbsio.StatusSuccess {
			if w.Op == verbsio.OpSend {
				q.resolve(q.sendSeq, st)
			} else {
				ps = append(ps, pendingComp{c: verbsio.Completion{WRID: w.WRID, Status: st, Op: w.Op, QP: q}})
			}
			for _, r := range wrs[i+1:] {
				ps = append(ps, pendingComp{c: verbsio.Completion{WRID: r.WRID, Status: verbsio.StatusFlushed, Op: r.Op, QP: q}})
			}
			q.enqueue(ps)
			q.sendFail(st, err)
			return nil
		}
		// An unsignaled success produces no completion, and holds none
		// back (only SENDs awaiting their acknowledgement do): it is not
		// queued.
		if w.Op != verbsio.OpSend && w.Signaled {
			ps = append(ps, pendingComp{c: verbsio.Completion{WRID: w.WRID, Op: w.Op, QP: q}, signaled: true})
		}
	}
	q.enqueue(ps)
	return nil
}

func sgLen(sg []verbsio.SGE) uint64 {
	var n uint64
	for _, s := range sg {
		n += uint64(s.Length)
	}
	return n
}

// sendFail moves the queue pair to the error state after a failed work
// request and tells the peer, whose posted receives are flushed. What the
// peer published in the incoming ring before the failure is taken first,
// as a NIC completes the messages that arrived before its queue pair
// failed: the peer's BYE, say, sent before it closed the region this
// write failed on.
func (q *qp) sendFail(st verbsio.Status, err error) {
	q.lossReported.Store(true) // the send queue has reported its failure
	if err == nil {
		err = st.Err()
	}
	if !q.lost.Load() {
		q.produce(recError, 0, uint32(st), 0, nil, 0, false)
	}
	q.consMu.Lock()
	q.drainLocked()
	q.failLocked(verbsio.StatusFlushed, err)
	q.consMu.Unlock()
}

// exec carries out one work request. The caller holds sendMu.
func (q *qp) exec(w *verbsio.SendWR) (verbsio.Status, error) {
	total := sgLen(w.SG)
	if total > maxMessage {
		return verbsio.StatusLocalLength, fmt.Errorf("%w: %d bytes, at most %d", verbsio.ErrLocalLength, total, maxMessage)
	}
	if q.lost.Load() {
		q.lossReported.Store(true)
		return verbsio.StatusRetryExceeded, lastError(q)
	}
	var arr [maxSGE][]byte
	segs := arr[:0]
	if w.Inline {
		for _, s := range w.SG {
			segs = append(segs, offheap.Bytes(s.Addr, int(s.Length)))
		}
	} else {
		need := verbsio.Access(0)
		if w.Op == verbsio.OpRead {
			need = verbsio.AccessLocalWrite
		}
		if w.Op != verbsio.OpSend && total > 0 {
			q.mapRemoteFile(w.Op != verbsio.OpRead, w.RemoteAddr, w.RKey, int(total))
		}
		q.pd.mu.RLock()
		defer q.pd.mu.RUnlock()
		for _, s := range w.SG {
			if _, st := q.pd.lookupLocal(s.LKey, s.Addr, s.Length, need); st != verbsio.StatusSuccess {
				return st, fmt.Errorf("%w: lkey %#x at %#x+%d", verbsio.ErrLocalProtection, s.LKey, s.Addr, s.Length)
			}
			segs = append(segs, offheap.Bytes(s.Addr, int(s.Length)))
		}
	}
	n := int(total)
	switch w.Op {
	case verbsio.OpSend:
		return q.sendPayload(segs, n)
	case verbsio.OpRead:
		if n == 0 {
			return verbsio.StatusSuccess, nil
		}
		return q.remoteCopy(false, segs, w.RemoteAddr, w.RKey, n)
	}
	if n > 0 {
		if st, err := q.remoteCopy(true, segs, w.RemoteAddr, w.RKey, n); st != verbsio.StatusSuccess {
			return st, err
		}
	}
	if w.Op == verbsio.OpWriteImm {
		var k [4]byte
		binary.LittleEndian.PutUint32(k[:], w.RKey)
		return q.produce(recWriteImm, 0, w.Imm, uint32(n), [][]byte{k[:]}, 0, true)
	}
	return verbsio.StatusSuccess, nil
}

// sendPayload puts a SEND into the peer's ring, in fragments of at most
// maxFragment bytes.
func (q *qp) sendPayload(segs [][]byte, n int) (verbsio.Status, error) {
	for from := 0; ; {
		to := min(from+maxFragment, n)
		flags := uint8(0)
		if to < n {
			flags = flagMore
		}
		st, err := q.produce(recSend, flags, q.sendSeq, uint32(to-from), segs, from, true)
		if st != verbsio.StatusSuccess || to == n {
			return st, err
		}
		from = to
	}
}

// produce appends a record to the peer's ring; a send's payload is bytes
// [from, from+n) of segs. It waits for room when wait is set (bounded by
// ringFullTimeout and the peer's life).
func (q *qp) produce(kind, flags uint8, imm, n uint32, segs [][]byte, from int, wait bool) (verbsio.Status, error) {
	r := q.out
	plen := 0
	switch kind {
	case recSend:
		plen = int(n)
	case recWriteImm:
		plen = 4 // the rkey
	}
	size := uint64(recordSize(plen))
	var since time.Time
	for {
		off := q.tail & (ringData - 1)
		toEnd := ringData - off
		if free := ringData - (q.tail - q.head); free < min(size, toEnd) {
			// Out of room by the head last read: read it again.
			q.head = atomic.LoadUint64(u64(r.mem, offHead))
			if q.tail-q.head > ringData {
				return verbsio.StatusRemoteOperation, fmt.Errorf("%w: onnode peer ring head %d, tail %d", verbsio.ErrBadFrame, q.head, q.tail)
			}
		}
		free := ringData - (q.tail - q.head)
		if size > toEnd && free >= toEnd {
			putRecordHeader(r.data[off:off], uint32(toEnd), recPad, 0, 0, 0)
			q.tail += toEnd
			atomic.StoreUint64(u64(r.mem, offTail), q.tail)
			continue
		}
		if size <= toEnd && size <= free {
			dst := r.data[off : off+size]
			putRecordHeader(dst[:0], uint32(size), kind, flags, imm, n)
			if plen > 0 {
				gather(dst[recHeader:recHeader+plen], segs, from)
			}
			q.tail += size
			atomic.StoreUint64(u64(r.mem, offTail), q.tail)
			// A SEND needs the peer to take it even when nobody polls there
			// (its acknowledgement completes it here): unless a Wait
			// polls there, which takes it.
			if atomic.LoadUint32(u32(r.mem, offSleep)) != 0 || kind == recSend && atomic.LoadUint32(u32(r.mem, offPoll)) == 0 {
				q.signal()
			}
			return verbsio.StatusSuccess, nil
		}
		// No room: make the peer's progress goroutine drain, then retry.
		q.signal()
		if !wait {
			return verbsio.StatusRemoteOperation, fmt.Errorf("%w: onnode peer ring full", verbsio.ErrQueueFull)
		}
		if since.IsZero() {
			since = time.Now()
		} else if time.Since(since) > ringFullTimeout {
			return verbsio.StatusRetryExceeded, fmt.Errorf("%w: %w: onnode peer ring full for %s", verbsio.ErrPeerLost, verbsio.ErrTimeout, ringFullTimeout)
		}
		if q.lost.Load() {
			return verbsio.StatusRetryExceeded, lastError(q)
		}
		select {
		case <-q.done:
			return verbsio.StatusFlushed, fmt.Errorf("%w: queue pair closed", verbsio.ErrFlushed)
		default:
		}
		// The peer's progress goroutine drains in microseconds; nothing
		// says when it has (adaptspin.Pause: not a Go timer, which would
		// take a millisecond).
		adaptspin.Pause(20 * time.Microsecond)
	}
}

// gather copies bytes [from, from+len(dst)) of the concatenation of segs.
func gather(dst []byte, segs [][]byte, from int) {
	for _, s := range segs {
		if from >= len(s) {
			from -= len(s)
			continue
		}
		c := copy(dst, s[from:])
		dst, from = dst[c:], 0
		if len(dst) == 0 {
			return
		}
	}
}

var one = [8]byte{1}

// signal wakes the peer's progress goroutine.
func (q *qp) signal() {
	q.signals.Add(1)
	unix.Write(q.peerEFD, one[:])
}

// remoteTarget checks access to the peer's region rkey at addr for n bytes
// in the peer's table and returns its entry, with the entry of the region
// whose file holds those bytes (fe, key fileKey: the region itself, or the
// granted region of a grant). With hold, the peer cannot release the
// region until unhold(held).
func (q *qp) remoteTarget(write bool, addr uint64, rkey uint32, n int, hold bool) (e, fe entry, fileKey uint32, held *uint64, st verbsio.Status, err error) {
	e, held, ok := readEntry(q.peerTable, q.peerCtr, int(rkey&(tableSlots-1)), hold)
	need := verbsio.AccessRemoteRead
	if write {
		need = verbsio.AccessRemoteWrite
	}
	if !ok || e.flags&flagValid == 0 || e.key != rkey || e.access&need != need ||
		addr < e.addr || addr-e.addr > e.length || uint64(n) > e.length-(addr-e.addr) {
		return e, fe, 0, held, verbsio.StatusRemoteAccess, fmt.Errorf("%w: rkey %#x at %#x+%d (%s)", verbsio.ErrRemoteAccess, rkey, addr, n, need)
	}
	if e.flags&flagGranted != 0 {
		return e, fe, 0, held, verbsio.StatusRemoteAccess, fmt.Errorf("%w: rkey %#x: the region admits writes through grants only", verbsio.ErrRemoteAccess, rkey)
	}
	// A grant: given to our peer queue pair; the file is its region's.
	fileKey, fe = rkey, e
	if e.flags&flagGrant != 0 {
		if e.qp != q.peerTok {
			return e, fe, 0, held, verbsio.StatusRemoteAccess, fmt.Errorf("%w: rkey %#x: a grant to another queue pair", verbsio.ErrRemoteAccess, rkey)
		}
		fileKey = uint32(e.parent)
		pe, _, pok := readEntry(q.peerTable, q.peerCtr, int(fileKey&(tableSlots-1)), false)
		if !pok || pe.flags&flagValid == 0 || pe.key != fileKey || addr < pe.addr || addr-pe.addr > pe.length || uint64(n) > pe.length-(addr-pe.addr) {
			return e, fe, 0, held, verbsio.StatusRemoteAccess, fmt.Errorf("%w: rkey %#x: the granted region is gone", verbsio.ErrRemoteAccess, rkey)
		}
		fe = pe
	}
	return e, fe, fileKey, held, verbsio.StatusSuccess, nil
}

// mapRemoteFile maps the file of the peer's region that an RDMA WRITE or
// READ of n bytes at addr through rkey reaches, where it is file-backed and
// not mapped yet (fileMapFor). exec calls it before it takes the
// protection domain's lock: the first such access asks the peer for the
// file and waits for its socket reader's answer, which takes the peer's
// own lock (pd.fileOf). Two processes each waiting for the other's answer
// while holding their lock would stall each other, through a Grant or an
// arriving write that waits for the lock and so holds up the reader, until
// the request's timeout (fdRequestTimeout). Access is checked again when
// the copy runs (remoteCopy).
func (q *qp) mapRemoteFile(write bool, addr uint64, rkey uint32, n int) {
	if q.mech == MechVM {
		return
	}
	e, fe, fileKey, _, st, _ := q.remoteTarget(write, addr, rkey, n, false)
	if st == verbsio.StatusSuccess && e.flags&flagFile != 0 && fe.flags&flagFile != 0 {
		q.fileMapFor(fileKey, fe)
	}
}

// remoteCopy writes segs into (or reads them from) the peer's region rkey at
// addr, after checking the key, the bounds and the access in the peer's
// table. The peer cannot release the region while the copy runs.
func (q *qp) remoteCopy(write bool, segs [][]byte, addr uint64, rkey uint32, n int) (verbsio.Status, error) {
	e, fe, fileKey, held, st, err := q.remoteTarget(write, addr, rkey, n, true)
	defer unhold(held)
	if st != verbsio.StatusSuccess {
		return st, err
	}
	if e.flags&flagFile != 0 && fe.flags&flagFile != 0 && q.mech != MechVM {
		if fm := q.fileMapFor(fileKey, fe); fm != nil {
			off := fm.delta + int(addr-fe.addr)
			remote := fm.mem[off : off+n]
			if !faultSafeCopy(write, remote, segs) {
				return verbsio.StatusRemoteAccess, fmt.Errorf("%w: rkey %#x: the peer's file shrank under its region", verbsio.ErrRemoteAccess, rkey)
			}
			return verbsio.StatusSuccess, nil
		}
	}
	if q.vmErr != nil {
		return verbsio.StatusRemoteOperation, q.vmErr
	}
	err = q.vmCopy(write, segs, addr, n)
	switch {
	case err == nil:
		return verbsio.StatusSuccess, nil
	case errors.Is(err, unix.ESRCH):
		return verbsio.StatusRetryExceeded, fmt.Errorf("%w: %w", verbsio.ErrPeerLost, err)
	case errors.Is(err, unix.EFAULT):
		return verbsio.StatusRemoteAccess, fmt.Errorf("%w: %w", verbsio.ErrRemoteAccess, err)
	}
	return verbsio.StatusRemoteOperation, fmt.Errorf("%w: %w", verbsio.ErrRemoteOperation, err)
}

// faultSafeCopy copies between remote and segs; it reports false if the
// mapping faulted (the peer truncated its file).
func faultSafeCopy(write bool, remote []byte, segs [][]byte) (ok bool) {
	defer func() {
		if recover() != nil {
			ok = false
		}
	}()
	old := debug.SetPanicOnFault(true)
	defer debug.SetPanicOnFault(old)
	for _, s := range segs {
		if write {
			copy(remote, s)
		} else {
			copy(s, remote)
		}
		remote = remote[len(s):]
	}
	return true
}

// fileMapFor maps the peer's file-backed region rkey, asking the peer for
// its file the first time; nil means "use process_vm_writev".
func (q *qp) fileMapFor(rkey uint32, e entry) *fileMap {
	if fm := q.fileMaps[rkey]; fm != nil {
		return fm
	}
	for k, fm := range q.fileMaps {
		cur, _, ok := readEntry(q.peerTable, q.peerCtr, int(k&(tableSlots-1)), false)
		if !ok || cur.flags&flagValid == 0 || cur.key != k {
			unix.Munmap(fm.mem)
			delete(q.fileMaps, k)
		}
	}
	fd := q.requestFD(rkey)
	if fd < 0 {
		return nil
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if unix.Fstat(fd, &st) != nil || st.Size < 0 || uint64(st.Size) < e.offset+e.length {
		return nil
	}
	page := uint64(unix.Getpagesize())
	base := e.offset &^ (page - 1)
	delta := int(e.offset - base)
	prot := unix.PROT_READ
	if e.access&verbsio.AccessRemoteWrite != 0 || e.flags&flagGranted != 0 {
		prot |= unix.PROT_WRITE
	}
	mem, err := unix.Mmap(fd, int64(base), delta+int(e.length), prot, unix.MAP_SHARED)
	if err != nil {
		return nil
	}
	fm := &fileMap{mem: mem, delta: delta}
	q.fileMaps[rkey] = fm
	return fm
}

// requestFD asks the peer for the file of region rkey; -1 when it has none
// (or no longer has the region, or does not answer in time).
func (q *qp) requestFD(rkey uint32) int {
	for {
		select {
		case a := <-q.fdResp:
			closeFD(a.fd)
			continue
		default:
		}
		break
	}
	q.writeMu.Lock()
	_, _, err := q.conn.WriteMsgUnix(control{Kind: msgFDReq, RKey: rkey}.Append(nil), nil, nil)
	q.writeMu.Unlock()
	if err != nil {
		return -1
	}
	t := time.NewTimer(fdRequestTimeout)
	defer t.Stop()
	for {
		select {
		case a := <-q.fdResp:
			if a.rkey == rkey {
				return a.fd
			}
			closeFD(a.fd)
		case <-q.lostCh:
			return -1
		case <-q.done:
			return -1
		case <-t.C:
			return -1
		}
	}
}

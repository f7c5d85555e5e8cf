package ibv

import (
	"sync"
	"syscall"
	"unsafe"

	"github.com/ebitengine/purego"
)

// postBatch is the most work requests one crossing posts; a longer chain
// takes one crossing per postBatch requests.
const postBatch = 256

// QP is a reliable-connected queue pair, or an unreliable-connected one
// made by CreateUCQP.
type QP struct {
	c    *Context
	mu   sync.RWMutex
	qp   uintptr
	qpn  uint32
	caps QPCaps
	uc   bool // IBV_QPT_UC: no acknowledgements, retries or RDMA reads

	// Work requests are built off the Go heap: sendMu guards send (postBatch
	// struct ibv_send_wr, then their struct ibv_sge, then the bad_wr
	// pointer the verb fills), recvMu guards recv, laid out alike.
	sendMu, recvMu sync.Mutex
	// sendArgs and recvArgs are the verbs' arguments (under sendMu and
	// recvMu): a call with a slice of its own would allocate one per post.
	sendArgs, recvArgs   [3]uintptr
	send, recv           scratch
	sendSGEs, recvSGEs   int // SGE capacity of each
	sendWRMax, recvWRMax int
}

// CreateQP makes a reliable-connected queue pair in RESET state. The
// granted sizes are in Caps.
func (p *PD) CreateQP(send, recv *CQ, want QPCaps) (*QP, error) {
	return p.createQP(send, recv, want, qpTypeRC)
}

// CreateUCQP makes an unreliable-connected queue pair in RESET state: RDMA
// WRITE (with or without immediate) and SEND only, no acknowledgements and
// no retries; a lost packet drops its whole message at the receiver. Its
// ToRTR and ToRTS set only the attributes UC takes (MaxDestRdAtomic,
// MinRNRTimer, Timeout, RetryCount, RNRRetry and MaxRdAtomic are ignored).
func (p *PD) CreateUCQP(send, recv *CQ, want QPCaps) (*QP, error) {
	return p.createQP(send, recv, want, qpTypeUC)
}

// UC reports whether the queue pair is unreliable-connected.
func (q *QP) UC() bool { return q.uc }

func (p *PD) createQP(send, recv *CQ, want QPCaps, qpType uint32) (*QP, error) {
	pd, err := p.live("ibv_create_qp")
	if err != nil {
		return nil, err
	}
	send.mu.RLock()
	defer send.mu.RUnlock()
	if send != recv {
		recv.mu.RLock()
		defer recv.mu.RUnlock()
	}
	if send.cq == 0 || recv.cq == 0 {
		return nil, p.c.errf("ibv_create_qp", syscall.EBADF, "completion queue closed")
	}
	a := cQPInitAttr{sendCQ: send.cq, recvCQ: recv.cq, qpType: qpType, cap: cQPCap{
		maxSendWR: uint32(want.MaxSendWR), maxRecvWR: uint32(want.MaxRecvWR),
		maxSendSGE: uint32(want.MaxSendSGE), maxRecvSGE: uint32(want.MaxRecvSGE), maxInlineData: uint32(want.MaxInline)}}
	p.c.cnt.control.Add(1)
	qp, e := p.c.l.callErrno(symCreateQP, pd, uintptr(unsafe.Pointer(&a)))
	if qp == 0 {
		return nil, p.c.errf("ibv_create_qp", orEIO(e), "%+v", want)
	}
	q := &QP{c: p.c, qp: qp, qpn: u32At(qp, offQPNum), uc: qpType == qpTypeUC, caps: QPCaps{
		MaxSendWR: int(a.cap.maxSendWR), MaxRecvWR: int(a.cap.maxRecvWR), MaxSendSGE: int(a.cap.maxSendSGE),
		MaxRecvSGE: int(a.cap.maxRecvSGE), MaxInline: int(a.cap.maxInlineData)}}
	q.sendWRMax = min(postBatch, max(q.caps.MaxSendWR, 1))
	q.recvWRMax = min(postBatch, max(q.caps.MaxRecvWR, 1))
	q.sendSGEs = q.sendWRMax * max(q.caps.MaxSendSGE, 1)
	q.recvSGEs = q.recvWRMax * max(q.caps.MaxRecvSGE, 1)
	sgeSize := int(unsafe.Sizeof(SGE{}))
	q.send, err = newScratch(q.sendWRMax*int(unsafe.Sizeof(cSendWR{})) + q.sendSGEs*sgeSize + 8)
	if err == nil {
		q.recv, err = newScratch(q.recvWRMax*int(unsafe.Sizeof(cRecvWR{})) + q.recvSGEs*sgeSize + 8)
	}
	if err != nil {
		q.send.free()
		p.c.l.call(symDestroyQP, qp)
		return nil, p.c.errf("mmap", lastErrno(err), "work request batch of qp %d", q.qpn)
	}
	return q, nil
}

// QPN is the queue pair number.
func (q *QP) QPN() uint32 { return q.qpn }

// Caps are the sizes the device granted.
func (q *QP) Caps() QPCaps { return q.caps }

func (q *QP) live(op string) (uintptr, error) {
	q.mu.RLock()
	if q.qp == 0 {
		q.mu.RUnlock()
		return 0, q.c.errf(op, syscall.EBADF, "queue pair %d closed", q.qpn)
	}
	return q.qp, nil
}

// Close destroys the queue pair. Idempotent.
func (q *QP) Close() error {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.qp == 0 {
		return nil
	}
	q.c.cnt.control.Add(1)
	if rc := rc32(q.c.l.call(symDestroyQP, q.qp)); rc != 0 {
		return q.c.errf("ibv_destroy_qp", errnoOf(rc), "qp %d", q.qpn)
	}
	q.qp = 0
	// Posts hold mu shared, so none is using the batches now.
	q.send.free()
	q.recv.free()
	q.send, q.recv = nil, nil
	return nil
}

// modify calls ibv_modify_qp with attr and mask.
func (q *QP) modify(op string, a *cQPAttr, mask int, format string, args ...any) error {
	qp, err := q.live(op)
	if err != nil {
		return err
	}
	defer q.mu.RUnlock()
	q.c.cnt.control.Add(1)
	r, e := q.c.l.callErrno(symModifyQP, qp, uintptr(unsafe.Pointer(a)), uintptr(mask))
	if rc := rc32(r); rc != 0 {
		return q.c.errf(op, verbErr(rc, e), format, args...)
	}
	return nil
}

// ToInit moves the queue pair from RESET to INIT.
func (q *QP) ToInit(port, pkeyIndex, access int) error {
	a := cQPAttr{qpState: QPSInit, pkeyIndex: uint16(pkeyIndex), portNum: uint8(port), qpAccessFlags: uint32(access)}
	return q.modify("ibv_modify_qp(INIT)", &a, maskState|maskPKeyIndex|maskPort|maskAccessFlags,
		"qp %d port %d pkey index %d", q.qpn, port, pkeyIndex)
}

// ToRTR moves the queue pair from INIT to RTR.
func (q *QP) ToRTR(r RTRAttr) error {
	mtu := MTUEnum(r.MTU)
	if mtu == 0 {
		return q.c.errf("ibv_modify_qp(RTR)", syscall.EINVAL, "mtu %d", r.MTU)
	}
	a := cQPAttr{qpState: QPSRTR, pathMTU: uint32(mtu), destQPNum: r.DestQPN, rqPSN: r.RQPSN,
		maxDestRdAtomic: uint8(r.MaxDestRdAtomic), minRNRTimer: uint8(r.MinRNRTimer)}
	a.ahAttr.dlid = r.DLID
	a.ahAttr.sl = uint8(r.SL)
	a.ahAttr.portNum = uint8(r.Port)
	if r.Global {
		a.ahAttr.isGlobal = 1
		a.ahAttr.grh.dgid = r.DGID
		a.ahAttr.grh.sgidIndex = uint8(r.SGIDIndex)
		a.ahAttr.grh.hopLimit = uint8(r.HopLimit)
		a.ahAttr.grh.trafficClass = uint8(r.TClass)
	}
	mask := maskState | maskAV | maskPathMTU | maskDestQPN | maskRQPSN
	if !q.uc {
		mask |= maskMaxDestRdAtomic | maskMinRNRTimer
	}
	return q.modify("ibv_modify_qp(RTR)", &a, mask,
		"qp %d -> qp %d gid %s mtu %d", q.qpn, r.DestQPN, r.DGID, r.MTU)
}

// ToRTS moves the queue pair from RTR to RTS.
func (q *QP) ToRTS(r RTSAttr) error {
	a := cQPAttr{qpState: QPSRTS, sqPSN: r.SQPSN, timeout: uint8(r.Timeout), retryCnt: uint8(r.RetryCount),
		rnrRetry: uint8(r.RNRRetry), maxRdAtomic: uint8(r.MaxRdAtomic)}
	mask := maskState | maskSQPSN
	if !q.uc {
		mask |= maskTimeout | maskRetryCnt | maskRNRRetry | maskMaxQPRdAtomic
	}
	return q.modify("ibv_modify_qp(RTS)", &a, mask, "qp %d", q.qpn)
}

// ToError moves the queue pair to ERROR: outstanding work requests complete
// as flushed.
func (q *QP) ToError() error {
	a := cQPAttr{qpState: QPSErr}
	return q.modify("ibv_modify_qp(ERR)", &a, maskState, "qp %d", q.qpn)
}

// State queries the queue pair's state (QPS*).
func (q *QP) State() (int, error) {
	qp, err := q.live("ibv_query_qp")
	if err != nil {
		return 0, err
	}
	defer q.mu.RUnlock()
	var a cQPAttr
	var init cQPInitAttr
	q.c.cnt.control.Add(1)
	r, e := q.c.l.callErrno(symQueryQP, qp, uintptr(unsafe.Pointer(&a)), maskState, uintptr(unsafe.Pointer(&init)))
	if rc := rc32(r); rc != 0 {
		return 0, q.c.errf("ibv_query_qp", verbErr(rc, e), "qp %d", q.qpn)
	}
	return int(a.qpState), nil
}

// PostSend posts a chain of work requests, built as linked struct
// ibv_send_wr off the Go heap, in one crossing per 256 requests. On failure
// it returns how many were posted before the one that failed, and the error.
func (q *QP) PostSend(wrs []SendWR, sges []SGE) (int, error) {
	if len(wrs) == 0 {
		return 0, nil
	}
	qp, err := q.live("ibv_post_send")
	if err != nil {
		return 0, err
	}
	defer q.mu.RUnlock()
	if err := checkSGEs(len(sges), func(i int) (uint32, uint32) { return wrs[i].SGEOff, wrs[i].NumSGE }, len(wrs)); err != nil {
		return 0, q.c.errf("ibv_post_send", syscall.EINVAL, "%v", err)
	}
	for i := range wrs {
		if int(wrs[i].NumSGE) > q.sendSGEs {
			return 0, q.c.errf("ibv_post_send", syscall.EINVAL, "work request %d has %d SGEs, the queue pair at most %d", i, wrs[i].NumSGE, q.caps.MaxSendSGE)
		}
		if b := &wrs[i].Bind; wrs[i].Opcode == WRBindMW && (b.MW == nil || b.MR == nil || b.MW.handle() == 0 || b.MR.handle() == 0) {
			return 0, q.c.errf("ibv_post_send", syscall.EBADF, "work request %d binds a memory window that is closed, or to a region that is", i)
		}
	}
	q.sendMu.Lock()
	defer q.sendMu.Unlock()
	base := q.send.addr()
	cw := unsafe.Slice((*cSendWR)(unsafe.Pointer(unsafe.SliceData(q.send))), q.sendWRMax)
	sgeBase := base + uintptr(q.sendWRMax)*unsafe.Sizeof(cSendWR{})
	cs := unsafe.Slice((*SGE)(ptrAt(sgeBase, 0)), q.sendSGEs)
	done := 0
	for done < len(wrs) {
		k, ns := 0, 0
		for done+k < len(wrs) && k < q.sendWRMax && ns+int(wrs[done+k].NumSGE) <= q.sendSGEs {
			w := &wrs[done+k]
			c := &cw[k]
			*c = cSendWR{wrID: w.WRID, numSGE: int32(w.NumSGE), opcode: w.Opcode, sendFlags: w.Flags,
				immData: be32(w.Imm), remoteAddr: w.RemoteAddr, rkey: w.RKey}
			switch w.Opcode {
			case WRLocalInv:
				c.immData = w.InvRKey // invalidate_rkey shares imm_data's place, in host order
			case WRBindMW:
				b := &w.Bind
				c.bindMW, c.bindRKey, c.bindMR = b.MW.handle(), b.RKey, b.MR.handle()
				c.bindAddr, c.bindLength, c.bindAccess = b.Addr, b.Length, uint32(b.Access)
			}
			if w.NumSGE > 0 {
				copy(cs[ns:], sges[w.SGEOff:w.SGEOff+w.NumSGE])
				c.sgList = sgeBase + uintptr(ns)*unsafe.Sizeof(SGE{})
				ns += int(w.NumSGE)
			}
			if k > 0 {
				cw[k-1].next = base + uintptr(k)*unsafe.Sizeof(cSendWR{})
			}
			k++
		}
		badAt := (*uintptr)(ptrAt(sgeBase, q.sendSGEs*int(unsafe.Sizeof(SGE{}))))
		*badAt = 0
		q.c.cnt.postSend.Add(1)
		q.sendArgs = [3]uintptr{qp, base, uintptr(unsafe.Pointer(badAt))}
		r, _, _ := purego.SyscallN(q.c.postSend, q.sendArgs[:]...)
		bad := *badAt
		if rc := rc32(r); rc != 0 {
			posted := done
			if bad >= base && bad < base+uintptr(k)*unsafe.Sizeof(cSendWR{}) {
				posted += int((bad - base) / unsafe.Sizeof(cSendWR{}))
			}
			q.c.cnt.sendWRs.Add(uint64(posted))
			return posted, q.c.errf("ibv_post_send", errnoOf(rc), "qp %d, %d of %d posted", q.qpn, posted, len(wrs))
		}
		done += k
	}
	q.c.cnt.sendWRs.Add(uint64(len(wrs)))
	return len(wrs), nil
}

// PostRecv posts a chain of receive work requests, built off the Go heap,
// in one crossing per 256 requests.
func (q *QP) PostRecv(wrs []RecvWR, sges []SGE) (int, error) {
	if len(wrs) == 0 {
		return 0, nil
	}
	qp, err := q.live("ibv_post_recv")
	if err != nil {
		return 0, err
	}
	defer q.mu.RUnlock()
	if err := checkSGEs(len(sges), func(i int) (uint32, uint32) { return wrs[i].SGEOff, wrs[i].NumSGE }, len(wrs)); err != nil {
		return 0, q.c.errf("ibv_post_recv", syscall.EINVAL, "%v", err)
	}
	for i := range wrs {
		if int(wrs[i].NumSGE) > q.recvSGEs {
			return 0, q.c.errf("ibv_post_recv", syscall.EINVAL, "work request %d has %d SGEs, the queue pair at most %d", i, wrs[i].NumSGE, q.caps.MaxRecvSGE)
		}
	}
	q.recvMu.Lock()
	defer q.recvMu.Unlock()
	base := q.recv.addr()
	cw := unsafe.Slice((*cRecvWR)(unsafe.Pointer(unsafe.SliceData(q.recv))), q.recvWRMax)
	sgeBase := base + uintptr(q.recvWRMax)*unsafe.Sizeof(cRecvWR{})
	cs := unsafe.Slice((*SGE)(ptrAt(sgeBase, 0)), q.recvSGEs)
	done := 0
	for done < len(wrs) {
		k, ns := 0, 0
		for done+k < len(wrs) && k < q.recvWRMax && ns+int(wrs[done+k].NumSGE) <= q.recvSGEs {
			w := &wrs[done+k]
			c := &cw[k]
			*c = cRecvWR{wrID: w.WRID, numSGE: int32(w.NumSGE)}
			if w.NumSGE > 0 {
				copy(cs[ns:], sges[w.SGEOff:w.SGEOff+w.NumSGE])
				c.sgList = sgeBase + uintptr(ns)*unsafe.Sizeof(SGE{})
				ns += int(w.NumSGE)
			}
			if k > 0 {
				cw[k-1].next = base + uintptr(k)*unsafe.Sizeof(cRecvWR{})
			}
			k++
		}
		badAt := (*uintptr)(ptrAt(sgeBase, q.recvSGEs*int(unsafe.Sizeof(SGE{}))))
		*badAt = 0
		q.c.cnt.postRecv.Add(1)
		q.recvArgs = [3]uintptr{qp, base, uintptr(unsafe.Pointer(badAt))}
		r, _, _ := purego.SyscallN(q.c.postRecv, q.recvArgs[:]...)
		bad := *badAt
		if rc := rc32(r); rc != 0 {
			posted := done
			if bad >= base && bad < base+uintptr(k)*unsafe.Sizeof(cRecvWR{}) {
				posted += int((bad - base) / unsafe.Sizeof(cRecvWR{}))
			}
			q.c.cnt.recvWRs.Add(uint64(posted))
			return posted, q.c.errf("ibv_post_recv", errnoOf(rc), "qp %d, %d of %d posted", q.qpn, posted, len(wrs))
		}
		done += k
	}
	q.c.cnt.recvWRs.Add(uint64(len(wrs)))
	return len(wrs), nil
}

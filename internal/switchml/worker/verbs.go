package worker

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/gdrlink/gdrlink/internal/ibv"
	"github.com/gdrlink/gdrlink/internal/switchml/aggsrv"
	"github.com/gdrlink/gdrlink/internal/switchml/rocev2"
)

// ErrNoDevice means this host has no ibverbs device that could carry a
// worker's queue pairs: no libibverbs, no device, or none with a RoCE v2
// GID for the worker's address; the error says which.
var ErrNoDevice = errors.New("switchml: no verbs device for the address")

// Verbs names the ibverbs device, port and GID that a worker's UC queue
// pairs use (Config.Verbs).
type Verbs struct {
	Device   string
	Port     int // 1 when zero
	GIDIndex int // a RoCE v2 GID whose IPv4 address is Config.Local
	// Soft says the device is Soft-RoCE (rdma_rxe: vendor 0xffffff). The
	// 6.1 kernel's rxe drops every later message of a UC queue pair once
	// the last packet of a multi-packet write was lost, so callers use
	// one-packet messages (Config.MsgSlots 1) there.
	Soft bool
}

// rxeVendor is rdma_rxe's vendor ID.
const rxeVendor = 0xffffff

// FindVerbs looks for an ibverbs device with an active port and a RoCE v2
// GID for the IPv4 address local. It returns the device; or an error
// matching ErrNoDevice that says what is missing; or another error when
// it could not tell (a device that would not open or answer).
func FindVerbs(local [4]byte) (Verbs, error) {
	if err := ibv.Load(); err != nil {
		if errors.Is(err, ibv.ErrUnavailable) {
			return Verbs{}, fmt.Errorf("%w: %w", ErrNoDevice, err)
		}
		return Verbs{}, err
	}
	devs, err := ibv.Devices()
	if errors.Is(err, syscall.ENOSYS) {
		return Verbs{}, fmt.Errorf("%w: the kernel has no RDMA support: %w", ErrNoDevice, err)
	}
	if err != nil {
		return Verbs{}, err
	}
	if len(devs) == 0 {
		return Verbs{}, fmt.Errorf("%w: no ibverbs device", ErrNoDevice)
	}
	var unsure []error
	for _, d := range devs {
		v, err := findOn(d.Name, local)
		if err == nil {
			return v, nil
		}
		if !errors.Is(err, ErrNoDevice) {
			unsure = append(unsure, err)
		}
	}
	if len(unsure) > 0 {
		return Verbs{}, fmt.Errorf("switchml: looking for a RoCE v2 GID for %v: %w", ipString(local), errors.Join(unsure...))
	}
	return Verbs{}, fmt.Errorf("%w: none of %d ibverbs devices has an active port with a RoCE v2 GID for %v", ErrNoDevice, len(devs), ipString(local))
}

func findOn(name string, local [4]byte) (Verbs, error) {
	c, err := ibv.Open(name)
	if err != nil {
		return Verbs{}, err
	}
	defer c.Close()
	da, err := c.QueryDevice()
	if err != nil {
		return Verbs{}, err
	}
	for port := 1; port <= da.PhysPortCount; port++ {
		pa, err := c.QueryPort(port)
		if err != nil {
			return Verbs{}, err
		}
		if pa.State != ibv.PortActive || pa.LinkLayer != ibv.LinkLayerEthernet {
			continue
		}
		var gids []ibv.GIDEntry
		for i := range pa.GIDTblLen {
			if e, err := c.QueryGID(port, i); err == nil {
				gids = append(gids, e)
			}
		}
		if i, ok := roceV2GID(gids, local); ok {
			return Verbs{Device: name, Port: port, GIDIndex: i, Soft: da.VendorID == rxeVendor}, nil
		}
	}
	return Verbs{}, fmt.Errorf("%w: %s has no active port with a RoCE v2 GID for %v", ErrNoDevice, name, ipString(local))
}

// roceV2GID picks the RoCE v2 entry whose GID is the IPv4-mapped address
// ip.
func roceV2GID(gids []ibv.GIDEntry, ip [4]byte) (int, bool) {
	for _, e := range gids {
		if e.Type == ibv.GIDTypeRoCEv2 && e.GID == mappedGID(ip) {
			return e.Index, true
		}
	}
	return 0, false
}

// mappedGID is the GID of an IPv4 address: ::ffff:a.b.c.d.
func mappedGID(ip [4]byte) ibv.GID {
	var g ibv.GID
	g[10], g[11] = 0xff, 0xff
	copy(g[12:], ip[:])
	return g
}

func ipString(ip [4]byte) string { return fmt.Sprintf("%d.%d.%d.%d", ip[0], ip[1], ip[2], ip[3]) }

// RegionVA is where the verbs transport maps its result region, in every
// worker process: the aggregator writes a result at the address its
// request named, and a switch, which keeps one address per pool index,
// needs it to be the same on every worker. One verbs worker per process.
const RegionVA = 0x3e40_0000_0000

// generations is how many messages of a queue pair have a result place of
// their own, in turn, for their first send: the place a message's reply
// lands in is free again four messages later.
const generations = 4

// resendPlaces is how many places each queue pair has for the replies to
// its resends. A place is used again only once no reply can come to it
// any more (see place).
const resendPlaces = 8

// layout places results and send buffers in the region: the result of
// queue pair q's message number m, sent the first time, at
// resultOff(m % generations, q); the results of its resends at
// resultOff(generations + k, q) for a free k below resendPlaces; and the
// payload it sends with set s at sendOff(q, s).
type layout struct {
	window, msgB int
}

func (l layout) resultOff(gen, q int) int { return (gen*l.window + q) * l.msgB }
func (l layout) sendOff(q, set int) int {
	return ((generations+resendPlaces)*l.window + 2*q + set) * l.msgB
}

// size is the region's length, in whole pages.
func (l layout) size() int {
	n := (generations + resendPlaces + 2) * l.window * l.msgB
	return (n + 4095) &^ 4095
}

// canary fills b with the 8-byte word c (b's length a multiple of 8).
func fillCanary(b []byte, c uint64) {
	for i := 0; i+8 <= len(b); i += 8 {
		binary.LittleEndian.PutUint64(b[i:], c)
	}
}

// isCanary reports whether b still holds only the word c.
func isCanary(b []byte, c uint64) bool {
	for i := 0; i+8 <= len(b); i += 8 {
		if binary.LittleEndian.Uint64(b[i:]) != c {
			return false
		}
	}
	return true
}

// Work request IDs: the queue pair's index, and whether a receive.
func wrID(q int, recv bool) uint64 {
	id := uint64(q) << 1
	if recv {
		id |= 1
	}
	return id
}

func wrQP(id uint64) (q int, recv bool) { return int(id >> 1), id&1 == 1 }

// recvDepth is the receives posted per queue pair, each reposted as it
// completes; sendDepth the queue pair's send queue.
const (
	recvDepth = 32
	sendDepth = 64
)

// placed is a result place that a send of a message named and whose
// reply has not been accounted for.
type placed struct {
	off   int    // the place's offset in the region
	count uint64 // the message's number (qp.count)
}

// sentPlaces is what a queue pair's receive side knows of its sends: the
// places awaiting a reply, oldest send first, and the message last sent.
type sentPlaces struct {
	pending []placed
	last    uint64
}

// verbsLink is the verbs transport: Window UC queue pairs on one device,
// a result region at RegionVA, one completion queue polled by one
// goroutine that hands each queue pair its result.
type verbsLink struct {
	w      *Worker
	v      Verbs
	lay    layout
	c      *ibv.Context
	pd     *ibv.PD
	cq     *ibv.CQ
	mr     *ibv.MR
	qps    []*ibv.QP
	mem    []byte // the region
	canary uint64
	sent   []sentPlaces // per queue pair (w.mu)
	stop   context.CancelFunc
	wg     sync.WaitGroup
	err    error // the first failure of a queue pair or the queue (w.mu)
}

func newVerbsLink(w *Worker, v Verbs) (_ *verbsLink, err error) {
	if v.Port == 0 {
		v.Port = 1
	}
	if w.cfg.Port != rocev2.Port || w.cfg.DataPort != rocev2.Port {
		return nil, fmt.Errorf("%w: a verbs device sends to and receives on UDP port %d, not %d and %d", ErrConfig, rocev2.Port, w.cfg.DataPort, w.cfg.Port)
	}
	l := &verbsLink{w: w, v: v, lay: layout{window: w.cfg.Window, msgB: w.msgB},
		canary: rand.New(rand.NewPCG(w.cfg.Seed^0xca4a, uint64(w.cfg.Rank))).Uint64() | 1}
	defer func() {
		if err != nil {
			l.close()
		}
	}()
	if l.c, err = ibv.Open(v.Device); err != nil {
		return nil, fmt.Errorf("switchml: verbs device: %w", err)
	}
	if l.pd, err = l.c.AllocPD(); err != nil {
		return nil, fmt.Errorf("switchml: verbs device: %w", err)
	}
	n := l.lay.size()
	p, err := unix.MmapPtr(-1, 0, unsafe.Add(nil, RegionVA), uintptr(n), unix.PROT_READ|unix.PROT_WRITE,
		unix.MAP_ANON|unix.MAP_PRIVATE|unix.MAP_FIXED_NOREPLACE)
	if err != nil {
		return nil, fmt.Errorf("switchml: mapping the result region at %#x (one verbs worker per process): %w", RegionVA, err)
	}
	l.mem = unsafe.Slice((*byte)(p), n)
	if uintptr(p) != RegionVA {
		return nil, fmt.Errorf("switchml: the result region was mapped at %p, not %#x (a kernel older than 4.17 ignores MAP_FIXED_NOREPLACE)", p, RegionVA)
	}
	if l.mr, err = l.pd.RegMR(RegionVA, n, ibv.AccessLocalWrite|ibv.AccessRemoteWrite); err != nil {
		return nil, fmt.Errorf("switchml: registering the result region: %w", err)
	}
	fillCanary(l.mem, l.canary)
	l.sent = make([]sentPlaces, w.cfg.Window)
	if l.cq, err = l.c.CreateCQ(w.cfg.Window * (recvDepth + sendDepth)); err != nil {
		return nil, fmt.Errorf("switchml: verbs device: %w", err)
	}
	return l, nil
}

func (l *verbsLink) name() string { return "verbs" }

func (l *verbsLink) announce(a *aggsrv.Announce, qps []*qp) error {
	a.RKey = l.mr.RKey()
	for _, q := range qps {
		x, err := l.pd.CreateUCQP(l.cq, l.cq, ibv.QPCaps{MaxSendWR: sendDepth, MaxRecvWR: recvDepth, MaxSendSGE: 1, MaxRecvSGE: 1})
		if err != nil {
			return fmt.Errorf("switchml: queue pair %d: %w", q.idx, err)
		}
		l.qps = append(l.qps, x)
		if err := x.ToInit(l.v.Port, 0, ibv.AccessLocalWrite|ibv.AccessRemoteWrite); err != nil {
			return fmt.Errorf("switchml: queue pair %d: %w", q.idx, err)
		}
		q.qpn = x.QPN()
		a.QPNs = append(a.QPNs, q.qpn)
		a.PSNs = append(a.PSNs, q.psn)
	}
	return nil
}

func (l *verbsLink) connect(as aggsrv.Assignment) error {
	dgid := mappedGID(as.Addr)
	recvs := make([]ibv.RecvWR, recvDepth)
	for i, q := range l.w.qps {
		x := l.qps[i]
		if err := x.ToRTR(ibv.RTRAttr{DestQPN: q.aqpn, RQPSN: q.rpsn, MTU: l.w.cfg.SlotBytes, Global: true, DGID: dgid,
			SGIDIndex: l.v.GIDIndex, HopLimit: 64, Port: l.v.Port}); err != nil {
			return fmt.Errorf("switchml: queue pair %d to aggregator %v: %w", i, ipString(as.Addr), err)
		}
		if err := x.ToRTS(ibv.RTSAttr{SQPSN: q.psn}); err != nil {
			return fmt.Errorf("switchml: queue pair %d: %w", i, err)
		}
		for k := range recvs {
			recvs[k] = ibv.RecvWR{WRID: wrID(i, true)}
		}
		if _, err := x.PostRecv(recvs, nil); err != nil {
			return fmt.Errorf("switchml: queue pair %d: posting receives: %w", i, err)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	l.stop = cancel
	l.wg.Add(1)
	go l.poll(ctx)
	return nil
}

func (l *verbsLink) replyVA(q *qp, count uint64, slot int) uint64 {
	return RegionVA + uint64(l.lay.resultOff(int(count%generations), q.idx))
}

// expect fills the message's result place with the canary, so that a
// completion can tell whether the current message's result arrived.
func (l *verbsLink) expect(q *qp, m *message) {
	off := int(m.va - RegionVA)
	fillCanary(l.mem[off:off+len(m.payload)], l.canary)
}

func (l *verbsLink) send(q *qp, m *message) error {
	w := l.w
	w.mu.Lock()
	err := l.err
	va := m.va
	if err == nil && len(m.payload) > 0 {
		var ok bool
		if va, ok = l.place(q, m); !ok {
			err = errNoPlace
		}
	}
	drop := err == nil && w.cfg.DropSend > 0 && w.rng.Float64() < w.cfg.DropSend
	if drop {
		w.stats.Dropped += uint64(m.n)
	} else if err == nil {
		w.stats.PacketsSent += uint64(m.n)
		w.stats.BytesSent += uint64(len(m.payload))
	}
	w.mu.Unlock()
	if err != nil || drop {
		return err
	}
	wr := ibv.SendWR{WRID: wrID(q.idx, false), Opcode: ibv.WRWriteImm, Flags: ibv.SendSignaled,
		RemoteAddr: va, RKey: m.rkey, Imm: m.imm}
	var sge []ibv.SGE
	if len(m.payload) > 0 {
		off := l.lay.sendOff(q.idx, m.set)
		copy(l.mem[off:], m.payload)
		wr.NumSGE = 1
		sge = []ibv.SGE{{Addr: RegionVA + uint64(off), Length: uint32(len(m.payload)), LKey: l.mr.LKey()}}
	}
	if _, err := l.qps[q.idx].PostSend([]ibv.SendWR{wr}, sge); err != nil {
		return fmt.Errorf("switchml: queue pair %d: %w", q.idx, err)
	}
	return nil
}

// place picks the result place of a send of q's data message m (w.mu
// held) and returns its address. The first send names the message's own
// place (m.va, which expect filled with the canary). A resend names a
// resend place that no reply can still come to, filled with the canary
// now, so that each place receives at most one write of another message:
// under load the aggregator answers a resend of the previous message long
// after this message went out. A place is free again once a reply to a
// later send has come (the aggregator answers the sends made before a
// message completed with one reply, to the latest).
//
// When every resend place may still receive a reply, the resend names
// again the place of this message that it named longest ago, one whose
// every pending send is of this message, without filling it again: any
// reply that lands there, to either naming, carries this message's
// result, byte for byte the same, so a late one cannot spoil it, and the
// place stays awaited (one entry per naming) until the replies to all its
// namings are accounted for. Without that, a message whose places all
// awaited a reply that was lost (the one that completed it, sent to the
// latest place after every resend had gone out) could not resend, and
// failed after Config.GiveUp. A place awaited by another message's send
// is never named: a late reply there would be taken for this message's
// result. An entry left after its place was taken (the reply to its
// naming lost) may take the completion of a later write instead, which
// then counts as stale and that message is resent: a delay, never a
// wrong result (attribute). place returns false only when no place of
// this message is awaited either: the first send's entry stays until a
// completion is taken as this message's.
func (l *verbsLink) place(q *qp, m *message) (uint64, bool) {
	sp := &l.sent[q.idx]
	if sp.last != q.count {
		sp.last = q.count
		sp.pending = append(sp.pending, placed{off: int(m.va - RegionVA), count: q.count})
		return m.va, true
	}
	for k := range resendPlaces {
		off := l.lay.resultOff(generations+k, q.idx)
		if !slices.ContainsFunc(sp.pending, func(p placed) bool { return p.off == off }) {
			fillCanary(l.mem[off:off+len(m.payload)], l.canary)
			sp.pending = append(sp.pending, placed{off: off, count: q.count})
			return RegionVA + uint64(off), true
		}
	}
	// Every resend place is awaited: name again this message's place
	// whose latest naming is the oldest.
	lastNamed := map[int]int{} // place: index of its latest entry
	other := map[int]bool{}    // places awaited by another message's send
	for i, p := range sp.pending {
		if p.count != q.count {
			other[p.off] = true
		}
		lastNamed[p.off] = i
	}
	best, bestAt := -1, len(sp.pending)
	for off, i := range lastNamed {
		if !other[off] && i < bestAt {
			best, bestAt = off, i
		}
	}
	if best < 0 {
		return 0, false
	}
	sp.pending = append(sp.pending, placed{off: best, count: q.count})
	return RegionVA + uint64(best), true
}

// poll takes completions until ctx ends, sleeping on the completion
// channel when there are none.
func (l *verbsLink) poll(ctx context.Context) {
	defer l.wg.Done()
	wc := make([]ibv.WC, 64)
	armed := false
	for {
		n, err := l.cq.Poll(wc)
		if err != nil {
			l.fail(err)
			return
		}
		if n == 0 {
			if !armed {
				if err := l.cq.Arm(); err != nil {
					l.fail(err)
					return
				}
				armed = true
				continue // a completion may have come before the arm
			}
			if err := l.cq.WaitEvent(ctx); err != nil {
				if ctx.Err() == nil {
					l.fail(err)
				}
				return
			}
			armed = false
			continue
		}
		for _, e := range wc[:n] {
			l.complete(e)
		}
	}
}

func (l *verbsLink) fail(err error) {
	w := l.w
	w.mu.Lock()
	if l.err == nil {
		l.err = fmt.Errorf("switchml: verbs device %s: %w", l.v.Device, err)
	}
	w.mu.Unlock()
}

// complete handles one completion: a send's is only checked; a receive's
// is reposted and, if it is the current message's result, handed over.
func (l *verbsLink) complete(e ibv.WC) {
	qi, recv := wrQP(e.WRID)
	w := l.w
	if qi >= len(w.qps) {
		return
	}
	if e.Status != ibv.WCSuccess {
		l.fail(fmt.Errorf("queue pair %d: completion status %d (vendor error %#x)", qi, e.Status, e.VendorErr))
		return
	}
	if !recv {
		return
	}
	if _, err := l.qps[qi].PostRecv([]ibv.RecvWR{{WRID: wrID(qi, true)}}, nil); err != nil {
		l.fail(fmt.Errorf("queue pair %d: reposting a receive: %w", qi, err))
	}
	q := w.qps[qi]
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.cfg.DropRecv > 0 && w.rng.Float64() < w.cfg.DropRecv {
		w.stats.Dropped++
		return
	}
	off, ok := l.attribute(q, e)
	if !ok {
		w.stats.StaleReplies++
		return
	}
	r := reply{va: q.want, imm: e.Imm, buf: append([]byte(nil), l.mem[off:off+q.wantSize]...)}
	q.want = 0
	select {
	case q.result <- r:
	default:
	}
}

// attribute says which write completion e reports (w.mu held) and returns
// the offset of the current message's result if it is that message's
// reply.
//
// A completion does not carry the address its write went to, and a queue
// pair receives, besides the current message's reply, second replies to
// resends of earlier messages (the aggregator answers a resend of a
// completed message again). Each send names a place of its own, filled
// with the canary before the send (place), and completions come in the
// order of the writes, which is the order of the sends: the aggregator
// answers a queue pair's requests in order, and its replies keep that
// order. So the write a completion reports is the one to the first
// awaited place, in send order, that no longer holds the canary; the
// places before it were never written and never will be (their replies
// would have come first), so they are no longer awaited. Checking only
// the current message's place would be wrong: a second reply's
// completion can be handled while the current reply is still being
// written into its place, which then holds part of the result and part
// of the canary.
//
// A place whose last slot still holds the canary was cut short (a
// multi-packet write whose last packet was lost, which completes
// nothing); it is passed over, and given up once a later place is
// written.
//
// An exponent-only message has no payload, so its place shows nothing: an
// empty write with immediate is its reply if one is awaited. (A queue
// pair always sends a data message between two exponent-only ones, and a
// second reply to the first comes before the reply to that data message.)
func (l *verbsLink) attribute(q *qp, e ibv.WC) (int, bool) {
	if e.ByteLen == 0 {
		return 0, q.want != 0 && q.wantSize == 0 && e.Flags&ibv.WCWithImm != 0
	}
	sp := &l.sent[q.idx]
	slot := l.w.cfg.SlotBytes
	for i, p := range sp.pending {
		end := p.off + l.lay.msgB
		if isCanary(l.mem[end-slot:end], l.canary) {
			continue
		}
		sp.pending = sp.pending[i+1:]
		if q.want == 0 || p.count != q.count || q.wantSize == 0 || int(e.ByteLen) != q.wantSize || e.Flags&ibv.WCWithImm == 0 {
			return 0, false
		}
		return p.off, true
	}
	return 0, false
}

// close stops the poller and releases the queue pairs, the queue, the
// region and the device.
func (l *verbsLink) close() error {
	if l.stop != nil {
		l.stop()
	}
	l.wg.Wait()
	var errs []error
	for _, x := range l.qps {
		errs = append(errs, x.Close())
	}
	if l.cq != nil {
		errs = append(errs, l.cq.Close())
	}
	if l.mr != nil {
		errs = append(errs, l.mr.Close())
	}
	if l.mem != nil {
		errs = append(errs, unix.MunmapPtr(unsafe.Pointer(unsafe.SliceData(l.mem)), uintptr(len(l.mem))))
	}
	if l.pd != nil {
		errs = append(errs, l.pd.Close())
	}
	if l.c != nil {
		errs = append(errs, l.c.Close())
	}
	l.qps, l.cq, l.mr, l.mem, l.pd, l.c = nil, nil, nil, nil, nil, nil
	return errors.Join(errs...)
}

package worker

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/gdrlink/gdrlink/internal/switchml/aggsrv"
	"github.com/gdrlink/gdrlink/internal/switchml/rocev2"
)

// udpLink is the UDP transport: the worker builds the RoCEv2 packets of UC
// queue pairs itself and sends them over a UDP socket bound at Local:Port;
// its receive loop is the UC responder of every queue pair.
type udpLink struct {
	w      *Worker
	sock   *net.UDPConn
	agg    netip.AddrPort
	aggIP  [4]byte
	byQPN  map[uint32]*qp
	mangle func([]byte)          // tests: changes a packet about to be sent
	link   func([]byte) [][]byte // tests: what the link delivers for a packet sent
	wg     sync.WaitGroup
}

// vaBase is where results land over UDP: message m of a queue pair at
// vaBase + (m<<20) + slot<<8, slot being the message's first (addresses
// only name replies; no memory is behind them).
const vaBase = 1 << 40

func newUDPLink(w *Worker) (*udpLink, error) {
	sock, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IP(w.cfg.Local[:]), Port: int(w.cfg.Port)})
	if err != nil {
		return nil, fmt.Errorf("switchml: data socket: %w", err)
	}
	if err := dontFragment(sock); err != nil {
		sock.Close()
		return nil, err
	}
	return &udpLink{w: w, sock: sock, byQPN: map[uint32]*qp{}}, nil
}

func dontFragment(c *net.UDPConn) error {
	rc, err := c.SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	if err := rc.Control(func(fd uintptr) {
		serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_IP, unix.IP_MTU_DISCOVER, unix.IP_PMTUDISC_DO)
	}); err != nil || serr != nil {
		return fmt.Errorf("switchml: setting don't-fragment: %w", errors.Join(err, serr))
	}
	return nil
}

func (u *udpLink) name() string { return "udp" }

func (u *udpLink) announce(a *aggsrv.Announce, qps []*qp) error {
	a.RKey = 0x5a00 | uint32(u.w.cfg.Rank)
	for _, q := range qps {
		q.qpn = uint32(0x1000 + q.idx)
		u.byQPN[q.qpn] = q
		a.QPNs = append(a.QPNs, q.qpn)
		a.PSNs = append(a.PSNs, q.psn)
	}
	return nil
}

func (u *udpLink) connect(as aggsrv.Assignment) error {
	u.aggIP = as.Addr
	u.agg = netip.AddrPortFrom(netip.AddrFrom4(as.Addr), u.w.cfg.DataPort)
	u.wg.Add(1)
	go u.receive()
	return nil
}

func (u *udpLink) replyVA(q *qp, count uint64, slot int) uint64 {
	return uint64(vaBase) + count<<20 + uint64(slot)<<8
}

func (u *udpLink) expect(*qp, *message) {}

func (u *udpLink) close() error {
	err := u.sock.Close()
	u.wg.Wait()
	return err
}

// receive is the UC responder of every queue pair: it reassembles the
// aggregator's writes and hands a complete one to its queue pair.
func (u *udpLink) receive() {
	defer u.wg.Done()
	buf := make([]byte, 1<<16)
	for {
		n, from, err := u.sock.ReadFromUDPAddrPort(buf)
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			continue
		}
		u.handle(buf[:n], from)
	}
}

func (u *udpLink) handle(b []byte, from netip.AddrPort) {
	w := u.w
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.cfg.DropRecv > 0 && w.rng.Float64() < w.cfg.DropRecv {
		w.stats.Dropped++
		return
	}
	p, err := rocev2.ParseTransport(b)
	if err != nil || !from.Addr().Is4() {
		w.stats.StaleReplies++
		return
	}
	ip := rocev2.IPv4{Src: from.Addr().As4(), Dst: w.cfg.Local, DontFragment: true, SrcPort: from.Port()}
	if rocev2.CheckICRC(&ip, b) != nil {
		w.stats.StaleReplies++
		return
	}
	q := u.byQPN[p.DestQP]
	if q == nil {
		w.stats.StaleReplies++
		return
	}
	if p.Opcode.Starts() {
		q.active, q.va, q.buf, q.size = true, p.VA, q.buf[:0], int(p.DMALen)
		if q.size != w.msgB && (q.size != 0 || p.Opcode != rocev2.WriteOnlyWithImm) {
			q.active = false
		}
	} else if !q.active || p.PSN != q.rpsn {
		q.active = false
	}
	q.rpsn = (p.PSN + 1) & psnMask
	if !q.active || len(p.Payload) != min(q.size, w.cfg.SlotBytes) {
		q.active = false
		w.stats.StaleReplies++
		return
	}
	q.buf = append(q.buf, p.Payload...)
	if !p.Opcode.Ends() {
		return
	}
	q.active = false
	if len(q.buf) != q.size || q.va != q.want {
		w.stats.StaleReplies++
		return
	}
	q.want = 0
	r := reply{va: q.va, imm: p.Imm, buf: append([]byte(nil), q.buf...)}
	select {
	case q.result <- r:
	default:
	}
}

// send builds m's packets with q's next PSNs and sends them.
func (u *udpLink) send(q *qp, m *message) error {
	w := u.w
	ip := rocev2.IPv4{Src: w.cfg.Local, Dst: u.aggIP, DontFragment: true, SrcPort: w.cfg.Port}
	pkt := q.sbuf
	defer func() { q.sbuf = pkt }()
	for k := range m.n {
		p := rocev2.Packet{DestQP: q.aqpn, PSN: q.psn, PKey: rocev2.DefaultPKey}
		if m.payload != nil {
			p.Payload = m.payload[k*w.cfg.SlotBytes : (k+1)*w.cfg.SlotBytes]
		}
		q.psn = (q.psn + 1) & psnMask
		p.Opcode = rocev2.WriteWithImmOpcode(k, m.n)
		if k == 0 {
			p.VA, p.RKey, p.DMALen = m.va, m.rkey, uint32(len(m.payload))
		}
		if p.Opcode.HasImm() {
			p.Imm = m.imm
		}
		var err error
		if pkt, err = rocev2.AppendUDP(pkt[:0], &ip, &p); err != nil {
			return err
		}
		w.mu.Lock()
		drop := w.cfg.DropSend > 0 && w.rng.Float64() < w.cfg.DropSend
		if drop {
			w.stats.Dropped++
		} else {
			w.stats.PacketsSent++
			w.stats.BytesSent += uint64(len(p.Payload))
		}
		w.mu.Unlock()
		if drop {
			continue
		}
		if u.mangle != nil {
			u.mangle(pkt)
		}
		one := [1][]byte{pkt}
		out := one[:]
		if u.link != nil {
			out = u.link(pkt)
		}
		for _, b := range out {
			if _, err := u.sock.WriteToUDPAddrPort(b, u.agg); err != nil && !errors.Is(err, unix.ECONNREFUSED) {
				return fmt.Errorf("switchml: sending to aggregator %v: %w", u.agg, err)
			}
		}
	}
	return nil
}

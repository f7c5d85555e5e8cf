// Package aggsrv serves the SwitchML aggregator's protocol core (package
// agg) on the network: RoCEv2 packets on a UDP socket, and a control
// endpoint, authenticated with the job key, where workers set up jobs.
//
// Packets go out through an ordinary UDP socket, so the kernel writes
// the IPv4 and UDP headers that the ICRC covers: the socket sets
// don't-fragment, and Linux then writes IP ID 0 (an unconnected socket's
// DF packets), which the ICRC is computed for (TestICRCOnTheWire checks the
// packets as sent).
//
// On the way in, the ICRC covers the sender's IP ID too, and a UDP socket
// does not show it. Read from the UDP socket (Config.RawIPv4 RawOff), the
// ICRC is checked assuming ID 0 and DF, which is what the software worker
// (package worker, an unconnected UDP socket with DF set) sends.
// Soft-RoCE does not: rxe writes an IP ID of its own choosing
// (__ip_select_ident), so every request from rxe fails that check, and
// hardware NICs need not write 0 either. With RawOn (or RawAuto where the
// process has CAP_NET_RAW) the server reads packets from a raw IPv4 socket
// instead, which shows each packet's IPv4 header as it arrived, and checks
// the ICRC over the true ID (TestRawICRC on loopback, TestRXEWorkers
// against rxe). Config.SkipICRC turns the check off altogether.
package aggsrv

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"sort"
	"sync"
	"time"

	"golang.org/x/net/ipv4"
	"golang.org/x/sys/unix"

	"github.com/gdrlink/gdrlink/internal/jobauth"
	"github.com/gdrlink/gdrlink/internal/switchml/agg"
	"github.com/gdrlink/gdrlink/internal/switchml/rocev2"
)

// MaxSlots is the number of slots the pool index of an rkey can name.
const MaxSlots = (agg.MaxPoolIndex + 1) / 2

// Errors of the package.
var (
	// ErrClosed means the server was closed.
	ErrClosed = errors.New("aggsrv: closed")
	// ErrSetup means a job that could not be set up (the assignment's
	// Err says why).
	ErrSetup = errors.New("aggsrv: job setup refused")
)

// Config configures a server.
type Config struct {
	// Key is the job key workers must prove on the control endpoint.
	// Without one, the control endpoint must be on loopback and the rank
	// of an announce is taken as it comes.
	Key jobauth.Key
	// Control accepts workers' control connections.
	Control net.Listener
	// Data is the RoCEv2 socket, bound to one IPv4 address (not the
	// wildcard: the ICRC covers the address); port 4791 for real NICs.
	Data *net.UDPConn
	// PeerPort is the UDP port replies go to; rocev2.Port when zero.
	PeerPort uint16
	// SkipICRC accepts packets without checking their ICRC.
	SkipICRC bool
	// RawIPv4 says whether data packets are read from a raw IPv4 socket,
	// which shows their IP ID, or from Data (see the package doc); RawOff
	// when zero.
	RawIPv4 RawMode
	// SetupTimeout bounds the handshake and the wait for a job's other
	// workers; 60 s when zero.
	SetupTimeout time.Duration
	// Seed seeds the aggregator's starting PSNs.
	Seed uint64
	// Logger, when set, gets setup events and refused connections.
	Logger *slog.Logger
	// Drop, between 0 and 1, drops that share of the packets received
	// and of the reply packets, at random (from Seed), to test loss.
	Drop float64
}

// Stats counts the data path.
type Stats struct {
	agg.Stats
	BadPackets uint64 // UDP payloads that did not parse
	BadICRC    uint64 // packets whose ICRC was wrong
	Injected   uint64 // packets dropped on purpose (Config.Drop)
	SendErrors uint64 // replies the socket refused
	Jobs       int    // jobs running
}

// Server is a running aggregator.
type Server struct {
	cfg   Config
	local [4]byte
	port  uint16
	raw   *net.IPConn      // the raw IPv4 socket data is read from, or nil
	rawPC *ipv4.PacketConn // raw's batch reader

	mu      sync.Mutex
	core    *agg.Aggregator
	jobs    map[int]*job
	pending map[string]*job
	// refused holds the jobs whose ranks disagreed, so that the ranks
	// still to announce hear it at once.
	refused map[string]refusal
	stats   Stats
	// dropLogs counts the drops told to the logger (the data loop's).
	dropLogs int
	closed   bool
	conns    map[net.Conn]bool
	wg       sync.WaitGroup
	done     chan struct{}
}

// job is a job being set up or running.
type job struct {
	name    string
	ann     Announce // the first worker's, which the others must match
	members []*member
	id      int
	base    int
	running bool
	ready   chan struct{} // closed when set up or refused
	err     string
	addrs   []*net.UDPAddr // each worker's, where its replies go
	ended   bool
}

type member struct {
	conn net.Conn
	ann  Announce
	eps  []agg.Endpoint
	// wmu orders what goes to the worker: its Assignment first, then an
	// Ended notice. assigned says the Assignment went; ended is a notice
	// that came before it, written right after it.
	wmu      sync.Mutex
	assigned bool
	ended    []byte
}

// New makes a server; Serve runs it.
func New(cfg Config) (*Server, error) {
	la, ok := cfg.Data.LocalAddr().(*net.UDPAddr)
	if !ok || la.IP.To4() == nil || la.IP.IsUnspecified() {
		return nil, fmt.Errorf("aggsrv: the data socket must be bound to one IPv4 address, not %v", cfg.Data.LocalAddr())
	}
	if cfg.PeerPort == 0 {
		cfg.PeerPort = rocev2.Port
	}
	if cfg.SetupTimeout == 0 {
		cfg.SetupTimeout = 60 * time.Second
	}
	if cfg.Key.IsZero() {
		if err := jobauth.CheckListen(cfg.Key, cfg.Control.Addr().String(), false); err != nil {
			return nil, err
		}
	}
	rc, err := cfg.Data.SyscallConn()
	if err != nil {
		return nil, err
	}
	var serr error
	if err := rc.Control(func(fd uintptr) {
		serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_IP, unix.IP_MTU_DISCOVER, unix.IP_PMTUDISC_DO)
	}); err != nil || serr != nil {
		return nil, fmt.Errorf("aggsrv: setting don't-fragment on the data socket: %w", errors.Join(err, serr))
	}
	s := &Server{cfg: cfg, port: uint16(la.Port), core: agg.New(cfg.Seed), jobs: map[int]*job{},
		pending: map[string]*job{}, refused: map[string]refusal{}, conns: map[net.Conn]bool{}, done: make(chan struct{})}
	copy(s.local[:], la.IP.To4())
	if cfg.RawIPv4 != RawOff {
		raw, pc, err := listenRaw(la.IP, s.port)
		if err == nil {
			err = dropAll(cfg.Data)
			if err != nil {
				raw.Close()
			}
		}
		switch {
		case err == nil:
			s.raw, s.rawPC = raw, pc
		case cfg.RawIPv4 == RawAuto:
			s.logf("switchml data path: no raw IPv4 socket, reading the UDP socket (the ICRC is checked assuming IP ID 0)", "err", err)
		default:
			return nil, err
		}
	}
	if s.raw != nil {
		s.logf("switchml data path: reading a raw IPv4 socket (the ICRC is checked over each packet's IP ID)", "addr", la)
	}
	return s, nil
}

// RawIPv4 says whether the server reads data packets from a raw IPv4
// socket (Config.RawIPv4).
func (s *Server) RawIPv4() bool { return s.raw != nil }

// Serve runs the control endpoint and the data path until Close; it
// returns ErrClosed then.
func (s *Server) Serve() error {
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		s.data()
	}()
	for {
		c, err := s.cfg.Control.Accept()
		if err != nil {
			s.mu.Lock()
			closed := s.closed
			s.mu.Unlock()
			if closed {
				return ErrClosed
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			return err
		}
		s.mu.Lock()
		if s.closed {
			s.mu.Unlock()
			c.Close()
			return ErrClosed
		}
		s.conns[c] = true
		s.wg.Add(1)
		s.mu.Unlock()
		go func() {
			defer s.wg.Done()
			s.control(c)
		}()
	}
}

// Close stops the server and waits for its goroutines; it is idempotent.
func (s *Server) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	close(s.done)
	for c := range s.conns {
		c.Close()
	}
	s.mu.Unlock()
	err := errors.Join(s.cfg.Control.Close(), s.cfg.Data.Close())
	if s.raw != nil {
		err = errors.Join(err, s.raw.Close())
	}
	s.wg.Wait()
	return err
}

// Stats returns the counters.
func (s *Server) Stats() Stats {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := s.stats
	st.Stats = s.core.Stats()
	st.Jobs = len(s.jobs)
	return st
}

func (s *Server) logf(msg string, args ...any) {
	if s.cfg.Logger != nil {
		s.cfg.Logger.Info(msg, args...)
	}
}

// maxDropLogs is how many packets the core drops before the logger stops
// hearing of each.
const maxDropLogs = 20

// batch is how many packets the data loop reads, and replies it writes,
// per system call (recvmmsg and sendmmsg on Linux).
const batch = 64

// maxPacket bounds a data packet the loop reads: a 1024-byte slot with
// its headers and ICRC fits with room to spare; a longer one is cut and
// then fails its ICRC.
const maxPacket = 4096

// data is the packet loop: it reads packets in batches (from the raw
// IPv4 socket when there is one), hands each to the core, and writes the
// replies of a batch together through the UDP socket.
func (s *Server) data() {
	pc := ipv4.NewPacketConn(s.cfg.Data)
	rpc := pc
	if s.rawPC != nil {
		rpc = s.rawPC
	}
	in := make([]ipv4.Message, batch)
	for i := range in {
		in[i].Buffers = [][]byte{make([]byte, maxPacket)}
	}
	loss := rand.New(rand.NewPCG(s.cfg.Seed, 0x1055))
	var out []agg.Reply
	var w writer
	for {
		n, err := rpc.ReadBatch(in, 0)
		if err != nil {
			select {
			case <-s.done:
				return
			default:
			}
			continue
		}
		s.mu.Lock()
		for i := range in[:n] {
			b := in[i].Buffers[0][:in[i].N]
			var ip rocev2.IPv4
			if s.raw != nil {
				var ok bool
				if ip, b, ok = parseRaw(b, s.port); !ok {
					s.stats.BadPackets++
					continue
				}
			} else {
				from, _ := in[i].Addr.(*net.UDPAddr)
				if from == nil || from.IP.To4() == nil {
					continue
				}
				// What an unconnected UDP socket with DF set sends.
				ip = rocev2.IPv4{DontFragment: true, SrcPort: uint16(from.Port)}
				copy(ip.Src[:], from.IP.To4())
			}
			ip.Dst = s.local
			out = s.packet(b, &ip, loss, out[:0], &w)
		}
		s.mu.Unlock()
		if failed := w.flush(pc); failed > 0 {
			s.mu.Lock()
			s.stats.SendErrors += failed
			s.mu.Unlock()
		}
	}
}

// packet handles one packet, the UDP payload b that came with the IPv4
// and UDP header fields in ip, queueing its replies on w; s.mu is held.
func (s *Server) packet(b []byte, ip *rocev2.IPv4, loss *rand.Rand, out []agg.Reply, w *writer) []agg.Reply {
	p, err := rocev2.ParseTransport(b)
	if s.cfg.Drop > 0 && loss.Float64() < s.cfg.Drop {
		s.stats.Injected++
		return out
	}
	if err != nil {
		s.stats.BadPackets++
		return out
	}
	if !s.cfg.SkipICRC {
		// The pseudo header names 4791 as the destination port, as on
		// the wire (a server bound elsewhere, in tests, is sent packets
		// made the same way).
		if err := rocev2.CheckICRC(ip, b); err != nil {
			s.stats.BadICRC++
			return out
		}
	}
	out, err = s.core.Handle(&p, out)
	if err != nil && s.cfg.Logger != nil && s.dropLogs < maxDropLogs {
		s.dropLogs++
		s.cfg.Logger.Debug("switchml data path: packet dropped", "err", err, "src", net.IP(ip.Src[:]).String())
	}
	for i := range out {
		j := s.jobs[out[i].Job]
		if j == nil {
			continue
		}
		if s.cfg.Drop > 0 && loss.Float64() < s.cfg.Drop {
			s.stats.Injected++
			continue
		}
		to := j.addrs[out[i].Worker]
		rip := rocev2.IPv4{Src: s.local, DontFragment: true, TTL: 64, SrcPort: s.port}
		copy(rip.Dst[:], to.IP.To4())
		wb, err := rocev2.AppendUDP(w.next(), &rip, &out[i].Packet)
		if err != nil {
			s.stats.SendErrors++
			continue
		}
		w.add(wb, to)
	}
	return out
}

// writer gathers reply datagrams and sends them in batches. Its buffers
// and each message's one-buffer vector are kept between batches, so that
// a reply allocates nothing.
type writer struct {
	msgs []ipv4.Message
	bufs [][]byte   // kept between batches
	iovs [][][]byte // msgs[i].Buffers, one buffer each
}

// next returns an empty buffer for the next datagram.
func (w *writer) next() []byte {
	if len(w.msgs) < len(w.bufs) {
		return w.bufs[len(w.msgs)][:0]
	}
	return make([]byte, 0, maxPacket)
}

// add queues datagram b (from next) to to.
func (w *writer) add(b []byte, to net.Addr) {
	if len(w.msgs) < len(w.bufs) {
		w.bufs[len(w.msgs)] = b
	} else {
		w.bufs = append(w.bufs, b)
	}
	i := len(w.msgs)
	if i == len(w.iovs) {
		w.iovs = append(w.iovs, make([][]byte, 1))
	}
	w.iovs[i][0] = b
	w.msgs = append(w.msgs, ipv4.Message{Buffers: w.iovs[i], Addr: to})
}

// flush sends the queued datagrams, batch at a time, and returns how many
// could not be sent (a worker's port closed, say).
func (w *writer) flush(pc *ipv4.PacketConn) (failed uint64) {
	m := w.msgs
	for len(m) > 0 {
		n, err := pc.WriteBatch(m[:min(len(m), batch)], 0)
		if err != nil {
			failed++
			n = max(n, 0) + 1 // skip the one that failed
		}
		m = m[min(n, len(m)):]
	}
	clear(w.msgs)
	w.msgs = w.msgs[:0]
	return failed
}

// control serves one worker's control connection.
func (s *Server) control(c net.Conn) {
	defer func() {
		s.mu.Lock()
		delete(s.conns, c)
		s.mu.Unlock()
		c.Close()
	}()
	deadline := time.Now().Add(s.cfg.SetupTimeout)
	c.SetDeadline(deadline)
	rank := -1
	if !s.cfg.Key.IsZero() {
		r, err := jobauth.Accept(c, s.cfg.Key, Purpose, jobauth.EndsOf(c, false))
		if err != nil {
			s.logf("switchml control connection refused", "from", c.RemoteAddr(), "err", err)
			return
		}
		rank = int(r)
	}
	body, err := readMessage(c)
	if err != nil {
		return
	}
	a, err := ParseAnnounce(body)
	if err == nil && rank >= 0 && a.Rank != rank {
		err = fmt.Errorf("rank %d announced, %d proven with the job key", a.Rank, rank)
	}
	if err != nil {
		writeMessage(c, (&Assignment{Err: err.Error()}).Append(nil))
		return
	}
	j, m, err := s.join(c, a)
	if err != nil {
		writeMessage(c, (&Assignment{Err: err.Error()}).Append(nil))
		return
	}
	select {
	case <-j.ready:
	case <-time.After(time.Until(deadline)):
		s.refuse(j, fmt.Sprintf("not every worker of job %q announced within %v", j.name, s.cfg.SetupTimeout))
		<-j.ready
	case <-s.done:
		return
	}
	as := Assignment{Err: j.err, Base: j.base, Addr: s.local}
	if j.err == "" {
		for _, e := range m.eps {
			as.QPNs = append(as.QPNs, e.QPN)
			as.PSNs = append(as.PSNs, e.PSN)
		}
	}
	c.SetDeadline(time.Time{})
	m.wmu.Lock()
	err = writeMessage(c, as.Append(nil))
	m.assigned = true
	if err == nil && m.ended != nil {
		// Another worker left as soon as its Assignment came.
		c.SetWriteDeadline(time.Now().Add(time.Second))
		writeMessage(c, m.ended)
		m.wmu.Unlock()
		return
	}
	m.wmu.Unlock()
	if err != nil || j.err != "" {
		s.end(j, m, err)
		return
	}
	// The job runs while every worker's connection stays open; a worker
	// that leaves on purpose may say why first (Leave).
	body, err = readMessage(c)
	switch {
	case errors.Is(err, io.ErrUnexpectedEOF):
		err = io.EOF
	case err == nil:
		var l Leave
		if l, err = ParseLeave(body); err == nil {
			err = &leaveError{why: l.Why}
		}
	}
	s.end(j, m, err)
}

// leaveError is why a job ended when a worker sent a Leave.
type leaveError struct{ why string }

func (e *leaveError) Error() string { return e.why }

// join adds an announce to its job, and sets the job up when it is the
// last one awaited.
func (s *Server) join(c net.Conn, a Announce) (*job, *member, error) {
	switch {
	case a.Workers > agg.MaxWorkers:
		return nil, nil, fmt.Errorf("job %q: %d workers, at most %d", a.Job, a.Workers, agg.MaxWorkers)
	case a.SlotBytes != agg.SlotSmall && a.SlotBytes != agg.SlotLarge:
		return nil, nil, fmt.Errorf("job %q: %d-byte slots, want %d or %d", a.Job, a.SlotBytes, agg.SlotSmall, agg.SlotLarge)
	case a.Slots < 1 || a.Slots > MaxSlots:
		return nil, nil, fmt.Errorf("job %q: %d slots, want 1..%d", a.Job, a.Slots, MaxSlots)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if r, ok := s.refused[a.Job]; ok {
		if time.Now().Before(r.until) {
			return nil, nil, errors.New(r.why)
		}
		delete(s.refused, a.Job)
	}
	j := s.pending[a.Job]
	if j == nil {
		j = &job{name: a.Job, ann: a, ready: make(chan struct{})}
		s.pending[a.Job] = j
	}
	f := j.ann
	if a.Workers != f.Workers || a.SlotBytes != f.SlotBytes || a.Slots != f.Slots {
		// The ranks disagree on the job's shape (message sizes differ
		// when the slot counts do): no rank of it can run, so every
		// rank that announced is told now, and those still to come
		// until the setup timeout has passed, rather than after it.
		why := fmt.Sprintf("job %q: rank %d announced %d workers, %d-byte slots, %d slots; rank %d announced %d, %d, %d: the ranks must agree (the same message size, GDRLINK_SWITCHML_MSG_PACKETS)",
			a.Job, a.Rank, a.Workers, a.SlotBytes, a.Slots, f.Rank, f.Workers, f.SlotBytes, f.Slots)
		delete(s.pending, a.Job)
		j.err = why
		close(j.ready)
		for name, r := range s.refused {
			if time.Now().After(r.until) {
				delete(s.refused, name)
			}
		}
		s.refused[a.Job] = refusal{why: why, until: time.Now().Add(s.cfg.SetupTimeout)}
		s.logf("switchml job refused", "job", a.Job, "why", why)
		return nil, nil, errors.New(why)
	}
	for _, m := range j.members {
		if m.ann.Rank == a.Rank {
			return nil, nil, fmt.Errorf("job %q: rank %d announced twice", a.Job, a.Rank)
		}
	}
	m := &member{conn: c, ann: a}
	j.members = append(j.members, m)
	if len(j.members) < a.Workers {
		return j, m, nil
	}
	delete(s.pending, a.Job)
	sort.Slice(j.members, func(x, y int) bool { return j.members[x].ann.Rank < j.members[y].ann.Rank })
	base, ok := s.place(a.Slots)
	if !ok {
		j.err = fmt.Sprintf("job %q: no room for %d slots", a.Job, a.Slots)
		close(j.ready)
		return j, m, nil
	}
	spec := agg.Job{Base: base, Slots: a.Slots, SlotBytes: a.SlotBytes}
	for _, mm := range j.members {
		spec.Workers = append(spec.Workers, agg.Worker{QPNs: mm.ann.QPNs, PSNs: mm.ann.PSNs, RKey: mm.ann.RKey})
		j.addrs = append(j.addrs, &net.UDPAddr{IP: net.IP(append([]byte(nil), mm.ann.Addr[:]...)), Port: int(s.cfg.PeerPort)})
	}
	id, eps, err := s.core.AddJob(spec)
	if err != nil {
		j.err = err.Error()
		close(j.ready)
		return j, m, nil
	}
	for i, mm := range j.members {
		mm.eps = eps[i]
	}
	j.id, j.base, j.running = id, base, true
	s.jobs[id] = j
	s.logf("switchml job set up", "job", a.Job, "workers", a.Workers, "slots", a.Slots, "base", base)
	close(j.ready)
	return j, m, nil
}

// refusal is why a job was refused, said to its ranks that announce until
// until.
type refusal struct {
	why   string
	until time.Time
}

// place finds room for n slots among the running jobs' ranges.
func (s *Server) place(n int) (int, bool) {
	type r struct{ lo, hi int }
	var used []r
	for _, j := range s.jobs {
		used = append(used, r{j.base, j.base + j.ann.Slots})
	}
	sort.Slice(used, func(a, b int) bool { return used[a].lo < used[b].lo })
	at := 0
	for _, u := range used {
		if u.lo-at >= n {
			return at, true
		}
		at = max(at, u.hi)
	}
	return at, MaxSlots-at >= n && n > 0
}

// refuse ends a job still being set up.
func (s *Server) refuse(j *job, why string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	select {
	case <-j.ready:
		return
	default:
	}
	if s.pending[j.name] == j {
		delete(s.pending, j.name)
	}
	j.err = why
	close(j.ready)
}

// end ends a running job once, because member gone's connection ended
// with why: its queue pairs go, and every other worker is told which rank
// left (an Ended message) before its connection is closed.
func (s *Server) end(j *job, gone *member, why error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if j.ended {
		return
	}
	j.ended = true
	if j.running {
		s.core.RemoveJob(j.id)
		delete(s.jobs, j.id)
		s.logf("switchml job ended", "job", j.name, "left", gone.ann.Rank, "why", why)
	}
	var left *leaveError
	notice := (&Ended{Rank: gone.ann.Rank, Why: fmt.Sprint(why), Abandoned: errors.As(why, &left)}).Append(nil)
	for _, m := range j.members {
		m.wmu.Lock()
		if m != gone && j.running && !m.assigned {
			// Its Assignment has not gone yet: the notice follows it,
			// and its connection closes after that.
			m.ended = notice
			m.wmu.Unlock()
			continue
		}
		if m != gone && j.running {
			// A bounded write: the connection's buffer takes it, or the
			// worker is gone too.
			m.conn.SetWriteDeadline(time.Now().Add(time.Second))
			writeMessage(m.conn, notice)
		}
		m.wmu.Unlock()
		m.conn.Close()
	}
}

// readMessage reads one length-prefixed control message.
func readMessage(r io.Reader) ([]byte, error) {
	var h [2]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return nil, err
	}
	n := int(binary.BigEndian.Uint16(h[:]))
	if n > MaxMessage {
		return nil, fmt.Errorf("%w: %d bytes", ErrMessage, n)
	}
	b := make([]byte, n)
	_, err := io.ReadFull(r, b)
	return b, err
}

// writeMessage writes one length-prefixed control message.
func writeMessage(w io.Writer, body []byte) error {
	_, err := w.Write(append(binary.BigEndian.AppendUint16(nil, uint16(len(body))), body...))
	return err
}

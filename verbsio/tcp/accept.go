package tcp

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"time"

	"github.com/gdrlink/gdrlink/internal/jobauth"
	"github.com/gdrlink/gdrlink/verbsio"
)

// The accepting side of lanes.
const (
	// lanePurpose names the lanes' jobauth handshakes, so that a handshake
	// made for another kind of connection of the job cannot open a lane.
	lanePurpose = "tcp-lane"
	// acceptTimeout bounds an accepted connection's handshake and hello,
	// together.
	acceptTimeout = 10 * time.Second
	// maxUnproven bounds the accepted connections whose other end has
	// proven nothing yet: not the job key (with a key), not a hello naming
	// a queue pair (without). A newer connection beyond it evicts the
	// oldest: refusing the newest instead would let that many idle
	// connections lock the job's own lanes out until acceptTimeout.
	maxUnproven = 64
	// maxUnprovenPerHost bounds the unproven connections from one address
	// (IP, whatever the port): beyond it, the oldest of that address is
	// closed, so that one flooding address holds at most this many of the
	// maxUnproven and cannot evict the connections of others. The oldest
	// goes rather than the newest for the reason above: the job's own
	// processes on the flooding host (every local process shares
	// 127.0.0.1) still get their lanes through.
	maxUnprovenPerHost = 16
	// authMagic starts jobauth's handshake on the wire: a device without
	// a key that reads it instead of a hello tells the two apart.
	authMagic = "GDRA"
)

// pending is an accepted connection whose hello is not answered yet.
type pending struct {
	seq    uint64
	host   string // the other end's IP
	proven bool
}

// hostOf is the IP of addr, or all of it when it has no port.
func hostOf(addr net.Addr) string {
	s := addr.String()
	if h, _, err := net.SplitHostPort(s); err == nil {
		return h
	}
	return s
}

func (d *device) acceptLoop() {
	defer d.wg.Done()
	for {
		c, err := d.ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			time.Sleep(10 * time.Millisecond)
			continue
		}
		d.mu.Lock()
		if d.closed {
			d.mu.Unlock()
			c.Close()
			return
		}
		host := hostOf(c.RemoteAddr())
		var evicted net.Conn
		var why error
		switch {
		case d.unprovenBy[host] >= maxUnprovenPerHost:
			evicted = d.oldestUnprovenLocked(host)
			why = fmt.Errorf("%w: tcp: connection from %s closed before proving anything, to make room: %s opened %d newer ones that had proven nothing either", jobauth.ErrRefused, evicted.RemoteAddr(), host, maxUnprovenPerHost)
		case d.unproven >= maxUnproven:
			// The address holding the most gives up its oldest: a flood
			// from one address does not evict the others'.
			evicted = d.oldestUnprovenLocked(d.busiestHostLocked())
			why = fmt.Errorf("%w: tcp: connection from %s closed before proving anything, to make room: %d newer ones had proven nothing either", jobauth.ErrRefused, evicted.RemoteAddr(), maxUnproven)
		}
		if evicted != nil {
			d.evictLocked(evicted, why)
		}
		d.acceptSeq++
		d.conns[c] = &pending{seq: d.acceptSeq, host: host}
		d.unproven++
		d.unprovenBy[host]++
		d.wg.Add(1)
		d.mu.Unlock()
		if evicted != nil {
			d.refuseLog.Refused(evicted.RemoteAddr().String(), why)
		}
		go d.handshake(c)
	}
}

// oldestUnprovenLocked is the oldest unproven connection from host, nil if
// none. Callers hold d.mu.
func (d *device) oldestUnprovenLocked(host string) net.Conn {
	var old net.Conn
	var seq uint64
	for c, p := range d.conns {
		if !p.proven && p.host == host && (old == nil || p.seq < seq) {
			old, seq = c, p.seq
		}
	}
	return old
}

// busiestHostLocked is the address with the most unproven connections.
// Callers hold d.mu.
func (d *device) busiestHostLocked() string {
	var busiest string
	n := 0
	for h, k := range d.unprovenBy {
		if k > n || k == n && h < busiest {
			busiest, n = h, k
		}
	}
	return busiest
}

// evictLocked closes c, unproven, to make room, and counts it with why.
// Callers hold d.mu, and log the refusal once they released it.
func (d *device) evictLocked(c net.Conn, why error) {
	d.forgetLocked(c)
	d.refused++
	d.evicted++
	d.lastRefusal = why
	c.Close()
}

// forgetLocked drops c from the connections being accepted. Callers hold
// d.mu.
func (d *device) forgetLocked(c net.Conn) {
	if p, ok := d.conns[c]; ok {
		if !p.proven {
			d.unprovedLocked(p)
		}
		delete(d.conns, c)
	}
}

// unprovedLocked takes p out of the unproven counts. Callers hold d.mu.
func (d *device) unprovedLocked(p *pending) {
	d.unproven--
	if d.unprovenBy[p.host]--; d.unprovenBy[p.host] <= 0 {
		delete(d.unprovenBy, p.host)
	}
}

// prove marks c as past what a stranger can reach, out of eviction's way.
// It is false when c was evicted (and closed) already.
func (d *device) prove(c net.Conn) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	p, ok := d.conns[c]
	if !ok {
		return false
	}
	if !p.proven {
		p.proven = true
		d.unprovedLocked(p)
	}
	return true
}

// refuse closes c, which does not reach a queue pair, and counts and logs
// it with why. A connection evicted or closed with the device was counted
// already, or is not counted.
func (d *device) refuse(c net.Conn, why error) {
	d.mu.Lock()
	_, ok := d.conns[c]
	counted := ok && !d.closed
	if counted {
		d.refused++
		d.lastRefusal = why
	}
	d.forgetLocked(c)
	d.mu.Unlock()
	c.Close()
	if counted {
		d.refuseLog.Refused(c.RemoteAddr().String(), why)
	}
}

// handshake takes an accepted connection: with a job key its other end
// proves the key first, before anything else is read from it; then its
// hello is read and the connection handed to the queue pair it names, or
// answered why not and closed.
func (d *device) handshake(c net.Conn) {
	defer d.wg.Done()
	c.SetDeadline(time.Now().Add(acceptTimeout))
	var rank uint32
	proven := false
	if !d.key.IsZero() {
		r, err := d.authenticate(c)
		if err != nil {
			d.refuse(c, err)
			return
		}
		if !d.prove(c) {
			c.Close()
			return
		}
		rank, proven = r, true
	}
	var b [helloLen]byte
	if _, err := io.ReadFull(c, b[:]); err != nil {
		d.refuse(c, fmt.Errorf("tcp: reading the hello of %s: %w", c.RemoteAddr(), err))
		return
	}
	answer := func(code byte, why error) {
		c.Write([]byte{code})
		d.refuse(c, why)
	}
	h, err := parseHello(b[:])
	if err != nil {
		if !proven && string(b[:4]) == authMagic {
			answer(helloMalformed, fmt.Errorf("%w: tcp: %s opened a lane with a job key handshake and this device has no key: give every process the same key", jobauth.ErrRefused, c.RemoteAddr()))
			return
		}
		answer(helloMalformed, fmt.Errorf("tcp: hello of %s: %w", c.RemoteAddr(), err))
		return
	}
	if proven && h.srcQP != rank {
		answer(helloMalformed, fmt.Errorf("%w: tcp: hello of %s from queue pair %d after a handshake for queue pair %d", verbsio.ErrBadFrame, c.RemoteAddr(), h.srcQP, rank))
		return
	}
	d.mu.Lock()
	q := d.qps[h.dstQP]
	d.mu.Unlock()
	switch {
	case q == nil:
		answer(helloNoQP, fmt.Errorf("tcp: hello of %s for queue pair %d, which does not exist", c.RemoteAddr(), h.dstQP))
		return
	case q.nonce != h.dstNonce:
		answer(helloBadNonce, fmt.Errorf("tcp: hello of %s for queue pair %d with the wrong nonce", c.RemoteAddr(), h.dstQP))
		return
	}
	if !proven && !d.prove(c) {
		c.Close()
		return
	}
	d.tune(c)
	if _, err := c.Write([]byte{helloOK}); err != nil {
		d.refuse(c, fmt.Errorf("tcp: answering the hello of %s: %w", c.RemoteAddr(), err))
		return
	}
	c.SetDeadline(time.Time{})
	d.mu.Lock()
	d.forgetLocked(c)
	d.mu.Unlock()
	if !q.addInbound(c, h) {
		c.Close()
	}
}

// authenticate has the other end of c prove the job key (jobauth.Accept)
// and returns the queue pair number its handshake claimed. A process
// without the key that opens with a hello is answered helloNeedKey, so
// its Connect says why; anything else that fails is left unanswered.
func (d *device) authenticate(c net.Conn) (uint32, error) {
	rec := &headReader{r: c}
	rw := struct {
		io.Reader
		io.Writer
	}{rec, c}
	qpn, err := jobauth.Accept(rw, d.key, lanePurpose, jobauth.EndsOf(c, false))
	if err == nil {
		return qpn, nil
	}
	if len(rec.head) == 4 && binary.BigEndian.Uint32(rec.head) == helloMagic {
		// Take the rest of the hello first: closing with unread bytes
		// would reset the connection and could lose the answer.
		if rec.n < helloLen {
			io.CopyN(io.Discard, c, int64(helloLen-rec.n))
		}
		c.Write([]byte{helloNeedKey})
		return 0, fmt.Errorf("%w: tcp: %s sent a lane hello without proving the job key (a process without the key?)", jobauth.ErrRefused, c.RemoteAddr())
	}
	return 0, fmt.Errorf("tcp: lane from %s: %w", c.RemoteAddr(), err)
}

// headReader reads through r and keeps the first four bytes read.
type headReader struct {
	r    io.Reader
	head []byte
	n    int
}

func (h *headReader) Read(p []byte) (int, error) {
	n, err := h.r.Read(p)
	if k := min(n, 4-len(h.head)); k > 0 {
		h.head = append(h.head, p[:k]...)
	}
	h.n += n
	return n, err
}

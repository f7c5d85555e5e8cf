package aggsrv

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"

	"github.com/gdrlink/gdrlink/internal/switchml/agg"
)

// The control protocol: after the job-key handshake (jobauth, purpose
// Purpose, the rank claimed being the worker's), a worker sends one
// Announce; when every worker of its job has announced, the aggregator
// answers each with an Assignment. The connection then stays open for the
// job's lifetime: the job ends when any of its workers' connections closes.
//
// Both messages are length-prefixed (a 2-byte big-endian length, then the
// body), start with a version byte, and use big-endian integers.

// Purpose names the control connection in the job-key handshake.
const Purpose = "switchml-aggregator"

const controlVersion = 1

// MaxMessage is the largest control message body, in bytes.
const MaxMessage = 4096

// ErrMessage means a control message that cannot be decoded.
var ErrMessage = errors.New("aggsrv: bad control message")

// Announce is what a worker tells the aggregator at job setup.
type Announce struct {
	Job       string   // the job's name, the same on every worker (1..64 bytes)
	Workers   int      // the job's worker count (1..32)
	Rank      int      // this worker's rank, 0..Workers-1 (the one proven with the job key)
	SlotBytes int      // 256 or 1024
	Slots     int      // slots the job needs (the aggregator picks where)
	Addr      [4]byte  // the worker's IPv4 address for RoCE traffic
	RKey      uint32   // rkey of the worker's result region
	QPNs      []uint32 // the worker's queue pairs, one per outstanding message
	PSNs      []uint32 // the PSN each starts sending with
}

// Assignment is the aggregator's answer.
type Assignment struct {
	// Err, when not empty, says why the job was refused; nothing else is
	// set then.
	Err string
	// Base is the job's first slot: the worker's pool indexes are
	// 2*(Base+i)+set for slot i of the job.
	Base int
	// Addr is the aggregator's IPv4 address for RoCE traffic.
	Addr [4]byte
	// QPNs and PSNs are the aggregator's queue pairs, paired with the
	// worker's in order, and the PSNs their replies start at.
	QPNs []uint32
	PSNs []uint32
}

// Len is the length of the announce's body.
func (a *Announce) Len() int { return 1 + 1 + len(a.Job) + 2 + 2 + 2 + 4 + 4 + 1 + 8*len(a.QPNs) }

// Append appends the announce's body to b.
func (a *Announce) Append(b []byte) []byte {
	b = append(b, controlVersion, byte(len(a.Job)))
	b = append(b, a.Job...)
	b = append(b, byte(a.Workers), byte(a.Rank))
	b = binary.BigEndian.AppendUint16(b, uint16(a.SlotBytes))
	b = binary.BigEndian.AppendUint16(b, uint16(a.Slots))
	b = append(b, a.Addr[:]...)
	b = binary.BigEndian.AppendUint32(b, a.RKey)
	b = append(b, byte(len(a.QPNs)))
	for i := range a.QPNs {
		b = binary.BigEndian.AppendUint32(b, a.QPNs[i])
		b = binary.BigEndian.AppendUint32(b, a.PSNs[i])
	}
	return b
}

// check reports an announce that cannot be encoded.
func (a *Announce) check() error {
	switch {
	case len(a.Job) < 1 || len(a.Job) > 64:
		return fmt.Errorf("%w: job name of %d bytes, want 1..64", ErrMessage, len(a.Job))
	case a.Workers < 1 || a.Workers > 255 || a.Rank < 0 || a.Rank >= a.Workers || a.SlotBytes < 0 || a.SlotBytes > 0xffff || a.Slots < 0 || a.Slots > 0xffff:
		return fmt.Errorf("%w: %d workers, %d-byte slots, %d slots", ErrMessage, a.Workers, a.SlotBytes, a.Slots)
	case len(a.QPNs) < 1 || len(a.QPNs) > 255 || len(a.QPNs) != len(a.PSNs):
		return fmt.Errorf("%w: %d queue pairs and %d PSNs", ErrMessage, len(a.QPNs), len(a.PSNs))
	}
	return nil
}

// ParseAnnounce decodes an announce's body.
func ParseAnnounce(b []byte) (Announce, error) {
	var a Announce
	r := reader{b: b}
	if v := r.u8(); v != controlVersion {
		return a, fmt.Errorf("%w: version %d", ErrMessage, v)
	}
	a.Job = string(r.bytes(int(r.u8())))
	a.Workers = int(r.u8())
	a.Rank = int(r.u8())
	a.SlotBytes = int(r.u16())
	a.Slots = int(r.u16())
	copy(a.Addr[:], r.bytes(4))
	a.RKey = r.u32()
	n := int(r.u8())
	for range n {
		a.QPNs = append(a.QPNs, r.u32())
		a.PSNs = append(a.PSNs, r.u32())
	}
	if r.err != nil || len(r.b) != 0 {
		return a, fmt.Errorf("%w: announce of %d bytes (%d left over)", ErrMessage, len(b), len(r.b))
	}
	if err := a.check(); err != nil {
		return a, err
	}
	return a, nil
}

// Len is the length of the assignment's body.
func (s *Assignment) Len() int {
	return 1 + 2 + len(s.Err) + 2 + 4 + 1 + 8*len(s.QPNs)
}

// Append appends the assignment's body to b.
func (s *Assignment) Append(b []byte) []byte {
	b = append(b, controlVersion)
	b = binary.BigEndian.AppendUint16(b, uint16(len(s.Err)))
	b = append(b, s.Err...)
	b = binary.BigEndian.AppendUint16(b, uint16(s.Base))
	b = append(b, s.Addr[:]...)
	b = append(b, byte(len(s.QPNs)))
	for i := range s.QPNs {
		b = binary.BigEndian.AppendUint32(b, s.QPNs[i])
		b = binary.BigEndian.AppendUint32(b, s.PSNs[i])
	}
	return b
}

// ParseAssignment decodes an assignment's body.
func ParseAssignment(b []byte) (Assignment, error) {
	var s Assignment
	r := reader{b: b}
	if v := r.u8(); v != controlVersion {
		return s, fmt.Errorf("%w: version %d", ErrMessage, v)
	}
	s.Err = string(r.bytes(int(r.u16())))
	s.Base = int(r.u16())
	copy(s.Addr[:], r.bytes(4))
	n := int(r.u8())
	for range n {
		s.QPNs = append(s.QPNs, r.u32())
		s.PSNs = append(s.PSNs, r.u32())
	}
	if r.err != nil || len(r.b) != 0 {
		return s, fmt.Errorf("%w: assignment of %d bytes (%d left over)", ErrMessage, len(b), len(r.b))
	}
	return s, nil
}

// reader takes fields off the front of b; past the end it records an
// error and gives zeros.
type reader struct {
	b   []byte
	err error
}

func (r *reader) bytes(n int) []byte {
	if r.err != nil || n > len(r.b) {
		r.err = ErrMessage
		r.b = nil
		return make([]byte, n)
	}
	v := r.b[:n]
	r.b = r.b[n:]
	return v
}

func (r *reader) u8() uint8   { return r.bytes(1)[0] }
func (r *reader) u16() uint16 { return binary.BigEndian.Uint16(r.bytes(2)) }
func (r *reader) u32() uint32 { return binary.BigEndian.Uint32(r.bytes(4)) }

// Ended is the aggregator's last message on a running job's control
// connection: the job ended because the worker of rank Rank left (its
// control connection ended, by Close or by its process dying, or it sent
// a Leave). The aggregator then closes every connection of the job.
type Ended struct {
	Rank int    // the worker that left, 0..31
	Why  string // how its connection ended, or its Leave's reason (at most 1024 bytes)
	// Abandoned: the worker left with a Leave, giving up a call it could
	// not take part in; it is alive, and may set the job up again.
	Abandoned bool
}

// maxWhy bounds Ended.Why.
const maxWhy = 1024

// Append appends the message's body to b.
func (e *Ended) Append(b []byte) []byte {
	why := e.Why
	if len(why) > maxWhy {
		why = why[:maxWhy]
	}
	b = append(b, controlVersion, byte(e.Rank))
	b = binary.BigEndian.AppendUint16(b, uint16(len(why)))
	b = append(b, why...)
	if e.Abandoned {
		// A trailing flag byte, absent otherwise, so that an Ended of a
		// worker that did not abandon reads as before.
		b = append(b, endedAbandoned)
	}
	return b
}

// endedAbandoned is Ended's optional trailing byte: the worker abandoned.
const endedAbandoned = 1

// ParseEnded decodes an Ended message's body.
func ParseEnded(b []byte) (Ended, error) {
	var e Ended
	r := reader{b: b}
	if v := r.u8(); v != controlVersion {
		return e, fmt.Errorf("%w: version %d", ErrMessage, v)
	}
	e.Rank = int(r.u8())
	n := int(r.u16())
	if n > maxWhy {
		return e, fmt.Errorf("%w: reason of %d bytes", ErrMessage, n)
	}
	e.Why = string(r.bytes(n))
	if r.err == nil && len(r.b) == 1 && r.b[0] == endedAbandoned {
		e.Abandoned = true
		r.b = r.b[1:]
	}
	if r.err != nil || len(r.b) != 0 || e.Rank >= agg.MaxWorkers {
		return e, fmt.Errorf("%w: end notice of %d bytes (%d left over, rank %d)", ErrMessage, len(b), len(r.b), e.Rank)
	}
	return e, nil
}

// Leave is the one message a worker may send on its control connection
// once its job runs, just before it closes it: it gives up the job
// because it cannot take part in a call (its tensor could not be staged,
// say), and says why. The aggregator ends the job as when a connection
// closes, and its Ended notice to the other workers says Abandoned, with
// this reason.
type Leave struct {
	Why string // at most 1024 bytes
}

// Append appends the message's body to b.
func (l *Leave) Append(b []byte) []byte {
	why := l.Why
	if len(why) > maxWhy {
		why = why[:maxWhy]
	}
	b = append(b, controlVersion)
	b = binary.BigEndian.AppendUint16(b, uint16(len(why)))
	return append(b, why...)
}

// ParseLeave decodes a Leave message's body.
func ParseLeave(b []byte) (Leave, error) {
	var l Leave
	r := reader{b: b}
	if v := r.u8(); v != controlVersion {
		return l, fmt.Errorf("%w: version %d", ErrMessage, v)
	}
	n := int(r.u16())
	if n > maxWhy {
		return l, fmt.Errorf("%w: reason of %d bytes", ErrMessage, n)
	}
	l.Why = string(r.bytes(n))
	if r.err != nil || len(r.b) != 0 {
		return l, fmt.Errorf("%w: leave of %d bytes (%d left over)", ErrMessage, len(b), len(r.b))
	}
	return l, nil
}

// WriteMessage writes one length-prefixed control message body to w.
func WriteMessage(w io.Writer, body []byte) error { return writeMessage(w, body) }

// ReadMessage reads one length-prefixed control message body from r.
func ReadMessage(r io.Reader) ([]byte, error) { return readMessage(r) }

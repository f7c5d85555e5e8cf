package bootstrap

import (
	"encoding/binary"
	"fmt"
	"io"

	"github.com/gdrlink/gdrlink/verbsio"
)

// A control message on the wire: a 4-byte big-endian length of what
// follows, a version byte, a type byte, then the body. Bodies are built from
// u32 integers and u32-length-prefixed byte strings.
const (
	msgVersion = 2 // 2: incarnations in the address list and calls; rejoin
	msgHdrLen  = 6
)

// Message types.
const (
	tHello     = 1 // rank -> root: rank, size, contact address
	tAddrs     = 2 // root -> rank: every rank's incarnation and contact address
	tGather    = 3 // rank -> root: its AllGather contribution
	tGathered  = 4 // root -> rank: every contribution
	tPeerHello = 5 // dialing rank -> peer: rank, size
	tExchange  = 6 // rank <-> peer: one Exchange payload
	tRefused   = 7 // root or peer -> rank: why it is turned away
	tCall      = 8 // rank -> peer: rank, size, incarnation, one Call request
	tReply     = 9 // peer -> rank: the answer to a Call or a notice
	// A process that joins in place of a dead rank (see Group.Rejoined).
	tRejoined = 10 // root -> rank: as tAddrs, the rank taken as a rejoin
	tNotice   = 11 // rejoined rank -> peer: rank, size, incarnation, contact, data
	tPing     = 12 // root -> rank: which incarnation answers here?
	tPong     = 13 // rank -> root: its incarnation (0 while joining)
	tMax      = tPong
)

type msg struct {
	typ  uint8
	body []byte
}

// appendMsg appends a framed message to b.
func appendMsg(b []byte, typ uint8, body []byte) []byte {
	b = binary.BigEndian.AppendUint32(b, uint32(2+len(body)))
	b = append(b, msgVersion, typ)
	return append(b, body...)
}

// readMsg reads one message of at most max body bytes.
func readMsg(r io.Reader, max int) (msg, error) {
	var h [msgHdrLen]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return msg{}, err
	}
	n := binary.BigEndian.Uint32(h[:])
	if err := checkHdr(h[:], max); err != nil {
		return msg{}, err
	}
	body := make([]byte, int(n)-2)
	if _, err := io.ReadFull(r, body); err != nil {
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return msg{}, err
	}
	return msg{typ: h[5], body: body}, nil
}

func checkHdr(h []byte, max int) error {
	n := binary.BigEndian.Uint32(h)
	switch {
	case n < 2:
		return fmt.Errorf("%w: control message length %d", verbsio.ErrBadFrame, n)
	case uint64(n)-2 > uint64(max):
		return fmt.Errorf("%w: control message of %d bytes over the limit %d", verbsio.ErrBadFrame, n-2, max)
	case h[4] != msgVersion:
		return fmt.Errorf("%w: control message version %d", verbsio.ErrBadFrame, h[4])
	case h[5] == 0 || h[5] > tMax:
		return fmt.Errorf("%w: control message type %d", verbsio.ErrBadFrame, h[5])
	}
	return nil
}

// parseMsg decodes one framed message from the front of b and returns the
// rest: the decoder that readMsg applies to a stream, for fuzzing.
func parseMsg(b []byte, max int) (msg, []byte, error) {
	if len(b) < msgHdrLen {
		return msg{}, nil, fmt.Errorf("%w: truncated control message header", verbsio.ErrBadFrame)
	}
	if err := checkHdr(b, max); err != nil {
		return msg{}, nil, err
	}
	n := int(binary.BigEndian.Uint32(b))
	if len(b) < 4+n {
		return msg{}, nil, fmt.Errorf("%w: truncated control message body", verbsio.ErrBadFrame)
	}
	return msg{typ: b[5], body: b[msgHdrLen : 4+n]}, b[4+n:], nil
}

// dec reads the fields of a body; the first error sticks.
type dec struct {
	b   []byte
	err error
}

func (d *dec) u32() uint32 {
	if d.err != nil {
		return 0
	}
	if len(d.b) < 4 {
		d.err = fmt.Errorf("%w: truncated integer", verbsio.ErrBadFrame)
		return 0
	}
	v := binary.BigEndian.Uint32(d.b)
	d.b = d.b[4:]
	return v
}

func (d *dec) u64() uint64 {
	hi := d.u32()
	return uint64(hi)<<32 | uint64(d.u32())
}

func (d *dec) bytes() []byte {
	n := d.u32()
	if d.err != nil {
		return nil
	}
	if uint64(n) > uint64(len(d.b)) {
		d.err = fmt.Errorf("%w: string of %d bytes with %d left", verbsio.ErrBadFrame, n, len(d.b))
		return nil
	}
	v := d.b[:n:n]
	d.b = d.b[n:]
	return v
}

// count reads a list length, checking that the list can fit in what is
// left (each element takes at least min bytes) before anything is allocated.
func (d *dec) count(min int) int {
	n := d.u32()
	if d.err == nil && uint64(n)*uint64(min) > uint64(len(d.b)) {
		d.err = fmt.Errorf("%w: list of %d elements in %d bytes", verbsio.ErrBadFrame, n, len(d.b))
		return 0
	}
	return int(n)
}

func (d *dec) end() error {
	if d.err == nil && len(d.b) != 0 {
		d.err = fmt.Errorf("%w: %d trailing bytes", verbsio.ErrBadFrame, len(d.b))
	}
	return d.err
}

func appendBytes(b, v []byte) []byte {
	b = binary.BigEndian.AppendUint32(b, uint32(len(v)))
	return append(b, v...)
}

// helloBody is what a rank tells the root or a peer.
type helloBody struct {
	rank, size int
	contact    string
}

// Append appends the encoded hello body to b.
func (h helloBody) Append(b []byte) []byte {
	b = binary.BigEndian.AppendUint32(b, uint32(h.rank))
	b = binary.BigEndian.AppendUint32(b, uint32(h.size))
	return appendBytes(b, []byte(h.contact))
}

func parseHello(b []byte) (helloBody, error) {
	d := dec{b: b}
	h := helloBody{rank: int(d.u32()), size: int(d.u32()), contact: string(d.bytes())}
	if err := d.end(); err != nil {
		return h, err
	}
	if h.size < 1 || h.size > 1<<20 || h.rank < 0 || h.rank >= h.size {
		return h, fmt.Errorf("%w: hello of rank %d of %d", verbsio.ErrBadFrame, h.rank, h.size)
	}
	return h, nil
}

// callBody is a Call: who calls (its rank and incarnation) and what it
// asks.
type callBody struct {
	rank, size int
	inc        uint64
	req        []byte
}

// Append appends the encoded call body to b.
func (c callBody) Append(b []byte) []byte {
	b = binary.BigEndian.AppendUint32(b, uint32(c.rank))
	b = binary.BigEndian.AppendUint32(b, uint32(c.size))
	b = binary.BigEndian.AppendUint64(b, c.inc)
	return appendBytes(b, c.req)
}

func parseCall(b []byte) (callBody, error) {
	d := dec{b: b}
	c := callBody{rank: int(d.u32()), size: int(d.u32()), inc: d.u64(), req: d.bytes()}
	if err := d.end(); err != nil {
		return c, err
	}
	if c.size < 1 || c.size > 1<<20 || c.rank < 0 || c.rank >= c.size {
		return c, fmt.Errorf("%w: call from rank %d of %d", verbsio.ErrBadFrame, c.rank, c.size)
	}
	return c, nil
}

// noticeBody is what a rank that rejoined tells each peer: who it is now
// and its data for the peer (Config.RejoinData).
type noticeBody struct {
	rank, size int
	inc        uint64
	contact    string
	data       []byte
}

// Append appends the encoded notice body to b.
func (n noticeBody) Append(b []byte) []byte {
	b = binary.BigEndian.AppendUint32(b, uint32(n.rank))
	b = binary.BigEndian.AppendUint32(b, uint32(n.size))
	b = binary.BigEndian.AppendUint64(b, n.inc)
	b = appendBytes(b, []byte(n.contact))
	return appendBytes(b, n.data)
}

func parseNotice(b []byte) (noticeBody, error) {
	d := dec{b: b}
	n := noticeBody{rank: int(d.u32()), size: int(d.u32()), inc: d.u64(), contact: string(d.bytes()), data: d.bytes()}
	if err := d.end(); err != nil {
		return n, err
	}
	if n.size < 1 || n.size > 1<<20 || n.rank < 0 || n.rank >= n.size || n.inc == 0 {
		return n, fmt.Errorf("%w: notice of rank %d of %d, incarnation %d", verbsio.ErrBadFrame, n.rank, n.size, n.inc)
	}
	return n, nil
}

// appendAddrs encodes the address list: each rank's incarnation and
// contact address.
func appendAddrs(b []byte, addrs []string, incs []uint64) []byte {
	b = binary.BigEndian.AppendUint32(b, uint32(len(addrs)))
	for i, a := range addrs {
		b = binary.BigEndian.AppendUint64(b, incs[i])
		b = appendBytes(b, []byte(a))
	}
	return b
}

func parseAddrs(b []byte, want int) ([]string, []uint64, error) {
	d := dec{b: b}
	n := d.count(12)
	if d.err != nil {
		return nil, nil, d.err
	}
	if n != want {
		return nil, nil, fmt.Errorf("%w: address list of %d entries, want %d", verbsio.ErrBadFrame, n, want)
	}
	addrs, incs := make([]string, n), make([]uint64, n)
	for i := range addrs {
		incs[i], addrs[i] = d.u64(), string(d.bytes())
		if d.err == nil && incs[i] == 0 {
			return nil, nil, fmt.Errorf("%w: rank %d of the address list has incarnation 0", verbsio.ErrBadFrame, i)
		}
	}
	return addrs, incs, d.end()
}

// appendList encodes a list of byte strings.
func appendList(b []byte, vs [][]byte) []byte {
	b = binary.BigEndian.AppendUint32(b, uint32(len(vs)))
	for _, v := range vs {
		b = appendBytes(b, v)
	}
	return b
}

func parseList(b []byte, want int) ([][]byte, error) {
	d := dec{b: b}
	n := d.count(4)
	if d.err != nil {
		return nil, d.err
	}
	if n != want {
		return nil, fmt.Errorf("%w: list of %d entries, want %d", verbsio.ErrBadFrame, n, want)
	}
	out := make([][]byte, n)
	for i := range out {
		out[i] = d.bytes()
	}
	return out, d.end()
}

// EncodeEndpoint appends a verbs endpoint in the form Exchange carries.
func EncodeEndpoint(b []byte, e verbsio.Endpoint) []byte {
	b = appendBytes(b, []byte(e.Provider))
	b = appendBytes(b, []byte(e.Host))
	return appendBytes(b, e.Data)
}

// DecodeEndpoint decodes what EncodeEndpoint made; malformed input is an
// error wrapping verbsio.ErrBadFrame.
func DecodeEndpoint(b []byte) (verbsio.Endpoint, error) {
	d := dec{b: b}
	e := verbsio.Endpoint{Provider: string(d.bytes()), Host: string(d.bytes())}
	if data := d.bytes(); len(data) > 0 {
		e.Data = append([]byte(nil), data...)
	}
	return e, d.end()
}

package tcp

import (
	"encoding/binary"
	"fmt"

	"github.com/gdrlink/gdrlink/verbsio"
)

// Wire format. Every connection starts with a hello from the dialing side
// (after jobauth's handshake when the job has a key) and a one-byte answer;
// after that the dialing side sends request frames (write, write with
// immediate, send, read request) and the accepting side answers each with
// exactly one response frame (ack, nak, read response), in order, except
// that a write, write with immediate or send carrying flagNoAck is answered
// only when it fails (nak): the next response on the lane, for a later
// request, says that it succeeded (as the AckReq bit of an InfiniBand
// request lets a responder coalesce its acknowledgements). All integers
// are big-endian.
//
// Version 2 added flagNoAck; a peer of version 1 is refused at the hello,
// the endpoint and the first frame alike.
//
// Frame header, 40 bytes, followed by Length payload bytes:
//
//	off size field
//	 0   1   version (frameVersion)
//	 1   1   opcode (op*)
//	 2   1   flags (flag*)
//	 3   1   status (a verbsio.Status, nak only)
//	 4   4   length: payload bytes that follow (read request: bytes asked)
//	 8   8   token: chosen by the requester, echoed in the response
//	16   8   remote address (requests)
//	24   4   rkey (write, write with immediate, read request)
//	28   4   immediate (write with immediate)
//	32   4   total: bytes the write with immediate reports to the receiver
//	36   4   reserved, zero
const (
	frameVersion = 2
	headerLen    = 40
	// maxPayload is the largest payload of one frame, also Caps.MaxMessage.
	maxPayload = 1 << 30
)

// Opcodes on the wire.
const (
	opWrite    = 1
	opWriteImm = 2
	opSend     = 3
	opReadReq  = 4
	opReadResp = 5
	opAck      = 6
	opNak      = 7
	opMax      = opNak
)

// flagLast marks the frame of a write with immediate that completes it at the
// receiver (a striped write sends its stripes as plain writes first).
// flagNoAck, on a write, write with immediate or send, asks for no
// acknowledgement of its success (see above).
const (
	flagLast  = 1
	flagNoAck = 2
)

// header is a decoded frame header.
type header struct {
	op     uint8
	flags  uint8
	status verbsio.Status
	length uint32
	token  uint64
	raddr  uint64
	rkey   uint32
	imm    uint32
	total  uint32
}

// Len is the encoded size of the header.
func (h *header) Len() int { return headerLen }

// Append appends the encoded header to b.
func (h *header) Append(b []byte) []byte {
	b = append(b, frameVersion, h.op, h.flags, uint8(h.status))
	b = binary.BigEndian.AppendUint32(b, h.length)
	b = binary.BigEndian.AppendUint64(b, h.token)
	b = binary.BigEndian.AppendUint64(b, h.raddr)
	b = binary.BigEndian.AppendUint32(b, h.rkey)
	b = binary.BigEndian.AppendUint32(b, h.imm)
	b = binary.BigEndian.AppendUint32(b, h.total)
	return binary.BigEndian.AppendUint32(b, 0)
}

// parseHeader decodes and checks a header strictly: any field that the
// opcode does not use must be zero, and lengths must be sane.
func parseHeader(b []byte) (header, error) {
	var h header
	if len(b) < headerLen {
		return h, fmt.Errorf("%w: header of %d bytes, want %d", verbsio.ErrBadFrame, len(b), headerLen)
	}
	if b[0] != frameVersion {
		return h, fmt.Errorf("%w: version %d, want %d", verbsio.ErrBadFrame, b[0], frameVersion)
	}
	h.op, h.flags, h.status = b[1], b[2], verbsio.Status(b[3])
	h.length = binary.BigEndian.Uint32(b[4:])
	h.token = binary.BigEndian.Uint64(b[8:])
	h.raddr = binary.BigEndian.Uint64(b[16:])
	h.rkey = binary.BigEndian.Uint32(b[24:])
	h.imm = binary.BigEndian.Uint32(b[28:])
	h.total = binary.BigEndian.Uint32(b[32:])
	if r := binary.BigEndian.Uint32(b[36:]); r != 0 {
		return h, fmt.Errorf("%w: reserved field %#x", verbsio.ErrBadFrame, r)
	}
	bad := func(what string) (header, error) {
		return h, fmt.Errorf("%w: %s in %s frame", verbsio.ErrBadFrame, what, opName(h.op))
	}
	if h.op == 0 || h.op > opMax {
		return h, fmt.Errorf("%w: unknown opcode %d", verbsio.ErrBadFrame, h.op)
	}
	if h.length > maxPayload {
		return bad(fmt.Sprintf("length %d over the limit %d", h.length, maxPayload))
	}
	if h.flags&^(flagLast|flagNoAck) != 0 || h.flags&flagLast != 0 && h.op != opWriteImm ||
		h.flags&flagNoAck != 0 && h.op != opWrite && h.op != opWriteImm && h.op != opSend {
		return bad(fmt.Sprintf("flags %#x", h.flags))
	}
	if h.status != 0 && h.op != opNak {
		return bad("status")
	}
	if h.imm != 0 && h.op != opWriteImm {
		return bad("immediate")
	}
	switch h.op {
	case opWriteImm:
		if h.total > maxPayload || h.total < h.length {
			return bad(fmt.Sprintf("total %d for length %d", h.total, h.length))
		}
		if h.flags&flagLast == 0 && h.total != 0 {
			return bad("total without the last flag")
		}
	default:
		if h.total != 0 {
			return bad("total")
		}
	}
	if h.raddr+uint64(h.length) < h.raddr {
		return bad("address range that wraps")
	}
	switch h.op {
	case opSend, opAck, opNak, opReadResp:
		if h.raddr != 0 || h.rkey != 0 {
			return bad("remote address or key")
		}
	}
	switch h.op {
	case opAck, opNak:
		if h.length != 0 {
			return bad("payload")
		}
	}
	if h.op == opNak && (h.status == verbsio.StatusSuccess || int(h.status) > int(verbsio.StatusGeneral)) {
		return bad(fmt.Sprintf("status %d", h.status))
	}
	return h, nil
}

func opName(op uint8) string {
	switch op {
	case opWrite:
		return "write"
	case opWriteImm:
		return "write-imm"
	case opSend:
		return "send"
	case opReadReq:
		return "read-request"
	case opReadResp:
		return "read-response"
	case opAck:
		return "ack"
	case opNak:
		return "nak"
	}
	return fmt.Sprintf("op%d", op)
}

// Hello, sent once by the dialing side of a lane, 32 bytes:
//
//	off size field
//	 0   4   magic "GDRT"
//	 4   1   version
//	 5   1   lane index
//	 6   1   lanes: how many lanes the dialer opens to this queue pair
//	 7   1   reserved, zero
//	 8   4   target queue pair number
//	12   8   target nonce (from the target's endpoint)
//	20   4   source queue pair number
//	24   8   source nonce
//
// The answer is one byte: helloOK, or a helloNo* code, after which the
// accepting side closes the connection.
//
// A device with a job key reads no hello before the dialer has proven the
// key (jobauth's handshake, purpose lanePurpose, which comes first on the
// connection); to a hello that came without the handshake it answers
// helloNeedKey and closes.
const (
	helloLen       = 32
	helloMagic     = 0x47445254 // "GDRT"
	helloOK        = 0
	helloNoQP      = 1
	helloBadNonce  = 2
	helloMalformed = 3
	helloNeedKey   = 4
	maxLanes       = 16
)

type hello struct {
	lane, lanes uint8
	dstQP       uint32
	dstNonce    uint64
	srcQP       uint32
	srcNonce    uint64
}

// Len is the encoded size of a hello.
func (h *hello) Len() int { return helloLen }

// Append appends the encoded hello to b.
func (h *hello) Append(b []byte) []byte {
	b = binary.BigEndian.AppendUint32(b, helloMagic)
	b = append(b, frameVersion, h.lane, h.lanes, 0)
	b = binary.BigEndian.AppendUint32(b, h.dstQP)
	b = binary.BigEndian.AppendUint64(b, h.dstNonce)
	b = binary.BigEndian.AppendUint32(b, h.srcQP)
	return binary.BigEndian.AppendUint64(b, h.srcNonce)
}

func parseHello(b []byte) (hello, error) {
	var h hello
	if len(b) != helloLen {
		return h, fmt.Errorf("%w: hello of %d bytes, want %d", verbsio.ErrBadFrame, len(b), helloLen)
	}
	if m := binary.BigEndian.Uint32(b); m != helloMagic {
		return h, fmt.Errorf("%w: hello magic %#x", verbsio.ErrBadFrame, m)
	}
	if b[4] != frameVersion || b[7] != 0 {
		return h, fmt.Errorf("%w: hello version %d", verbsio.ErrBadFrame, b[4])
	}
	h.lane, h.lanes = b[5], b[6]
	if h.lanes == 0 || h.lanes > maxLanes || h.lane >= h.lanes {
		return h, fmt.Errorf("%w: hello lane %d of %d", verbsio.ErrBadFrame, h.lane, h.lanes)
	}
	h.dstQP = binary.BigEndian.Uint32(b[8:])
	h.dstNonce = binary.BigEndian.Uint64(b[12:])
	h.srcQP = binary.BigEndian.Uint32(b[20:])
	h.srcNonce = binary.BigEndian.Uint64(b[24:])
	return h, nil
}

// endpointData is Endpoint.Data of a tcp queue pair:
//
//	version u8, lanes u8, queue pair number u32, nonce u64,
//	address length u16, address ("host:port").
type endpointData struct {
	lanes uint8
	qp    uint32
	nonce uint64
	addr  string
}

const maxAddrLen = 512

// Len is the encoded size.
func (e *endpointData) Len() int { return 16 + len(e.addr) }

// Append appends the encoding to b.
func (e *endpointData) Append(b []byte) []byte {
	b = append(b, frameVersion, e.lanes)
	b = binary.BigEndian.AppendUint32(b, e.qp)
	b = binary.BigEndian.AppendUint64(b, e.nonce)
	b = binary.BigEndian.AppendUint16(b, uint16(len(e.addr)))
	return append(b, e.addr...)
}

func parseEndpointData(b []byte) (endpointData, error) {
	var e endpointData
	if len(b) < 16 {
		return e, fmt.Errorf("%w: endpoint of %d bytes", verbsio.ErrBadFrame, len(b))
	}
	if b[0] != frameVersion {
		return e, fmt.Errorf("%w: endpoint version %d", verbsio.ErrBadFrame, b[0])
	}
	e.lanes = b[1]
	if e.lanes == 0 || e.lanes > maxLanes {
		return e, fmt.Errorf("%w: endpoint with %d lanes", verbsio.ErrBadFrame, e.lanes)
	}
	e.qp = binary.BigEndian.Uint32(b[2:])
	e.nonce = binary.BigEndian.Uint64(b[6:])
	n := int(binary.BigEndian.Uint16(b[14:]))
	if n == 0 || n > maxAddrLen || len(b) != 16+n {
		return e, fmt.Errorf("%w: endpoint address of %d bytes in %d", verbsio.ErrBadFrame, n, len(b)-16)
	}
	e.addr = string(b[16:])
	return e, nil
}

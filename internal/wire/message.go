package wire

import (
	"encoding/binary"
	"fmt"
	"math"
	"slices"

	"github.com/gdrlink/gdrlink/tensor"
)

// Version is the protocol version this package writes and the only one it
// reads.
const Version = 1

// Limits of the encoding.
const (
	// HeaderLen is the size of every frame's header.
	HeaderLen = 8
	// MaxFrame is the largest frame, header included. Receive buffers of
	// this size hold any frame.
	MaxFrame = 8192
	// MinSlot is the smallest receive buffer a peer may post (HELLO's
	// Slot), the size of the first release's: every frame but EAGER fits
	// it, and an EAGER goes only to a peer whose buffers hold it.
	MinSlot = 4096
	// MaxEager is the largest tensor an EAGER may be made for: with its
	// header, name and meta-data the frame must fit MaxFrame.
	MaxEager = MaxFrame - MinSlot
	// MaxName is the longest tensor name, in bytes.
	MaxName = 1024
	// MaxText is the longest error message or host name, in bytes.
	MaxText = 1024
	// MaxEndpoints is the most queue pair endpoints (rails) a HELLO carries.
	MaxEndpoints = 8
	// MaxEndpointData is the longest provider-specific endpoint blob.
	MaxEndpointData = 512
	// MaxPullHandle is the longest pull handle (RespPull): an opaque
	// description of the sender's exported memory, such as a 64-byte
	// legacy CUDA IPC handle with the arena's size.
	MaxPullHandle = 256
)

// Type is a message type. Its values are part of the wire format.
type Type uint8

// Message types.
const (
	// TypeRequest is TENSOR_REQUEST: the receiver asks for a tensor and says
	// where to write it.
	TypeRequest Type = iota + 1
	// TypeMetaResponse is META_DATA_RESPONSE: the tensor's meta-data did not
	// match the receiver's cache (or no write follows: dead and empty
	// tensors).
	TypeMetaResponse
	// TypeReRequest is TENSOR_RE_REQUEST: the receiver reallocated after a
	// META_DATA_RESPONSE and gives the new address.
	TypeReRequest
	// TypeError is ERROR_STATUS: the sender could not serve a request.
	TypeError
	// TypeCredit returns receive credits and says nothing else. A channel
	// also sends it as a keepalive to a peer that has been silent while work
	// is pending: the peer's NIC must acknowledge it, so a dead peer makes
	// the send fail. The receiver handles it as any CREDIT and never answers.
	TypeCredit
	// TypeChecksum carries the CRC-32C of the bytes about to be written for a
	// request (checksum mode).
	TypeChecksum
	// TypeCancel withdraws a request; the sender answers with ERROR_STATUS
	// (CodeCancelled) unless the write is already on its way. A CANCEL may
	// carry a Code: the receiver refuses the tensor for that reason
	// (CodeTooLarge, CodeNoMemory), and the
	// sender fails its Send rather than keep the tensor for another request.
	TypeCancel
	// TypeBye says the peer is closing the channel on purpose. It may carry
	// (ByeImms) how many writes with immediate its sender took in on the
	// channel's queue pair, so that the side that wrote them knows which
	// arrived.
	TypeBye
	// TypeHello is what peers trade before connecting: endpoints, ring
	// depth, options.
	TypeHello
	// TypeConfirm is CONFIRM: in checksum mode with a peer that offers it
	// (HelloConfirm), the receiver says that the write answering a request
	// arrived and matched its checksum, so the sender may give the source
	// back and report it delivered; with ConfirmBad, that it did not and
	// the receiver gives up (it asks again with TENSOR_RE_REQUEST instead,
	// a bounded number of times). A peer that did not offer HelloConfirm
	// is never sent one.
	TypeConfirm
	// TypeEager is EAGER: a small tensor sent before any request for it,
	// its bytes in the frame (Data), to a peer that offered HelloEager.
	// The receiver keeps it for the Recv of its key and step, or hands it
	// to one already waiting (whose TENSOR_REQUEST, crossing it, the
	// sender drops). A sender has at most the peer's eager window of them
	// not yet counted by a TAKEN.
	TypeEager
	// TypeTaken is TAKEN: Count is how many EAGER frames the receiver has
	// handed to Recvs on the channel, modulo 2^32. Every TENSOR_REQUEST the
	// receiver sent for a tensor that came eagerly went out before the
	// TAKEN that counts it.
	TypeTaken
	numTypes
)

var typeNames = [numTypes]string{"", "TENSOR_REQUEST", "META_DATA_RESPONSE", "TENSOR_RE_REQUEST", "ERROR_STATUS", "CREDIT", "CHECKSUM", "CANCEL", "BYE", "HELLO", "CONFIRM", "EAGER", "TAKEN"}

// String names the type as the protocol description does.
func (t Type) String() string {
	if t > 0 && t < numTypes {
		return typeNames[t]
	}
	return fmt.Sprintf("Type(%d)", uint8(t))
}

// Flags of TENSOR_REQUEST.
const (
	// ReqName: the request carries the tensor's name and thereby assigns it
	// NameIndex for every later request on the channel.
	ReqName uint8 = 1 << iota
	// ReqMeta: the request carries the receiver's cached meta-data, and Addr,
	// RKey and Capacity name a result buffer allocated from it.
	ReqMeta
	// ReqRails: the request carries the result buffer's rkeys on the
	// channel's extra rails (RailKeys), so the sender may stripe the write.
	ReqRails
	// ReqExact: the result buffer takes only the cached meta-data; a
	// changed tensor needs a re-request even when it would fit
	// (RespWriteFollows is not allowed).
	ReqExact
	// ReqChunks: the request carries ChunkShift, and a write that answers
	// it comes as chunks of 1<<ChunkShift bytes (the last may be shorter),
	// each a write with immediate naming the request, in order on the
	// channel's own queue pair (never striped over rails), so the receiver
	// can hand each chunk on as it lands (a proxy result copied to the GPU
	// while the rest is on the wire). Only tensors larger than one chunk
	// are split.
	ReqChunks
	// ReqPull: the receiver can pull the tensor itself from the sender's
	// device memory (both peers offered HelloPull, and the pair's on-node
	// device path is set up): the sender may answer with a
	// META_DATA_RESPONSE carrying RespPull instead of writing. A sender
	// whose source is not in memory it exported answers as without it.
	ReqPull
	reqAll = ReqName | ReqMeta | ReqRails | ReqExact | ReqChunks | ReqPull
)

// Chunk sizes of ReqChunks and TENSOR_RE_REQUEST, as powers of two.
const (
	// MinChunkShift is the smallest chunk, 4 KiB.
	MinChunkShift = 12
	// MaxChunkShift is the largest chunk, 1 GiB.
	MaxChunkShift = 30
)

// MaxRailKeys is the most extra-rail rkeys a request carries.
const MaxRailKeys = MaxEndpoints - 1

// Flags of META_DATA_RESPONSE.
const (
	// RespFinal: no write follows; the request completes with this message
	// (dead and empty tensors).
	RespFinal uint8 = 1 << iota
	// RespChecksum: Checksum holds the CRC-32C of the bytes to be written.
	RespChecksum
	// RespWriteFollows: the tensor fits the result buffer the request named
	// though its meta-data changed; the write follows into that buffer with
	// no re-request.
	RespWriteFollows
	// RespPull answers a request with ReqPull: no write follows; the
	// tensor's bytes (Meta.ByteSize of them) are at PullOffset of the
	// sender's exported arena PullArena, which PullHandle describes. The
	// receiver copies them itself and then sends CONFIRM (ConfirmBad when
	// the copy failed), after which the sender gives the source back. It
	// excludes the other flags.
	RespPull
	respAll = RespFinal | RespChecksum | RespWriteFollows | RespPull
)

// Flags of BYE.
const (
	// ByeImms: Imms holds the number of writes with immediate the sender
	// of the BYE took in on the channel's queue pair, modulo 2^32.
	ByeImms uint8 = 1 << iota
	// ByeEagers: Eagers holds the number of EAGER frames the sender of the
	// BYE took in on the channel, modulo 2^32 (sent only to a peer that
	// offered HelloEager).
	ByeEagers
	byeAll = ByeImms | ByeEagers
)

// Flags of HELLO.
const (
	// HelloChecksum: the peer runs in checksum mode (with HelloChecksumAuto:
	// would, by its provider's default).
	HelloChecksum uint8 = 1 << iota
	// HelloChecksumAuto: the peer's checksum mode is its provider's
	// default, not its user's choice: it follows a peer whose mode is a
	// choice. Without it, the mode is required, as from a peer of the
	// first release.
	HelloChecksumAuto
	// HelloConfirm: in checksum mode the peer keeps every source until the
	// receiver's CONFIRM, writes it again on a TENSOR_RE_REQUEST for a
	// request it answered (the checksum failed), and confirms the writes
	// it takes in. Both peers must offer it for either to use it.
	HelloConfirm
	// HelloPull: the peer takes ReqPull, RespPull and the CONFIRM of a
	// pulled tensor. Both peers must offer it for either to use it.
	HelloPull
	// HelloEager: the peer takes EAGER frames as large as its Slot, keeps
	// up to EagerWindow of them not yet taken by a Recv, and sends TAKEN.
	// A peer sends EAGER only to a peer that offered it.
	HelloEager
	// HelloEagerChecksum: with HelloEager, the peer takes EAGER frames in
	// checksum mode, each carrying the CRC-32C of its bytes
	// (EagerChecksum), and then sends a TAKEN for every frame it hands to
	// a Recv. Without it from both peers, a channel in checksum mode sends
	// no EAGER.
	HelloEagerChecksum
	helloAll = HelloChecksum | HelloChecksumAuto | HelloConfirm | HelloPull | HelloEager | HelloEagerChecksum
)

// Flags of EAGER.
const (
	// EagerChecksum: Checksum holds the CRC-32C of the tensor's bytes
	// (a channel in checksum mode).
	EagerChecksum uint8 = 1 << iota
	eagerAll            = EagerChecksum
)

// EagerWindow is how many EAGER frames a sender may have sent that the
// receiver's TAKEN does not count yet.
const EagerWindow = 32

// Flags of CONFIRM.
const (
	// ConfirmBad: the write arrived but did not match its checksum, and the
	// receiver asks no more: the send fails.
	ConfirmBad uint8 = 1 << iota
	confirmAll       = ConfirmBad
)

// Code is the reason of an ERROR_STATUS. Unknown codes decode as they are,
// so a newer peer's codes pass through.
type Code uint16

// Error codes.
const (
	// CodeInternal: the sender failed for a reason of its own.
	CodeInternal Code = iota + 1
	// CodeCancelled: the request was cancelled (CANCEL, or the sender closed).
	CodeCancelled
	// CodeSender: the sending application reported an error for this tensor.
	CodeSender
	// CodeBadRequest: the request was malformed or named an unknown index.
	CodeBadRequest
	// CodeTooSmall: the result buffer cannot hold the tensor.
	CodeTooSmall
	// CodeRemoteAccess: the write into the result buffer failed.
	CodeRemoteAccess
	// CodeLimit: the sender refused the request because serving it would
	// take it beyond one of its bounds on what a peer may make it hold
	// (requests for tensors not sent yet, names); the text names the
	// bound and its value. The channel goes on.
	CodeLimit
	// CodeTooLarge: the receiver refused the tensor, larger than it
	// accepts (CANCEL).
	CodeTooLarge
	// CodeNoMemory: the receiver refused the tensor for want of memory to
	// put it in, its pool exhausted (CANCEL).
	CodeNoMemory
)

var codeNames = [...]string{"", "internal", "cancelled", "sender error", "bad request", "buffer too small", "remote access", "limit reached", "too large", "no memory"}

// String names the code.
func (c Code) String() string {
	if int(c) < len(codeNames) && c > 0 {
		return codeNames[c]
	}
	return fmt.Sprintf("Code(%d)", uint16(c))
}

// Meta is tensor meta-data as it travels: a fixed array of dimensions so a
// Message holds it without allocating.
type Meta struct {
	DType    tensor.DType
	Dead     bool
	Rank     uint8
	Dims     [tensor.MaxRank]int64
	ByteSize int64
}

// SetMeta copies m into w. Ranks above tensor.MaxRank are cut; callers
// validate m first.
func (w *Meta) SetMeta(m tensor.Meta) {
	w.DType, w.Dead, w.ByteSize = m.DType, m.IsDead, m.ByteSize
	n := min(len(m.Shape), tensor.MaxRank)
	w.Rank = uint8(n)
	copy(w.Dims[:n], m.Shape[:n])
}

// Shape is the dimensions, sharing w's memory.
func (w *Meta) Shape() tensor.Shape { return tensor.Shape(w.Dims[:w.Rank]) }

// Tensor returns the meta-data as a tensor.Meta with its own shape.
func (w *Meta) Tensor() tensor.Meta {
	return tensor.Meta{DType: w.DType, IsDead: w.Dead, ByteSize: w.ByteSize, Shape: slices.Clone(w.Shape())}
}

// Equal reports whether w describes m, without allocating.
func (w *Meta) Equal(m tensor.Meta) bool {
	return w.DType == m.DType && w.Dead == m.IsDead && w.ByteSize == m.ByteSize && slices.Equal(w.Shape(), m.Shape)
}

func (w *Meta) len() int { return 3 + 8*int(w.Rank) + 8 }

// Endpoint is one queue pair endpoint in a HELLO, its fields aliasing the
// decoded input.
type Endpoint struct {
	Provider []byte
	Host     []byte
	Data     []byte
}

// Message is any frame. Which fields are meaningful depends on Type:
//
//	TENSOR_REQUEST      Flags(ReqName|ReqMeta|ReqRails|ReqExact|ReqChunks) Req Step NameIndex [Name] Addr RKey Capacity [RailKeys] [Meta] [ChunkShift]
//	META_DATA_RESPONSE  Flags(RespFinal|RespChecksum|RespWriteFollows|RespPull) Req Meta [Checksum] [PullArena PullOffset PullHandle]
//	TENSOR_RE_REQUEST   Req Addr RKey Capacity RailKeys [ChunkShift]
//	ERROR_STATUS        Req Code Text
//	CREDIT              (header only)
//	BYE                 [Flags(ByeImms|ByeEagers) [Imms] [Eagers]]
//	CHECKSUM            Req Checksum
//	CANCEL              Req [Code]
//	CONFIRM             Flags(ConfirmBad) Req
//	HELLO               Flags(HelloChecksum|HelloChecksumAuto|HelloConfirm|HelloPull|HelloEager|HelloEagerChecksum) Ring Slot Text(peer name) Host Endpoints
//	EAGER               Flags(EagerChecksum) Step Name Meta [Checksum] Data(the rest of the frame: Meta.ByteSize bytes)
//	TAKEN               Count
//
// Credits rides in every header. ChunkShift is optional in both requests so
// that frames without it are exactly the frames of the first release: in
// TENSOR_REQUEST it follows ReqChunks; in TENSOR_RE_REQUEST, which has no
// flags, it is one trailing byte, present exactly when it is not 0 (a
// trailing 0 is refused, so every value keeps one encoding). In the same
// way CANCEL's Code is two trailing bytes present exactly when it is not 0,
// and BYE's body is empty or a flags byte that is not 0 and the fields it
// announces: the BYE and CANCEL of the first release decode unchanged. A
// decoder of the first release refuses the longer forms (ErrLength). A
// Message is plain data: reuse one for
// decoding many frames; its byte slices alias the last input.
type Message struct {
	Type    Type
	Credits uint16
	Flags   uint8

	// Req is the request index, the immediate of the write that answers it.
	Req       uint32
	Step      int64
	NameIndex uint32
	Name      []byte

	// Addr, RKey and Capacity name the receiver's result buffer.
	Addr     uint64
	RKey     uint32
	Capacity uint64

	// RailKeys are the result buffer's rkeys on rails 1..NumRailKeys
	// (TENSOR_REQUEST with ReqRails, TENSOR_RE_REQUEST).
	RailKeys    [MaxRailKeys]uint32
	NumRailKeys uint8

	Meta     Meta
	Checksum uint32

	// PullArena, PullOffset and PullHandle say where the receiver pulls a
	// tensor from (META_DATA_RESPONSE with RespPull).
	PullArena  uint64
	PullOffset uint64
	PullHandle []byte

	// Imms is the count of writes with immediate taken in (BYE with
	// ByeImms).
	Imms uint32

	// Data is an EAGER tensor's bytes; Count is TAKEN's count of EAGER
	// frames handed to Recvs; Eagers is BYE's count of EAGER frames taken
	// in (ByeEagers).
	Data   []byte
	Count  uint32
	Eagers uint32

	// ChunkShift, when not 0, asks for the write in chunks of
	// 1<<ChunkShift bytes, MinChunkShift..MaxChunkShift (TENSOR_REQUEST
	// with ReqChunks, TENSOR_RE_REQUEST).
	ChunkShift uint8

	Code Code
	// Text is the error message (ERROR_STATUS) or the peer's name (HELLO).
	Text []byte

	// Ring is the number of receive buffers the peer posts per channel:
	// the credits each side starts with (HELLO).
	Ring uint16
	// Slot is the size of each receive buffer (HELLO).
	Slot uint32
	// Host identifies the peer's machine (HELLO).
	Host         []byte
	Endpoints    [MaxEndpoints]Endpoint
	NumEndpoints uint8
}

// Len is the size of m's encoding.
func (m *Message) Len() int {
	n := HeaderLen
	switch m.Type {
	case TypeRequest:
		n += 1 + 4 + 8 + 4 + 8 + 4 + 8
		if m.Flags&ReqName != 0 {
			n += 2 + len(m.Name)
		}
		if m.Flags&ReqRails != 0 {
			n += m.railsLen()
		}
		if m.Flags&ReqMeta != 0 {
			n += m.Meta.len()
		}
		if m.Flags&ReqChunks != 0 {
			n++
		}
	case TypeMetaResponse:
		n += 1 + 4 + m.Meta.len()
		if m.Flags&RespChecksum != 0 {
			n += 4
		}
		if m.Flags&RespPull != 0 {
			n += 8 + 8 + 2 + len(m.PullHandle)
		}
	case TypeReRequest:
		n += 4 + 8 + 4 + 8 + m.railsLen()
		if m.ChunkShift != 0 {
			n++
		}
	case TypeError:
		n += 4 + 2 + 2 + len(m.Text)
	case TypeChecksum:
		n += 4 + 4
	case TypeConfirm:
		n += 1 + 4
	case TypeCancel:
		n += 4
		if m.Code != 0 {
			n += 2
		}
	case TypeBye:
		if m.Flags != 0 {
			n++
		}
		if m.Flags&ByeImms != 0 {
			n += 4
		}
		if m.Flags&ByeEagers != 0 {
			n += 4
		}
	case TypeEager:
		n += 1 + 8 + 2 + len(m.Name) + m.Meta.len() + len(m.Data)
		if m.Flags&EagerChecksum != 0 {
			n += 4
		}
	case TypeTaken:
		n += 4
	case TypeHello:
		n += 1 + 2 + 4 + 2 + len(m.Text) + 2 + len(m.Host) + 1
		for i := 0; i < int(m.NumEndpoints) && i < MaxEndpoints; i++ {
			e := &m.Endpoints[i]
			n += 6 + len(e.Provider) + len(e.Host) + len(e.Data)
		}
	}
	return n
}

// Append appends m's encoding to b and returns the extended slice. It
// allocates only when b lacks room for Len() more bytes. Append encodes what
// it is given; Check says whether the result will decode.
func (m *Message) Append(b []byte) []byte {
	n := m.Len()
	if cap(b)-len(b) < n {
		nb := make([]byte, len(b), len(b)+n)
		copy(nb, b)
		b = nb
	}
	le := binary.LittleEndian
	b = append(b, Version, byte(m.Type))
	b = le.AppendUint16(b, m.Credits)
	b = le.AppendUint32(b, uint32(n))
	switch m.Type {
	case TypeRequest:
		b = append(b, m.Flags)
		b = le.AppendUint32(b, m.Req)
		b = le.AppendUint64(b, uint64(m.Step))
		b = le.AppendUint32(b, m.NameIndex)
		if m.Flags&ReqName != 0 {
			b = appendBytes16(b, m.Name)
		}
		b = le.AppendUint64(b, m.Addr)
		b = le.AppendUint32(b, m.RKey)
		b = le.AppendUint64(b, m.Capacity)
		if m.Flags&ReqRails != 0 {
			b = m.appendRails(b)
		}
		if m.Flags&ReqMeta != 0 {
			b = m.Meta.append(b)
		}
		if m.Flags&ReqChunks != 0 {
			b = append(b, m.ChunkShift)
		}
	case TypeMetaResponse:
		b = append(b, m.Flags)
		b = le.AppendUint32(b, m.Req)
		b = m.Meta.append(b)
		if m.Flags&RespChecksum != 0 {
			b = le.AppendUint32(b, m.Checksum)
		}
		if m.Flags&RespPull != 0 {
			b = le.AppendUint64(b, m.PullArena)
			b = le.AppendUint64(b, m.PullOffset)
			b = appendBytes16(b, m.PullHandle)
		}
	case TypeReRequest:
		b = le.AppendUint32(b, m.Req)
		b = le.AppendUint64(b, m.Addr)
		b = le.AppendUint32(b, m.RKey)
		b = le.AppendUint64(b, m.Capacity)
		b = m.appendRails(b)
		if m.ChunkShift != 0 {
			b = append(b, m.ChunkShift)
		}
	case TypeError:
		b = le.AppendUint32(b, m.Req)
		b = le.AppendUint16(b, uint16(m.Code))
		b = appendBytes16(b, m.Text)
	case TypeChecksum:
		b = le.AppendUint32(b, m.Req)
		b = le.AppendUint32(b, m.Checksum)
	case TypeConfirm:
		b = append(b, m.Flags)
		b = le.AppendUint32(b, m.Req)
	case TypeCancel:
		b = le.AppendUint32(b, m.Req)
		if m.Code != 0 {
			b = le.AppendUint16(b, uint16(m.Code))
		}
	case TypeBye:
		if m.Flags != 0 {
			b = append(b, m.Flags)
		}
		if m.Flags&ByeImms != 0 {
			b = le.AppendUint32(b, m.Imms)
		}
		if m.Flags&ByeEagers != 0 {
			b = le.AppendUint32(b, m.Eagers)
		}
	case TypeEager:
		b = append(b, m.Flags)
		b = le.AppendUint64(b, uint64(m.Step))
		b = appendBytes16(b, m.Name)
		b = m.Meta.append(b)
		if m.Flags&EagerChecksum != 0 {
			b = le.AppendUint32(b, m.Checksum)
		}
		b = append(b, m.Data...)
	case TypeTaken:
		b = le.AppendUint32(b, m.Count)
	case TypeHello:
		b = append(b, m.Flags)
		b = le.AppendUint16(b, m.Ring)
		b = le.AppendUint32(b, m.Slot)
		b = appendBytes16(b, m.Text)
		b = appendBytes16(b, m.Host)
		ne := min(int(m.NumEndpoints), MaxEndpoints)
		b = append(b, byte(ne))
		for i := 0; i < ne; i++ {
			e := &m.Endpoints[i]
			b = appendBytes16(b, e.Provider)
			b = appendBytes16(b, e.Host)
			b = appendBytes16(b, e.Data)
		}
	}
	return b
}

func (m *Message) railsLen() int { return 1 + 4*min(int(m.NumRailKeys), MaxRailKeys) }

func (m *Message) appendRails(b []byte) []byte {
	k := min(int(m.NumRailKeys), MaxRailKeys)
	b = append(b, byte(k))
	for i := 0; i < k; i++ {
		b = binary.LittleEndian.AppendUint32(b, m.RailKeys[i])
	}
	return b
}

func (w *Meta) append(b []byte) []byte {
	le := binary.LittleEndian
	var f byte
	if w.Dead {
		f = 1
	}
	b = append(b, byte(w.DType), f, w.Rank)
	for i := 0; i < int(w.Rank) && i < tensor.MaxRank; i++ {
		b = le.AppendUint64(b, uint64(w.Dims[i]))
	}
	return le.AppendUint64(b, uint64(w.ByteSize))
}

func appendBytes16(b, v []byte) []byte {
	b = binary.LittleEndian.AppendUint16(b, uint16(len(v)))
	return append(b, v...)
}

// Check reports whether m would encode to a frame that Decode accepts, with
// the same error Decode would give. Senders call it on anything built from
// user input (names, error messages) before Append.
func (m *Message) Check() error {
	var buf [MaxFrame]byte
	if n := m.Len(); n > MaxFrame {
		return fmt.Errorf("%w: %s frame of %d bytes exceeds %d", ErrLength, m.Type, n, MaxFrame)
	}
	var d Message
	_, err := Decode(m.Append(buf[:0]), &d)
	return err
}

// Decode decodes the frame at the start of b into m and returns its length.
// Bytes after the frame are left alone (the next frame of a batch). On error
// m holds partial data.
func Decode(b []byte, m *Message) (int, error) {
	if len(b) < HeaderLen {
		return 0, fmt.Errorf("%w: %d bytes, header needs %d", ErrTruncated, len(b), HeaderLen)
	}
	if b[0] != Version {
		return 0, fmt.Errorf("%w: version %d at offset 0, want %d", ErrVersion, b[0], Version)
	}
	t := Type(b[1])
	if t == 0 || t >= numTypes {
		return 0, fmt.Errorf("%w: %d at offset 1", ErrType, b[1])
	}
	le := binary.LittleEndian
	n := le.Uint32(b[4:8])
	switch {
	case n < HeaderLen || n > MaxFrame:
		return 0, fmt.Errorf("%w: frame length %d at offset 4, want %d..%d", ErrLength, n, HeaderLen, MaxFrame)
	case int(n) > len(b):
		return 0, fmt.Errorf("%w: %s frame of %d bytes, input has %d", ErrTruncated, t, n, len(b))
	}
	m.Type = t
	m.Credits = le.Uint16(b[2:4])
	r := reader{b: b[:n], off: HeaderLen, t: t}
	switch t {
	case TypeRequest:
		m.Flags = r.u8()
		m.Req = r.u32()
		m.Step = int64(r.u64())
		at := r.off
		m.NameIndex = r.u32()
		if r.err == nil && m.Flags&^reqAll != 0 {
			return 0, fmt.Errorf("%w: %#x in %s", ErrFlags, m.Flags, t)
		}
		if r.err == nil && m.NameIndex == 0 {
			return 0, fmt.Errorf("%w: name index 0 at offset %d", ErrField, at)
		}
		m.Name = nil
		if m.Flags&ReqName != 0 {
			at := r.off
			m.Name = r.bytes16(MaxName, "name")
			if r.err == nil && len(m.Name) == 0 {
				return 0, fmt.Errorf("%w: empty name at offset %d", ErrField, at)
			}
		}
		m.Addr = r.u64()
		m.RKey = r.u32()
		m.Capacity = r.u64()
		m.NumRailKeys = 0
		if m.Flags&ReqRails != 0 {
			r.rails(m, 1)
		}
		if m.Flags&ReqMeta != 0 {
			r.meta(&m.Meta)
		}
		m.ChunkShift = 0
		if m.Flags&ReqChunks != 0 {
			r.chunkShift(m)
		}
	case TypeMetaResponse:
		m.Flags = r.u8()
		if r.err == nil && (m.Flags&^respAll != 0 || m.Flags&RespFinal != 0 && m.Flags&RespWriteFollows != 0 ||
			m.Flags&RespPull != 0 && m.Flags != RespPull) {
			return 0, fmt.Errorf("%w: %#x in %s", ErrFlags, m.Flags, t)
		}
		m.Req = r.u32()
		r.meta(&m.Meta)
		if m.Flags&RespChecksum != 0 {
			m.Checksum = r.u32()
		}
		m.PullArena, m.PullOffset, m.PullHandle = 0, 0, nil
		if m.Flags&RespPull != 0 {
			m.PullArena = r.u64()
			m.PullOffset = r.u64()
			at := r.off
			m.PullHandle = r.bytes16(MaxPullHandle, "pull handle")
			if r.err == nil && (m.Meta.Dead || m.Meta.ByteSize == 0) {
				return 0, fmt.Errorf("%w: %s to pull a tensor of no bytes at offset %d", ErrField, t, at)
			}
		}
	case TypeReRequest:
		m.Req = r.u32()
		m.Addr = r.u64()
		m.RKey = r.u32()
		m.Capacity = r.u64()
		r.rails(m, 0)
		m.ChunkShift = 0
		if r.err == nil && r.off < len(r.b) {
			r.chunkShift(m)
		}
	case TypeError:
		m.Req = r.u32()
		m.Code = Code(r.u16())
		m.Text = r.bytes16(MaxText, "message")
	case TypeChecksum:
		m.Req = r.u32()
		m.Checksum = r.u32()
	case TypeConfirm:
		m.Flags = r.u8()
		if r.err == nil && m.Flags&^confirmAll != 0 {
			return 0, fmt.Errorf("%w: %#x in %s", ErrFlags, m.Flags, t)
		}
		m.Req = r.u32()
	case TypeCancel:
		m.Req = r.u32()
		m.Code = 0
		if r.err == nil && len(r.b)-r.off >= 2 {
			at := r.off
			if m.Code = Code(r.u16()); r.err == nil && m.Code == 0 {
				return 0, fmt.Errorf("%w: trailing code 0 at offset %d", ErrField, at)
			}
		}
	case TypeBye:
		m.Flags, m.Imms, m.Eagers = 0, 0, 0
		if r.off < len(r.b) {
			at := r.off
			m.Flags = r.u8()
			if m.Flags == 0 || m.Flags&^byeAll != 0 {
				return 0, fmt.Errorf("%w: %#x at offset %d in %s", ErrFlags, m.Flags, at, t)
			}
			if m.Flags&ByeImms != 0 {
				m.Imms = r.u32()
			}
			if m.Flags&ByeEagers != 0 {
				m.Eagers = r.u32()
			}
		}
	case TypeCredit:
	case TypeEager:
		m.Flags = r.u8()
		if r.err == nil && m.Flags&^eagerAll != 0 {
			return 0, fmt.Errorf("%w: %#x in %s", ErrFlags, m.Flags, t)
		}
		m.Step = int64(r.u64())
		at := r.off
		m.Name = r.bytes16(MaxName, "name")
		if r.err == nil && len(m.Name) == 0 {
			return 0, fmt.Errorf("%w: empty name at offset %d", ErrField, at)
		}
		at = r.off
		r.meta(&m.Meta)
		if r.err == nil && (m.Meta.Dead || m.Meta.ByteSize == 0 || m.Meta.DType == tensor.String) {
			return 0, fmt.Errorf("%w: %s of a dead, empty or string tensor at offset %d", ErrField, t, at)
		}
		if m.Flags&EagerChecksum != 0 {
			m.Checksum = r.u32()
		}
		if r.err == nil && int64(len(r.b)-r.off) != m.Meta.ByteSize {
			return 0, fmt.Errorf("%w: %s of %d tensor bytes carries %d at offset %d", ErrLength, t, m.Meta.ByteSize, len(r.b)-r.off, r.off)
		}
		m.Data = nil
		if r.err == nil {
			m.Data = r.b[r.off:len(r.b):len(r.b)]
			r.off = len(r.b)
		}
	case TypeTaken:
		m.Count = r.u32()
	case TypeHello:
		m.Flags = r.u8()
		if r.err == nil && m.Flags&^helloAll != 0 {
			return 0, fmt.Errorf("%w: %#x in %s", ErrFlags, m.Flags, t)
		}
		m.Ring = r.u16()
		m.Slot = r.u32()
		m.Text = r.bytes16(MaxText, "peer name")
		m.Host = r.bytes16(MaxText, "host")
		at := r.off
		ne := r.u8()
		if r.err == nil && ne > MaxEndpoints {
			return 0, fmt.Errorf("%w: %d endpoints at offset %d, at most %d", ErrLength, ne, at, MaxEndpoints)
		}
		m.NumEndpoints = ne
		for i := 0; i < int(ne) && r.err == nil; i++ {
			e := &m.Endpoints[i]
			e.Provider = r.bytes16(MaxText, "provider")
			e.Host = r.bytes16(MaxText, "endpoint host")
			e.Data = r.bytes16(MaxEndpointData, "endpoint data")
		}
	}
	if r.err != nil {
		return 0, r.err
	}
	if r.off != int(n) {
		return 0, fmt.Errorf("%w: %s frame says %d bytes, body ends at %d", ErrLength, t, n, r.off)
	}
	return int(n), nil
}

// reader reads fixed-width fields and remembers the first error.
type reader struct {
	b   []byte
	off int
	t   Type
	err error
}

func (r *reader) need(k int, what string) bool {
	if r.err != nil {
		return false
	}
	if len(r.b)-r.off < k {
		r.err = fmt.Errorf("%w: %s of %s at offset %d needs %d bytes, frame has %d left", ErrTruncated, what, r.t, r.off, k, len(r.b)-r.off)
		return false
	}
	return true
}

func (r *reader) u8() uint8 {
	if !r.need(1, "field") {
		return 0
	}
	v := r.b[r.off]
	r.off++
	return v
}

func (r *reader) u16() uint16 {
	if !r.need(2, "field") {
		return 0
	}
	v := binary.LittleEndian.Uint16(r.b[r.off:])
	r.off += 2
	return v
}

func (r *reader) u32() uint32 {
	if !r.need(4, "field") {
		return 0
	}
	v := binary.LittleEndian.Uint32(r.b[r.off:])
	r.off += 4
	return v
}

func (r *reader) u64() uint64 {
	if !r.need(8, "field") {
		return 0
	}
	v := binary.LittleEndian.Uint64(r.b[r.off:])
	r.off += 8
	return v
}

func (r *reader) bytes16(limit int, what string) []byte {
	at := r.off
	n := int(r.u16())
	if r.err != nil {
		return nil
	}
	if n > limit {
		r.err = fmt.Errorf("%w: %s of %d bytes at offset %d, at most %d", ErrLength, what, n, at, limit)
		return nil
	}
	if !r.need(n, what) {
		return nil
	}
	v := r.b[r.off : r.off+n : r.off+n]
	r.off += n
	return v
}

// rails reads a rail-key count of least..MaxRailKeys and the keys.
func (r *reader) rails(m *Message, least int) {
	at := r.off
	k := int(r.u8())
	if r.err != nil {
		return
	}
	if k < least || k > MaxRailKeys {
		r.err = fmt.Errorf("%w: %d rail keys at offset %d, want %d..%d", ErrLength, k, at, least, MaxRailKeys)
		return
	}
	m.NumRailKeys = uint8(k)
	for i := 0; i < k; i++ {
		m.RailKeys[i] = r.u32()
	}
}

// chunkShift reads a chunk size, MinChunkShift..MaxChunkShift.
func (r *reader) chunkShift(m *Message) {
	at := r.off
	v := r.u8()
	if r.err != nil {
		return
	}
	if v < MinChunkShift || v > MaxChunkShift {
		r.err = fmt.Errorf("%w: chunk shift %d at offset %d, want %d..%d", ErrField, v, at, MinChunkShift, MaxChunkShift)
		return
	}
	m.ChunkShift = v
}

func (r *reader) meta(w *Meta) {
	at := r.off
	w.DType = tensor.DType(r.u8())
	f := r.u8()
	w.Rank = r.u8()
	if r.err != nil {
		return
	}
	if f > 1 {
		r.err = fmt.Errorf("%w: meta-data flags %#x at offset %d", ErrFlags, f, at+1)
		return
	}
	w.Dead = f == 1
	if w.Rank > tensor.MaxRank {
		r.err = fmt.Errorf("%w: rank %d at offset %d exceeds %d", ErrMeta, w.Rank, at+2, tensor.MaxRank)
		return
	}
	for i := 0; i < int(w.Rank); i++ {
		d := r.u64()
		if d > math.MaxInt64 {
			r.err = fmt.Errorf("%w: dimension %d at offset %d does not fit an int64", ErrMeta, i, r.off-8)
			return
		}
		w.Dims[i] = int64(d)
	}
	bs := r.u64()
	if r.err != nil {
		return
	}
	if bs > math.MaxInt64 {
		r.err = fmt.Errorf("%w: byte size at offset %d does not fit an int64", ErrMeta, r.off-8)
		return
	}
	w.ByteSize = int64(bs)
	tm := tensor.Meta{DType: w.DType, IsDead: w.Dead, ByteSize: w.ByteSize, Shape: w.Shape()}
	if err := tm.Validate(); err != nil {
		r.err = fmt.Errorf("%w: at offset %d: %w", ErrMeta, at, err)
	}
}

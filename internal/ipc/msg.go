package ipc

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// Errors of this package.
var (
	// ErrProtocol: a setup message that makes no sense in the current state.
	ErrProtocol = errors.New("ipc: protocol error")
	// ErrBadMessage: bytes that do not decode as a message.
	ErrBadMessage = errors.New("ipc: malformed message")
	// ErrClosed: the cache or peer was closed.
	ErrClosed = errors.New("ipc: closed")
	// ErrNotMapped: a range outside every mapping.
	ErrNotMapped = errors.New("ipc: range not mapped")
)

// Kind is the kind of a message.
type Kind uint8

// Kinds of setup messages.
const (
	// KindRequest asks the peer whether the IPC path can be used.
	KindRequest Kind = iota + 1
	// KindNotReady: the peer's device is not up yet; ask again later.
	KindNotReady
	// KindAck answers a request: Reach says whether the devices can reach
	// each other.
	KindAck
	// KindConfirm tells the answering side the outcome.
	KindConfirm
	// KindExport announces an exported arena (its handle; the descriptor,
	// if any, travels beside the message).
	KindExport
	// KindRelease: the exporter released an arena.
	KindRelease
	// KindPull offers a tensor to pull: Size bytes at Offset of Arena.
	KindPull
	// KindDone: the receiver's pull of a tensor is complete; the sender
	// may let the source go.
	KindDone
)

func (k Kind) String() string {
	switch k {
	case KindRequest:
		return "REQUEST"
	case KindNotReady:
		return "NOT_READY"
	case KindAck:
		return "ACK"
	case KindConfirm:
		return "CONFIRM"
	case KindExport:
		return "EXPORT"
	case KindRelease:
		return "RELEASE"
	case KindPull:
		return "PULL"
	case KindDone:
		return "DONE"
	}
	return fmt.Sprintf("Kind(%d)", uint8(k))
}

// MaxDevice bounds a device name in a message (a PCI bus id is 16 bytes).
const MaxDevice = 64

// MaxHandle bounds an opaque handle in a message (a legacy CUDA IPC handle
// is 64 bytes).
const MaxHandle = 128

// Msg is one message between the two sides of a pair.
type Msg struct {
	Kind Kind
	// From is the sender's rank.
	From uint32
	// Try numbers a request (1..MaxTries).
	Try uint8
	// Reach is the answer of an ACK or CONFIRM.
	Reach bool
	// Device names the sender's device (REQUEST, ACK).
	Device string
	// Arena, Size and Handle describe an exported arena (EXPORT, RELEASE).
	Arena  uint64
	Size   uint64
	Handle []byte
	// Offset is where a tensor starts in its arena (PULL, DONE).
	Offset uint64
}

const (
	msgMagic   = 0x4950 // "IP"
	msgVersion = 1
	msgHeader  = 2 + 1 + 1 + 4 + 1 + 1 + 8 + 8 + 8 + 1 + 1
)

// Append appends the encoding of m to b.
func (m Msg) Append(b []byte) []byte {
	b = binary.BigEndian.AppendUint16(b, msgMagic)
	b = append(b, msgVersion, byte(m.Kind))
	b = binary.BigEndian.AppendUint32(b, m.From)
	var reach byte
	if m.Reach {
		reach = 1
	}
	b = append(b, m.Try, reach)
	b = binary.BigEndian.AppendUint64(b, m.Arena)
	b = binary.BigEndian.AppendUint64(b, m.Size)
	b = binary.BigEndian.AppendUint64(b, m.Offset)
	b = append(b, byte(len(m.Device)), byte(len(m.Handle)))
	b = append(b, m.Device...)
	return append(b, m.Handle...)
}

// Decode decodes one message that fills b. Errors wrap ErrBadMessage.
func Decode(b []byte) (Msg, error) {
	var m Msg
	if len(b) < msgHeader {
		return m, fmt.Errorf("%w: %d bytes, header is %d", ErrBadMessage, len(b), msgHeader)
	}
	if binary.BigEndian.Uint16(b) != msgMagic || b[2] != msgVersion {
		return m, fmt.Errorf("%w: magic %#x version %d", ErrBadMessage, binary.BigEndian.Uint16(b), b[2])
	}
	m.Kind = Kind(b[3])
	if m.Kind < KindRequest || m.Kind > KindDone {
		return m, fmt.Errorf("%w: kind %d", ErrBadMessage, b[3])
	}
	m.From = binary.BigEndian.Uint32(b[4:])
	m.Try = b[8]
	switch b[9] {
	case 0:
	case 1:
		m.Reach = true
	default:
		return m, fmt.Errorf("%w: reach %d", ErrBadMessage, b[9])
	}
	m.Arena = binary.BigEndian.Uint64(b[10:])
	m.Size = binary.BigEndian.Uint64(b[18:])
	m.Offset = binary.BigEndian.Uint64(b[26:])
	if m.Offset+m.Size < m.Offset {
		return m, fmt.Errorf("%w: offset %d + size %d wraps", ErrBadMessage, m.Offset, m.Size)
	}
	nd, nh := int(b[34]), int(b[35])
	if nd > MaxDevice || nh > MaxHandle {
		return m, fmt.Errorf("%w: device %d bytes, handle %d bytes", ErrBadMessage, nd, nh)
	}
	if len(b) != msgHeader+nd+nh {
		return m, fmt.Errorf("%w: %d bytes, %d announced", ErrBadMessage, len(b), msgHeader+nd+nh)
	}
	m.Device = string(b[msgHeader : msgHeader+nd])
	if nh > 0 {
		m.Handle = append([]byte(nil), b[msgHeader+nd:]...)
	}
	return m, nil
}

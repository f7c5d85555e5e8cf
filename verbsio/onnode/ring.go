package onnode

import (
	"encoding/binary"
	"fmt"

	"github.com/gdrlink/gdrlink/verbsio"
)

// The notification ring: one per direction of a connected queue pair, in a
// memfd owned by the receiving side, written by the sending side only.
// The first page holds, each on its own cache line: the producer's tail,
// the consumer's head, the consumer's sleep flag, a probe word, and the
// words that spare a SEND its wake-ups (see below); records follow.
// Positions grow without wrapping; a record never straddles the end of the
// data area (a pad record fills the gap).
//
// A SEND completes when the consumer has taken it, so the consumer must
// take it even when nobody polls there, and tell the producer. Both cost
// wake-ups of goroutines sleeping in the network poller (on a host with
// few cores, a thread that waits for a core held by a polling waiter): so
// the consumer sets offPoll while a Wait of its receive queue polls (the
// producer then does not signal a SEND: the poller takes it), and writes
// the sequence number of the last SEND it took into offAcked, which a
// producer that says so in offFeatures reads as its acknowledgements. The
// consumer acknowledges through the socket as well only while that
// producer's send queue sleeps (offAckWake), or when it failed a SEND. A
// peer of a release before these words leaves them zero: it is signalled
// and acknowledged as before.
const (
	ringHeader  = 4096
	ringData    = 1 << 20
	ringFile    = ringHeader + ringData
	offTail     = 0
	offHead     = 64
	offSleep    = 128
	offProbe    = 192
	offPoll     = 256 // u32, consumer: a Wait of its receive queue polls
	offAcked    = 320 // u32, consumer: the sequence number of the last SEND it took
	offAckWake  = 384 // u32, producer: a Wait of its send queue sleeps
	offFeatures = 448 // u32, producer: featAckWord
	recHeader   = 16
	maxFragment = 64 << 10
)

// featAckWord, in offFeatures: the producer reads offAcked, so the consumer
// acknowledges through the socket only while offAckWake is set and for a
// failed SEND.
const featAckWord = 1

// Record kinds.
const (
	recPad      = 1
	recSend     = 2 // payload follows; flagMore: more fragments of this send follow
	recWriteImm = 3 // imm and byte length; a 4-byte payload: the rkey written through
	recError    = 4 // the peer's queue pair failed; imm is its status
)

const flagMore = 1

// record is a decoded ring record. Layout, little endian: size u32 (the whole
// record, a multiple of 16), kind u8, flags u8, reserved u16, imm u32, n u32
// (payload bytes of a send, byte length of a write with immediate).
type record struct {
	Size    uint32
	Kind    uint8
	Flags   uint8
	Imm     uint32
	N       uint32
	Payload []byte
	// RKey is the key a write with immediate targeted (its 4-byte
	// payload), for the receiver to count the grant's writes.
	RKey uint32
}

func recordSize(payload int) uint32 { return uint32((recHeader + payload + 15) &^ 15) }

// appendRecord appends the encoding of r (with r.Payload) to b.
func appendRecord(b []byte, r record) []byte {
	size := r.Size
	if size == 0 {
		size = recordSize(len(r.Payload))
	}
	b = putRecordHeader(b, size, r.Kind, r.Flags, r.Imm, r.N)
	b = append(b, r.Payload...)
	for i := recHeader + len(r.Payload); i < int(size); i++ {
		b = append(b, 0)
	}
	return b
}

func putRecordHeader(b []byte, size uint32, kind, flags uint8, imm, n uint32) []byte {
	b = binary.LittleEndian.AppendUint32(b, size)
	b = append(b, kind, flags, 0, 0)
	b = binary.LittleEndian.AppendUint32(b, imm)
	return binary.LittleEndian.AppendUint32(b, n)
}

// parseRecord decodes the record at the start of b, which holds every byte
// the producer has published from there up to the end of the data area.
// The payload aliases b.
func parseRecord(b []byte) (record, error) {
	var r record
	if len(b) < recHeader {
		return r, fmt.Errorf("%w: onnode: ring record header truncated (%d bytes)", verbsio.ErrBadFrame, len(b))
	}
	r.Size = binary.LittleEndian.Uint32(b)
	r.Kind, r.Flags = b[4], b[5]
	r.Imm = binary.LittleEndian.Uint32(b[8:])
	r.N = binary.LittleEndian.Uint32(b[12:])
	if b[6] != 0 || b[7] != 0 {
		return r, fmt.Errorf("%w: onnode: ring record reserved bytes %#x %#x", verbsio.ErrBadFrame, b[6], b[7])
	}
	if r.Size < recHeader || r.Size%16 != 0 || uint64(r.Size) > uint64(len(b)) {
		return r, fmt.Errorf("%w: onnode: ring record size %d with %d bytes published", verbsio.ErrBadFrame, r.Size, len(b))
	}
	switch r.Kind {
	case recPad, recError:
		if r.Flags != 0 {
			return r, fmt.Errorf("%w: onnode: ring record kind %d with flags %#x", verbsio.ErrBadFrame, r.Kind, r.Flags)
		}
	case recWriteImm:
		if r.Flags != 0 || r.Size < recordSize(4) {
			return r, fmt.Errorf("%w: onnode: write-with-immediate record of %d bytes, flags %#x", verbsio.ErrBadFrame, r.Size, r.Flags)
		}
		r.RKey = binary.LittleEndian.Uint32(b[recHeader:])
	case recSend:
		if r.Flags&^flagMore != 0 || uint64(r.N)+recHeader > uint64(r.Size) {
			return r, fmt.Errorf("%w: onnode: send record of %d bytes with payload %d, flags %#x", verbsio.ErrBadFrame, r.Size, r.N, r.Flags)
		}
		r.Payload = b[recHeader : recHeader+r.N]
	default:
		return r, fmt.Errorf("%w: onnode: ring record kind %d", verbsio.ErrBadFrame, r.Kind)
	}
	return r, nil
}

// ring is a mapped notification ring.
type ring struct {
	mem  []byte // the whole file
	data []byte
}

func newRing(mem []byte) *ring {
	return &ring{mem: mem, data: mem[ringHeader : ringHeader+ringData]}
}

package ibverbs

import (
	"encoding/binary"
	"fmt"

	"github.com/gdrlink/gdrlink/internal/ibv"
	"github.com/gdrlink/gdrlink/verbsio"
)

// endpointVersion is the first byte of Endpoint.Data.
const endpointVersion = 1

// endpointLen is the encoded size of version 1.
const endpointLen = 1 + 1 + 2 + 4 + 4 + 2 + 16

// Flags of an encoded endpoint.
const (
	// epGlobal: the peer must be reached with a global route header (RoCE).
	epGlobal = 1 << 0
	epKnown  = epGlobal
)

// endpointData is what Endpoint.Data carries for this provider: the queue
// pair number, its first packet sequence number, the port's LID (InfiniBand)
// and GID (RoCE), and the path MTU the side can use.
type endpointData struct {
	Flags uint8
	MTU   uint16 // bytes
	QPN   uint32 // 24 bits
	PSN   uint32 // 24 bits
	LID   uint16
	GID   ibv.GID
}

// Len is the encoded length.
func (e *endpointData) Len() int { return endpointLen }

// Append appends the encoding: version, flags, MTU, QPN, PSN, LID, GID, all
// big-endian.
func (e *endpointData) Append(b []byte) []byte {
	b = append(b, endpointVersion, e.Flags)
	b = binary.BigEndian.AppendUint16(b, e.MTU)
	b = binary.BigEndian.AppendUint32(b, e.QPN)
	b = binary.BigEndian.AppendUint32(b, e.PSN)
	b = binary.BigEndian.AppendUint16(b, e.LID)
	return append(b, e.GID[:]...)
}

// parseEndpoint decodes Endpoint.Data; anything malformed is an error
// wrapping verbsio.ErrBadFrame.
func parseEndpoint(b []byte) (endpointData, error) {
	var e endpointData
	if len(b) < 1 {
		return e, fmt.Errorf("%w: ibverbs endpoint is empty", verbsio.ErrBadFrame)
	}
	if b[0] != endpointVersion {
		return e, fmt.Errorf("%w: ibverbs endpoint version %d, want %d", verbsio.ErrBadFrame, b[0], endpointVersion)
	}
	if len(b) != endpointLen {
		return e, fmt.Errorf("%w: ibverbs endpoint of %d bytes, want %d", verbsio.ErrBadFrame, len(b), endpointLen)
	}
	e.Flags = b[1]
	e.MTU = binary.BigEndian.Uint16(b[2:])
	e.QPN = binary.BigEndian.Uint32(b[4:])
	e.PSN = binary.BigEndian.Uint32(b[8:])
	e.LID = binary.BigEndian.Uint16(b[12:])
	copy(e.GID[:], b[14:])
	switch {
	case e.Flags&^epKnown != 0:
		return e, fmt.Errorf("%w: ibverbs endpoint flags %#x", verbsio.ErrBadFrame, e.Flags)
	case ibv.MTUEnum(int(e.MTU)) == 0:
		return e, fmt.Errorf("%w: ibverbs endpoint MTU %d", verbsio.ErrBadFrame, e.MTU)
	case e.QPN == 0 || e.QPN >= 1<<24:
		return e, fmt.Errorf("%w: ibverbs endpoint QPN %d", verbsio.ErrBadFrame, e.QPN)
	case e.PSN >= 1<<24:
		return e, fmt.Errorf("%w: ibverbs endpoint PSN %d", verbsio.ErrBadFrame, e.PSN)
	case e.Flags&epGlobal != 0 && e.GID.IsZero():
		return e, fmt.Errorf("%w: ibverbs endpoint needs a GID and has none", verbsio.ErrBadFrame)
	case e.Flags&epGlobal == 0 && e.LID == 0:
		return e, fmt.Errorf("%w: ibverbs endpoint has neither LID nor GID route", verbsio.ErrBadFrame)
	}
	return e, nil
}

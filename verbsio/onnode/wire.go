package onnode

import (
	"encoding/binary"
	"fmt"

	"github.com/gdrlink/gdrlink/verbsio"
)

// wireVersion is the version of the endpoint, hello and control encodings,
// and of the connection set-up and ring records (2: credentials and the job
// key checked first, the dialler's hello first, four descriptors; 3: grants
// in the region table, the key in write-with-immediate records).
const wireVersion = 3

// endpointData is what Endpoint.Data holds: the queue pair's abstract unix
// socket name and its process.
type endpointData struct {
	PID  uint32
	Name string
}

// Len is the encoded size.
func (e endpointData) Len() int { return 1 + 4 + 1 + len(e.Name) }

// Append appends the encoding: version u8, pid u32, name length u8, name.
func (e endpointData) Append(b []byte) []byte {
	b = append(b, wireVersion)
	b = binary.LittleEndian.AppendUint32(b, e.PID)
	b = append(b, byte(len(e.Name)))
	return append(b, e.Name...)
}

func parseEndpointData(b []byte) (endpointData, error) {
	var e endpointData
	if len(b) < 6 {
		return e, fmt.Errorf("%w: onnode endpoint of %d bytes", verbsio.ErrBadFrame, len(b))
	}
	if b[0] != wireVersion {
		return e, fmt.Errorf("%w: onnode endpoint version %d, want %d", verbsio.ErrBadFrame, b[0], wireVersion)
	}
	e.PID = binary.LittleEndian.Uint32(b[1:])
	n := int(b[5])
	if n == 0 || len(b) != 6+n {
		return e, fmt.Errorf("%w: onnode endpoint name of %d bytes in %d", verbsio.ErrBadFrame, n, len(b))
	}
	e.Name = string(b[6:])
	return e, nil
}

// Control messages over the queue pair's unix socket.
const (
	msgHello  = 1 // fds: ring, eventfd, region table, write counters
	msgFDReq  = 2 // rkey: asks for the file of a file-backed region
	msgFDResp = 3 // rkey, ok; fd: the file when ok
	msgAck    = 4 // rkey holds a SEND's sequence number; ok: it landed in a receive
)

// hello is the first message of each side on a new connection, after the
// job-key handshake (when the job has a key); the dialler sends its own first.
type hello struct {
	PID      uint32
	Probe    uint64 // address of the sender's probe word (process_vm_writev check)
	RingSize uint32
	Name     string // the sender's queue pair
	PeerName string // the queue pair it means to reach
}

// Len is the encoded size.
func (h hello) Len() int { return 2 + 4 + 8 + 4 + 1 + len(h.Name) + 1 + len(h.PeerName) }

// Append appends the encoding.
func (h hello) Append(b []byte) []byte {
	b = append(b, wireVersion, msgHello)
	b = binary.LittleEndian.AppendUint32(b, h.PID)
	b = binary.LittleEndian.AppendUint64(b, h.Probe)
	b = binary.LittleEndian.AppendUint32(b, h.RingSize)
	b = append(b, byte(len(h.Name)))
	b = append(b, h.Name...)
	b = append(b, byte(len(h.PeerName)))
	return append(b, h.PeerName...)
}

func parseHello(b []byte) (hello, error) {
	var h hello
	const fixed = 2 + 4 + 8 + 4 + 1
	if len(b) < fixed || b[0] != wireVersion || b[1] != msgHello {
		return h, fmt.Errorf("%w: onnode hello of %d bytes", verbsio.ErrBadFrame, len(b))
	}
	h.PID = binary.LittleEndian.Uint32(b[2:])
	h.Probe = binary.LittleEndian.Uint64(b[6:])
	h.RingSize = binary.LittleEndian.Uint32(b[14:])
	n := int(b[18])
	if len(b) < fixed+n+1 {
		return h, fmt.Errorf("%w: onnode hello name truncated", verbsio.ErrBadFrame)
	}
	h.Name = string(b[fixed : fixed+n])
	m := int(b[fixed+n])
	if len(b) != fixed+n+1+m {
		return h, fmt.Errorf("%w: onnode hello peer name of %d bytes in %d", verbsio.ErrBadFrame, m, len(b))
	}
	h.PeerName = string(b[fixed+n+1:])
	return h, nil
}

// control is an FD request or response, or a SEND's acknowledgement.
type control struct {
	Kind uint8
	RKey uint32
	OK   bool
}

// Len is the encoded size.
// controlLen is the length of every control message.
const controlLen = 7

func (c control) Len() int { return controlLen }

// Append appends the encoding.
func (c control) Append(b []byte) []byte {
	b = append(b, wireVersion, c.Kind)
	b = binary.LittleEndian.AppendUint32(b, c.RKey)
	ok := byte(0)
	if c.OK {
		ok = 1
	}
	return append(b, ok)
}

func parseControl(b []byte) (control, error) {
	var c control
	if len(b) != controlLen || b[0] != wireVersion || (b[1] != msgFDReq && b[1] != msgFDResp && b[1] != msgAck) || b[6] > 1 {
		return c, fmt.Errorf("%w: onnode control message of %d bytes", verbsio.ErrBadFrame, len(b))
	}
	c.Kind = b[1]
	c.RKey = binary.LittleEndian.Uint32(b[2:])
	c.OK = b[6] == 1
	return c, nil
}

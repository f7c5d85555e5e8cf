package gdrlink

import (
	"encoding/binary"
	"fmt"

	"github.com/gdrlink/gdrlink/verbsio"
)

// The messages of lazy connection setup, carried by bootstrap Calls. Only
// the lower rank of a pair makes a connection: it sends connectMsg with a
// provider and its channel's hello, and the higher rank answers with its
// own hello. The higher rank asks the lower one to start with kickMsg, and
// tells it that its side of an attempt failed with failedMsg (so the lower
// rank stops waiting on it and tries the next provider); the lower rank
// says it gave up (every provider failed) with giveUpMsg.
const (
	connMsgVersion = 1

	kickMsg    = 1
	connectMsg = 2
	giveUpMsg  = 3
	failedMsg  = 4
	// ipcMsg carries a message of the on-node GPU path (ipc.Msg) in its
	// payload; the reply holds the answers, each prefixed with its
	// length (ipclink.go).
	ipcMsg = 5
)

// maxConnField bounds a connection message's provider name.
const maxConnField = 64

type connMsg struct {
	kind     byte
	provider string
	// payload is the channel hello (connectMsg) or the reason (giveUpMsg,
	// failedMsg).
	payload []byte
}

func (m connMsg) Append(b []byte) []byte {
	b = append(b, connMsgVersion, m.kind)
	b = binary.BigEndian.AppendUint16(b, uint16(len(m.provider)))
	b = append(b, m.provider...)
	b = binary.BigEndian.AppendUint32(b, uint32(len(m.payload)))
	return append(b, m.payload...)
}

// decodeConnMsg parses a connection message; hostile or truncated input is
// an error wrapping verbsio.ErrBadFrame.
func decodeConnMsg(b []byte) (connMsg, error) {
	bad := func(why string) (connMsg, error) {
		return connMsg{}, fmt.Errorf("%w: connection message: %s", verbsio.ErrBadFrame, why)
	}
	if len(b) < 2 || b[0] != connMsgVersion {
		return bad("no version header")
	}
	m := connMsg{kind: b[1]}
	if m.kind < kickMsg || m.kind > ipcMsg {
		return bad(fmt.Sprintf("kind %d", m.kind))
	}
	b = b[2:]
	if len(b) < 2 {
		return bad("truncated provider")
	}
	n := int(binary.BigEndian.Uint16(b))
	if n > maxConnField || len(b) < 2+n {
		return bad(fmt.Sprintf("provider of %d bytes with %d left", n, len(b)-2))
	}
	m.provider = string(b[2 : 2+n])
	b = b[2+n:]
	if len(b) < 4 {
		return bad("truncated payload")
	}
	if p := binary.BigEndian.Uint32(b); uint64(p) != uint64(len(b)-4) {
		return bad(fmt.Sprintf("payload of %d bytes with %d left", p, len(b)-4))
	}
	m.payload = b[4:]
	return m, nil
}

package onnode

import (
	"bytes"
	"context"
	"encoding/hex"
	"errors"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/internal/jobauth"
	"github.com/gdrlink/gdrlink/internal/logcapture"
	"github.com/gdrlink/gdrlink/verbsio"
)

// packetRec serves a SOCK_SEQPACKET connection to jobauth as a stream and
// keeps every packet read.
type packetRec struct {
	c       *net.UnixConn
	packets [][]byte
	cur     []byte
}

func (p *packetRec) Read(b []byte) (int, error) {
	if len(p.cur) == 0 {
		buf := make([]byte, 512)
		n, err := p.c.Read(buf)
		if err != nil {
			return 0, err
		}
		if n == 0 {
			return 0, io.EOF
		}
		p.packets = append(p.packets, buf[:n])
		p.cur = buf[:n]
	}
	k := copy(b, p.cur)
	p.cur = p.cur[k:]
	return k, nil
}

func (p *packetRec) Write(b []byte) (int, error) { return p.c.Write(b) }

// TestReplay: the packets an honest queue pair sent to prove the key while
// it dialled ours (recorded by the test answering on our socket with the
// key) are replayed on a fresh connection to the socket, from the same
// process, while our queue pair accepts that process for real. (The
// replay cannot come from another process: the socket admits only the
// pid named in the endpoint, and the proof claims that pid as its rank.)
// Our challenge is fresh, so the recorded proof does not answer it: the
// replayer reads the challenge and a refusal, no descriptor, and the
// connection closes; Connect fails with ErrRefused, the refusal is logged,
// and the queue pair then connects with a helper process and moves data.
func TestReplay(t *testing.T) {
	key := newKey(t)
	k, err := jobauth.FromBytes(key)
	if err != nil {
		t.Fatal(err)
	}
	var logs logcapture.Buffer
	n, err := newNodeConfig(verbsio.Config{JobKey: key, Logger: logs.Logger()}, Options{Spin: defaultSpin})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(n.close)
	honest := keyedNode(t, key)
	q := n.qp.(*qp)
	// The honest queue pair must dial ours: its name sorts first.
	for i := 0; honest.qp.(*qp).name > q.name; i++ {
		if i == 64 {
			t.Fatal("no queue pair name sorts before ours")
		}
		if err := honest.newQP(); err != nil {
			t.Fatal(err)
		}
	}
	hq := honest.qp.(*qp)

	// Record: answer the honest dial on our socket, with the key.
	type recorded struct {
		packets [][]byte
		err     error
	}
	recc := make(chan recorded, 1)
	go func() {
		q.ln.SetDeadline(time.Now().Add(10 * time.Second))
		c, err := q.ln.AcceptUnix()
		q.ln.SetDeadline(time.Time{})
		if err != nil {
			recc <- recorded{err: err}
			return
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(10 * time.Second))
		rec := &packetRec{c: c}
		_, err = jobauth.Accept(rec, k, authPurpose, jobauth.Ends{Initiator: sockAddr(hq.name), Acceptor: sockAddr(q.name)})
		recc <- recorded{rec.packets, err}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	herr := honest.qp.Connect(ctx, n.qp.Endpoint())
	r := <-recc
	if r.err != nil {
		t.Fatalf("the honest handshake: %v (its Connect: %v)", r.err, herr)
	}
	if len(r.packets) != 2 {
		t.Fatalf("recorded %d packets of the handshake, want 2", len(r.packets))
	}

	// Replay, while our queue pair accepts the honest process for real.
	errc := make(chan error, 1)
	go func() { errc <- n.qp.Connect(ctx, hq.Endpoint()) }()
	c, err := net.Dial("unixpacket", "@"+q.name)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	raw := c.(*net.UnixConn)
	xchg := func(b []byte) []string {
		t.Helper()
		if _, err := raw.Write(b); err != nil {
			t.Fatal(err)
		}
		return strings.Fields(rawReadHex(raw, 5*time.Second))[1:]
	}
	challenge := xchg(r.packets[0])
	ch, _ := hex.DecodeString(challenge[0])
	if len(ch) != 69 || string(ch[:4]) != authMagic || strings.Join(challenge[1:], " ") != "0 false" || bytes.Contains(r.packets[0], ch[5:37]) {
		t.Fatalf("the answer to the replayed first message: %q, want a fresh challenge of 69 bytes", challenge)
	}
	if got := xchg(r.packets[1]); strings.Join(got, " ") != "01 0 false" {
		t.Errorf("the answer to the replayed proof: %q, want a refusal (01) and no descriptor", got)
	}
	if got := rawRead(raw, 5*time.Second); got != "raw 0 0 true" {
		t.Errorf("after the refusal the replayer read %q, want nothing, no descriptor and the connection closed", got)
	}
	if err := <-errc; !errors.Is(err, jobauth.ErrRefused) {
		t.Errorf("Connect while the replay came: %v, want ErrRefused", err)
	}
	t.Log(logs.WaitLine(t, `msg="onnode: connection refused"`, "pid", jobauth.ErrRefused.Error()))

	// The job's own connection still works.
	p := startPeerWith(t, peerOpts{key: key})
	connect(t, n, p, p.one("ep", "ep"))
	sendRecv(t, n, p)
}

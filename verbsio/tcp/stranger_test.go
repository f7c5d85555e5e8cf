package tcp

import (
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"net"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gdrlink/gdrlink/internal/jobauth"
	"github.com/gdrlink/gdrlink/internal/logcapture"
	"github.com/gdrlink/gdrlink/verbsio"
)

// strangerEnv turns a re-executed test binary into a stranger to a
// device's lanes, in a process of its own (see strangerMain); the other
// variables give it the device's address, the bytes to send, the local
// address to send them from and a key.
const (
	strangerEnv      = "GDRLINK_TCP_STRANGER"
	strangerAddrEnv  = "GDRLINK_TCP_STRANGER_ADDR"
	strangerDataEnv  = "GDRLINK_TCP_STRANGER_DATA"
	strangerLocalEnv = "GDRLINK_TCP_STRANGER_LOCAL"
	strangerKeyEnv   = "GDRLINK_TCP_STRANGER_KEY"
)

func init() {
	if how := os.Getenv(strangerEnv); how != "" {
		json.NewEncoder(os.Stdout).Encode(strangerMain(how))
		os.Exit(0)
	}
}

// strangerReport is what the stranger process saw.
type strangerReport struct {
	Local string // its address, as the device sees it
	// Handshake is the error of its own job-key handshake (wrongkey), and
	// Refused whether it wraps jobauth.ErrRefused.
	Handshake string
	Refused   bool
	// Challenge is the device's answer to the first message of a replayed
	// handshake, Status its answer to the second (-1: none).
	Challenge []byte
	Status    int
	// Rest is what it read after that until the device closed the
	// connection (Closed).
	Rest   []byte
	Closed bool
	Err    string
}

// strangerMain dials the device and
//
//	nokey:    sends the data (a forged hello, frames) without a handshake;
//	wrongkey: makes the handshake with the key (its derived bytes), then
//	          sends the data;
//	replay:   sends the data, an honest initiator's recording, from the
//	          local address the recording was made from, message by message
//	          as the honest initiator did;
//
// and reads what comes back until the device closes the connection.
func strangerMain(how string) (rep strangerReport) {
	rep.Status = -1
	fail := func(err error) strangerReport { rep.Err = err.Error(); return rep }
	data, err := hex.DecodeString(os.Getenv(strangerDataEnv))
	if err != nil {
		return fail(err)
	}
	d := net.Dialer{Timeout: 5 * time.Second}
	if l := os.Getenv(strangerLocalEnv); l != "" {
		if d.LocalAddr, err = net.ResolveTCPAddr("tcp", l); err != nil {
			return fail(err)
		}
		d.Control = func(_, _ string, rc syscall.RawConn) error {
			var serr error
			err := rc.Control(func(fd uintptr) { serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEADDR, 1) })
			return errors.Join(err, serr)
		}
	}
	c, err := d.Dial("tcp", os.Getenv(strangerAddrEnv))
	if err != nil {
		return fail(err)
	}
	defer c.Close()
	rep.Local = c.LocalAddr().String()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	switch how {
	case "wrongkey":
		kb, _ := hex.DecodeString(os.Getenv(strangerKeyEnv))
		k, err := jobauth.FromBytes(kb)
		if err != nil {
			return fail(err)
		}
		if err := jobauth.Initiate(c, k, lanePurpose, 1, jobauth.EndsOf(c, true)); err != nil {
			rep.Handshake, rep.Refused = err.Error(), errors.Is(err, jobauth.ErrRefused)
		}
	case "replay":
		// The initiator's first message, the acceptor's challenge, the
		// initiator's proof, the acceptor's verdict: then the hello.
		first := len(authMagic) + 2 + len(lanePurpose) + 4 + 32
		if len(data) < first+1+32 {
			return fail(errors.New("recording too short"))
		}
		if _, err := c.Write(data[:first]); err != nil {
			return fail(err)
		}
		rep.Challenge = make([]byte, len(authMagic)+1+32+32)
		if _, err := io.ReadFull(c, rep.Challenge); err != nil {
			return fail(err)
		}
		if _, err := c.Write(data[first : first+1+32]); err != nil {
			return fail(err)
		}
		var st [1]byte
		if _, err := io.ReadFull(c, st[:]); err != nil {
			rep.Closed = true
			return rep
		}
		rep.Status = int(st[0])
		data = data[first+1+32:]
		if rep.Status != 0 {
			data = nil
		}
	}
	if len(data) > 0 {
		c.Write(data)
	}
	rest, err := io.ReadAll(c)
	rep.Rest, rep.Closed = rest, err == nil || !isTimeout(err)
	return rep
}

// runStranger runs strangerMain as a process of its own, with env.
func runStranger(t *testing.T, how string, env ...string) strangerReport {
	t.Helper()
	rep := runStrangerErr(t, how, env...)
	if rep.Err != "" {
		t.Fatalf("stranger: %s", rep.Err)
	}
	return rep
}

// runStrangerErr is runStranger, the stranger's own error left in the
// report.
func runStrangerErr(t *testing.T, how string, env ...string) strangerReport {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(append(os.Environ(), strangerEnv+"="+how), env...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("stranger: %v\n%s", err, stderr.Bytes())
	}
	var rep strangerReport
	if err := json.Unmarshal(out, &rep); err != nil {
		t.Fatalf("stranger's report %q: %v", out, err)
	}
	t.Logf("stranger (%s): %+v", how, rep)
	return rep
}

// newQP gives the side a fresh queue pair on its device.
func (s *authSide) newQP(t *testing.T) {
	t.Helper()
	q, err := s.pd.CreateQP(verbsio.QPConfig{SendCQ: s.cq, RecvCQ: s.cq})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { q.Close() })
	s.qp = q.(*qp)
}

// stillWorks connects fresh queue pairs of a and z, on the same devices,
// and sends a's bytes to z.
func stillWorks(t *testing.T, a, z *authSide) {
	t.Helper()
	a.newQP(t)
	z.newQP(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if errA, errZ := connectBoth(ctx, a, z); errA != nil || errZ != nil {
		t.Fatalf("Connect after the stranger: %v, %v", errA, errZ)
	}
	z.postRecv(t, 9)
	copy(a.mem, "after the stranger")
	if c := send(t, a, z, 18); c.Status != verbsio.StatusSuccess || string(z.mem[:18]) != "after the stranger" {
		t.Fatalf("receive %+v holding %q", c, z.mem[:18])
	}
}

// TestStrangerProcess: a separate process without the key sends a forged
// lane hello with frames behind it, or makes the handshake with another
// job's key and then sends its hello. It reads nothing but the refusal
// (helloNeedKey without a key, nothing after a failed handshake), the
// device counts and logs the refusal as a job-key one, and the job's own
// queue pairs connect and move data on the same listener afterwards.
func TestStrangerProcess(t *testing.T) {
	key := newJobKey(t)
	for _, how := range []string{"nokey", "wrongkey"} {
		t.Run(how, func(t *testing.T) {
			var logs logcapture.Buffer
			a := openAuthSide(t, key, 0x11)
			z := openAuthSideConfig(t, verbsio.Config{JobKey: key.Bytes(), Logger: logs.Logger()}, 0x22)
			h := hello{lanes: 1, dstQP: z.qp.id, dstNonce: z.qp.nonce, srcQP: a.qp.id, srcNonce: a.qp.nonce}
			forged := append(h.Append(nil), frame(header{op: opWrite, token: 2, raddr: uint64(z.mr.Addr()), rkey: z.mr.RKey()}, []byte("forged write"))...)
			rep := runStranger(t, how, strangerAddrEnv+"="+z.dev.Info().Address, strangerDataEnv+"="+hex.EncodeToString(forged),
				strangerKeyEnv+"="+hex.EncodeToString(newJobKey(t).Bytes()))
			if !rep.Closed {
				t.Error("the device left the stranger's connection open")
			}
			switch how {
			case "nokey":
				// The device may reset the connection before its answer
				// arrives; it never sends anything else.
				if len(rep.Rest) > 1 || len(rep.Rest) == 1 && rep.Rest[0] != helloNeedKey {
					t.Errorf("the stranger read %v, want at most [%d]", rep.Rest, helloNeedKey)
				}
			case "wrongkey":
				if !rep.Refused || len(rep.Rest) != 0 {
					t.Errorf("another job's key: handshake %q (refused %v), then read %v; want refused, then nothing", rep.Handshake, rep.Refused, rep.Rest)
				}
			}
			if why := waitRefused(t, z.dev, 1); !errors.Is(why, jobauth.ErrRefused) {
				t.Errorf("the device's refusal: %v, want jobauth.ErrRefused", why)
			}
			t.Log(logs.WaitLine(t, `msg="tcp: connection refused"`, "peer="+rep.Local, jobauth.ErrRefused.Error()))
			z.untouched(t)
			stillWorks(t, a, z)
		})
	}
}

// recConn records what a lane's dialler writes.
type recConn struct {
	*net.TCPConn
	mu   sync.Mutex
	sent bytes.Buffer
}

func (c *recConn) Write(b []byte) (int, error) {
	c.mu.Lock()
	c.sent.Write(b)
	c.mu.Unlock()
	return c.TCPConn.Write(b)
}

// TestReplayProcess: the bytes an honest queue pair sent on a lane it
// opened with the job key (its handshake and hello), replayed by a
// separate process from the very address and port the lane came from, to
// the same device: the device's challenge is fresh, so the recorded proof
// does not answer it. The replayer reads the challenge and a refusal and
// nothing else, the device logs the refusal, and the job's queue pairs
// still connect and move data.
func TestReplayProcess(t *testing.T) {
	key := newJobKey(t)
	var logs logcapture.Buffer
	a := openAuthSide(t, key, 0x11)
	z := openAuthSideConfig(t, verbsio.Config{JobKey: key.Bytes(), Logger: logs.Logger()}, 0x22)
	var mu sync.Mutex
	var lanes []*recConn
	a.dev.dialFn = func(ctx context.Context, addr string) (net.Conn, error) {
		var d net.Dialer
		c, err := d.DialContext(ctx, "tcp", addr)
		if err != nil {
			return nil, err
		}
		rc := &recConn{TCPConn: c.(*net.TCPConn)}
		mu.Lock()
		lanes = append(lanes, rc)
		mu.Unlock()
		return rc, nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if errA, errZ := connectBoth(ctx, a, z); errA != nil || errZ != nil {
		t.Fatalf("Connect: %v, %v", errA, errZ)
	}
	z.postRecv(t, 2)
	copy(a.mem, "honest")
	if c := send(t, a, z, 6); c.Status != verbsio.StatusSuccess || string(z.mem[:6]) != "honest" {
		t.Fatalf("receive %+v holding %q", c, z.mem[:6])
	}
	mu.Lock()
	if len(lanes) != 1 {
		t.Fatalf("%d lanes dialled, want 1", len(lanes))
	}
	lane := lanes[0]
	mu.Unlock()
	lane.mu.Lock()
	rec := bytes.Clone(lane.sent.Bytes())
	lane.mu.Unlock()
	if want := len(authMagic) + 2 + len(lanePurpose) + 4 + 32 + 1 + 32 + helloLen; len(rec) < want {
		t.Fatalf("recorded %d bytes, want the handshake and hello, %d", len(rec), want)
	}
	// Free the lane's port at once (a reset, no TIME_WAIT), so that the
	// replay comes from the address the recorded proof names.
	from := lane.LocalAddr().String()
	lane.SetLinger(0)
	a.qp.Close()
	refusedBefore, _ := z.dev.refusals()

	// The reset goes out when the last reader of the lane lets its
	// descriptor go, which may be just after Close returns: until then
	// the port is taken.
	var rep strangerReport
	for try := 0; ; try++ {
		rep = runStrangerErr(t, "replay", strangerAddrEnv+"="+z.dev.Info().Address, strangerDataEnv+"="+hex.EncodeToString(rec), strangerLocalEnv+"="+from)
		if try == 20 || !strings.Contains(rep.Err, "address already in use") {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if rep.Err != "" {
		t.Fatalf("stranger: %s", rep.Err)
	}
	if rep.Local != from {
		t.Fatalf("the replay came from %s, the recording from %s", rep.Local, from)
	}
	if len(rep.Challenge) != 69 || string(rep.Challenge[:4]) != authMagic || bytes.Contains(rec, rep.Challenge[5:37]) {
		t.Errorf("the device's challenge %x: want a fresh nonce, not one of the recording", rep.Challenge)
	}
	if rep.Status != 1 || len(rep.Rest) != 0 || !rep.Closed {
		t.Errorf("the replayed proof was answered %d, then %v (closed %v); want a refusal (1), then nothing and the connection closed", rep.Status, rep.Rest, rep.Closed)
	}
	if why := waitRefused(t, z.dev, refusedBefore+1); !errors.Is(why, jobauth.ErrRefused) {
		t.Errorf("the device's refusal: %v, want jobauth.ErrRefused", why)
	}
	t.Log(logs.WaitLine(t, `msg="tcp: connection refused"`, "peer="+from, jobauth.ErrRefused.Error()))
	stillWorks(t, a, z)
}

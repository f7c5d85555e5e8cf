package bootstrap

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/internal/jobauth"
	"github.com/gdrlink/gdrlink/internal/logcapture"
)

// strangerEnv turns a re-executed test binary into a stranger to a job:
// a process of its own that dials the root at strangerAddrEnv, without
// the key ("nokey") or with another job's key ("wrongkey", the secret in
// strangerKeyEnv), and prints what it got as one JSON line (strangerReport).
const (
	strangerEnv     = "GDRLINK_BOOTSTRAP_STRANGER"
	strangerAddrEnv = "GDRLINK_BOOTSTRAP_STRANGER_ADDR"
	strangerKeyEnv  = "GDRLINK_BOOTSTRAP_STRANGER_KEY"
)

func init() {
	if how := os.Getenv(strangerEnv); how != "" {
		json.NewEncoder(os.Stdout).Encode(strangerMain(how, os.Getenv(strangerAddrEnv), os.Getenv(strangerKeyEnv)))
		os.Exit(0)
	}
}

// strangerReport is what the stranger process saw.
type strangerReport struct {
	// Local is the stranger's address, as the root sees it.
	Local string
	// Handshake is the error of its job-key handshake ("" without one),
	// and Refused whether it wraps jobauth.ErrRefused.
	Handshake string
	Refused   bool
	// Types are the bootstrap messages it read after its hello, and
	// Refusal the text of a tRefused among them.
	Types   []uint8
	Refusal string
	// Rest is what it read that was no message, until the root closed the
	// connection; Closed says the root did.
	Rest   []byte
	Closed bool
	Err    string
}

func strangerMain(how, addr, secret string) (rep strangerReport) {
	c, err := net.Dial("tcp", addr)
	if err != nil {
		rep.Err = err.Error()
		return rep
	}
	defer c.Close()
	rep.Local = c.LocalAddr().String()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	if how == "wrongkey" {
		k, err := jobauth.Parse(secret)
		if err != nil {
			rep.Err = err.Error()
			return rep
		}
		if err := jobauth.Initiate(c, k, authPurpose, 1, jobauth.EndsOf(c, true)); err != nil {
			rep.Handshake, rep.Refused = err.Error(), errors.Is(err, jobauth.ErrRefused)
		}
	}
	// Say hello as rank 1 all the same, and read whatever comes back.
	if _, err := c.Write(appendMsg(nil, tHello, helloBody{rank: 1, size: 2, contact: "127.0.0.1:1"}.Append(nil))); err != nil {
		rep.Closed = true
		return rep
	}
	b, err := io.ReadAll(c)
	rep.Closed = err == nil || !isTimeout(err)
	for len(b) > 0 {
		m, err := readMsg(bytes.NewReader(b), 1<<20)
		if err != nil {
			rep.Rest = b
			break
		}
		rep.Types = append(rep.Types, m.typ)
		if m.typ == tRefused {
			rep.Refusal = string(m.body)
		}
		b = b[msgHdrLen+len(m.body):]
	}
	return rep
}

// runStranger runs a stranger process against the root at addr.
func runStranger(t *testing.T, how, addr, secret string) strangerReport {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), strangerEnv+"="+how, strangerAddrEnv+"="+addr, strangerKeyEnv+"="+secret)
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
	if rep.Err != "" {
		t.Fatalf("stranger: %s", rep.Err)
	}
	return rep
}

// TestStrangerProcess: a separate process dials the root of a two-rank
// job and says hello as rank 1, without the key or with another job's.
// It reads nothing of the job (no rank table, only a refusal when it
// proved nothing, nothing at all after a failed handshake), and its
// connection is closed; the root logs the refusal as a job-key one, and
// the real rank 1 joins afterwards.
func TestStrangerProcess(t *testing.T) {
	key := testKey(t, "stranger process")
	for _, how := range []string{"nokey", "wrongkey"} {
		t.Run(how, func(t *testing.T) {
			var logs logcapture.Buffer
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			root := joinAsync(t, ctx, Config{Rank: 0, Size: 2, Listener: ln, Key: key, Logger: logs.Logger()})

			rep := runStranger(t, how, ln.Addr().String(), "bootstrap test key another job")
			if !rep.Closed {
				t.Error("the root left the stranger's connection open")
			}
			for _, typ := range rep.Types {
				if typ != tRefused {
					t.Errorf("the stranger read a message of type %d", typ)
				}
			}
			switch how {
			case "nokey":
				if len(rep.Types) != 1 || !strings.Contains(rep.Refusal, "job key") || len(rep.Rest) != 0 {
					t.Errorf("a hello without the key: messages %v %q, then %q; want one refusal asking for the job key", rep.Types, rep.Refusal, rep.Rest)
				}
			case "wrongkey":
				if !rep.Refused || len(rep.Types) != 0 || len(rep.Rest) != 0 {
					t.Errorf("another job's key: handshake %q (refused %v), then messages %v and %q; want refused, then nothing", rep.Handshake, rep.Refused, rep.Types, rep.Rest)
				}
			}
			l := logs.WaitLine(t, `msg="bootstrap: connection refused"`, "peer="+rep.Local, "reason=", jobauth.ErrRefused.Error())
			t.Log(l)

			r1 := joinAsync(t, ctx, Config{Rank: 1, Size: 2, Root: ln.Addr().String(), Key: key})
			gs := []*Group{wait(t, root, "root"), wait(t, r1, "rank 1")}
			barrier(t, gs...)
		})
	}
}

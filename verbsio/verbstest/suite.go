// Package verbstest is the conformance suite of verbsio providers, in the
// manner of golang.org/x/net/nettest: Run checks a provider's advertised
// capabilities against its behaviour, and its verbs semantics (keys and
// access, write, write with immediate, send and receive, read, remote-access
// errors with guard patterns, a peer dying mid-transfer) between this
// process and a real peer process: the test binary re-executed, running
// PeerMain from TestMain and driven over its standard input and output.
package verbstest

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"sync"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/internal/offheap"
	"github.com/gdrlink/gdrlink/verbsio"
)

// Harness says how to run the suite against one provider.
type Harness struct {
	// Provider is the registered name of the provider under test.
	Provider string
	// Config opens the device in this process (zero: defaults).
	Config verbsio.Config
	// PeerEnv is added to the peer's environment (for example
	// GDRLINK_LISTEN_ADDR=10.1.0.2:0).
	PeerEnv []string
	// Wrap, when set, turns the peer's command line into the one to run
	// (for example to prefix "ip netns exec NAME").
	Wrap func(argv []string) []string
	// RequireEnv names an environment variable ("GDRLINK_REQUIRE_RDMA")
	// that, set to 1, makes a device that cannot open fail the test instead
	// of skipping it.
	RequireEnv string
	// Timeout bounds each wait for a completion or a peer's answer
	// (0: 30s).
	Timeout time.Duration
}

func (h *Harness) timeout() time.Duration {
	if h.Timeout > 0 {
		return h.Timeout
	}
	return 30 * time.Second
}

// Run runs the suite. A device that cannot open here skips it with the
// reason, unless h.RequireEnv says the hardware must be there.
func Run(t *testing.T, h Harness) {
	dev, err := verbsio.Open(h.Provider, h.Config)
	if err != nil {
		if h.RequireEnv != "" && os.Getenv(h.RequireEnv) == "1" {
			t.Fatalf("%s=1 but provider %q cannot open a device: %v", h.RequireEnv, h.Provider, err)
		}
		t.Skipf("provider %q cannot open a device here: %v", h.Provider, err)
	}
	s := &suite{h: h, dev: dev}
	t.Cleanup(func() {
		if s.pd != nil {
			if err := s.pd.Close(); err != nil {
				t.Errorf("closing the protection domain: %v", err)
			}
		}
		if err := dev.Close(); err != nil {
			t.Errorf("closing the device: %v", err)
		}
	})
	if s.pd, err = dev.AllocPD(); err != nil {
		t.Fatalf("AllocPD: %v", err)
	}
	t.Run("Caps", s.testCaps)
	t.Run("Register", s.testRegister)
	t.Run("CloseBusy", s.testCloseBusy)
	t.Run("WaitCancel", s.testWaitCancel)
	s.peer = startPeer(t, h)
	t.Run("ConnectBootstrap", s.testConnectBootstrap)
	t.Run("Write", s.testWrite)
	t.Run("LargeWrite", s.testLargeWrite)
	t.Run("WriteImm", s.testWriteImm)
	t.Run("Inline", s.testInline)
	t.Run("Gather", s.testGather)
	t.Run("SendRecv", s.testSendRecv)
	t.Run("RecvTooSmall", s.testRecvTooSmall)
	t.Run("Read", s.testRead)
	t.Run("ChainPollBatch", s.testChain)
	t.Run("RemoteAccess", s.testRemoteAccess)
	t.Run("DeregisterThenUse", s.testDeregister)
	t.Run("PeerKilled", s.testPeerKilled)
}

type suite struct {
	h    Harness
	dev  verbsio.Device
	pd   verbsio.ProtectionDomain
	peer *peerProc
}

// peerProc is a running peer process.
type peerProc struct {
	t       testing.TB
	h       Harness
	cmd     *exec.Cmd
	in      io.WriteCloser
	out     *os.File
	dec     *json.Decoder
	mu      sync.Mutex
	waitErr chan error
}

func startPeer(t testing.TB, h Harness) *peerProc {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatalf("finding the test binary: %v", err)
	}
	argv := []string{exe, "-test.run=^$"}
	if h.Wrap != nil {
		argv = h.Wrap(argv)
	}
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Env = append(append(os.Environ(), PeerEnv+"="+h.Provider), h.PeerEnv...)
	cmd.Stderr = os.Stderr
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	pr, pw, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stdout = pw
	if err := cmd.Start(); err != nil {
		t.Fatalf("starting the peer %v: %v", argv, err)
	}
	pw.Close()
	p := &peerProc{t: t, h: h, cmd: cmd, in: in, out: pr, dec: json.NewDecoder(bufio.NewReader(pr)), waitErr: make(chan error, 1)}
	go func() { p.waitErr <- cmd.Wait() }()
	t.Cleanup(p.stop)
	var ready reply
	if err := p.read(&ready); err != nil {
		t.Fatalf("peer did not start (does TestMain call verbstest.PeerMain?): %v", err)
	}
	return p
}

func (p *peerProc) read(r *reply) error {
	p.out.SetReadDeadline(time.Now().Add(p.h.timeout() + 10*time.Second))
	return p.dec.Decode(r)
}

// call sends one command and returns the answer; a peer that does not
// answer in time is killed and the test fails.
func (p *peerProc) call(t testing.TB, r request) reply {
	t.Helper()
	rep, err := p.try(r)
	if err != nil {
		t.Fatalf("peer %s: %v", r.Op, err)
	}
	return rep
}

func (p *peerProc) try(r request) (reply, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	b, _ := json.Marshal(r)
	if _, err := p.in.Write(append(b, '\n')); err != nil {
		return reply{}, fmt.Errorf("writing to the peer: %w", err)
	}
	var rep reply
	if err := p.read(&rep); err != nil {
		p.cmd.Process.Kill()
		return reply{}, fmt.Errorf("reading from the peer: %w", err)
	}
	if rep.Err != "" {
		return rep, errors.New(rep.Err)
	}
	return rep, nil
}

// kill ends the peer with SIGKILL, as a crash would.
func (p *peerProc) kill() {
	p.cmd.Process.Kill()
	<-p.waitErr
	p.waitErr <- nil
}

func (p *peerProc) stop() {
	p.mu.Lock()
	p.in.Write([]byte(`{"Op":"exit"}` + "\n"))
	p.in.Close()
	p.mu.Unlock()
	select {
	case <-p.waitErr:
	case <-time.After(10 * time.Second):
		p.cmd.Process.Kill()
		<-p.waitErr
	}
	p.out.Close()
}

// remoteRegion is a region registered by the peer, with guard bytes on both
// sides of it.
type remoteRegion struct {
	id    int
	addr  uint64
	rkey  uint32
	size  int
	guard int
}

func (s *suite) peerRegion(t testing.TB, p *peerProc, size, guard int, fill byte, access verbsio.Access) remoteRegion {
	t.Helper()
	rep := p.call(t, request{Op: "reg", Size: size, Guard: guard, Fill: fill, Access: access})
	return remoteRegion{id: rep.ID, addr: rep.Addr, rkey: rep.RKey, size: size, guard: guard}
}

// peerBytes reads back the peer's whole mapping of a region, guards included.
func peerBytes(t testing.TB, p *peerProc, r remoteRegion) []byte {
	t.Helper()
	return p.call(t, request{Op: "bytes", ID: r.id}).Data
}

// localRegion is mmap'd memory registered in the suite's protection domain.
type localRegion struct {
	mem []byte
	mr  verbsio.MemoryRegion
}

func (s *suite) local(t testing.TB, size int, access verbsio.Access) localRegion {
	t.Helper()
	mem := mmap(t, size)
	mr, err := s.pd.RegisterMemory(offheap.Addr(mem), size, access)
	if err != nil {
		t.Fatalf("RegisterMemory(%d bytes, %v): %v", size, access, err)
	}
	t.Cleanup(func() { mr.Close() })
	return localRegion{mem: mem, mr: mr}
}

func (l localRegion) sge(off, n int) verbsio.SGE {
	return verbsio.SGE{Addr: l.mr.Addr() + uintptr(off), Length: uint32(n), LKey: l.mr.LKey()}
}

// conn is a connected pair: a local queue pair and the peer's.
type conn struct {
	s        *suite
	p        *peerProc
	qp       verbsio.QueuePair
	scq, rcq verbsio.CompletionQueue
	peerQP   int
}

func (s *suite) newQP(t testing.TB, cfg verbsio.QPConfig) *conn {
	t.Helper()
	c := &conn{s: s, p: s.peer}
	var err error
	if c.scq, err = s.dev.CreateCQ(1024); err != nil {
		t.Fatalf("CreateCQ: %v", err)
	}
	if c.rcq, err = s.dev.CreateCQ(1024); err != nil {
		t.Fatalf("CreateCQ: %v", err)
	}
	cfg.SendCQ, cfg.RecvCQ = c.scq, c.rcq
	if c.qp, err = s.pd.CreateQP(cfg); err != nil {
		t.Fatalf("CreateQP: %v", err)
	}
	t.Cleanup(func() {
		for _, err := range []error{c.qp.Close(), c.scq.Close(), c.rcq.Close()} {
			if err != nil {
				t.Errorf("closing the queue pair: %v", err)
			}
		}
	})
	return c
}

// connect makes a connected pair with the given peer process, trading
// endpoints over the control pipe.
func (s *suite) connect(t testing.TB, p *peerProc, cfg verbsio.QPConfig) *conn {
	t.Helper()
	c := s.newQP(t, cfg)
	c.p = p
	rep := p.call(t, request{Op: "qp", Count: 1024})
	c.peerQP = rep.ID
	t.Cleanup(func() { p.try(request{Op: "closeqp", ID: c.peerQP}) })
	ctx, cancel := context.WithTimeout(context.Background(), s.h.timeout())
	defer cancel()
	errc := make(chan error, 1)
	go func() { errc <- c.qp.Connect(ctx, *rep.Endpoint) }()
	ep := c.qp.Endpoint()
	if _, err := p.try(request{Op: "connect", ID: c.peerQP, Endpoint: &ep}); err != nil {
		t.Fatalf("peer Connect: %v", err)
	}
	if err := <-errc; err != nil {
		t.Fatalf("Connect: %v", err)
	}
	if st := c.qp.State(); st != verbsio.QPReady {
		t.Fatalf("state after Connect = %v, want ready", st)
	}
	return c
}

// wait collects n completions from cq, failing the test on timeout.
func (s *suite) wait(t testing.TB, cq verbsio.CompletionQueue, n int) []verbsio.Completion {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), s.h.timeout())
	defer cancel()
	var out []verbsio.Completion
	buf := make([]verbsio.Completion, 8)
	for len(out) < n {
		k, err := cq.Wait(ctx, buf)
		if err != nil {
			t.Fatalf("after %d of %d completions: Wait: %v", len(out), n, err)
		}
		if k > len(buf) {
			t.Fatalf("Wait returned %d completions for a buffer of %d", k, len(buf))
		}
		out = append(out, buf[:k]...)
	}
	return out
}

// post posts one signaled work request and returns its completion.
func (c *conn) post(t testing.TB, wr verbsio.SendWR) verbsio.Completion {
	t.Helper()
	wr.Signaled = true
	if err := c.qp.PostSend([]verbsio.SendWR{wr}); err != nil {
		t.Fatalf("PostSend(%v): %v", wr.Op, err)
	}
	cs := c.s.wait(t, c.scq, 1)
	if cs[0].WRID != wr.WRID {
		t.Fatalf("completion WRID %d, want %d", cs[0].WRID, wr.WRID)
	}
	return cs[0]
}

func (c *conn) peerPoll(t testing.TB, n int) []wireCompletion {
	t.Helper()
	return c.p.call(t, request{Op: "poll", ID: c.peerQP, Count: n, Timeout: c.s.h.timeout()}).Completions
}

func rootListenAddr(cfg verbsio.Config) string {
	if h, _, err := net.SplitHostPort(cfg.ListenAddr); err == nil && h != "" {
		return net.JoinHostPort(h, "0")
	}
	return "127.0.0.1:0"
}

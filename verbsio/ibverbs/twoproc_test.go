package ibverbs

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/internal/bootstrap"
	"github.com/gdrlink/gdrlink/verbsio"
	"github.com/gdrlink/gdrlink/verbsio/verbstest"
)

// The two-process tests re-execute the test binary as the peer: with
// helperEnv set, TestMain runs the named helper instead of the tests.
const helperEnv = "GDRLINK_IBVERBS_HELPER"

func TestMain(m *testing.M) {
	verbstest.PeerMain()
	if h := os.Getenv(helperEnv); h != "" {
		os.Exit(runHelper(h))
	}
	os.Exit(m.Run())
}

func runHelper(name string) int {
	var err error
	switch name {
	case "peer":
		err = peerMain()
	default:
		err = fmt.Errorf("unknown helper %q", name)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "helper %s: %v\n", name, err)
		return 1
	}
	return 0
}

// Queue pairs of the two-process test, one per case: a remote access
// error moves the requester's queue pair to the error state.
const (
	qpMain = iota
	qpWrongKey
	qpOutOfBounds
	qpReadOnly
	qpDeregistered
	qpCount
)

// side is one process's half of the test: a device, a domain, a queue per
// direction and qpCount queue pairs.
type side struct {
	d      *device
	pd     verbsio.ProtectionDomain
	scq    verbsio.CompletionQueue
	rcq    verbsio.CompletionQueue
	qps    [qpCount]verbsio.QueuePair
	cancel []func() error
}

func newSide(cfg verbsio.Config) (*side, error) {
	s := &side{}
	var err error
	if s.d, err = newProvider().openDevice(cfg); err != nil {
		return nil, err
	}
	s.cancel = append(s.cancel, s.d.Close)
	if s.pd, err = s.d.AllocPD(); err != nil {
		return s, err
	}
	s.cancel = append(s.cancel, s.pd.Close)
	if s.scq, err = s.d.CreateCQ(64); err != nil {
		return s, err
	}
	s.cancel = append(s.cancel, s.scq.Close)
	if s.rcq, err = s.d.CreateCQ(64); err != nil {
		return s, err
	}
	s.cancel = append(s.cancel, s.rcq.Close)
	for i := range s.qps {
		if s.qps[i], err = s.pd.CreateQP(verbsio.QPConfig{SendCQ: s.scq, RecvCQ: s.rcq, MaxSendWR: 16, MaxRecvWR: 16}); err != nil {
			return s, err
		}
		s.cancel = append(s.cancel, s.qps[i].Close)
	}
	return s, nil
}

func (s *side) close() error {
	var errs []error
	for i := len(s.cancel) - 1; i >= 0; i-- {
		errs = append(errs, s.cancel[i]())
	}
	return errors.Join(errs...)
}

// hello is what the sides trade through the bootstrap.
type hello struct {
	Endpoints [][]byte
	// Regions: name -> address, key, length.
	Regions map[string][3]uint64
}

func (s *side) hello(regions map[string]verbsio.MemoryRegion) ([]byte, error) {
	h := hello{Regions: map[string][3]uint64{}}
	for _, q := range s.qps {
		h.Endpoints = append(h.Endpoints, bootstrap.EncodeEndpoint(nil, q.Endpoint()))
	}
	for n, m := range regions {
		h.Regions[n] = [3]uint64{uint64(m.Addr()), uint64(m.RKey()), uint64(m.Len())}
	}
	return json.Marshal(h)
}

func (s *side) connect(ctx context.Context, g *bootstrap.Group, peer int, regions map[string]verbsio.MemoryRegion) (hello, error) {
	var h hello
	mine, err := s.hello(regions)
	if err != nil {
		return h, err
	}
	theirs, err := g.Exchange(ctx, peer, mine)
	if err != nil {
		return h, err
	}
	if err := json.Unmarshal(theirs, &h); err != nil {
		return h, err
	}
	if len(h.Endpoints) != qpCount {
		return h, fmt.Errorf("peer sent %d endpoints", len(h.Endpoints))
	}
	for i, b := range h.Endpoints {
		e, err := bootstrap.DecodeEndpoint(b)
		if err != nil {
			return h, err
		}
		if err := s.qps[i].Connect(ctx, e); err != nil {
			return h, fmt.Errorf("queue pair %d: %w", i, err)
		}
	}
	return h, g.Barrier(ctx)
}

// post posts one work request on queue pair i and waits for its completion.
func (s *side) post(i int, wr verbsio.SendWR) (verbsio.Completion, error) {
	wr.Signaled = true
	if err := s.qps[i].PostSend([]verbsio.SendWR{wr}); err != nil {
		return verbsio.Completion{}, err
	}
	c, err := waitN(s.scq, 1, 60*time.Second)
	if err != nil {
		return verbsio.Completion{}, err
	}
	return c[0], nil
}

const (
	targetLen = 256 << 10
	seed      = 0x5c
)

// TestTwoProcesses runs the provider between this process (rank 0, the
// target) and a re-executed copy of the test binary (rank 1, the
// initiator), joined through the bootstrap: RDMA WRITE, WRITE WITH
// IMMEDIATE, SEND/RECV and READ, then the remote access errors as the
// device reports them (wrong rkey, out of bounds, read-only region,
// deregistered region), and finally the peer's death.
func TestTwoProcesses(t *testing.T) {
	cfg := testConfig(t)
	// A short ACK timeout, so the dead peer is found in well under a second
	// of retries (4.096 us * 2^12 = 16.8 ms, times 8 tries).
	cfg.Timeout = 12
	// RetryCount stays at its default, 7, which Soft-RoCE would take as
	// "retry forever" if the provider did not make it 6 there.
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var peerOut bytes.Buffer
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), helperEnv+"=peer", "GDRLINK_ROOT="+ln.Addr().String(), "GDRLINK_RANK=1", "GDRLINK_SIZE=2",
		fmt.Sprintf("RDMA_DEVICE=%s", cfg.Device), fmt.Sprintf("RDMA_GID_INDEX=%d", cfg.GIDIndex), "RDMA_QP_TIMEOUT=12")
	cmd.Stdout, cmd.Stderr = &peerOut, &peerOut
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	peerDone := make(chan error, 1)
	go func() { peerDone <- cmd.Wait() }()
	defer func() {
		cancel()
		<-peerDone
		t.Logf("peer output:\n%s", peerOut.String())
	}()

	g, err := bootstrap.Join(ctx, bootstrap.Config{Rank: 0, Size: 2, Listener: ln})
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	s, err := newSide(cfg)
	if s != nil {
		defer func() {
			if err := s.close(); err != nil {
				t.Errorf("close: %v", err)
			}
		}()
	}
	if err != nil {
		t.Fatal(err)
	}
	// The target region, with a guard page after it that no write may touch.
	mem := mapMem(t, targetLen+4096)
	guard := mem[targetLen:]
	pattern(guard, 0xee)
	target, err := s.pd.RegisterMemory(mem.addr(), targetLen, verbsio.AccessLocalWrite|verbsio.AccessRemoteWrite)
	if err != nil {
		t.Fatal(err)
	}
	defer mustClose(t, "target", target)
	roMem := mapMem(t, 4096)
	pattern(roMem, 0xa5)
	ro, err := s.pd.RegisterMemory(roMem.addr(), len(roMem), verbsio.AccessRemoteRead)
	if err != nil {
		t.Fatal(err)
	}
	defer mustClose(t, "read-only", ro)
	goneMem := mapMem(t, 4096)
	gone, err := s.pd.RegisterMemory(goneMem.addr(), len(goneMem), verbsio.AccessLocalWrite|verbsio.AccessRemoteWrite)
	if err != nil {
		t.Fatal(err)
	}
	recvMem := mapMem(t, 4096)
	rmr, err := s.pd.RegisterMemory(recvMem.addr(), len(recvMem), verbsio.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	defer mustClose(t, "receive", rmr)
	// One receive for the write with immediate, one for the send.
	if err := s.qps[qpMain].PostRecv([]verbsio.RecvWR{
		{WRID: 100, SG: []verbsio.SGE{{Addr: rmr.Addr(), Length: 1024, LKey: rmr.LKey()}}},
		{WRID: 101, SG: []verbsio.SGE{{Addr: rmr.Addr() + 1024, Length: 1024, LKey: rmr.LKey()}}},
	}); err != nil {
		t.Fatal(err)
	}
	peer, err := s.connect(ctx, g, 1, map[string]verbsio.MemoryRegion{"target": target, "ro": ro, "gone": gone})
	if err != nil {
		t.Fatal(err)
	}

	// 1. The peer writes the target (a write, then a write with immediate),
	// then sends a message.
	got, err := waitN(s.rcq, 2, 60*time.Second)
	if err != nil {
		t.Fatalf("receives: %v", err)
	}
	if c := got[0]; c.Status != verbsio.StatusSuccess || c.Op != verbsio.OpRecvImm || !c.HasImm || c.Imm != 0xc0ffee || c.WRID != 100 || c.QP != s.qps[qpMain] {
		t.Errorf("write-with-immediate completion %+v", c)
	}
	if c := got[1]; c.Status != verbsio.StatusSuccess || c.Op != verbsio.OpRecv || c.ByteLen != 11 || c.WRID != 101 {
		t.Errorf("send completion %+v", c)
	} else if msg := string(recvMem[1024 : 1024+11]); msg != "hello, rank" {
		t.Errorf("received %q", msg)
	}
	if err := checkPattern(mem[:targetLen], seed); err != nil {
		t.Errorf("target after the peer's writes: %v", err)
	}
	// 2. The peer's faulty writes (wrong key, out of bounds, read-only):
	// they run between these barriers.
	if err := g.Barrier(ctx); err != nil {
		t.Fatal(err)
	}
	if err := g.Barrier(ctx); err != nil {
		t.Fatal(err)
	}
	if err := checkPattern(guard, 0xee); err != nil {
		t.Errorf("guard page after an out-of-bounds write: %v", err)
	}
	if err := checkPattern(roMem, 0xa5); err != nil {
		t.Errorf("read-only region after a write: %v", err)
	}
	// 3. Deregistration while idle: the peer's next write to it must fail.
	if err := gone.Close(); err != nil {
		t.Fatal(err)
	}
	if err := g.Barrier(ctx); err != nil {
		t.Fatal(err)
	}
	if err := g.Barrier(ctx); err != nil {
		t.Fatal(err)
	}
	for i, b := range goneMem {
		if b != 0 {
			t.Fatalf("deregistered region written at %d", i)
		}
	}
	// 4. The peer dies without closing anything; writing to it must end
	// in an error completion that says the peer is lost.
	if err := g.Barrier(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-peerDone:
		peerDone <- err
		if err != nil {
			t.Fatalf("peer: %v", err)
		}
	case <-ctx.Done():
		t.Fatal("peer did not exit")
	}
	// A receive posted before the failure must come back flushed.
	if err := s.qps[qpMain].PostRecv([]verbsio.RecvWR{{WRID: 102, SG: []verbsio.SGE{{Addr: rmr.Addr(), Length: 64, LKey: rmr.LKey()}}}}); err != nil {
		t.Fatal(err)
	}
	rs := peer.Regions["src"]
	c, err := s.post(qpMain, verbsio.SendWR{WRID: 9, Op: verbsio.OpWrite, SG: []verbsio.SGE{{Addr: target.Addr(), Length: 4096, LKey: target.LKey()}},
		RemoteAddr: rs[0], RKey: uint32(rs[1])})
	if err != nil {
		t.Fatal(err)
	}
	if c.Status == verbsio.StatusSuccess || c.WRID != 9 || c.Op != verbsio.OpWrite {
		t.Fatalf("write to a dead peer: %+v", c)
	}
	t.Logf("write to a dead peer: %s (%v)", c.Status, c.Status.Err())
	if !errors.Is(c.Status.Err(), verbsio.ErrPeerLost) {
		t.Errorf("write to a dead peer completed with %s, want an error wrapping ErrPeerLost", c.Status)
	}
	if st := s.qps[qpMain].State(); st != verbsio.QPError {
		t.Errorf("queue pair after the peer died: %s", st)
	}
	if err := s.qps[qpMain].PostSend([]verbsio.SendWR{{Op: verbsio.OpWrite}}); !errors.Is(err, verbsio.ErrQPState) {
		t.Errorf("post after the error: %v", err)
	}
	if got, err := waitN(s.rcq, 1, 30*time.Second); err != nil {
		t.Errorf("the receive posted before the failure did not complete: %v", err)
	} else if c := got[0]; c.WRID != 102 || c.Status != verbsio.StatusFlushed || c.Op != verbsio.OpRecv || c.QP != s.qps[qpMain] {
		t.Errorf("receive after the failure: %+v, want flushed", c)
	}
}

// peerMain is rank 1 of TestTwoProcesses.
func peerMain() error {
	cfg, err := verbsio.ConfigFromEnv()
	if err != nil {
		return err
	}
	bc, err := bootstrap.FromEnv()
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	g, err := bootstrap.Join(ctx, bc)
	if err != nil {
		return err
	}
	s, err := newSide(cfg)
	if err != nil {
		return err
	}
	src, err := mmapAnon(targetLen)
	if err != nil {
		return err
	}
	pattern(src, seed)
	// Written by the dead-peer write of rank 0, so it allows remote writes.
	smr, err := s.pd.RegisterMemory(src.addr(), len(src), verbsio.AccessLocalWrite|verbsio.AccessRemoteWrite)
	if err != nil {
		return err
	}
	peer, err := s.connect(ctx, g, 0, map[string]verbsio.MemoryRegion{"src": smr})
	if err != nil {
		return err
	}
	tg, ro, gone := peer.Regions["target"], peer.Regions["ro"], peer.Regions["gone"]
	sge := func(off, n int) []verbsio.SGE {
		return []verbsio.SGE{{Addr: smr.Addr() + uintptr(off), Length: uint32(n), LKey: smr.LKey()}}
	}
	// 1. A chain: write the first half, write the second half with an
	// immediate, send a message. Only the last two are signaled.
	half := targetLen / 2
	chain := []verbsio.SendWR{
		{WRID: 1, Op: verbsio.OpWrite, SG: sge(0, half), RemoteAddr: tg[0], RKey: uint32(tg[1])},
		{WRID: 2, Op: verbsio.OpWriteImm, Imm: 0xc0ffee, Signaled: true, SG: sge(half, half), RemoteAddr: tg[0] + uint64(half), RKey: uint32(tg[1])},
	}
	before := s.d.Stats()
	if err := s.qps[qpMain].PostSend(chain); err != nil {
		return err
	}
	if got := s.d.Stats().PostSend - before.PostSend; got != 1 {
		return fmt.Errorf("a chain of 2 took %d post crossings", got)
	}
	cs, err := waitN(s.scq, 1, time.Minute)
	if err != nil {
		return err
	}
	if c := cs[0]; c.Status != verbsio.StatusSuccess || c.Op != verbsio.OpWriteImm || c.WRID != 2 {
		return fmt.Errorf("write-with-immediate completion %+v", c)
	}
	// The send goes from a scratch region so the target pattern stays.
	scratch, err := mmapAnon(4096)
	if err != nil {
		return err
	}
	copy(scratch, "hello, rank")
	sm, err := s.pd.RegisterMemory(scratch.addr(), len(scratch), verbsio.AccessLocalWrite)
	if err != nil {
		return err
	}
	c, err := s.post(qpMain, verbsio.SendWR{WRID: 3, Op: verbsio.OpSend, SG: []verbsio.SGE{{Addr: sm.Addr(), Length: 11, LKey: sm.LKey()}}})
	if err != nil || c.Status != verbsio.StatusSuccess || c.Op != verbsio.OpSend {
		return fmt.Errorf("send: %+v, %v", c, err)
	}
	// A read of the read-only region works.
	c, err = s.post(qpMain, verbsio.SendWR{WRID: 4, Op: verbsio.OpRead, SG: []verbsio.SGE{{Addr: sm.Addr() + 1024, Length: 4096 - 1024, LKey: sm.LKey()}},
		RemoteAddr: ro[0], RKey: uint32(ro[1])})
	if err != nil || c.Status != verbsio.StatusSuccess || c.Op != verbsio.OpRead {
		return fmt.Errorf("read of the read-only region: %+v, %v", c, err)
	}
	roWant := make([]byte, 4096)
	pattern(roWant, 0xa5)
	if !bytes.Equal(scratch[1024:], roWant[:4096-1024]) {
		return errors.New("read returned wrong bytes")
	}
	if err := g.Barrier(ctx); err != nil {
		return err
	}
	// 2. Remote access errors, each on its own queue pair.
	var fails []string
	expectAccessError := func(what string, qp int, wr verbsio.SendWR) {
		c, err := s.post(qp, wr)
		switch {
		case err != nil:
			fails = append(fails, fmt.Sprintf("%s: %v", what, err))
		case c.Status != verbsio.StatusRemoteAccess || !errors.Is(c.Status.Err(), verbsio.ErrRemoteAccess) || c.WRID != wr.WRID || c.Op != wr.Op:
			fails = append(fails, fmt.Sprintf("%s: completion %+v, want a remote access error", what, c))
		default:
			fmt.Printf("%s: %s\n", what, c.Status)
			if st := s.qps[qp].State(); st != verbsio.QPError {
				fails = append(fails, fmt.Sprintf("%s: queue pair in state %s after the error", what, st))
			}
			if err := s.qps[qp].PostSend([]verbsio.SendWR{wr}); !errors.Is(err, verbsio.ErrQPState) {
				fails = append(fails, fmt.Sprintf("%s: post after the error: %v", what, err))
			}
		}
	}
	expectAccessError("wrong rkey", qpWrongKey, verbsio.SendWR{WRID: 10, Op: verbsio.OpWrite, SG: sge(0, 4096), RemoteAddr: tg[0], RKey: uint32(tg[1]) ^ 0x5a5a00})
	expectAccessError("out of bounds", qpOutOfBounds, verbsio.SendWR{WRID: 11, Op: verbsio.OpWrite, SG: sge(0, 8192), RemoteAddr: tg[0] + tg[2] - 4096, RKey: uint32(tg[1])})
	expectAccessError("read-only region", qpReadOnly, verbsio.SendWR{WRID: 12, Op: verbsio.OpWrite, SG: sge(0, 64), RemoteAddr: ro[0], RKey: uint32(ro[1])})
	if err := g.Barrier(ctx); err != nil {
		return err
	}
	// 3. Rank 0 deregisters "gone" between these barriers.
	if err := g.Barrier(ctx); err != nil {
		return err
	}
	expectAccessError("deregistered region", qpDeregistered, verbsio.SendWR{WRID: 13, Op: verbsio.OpWrite, SG: sge(0, 4096), RemoteAddr: gone[0], RKey: uint32(gone[1])})
	if err := g.Barrier(ctx); err != nil {
		return err
	}
	if len(fails) > 0 {
		return errors.New(strings.Join(fails, "; "))
	}
	// 4. Die without closing anything: the kernel tears the queue pairs down.
	if err := g.Barrier(ctx); err != nil {
		return err
	}
	os.Exit(0)
	return nil
}

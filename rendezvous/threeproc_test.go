package rendezvous

import (
	"bufio"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/internal/ibvdiag"
	"github.com/gdrlink/gdrlink/internal/offheap"
	"github.com/gdrlink/gdrlink/internal/wire"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

// hostileEnv turns a re-executed test binary into the hostile peer of the
// three-process tests.
const hostileEnv = "GDRLINK_RDV_HOSTILE"

func init() {
	if os.Getenv(hostileEnv) != "" {
		os.Exit(hostileMain(os.Stdin, os.Stdout))
	}
}

// hostileMain is a job peer gone bad, in a process of its own: it holds a
// channel of the victim's over the provider as any peer does, but speaks
// the protocol by hand over its queue pair, so that it can write wherever
// it likes with whatever key it observed. One command per input line:
//
//	connect HELLO                  hello, then connect to the victim's channel of that hello: "hello HEX", then "ready ID"
//	write ID ADDR RKEY N FILL IMM  write N bytes of FILL at ADDR with RKEY and immediate IMM from connection ID: "status CODE"
//	quit                           exit
func hostileMain(in io.Reader, out io.Writer) int {
	fail := func(err error) int {
		fmt.Fprintf(out, "error %v\n", err)
		return 1
	}
	cfg, err := verbsio.ConfigFromEnv()
	if err != nil {
		return fail(err)
	}
	dev, err := verbsio.Open(os.Getenv("GDRLINK_RDV_PROVIDER"), cfg)
	if err != nil {
		return fail(err)
	}
	defer dev.Close()
	pd, err := dev.AllocPD()
	if err != nil {
		return fail(err)
	}
	defer pd.Close()
	const src = 1 << 20
	type conn struct {
		qp  verbsio.QueuePair
		cq  verbsio.CompletionQueue
		mem []byte // receive slots, then the source of writes
		mr  verbsio.MemoryRegion
	}
	var conns []*conn
	defer func() {
		for _, c := range conns {
			c.qp.Close()
			c.cq.Close()
			c.mr.Close()
			unix.Munmap(c.mem)
		}
	}()
	repost := func(c *conn, slot int) error {
		sge := verbsio.SGE{Addr: offheap.Addr(c.mem) + uintptr(slot*wire.MaxFrame), Length: wire.MaxFrame, LKey: c.mr.LKey()}
		return c.qp.PostRecv([]verbsio.RecvWR{{WRID: uint64(slot), SG: []verbsio.SGE{sge}}})
	}
	connect := func(victimHello []byte) error {
		c := &conn{}
		var err error
		if c.mem, err = unix.Mmap(-1, 0, hostileRing*wire.MaxFrame+src, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS); err != nil {
			return err
		}
		if c.mr, err = pd.RegisterMemory(offheap.Addr(c.mem), len(c.mem), verbsio.AccessLocalWrite); err != nil {
			unix.Munmap(c.mem)
			return err
		}
		if c.cq, err = dev.CreateCQ(64); err != nil {
			c.mr.Close()
			unix.Munmap(c.mem)
			return err
		}
		if c.qp, err = pd.CreateQP(verbsio.QPConfig{SendCQ: c.cq, RecvCQ: c.cq, MaxSendWR: 16, MaxRecvWR: hostileRing}); err != nil {
			c.cq.Close()
			c.mr.Close()
			unix.Munmap(c.mem)
			return err
		}
		conns = append(conns, c)
		for i := 0; i < hostileRing; i++ {
			if err := repost(c, i); err != nil {
				return err
			}
		}
		var vh wire.Message
		if _, err := wire.Decode(victimHello, &vh); err != nil {
			return err
		}
		e := vh.Endpoints[0]
		vep := verbsio.Endpoint{Provider: string(e.Provider), Host: string(e.Host), Data: append([]byte(nil), e.Data...)}
		hello := wire.Message{Type: wire.TypeHello, Ring: hostileRing, Slot: wire.MaxFrame, Text: []byte("hostile"), NumEndpoints: 1}
		ep := c.qp.Endpoint()
		hello.Endpoints[0] = wire.Endpoint{Provider: []byte(ep.Provider), Host: []byte(ep.Host), Data: ep.Data}
		fmt.Fprintf(out, "hello %x\n", hello.Append(nil))
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := c.qp.Connect(ctx, vep); err != nil {
			return err
		}
		fmt.Fprintln(out, "ready", len(conns)-1)
		return nil
	}
	write := func(c *conn, addr uint64, rkey uint32, n int, fill byte, imm uint32) (verbsio.Status, error) {
		b := c.mem[hostileRing*wire.MaxFrame:][:n]
		for i := range b {
			b[i] = fill
		}
		wr := verbsio.SendWR{WRID: 1 << 40, Op: verbsio.OpWriteImm, Imm: imm, Signaled: true, RemoteAddr: addr, RKey: rkey,
			SG: []verbsio.SGE{{Addr: offheap.Addr(b), Length: uint32(n), LKey: c.mr.LKey()}}}
		if err := c.qp.PostSend([]verbsio.SendWR{wr}); err != nil {
			return 0, err
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		var wc [4]verbsio.Completion
		for {
			k, err := c.cq.Wait(ctx, wc[:])
			if err != nil {
				return 0, fmt.Errorf("the write never completed: %w", err)
			}
			for _, x := range wc[:k] {
				if x.WRID == wr.WRID {
					return x.Status, nil
				}
				if x.Op == verbsio.OpRecv && x.Status == verbsio.StatusSuccess {
					repost(c, int(x.WRID)) // the victim's credits or keepalives
				}
			}
		}
	}
	sc := bufio.NewScanner(in)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 0 {
			continue
		}
		switch f[0] {
		case "connect":
			h, err := hex.DecodeString(f[1])
			if err == nil {
				err = connect(h)
			}
			if err != nil {
				return fail(err)
			}
		case "write":
			var v [6]uint64
			for i := range v {
				if v[i], err = strconv.ParseUint(f[i+1], 10, 64); err != nil {
					return fail(err)
				}
			}
			if v[0] >= uint64(len(conns)) {
				return fail(fmt.Errorf("no connection %d", v[0]))
			}
			st, err := write(conns[v[0]], v[1], uint32(v[2]), int(v[3]), byte(v[4]), uint32(v[5]))
			if err != nil {
				return fail(err)
			}
			fmt.Fprintln(out, "status", int(st))
		case "quit":
			return 0
		default:
			return fail(fmt.Errorf("unknown command %q", f[0]))
		}
	}
	return 0
}

// startHostile starts a hostile peer process; its handle's local side is
// empty (the victim's channels are the test's).
func startHostile(t *testing.T, provider string) *peerProc {
	t.Helper()
	return launchProc(t, nil, []string{hostileEnv + "=1", "GDRLINK_RDV_PROVIDER=" + provider}, &side{})
}

// hostileConn connects a new channel of the victim v over mem to the
// hostile process h and returns the connection's number there. The
// channel closes when the test ends, before v.
func hostileConn(t *testing.T, v *side, mem Memory, h *peerProc) int {
	t.Helper()
	ch, err := New(v.dev, v.pd, mem, WithName("victim-to-hostile"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ch.Close() })
	h.send("connect %x", ch.Hello())
	hh, err := hex.DecodeString(h.expect("hello "))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := ch.Connect(ctx, hh); err != nil {
		t.Fatalf("victim's Connect to the hostile peer: %v", err)
	}
	id, err := strconv.Atoi(h.expect("ready "))
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// ownResultPool is the result pool of the victim's channels to the hostile
// peer where the device gives no grants: a pool of that peer's own,
// registered for remote write, as the front door gives each peer on such
// a device. It is closed when the test ends, after the channels.
func ownResultPool(t *testing.T, v *side) Memory {
	t.Helper()
	p, err := alloc.New(alloc.NewMmapSource(alloc.MmapOptions{NUMANode: -1}), alloc.WithVisitors(registration(v.pd, 0)), alloc.WithName("results from the hostile peer"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := p.Close(); err != nil {
			t.Errorf("closing the hostile peer's pool: %v", err)
		}
	})
	return PoolMemory(regionOf, p)
}

// TestThreeProcessHostilePeer: a victim (this process) receives from an
// honest peer process while a hostile peer process, connected to the
// victim through a channel of its own on the same device, writes into the
// result tensor of a request the victim sent the honest peer. Each hostile
// write fails at the hostile peer with a remote access error, no byte of
// the result or of the guard tensors around it changes, and the honest
// peer's traffic, a stream running all along and the result itself,
// arrives byte for byte.
//
// Where the device gives grants (tcp, onnode, ibverbs with memory
// windows) the victim's arenas admit no write through their own rkey, and
// the hostile peer writes with the grant's rkey it observed on the wire,
// with the arena's rkey, and with the grant's rkey into the tensor beside
// the result (that last one only where the device bounds a grant in
// space: Soft-RoCE's windows end in time but are not bounded). Where it
// gives none (ibverbs without windows, as Soft-RoCE is by default) the
// hostile peer's channel gets a result pool of its own, as the front door
// does, and the hostile peer writes with its own arena's rkey (what it
// observes in requests sent to it) into the honest peer's result and the
// tensor beside it. On onnode the hostile process uses the provider: one
// that bypasses its provider is outside what grants bound (see the
// README's threat model).
func TestThreeProcessHostilePeer(t *testing.T) {
	forEachProvider(t, testThreeProcessHostilePeer)
}

func testThreeProcessHostilePeer(t *testing.T, provider string) {
	const size = 4096
	// The requests' grants are what is attacked: the victim takes no
	// tensor eagerly (its Recvs all go by request).
	v, err := openSide(provider, "victim", WithEager(0))
	if err != nil {
		skipUnavailable(t, provider, err)
	}
	grants := v.dev.Caps().Grants
	unbounded := grantsUnbounded(v.dev)
	honest := startPeerOn(t, provider, v, nil, nil)
	hostile := startHostile(t, provider)
	hostileMem := v.mem
	if !grants {
		hostileMem = ownResultPool(t, v)
	}
	ctx := recvCtx(t)
	recv := func(key string, step int64) {
		t.Helper()
		honest.send("send %s %d uint8 %d", key, step, size)
		got, _, err := v.ch.Recv(ctx, key, step)
		if err != nil {
			t.Fatalf("%s step %d: %v", key, step, err)
		}
		if err := checkTensor(got, "uint8", tensor.Shape{size}, key, step); err != nil {
			t.Fatalf("%s step %d: %v", key, step, err)
		}
		_ = got.Release()
	}
	recv("r", 0) // meta-data cached: the next request carries the buffer

	// The honest peer's result, between two guard tensors of the arena.
	w := &arenaWindow{}
	if w.before, err = v.pool.Alloc(size); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.before.Free() })
	type recvResult struct {
		t   *tensor.Tensor
		err error
	}
	res := make(chan recvResult, 1)
	v.ch.RecvFunc(ctx, "r", 1, func(t *tensor.Tensor, _ Transfer, err error) { res <- recvResult{t, err} })
	if w.after, err = v.pool.Alloc(size); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.after.Free() })
	var addr uintptr
	var grantKey uint32
	for deadline := time.Now().Add(20 * time.Second); addr == 0; time.Sleep(time.Millisecond) {
		v.ch.mu.Lock()
		for _, r := range v.ch.rcv.reqs {
			if r.key.name == "r" && r.key.step == 1 && r.buf != nil && (len(r.grants) > 0 || !grants) {
				addr = r.buf.Addr()
				if grants {
					grantKey = r.grants[0].RKey()
				}
			}
		}
		v.ch.mu.Unlock()
		if time.Now().After(deadline) {
			t.Fatal("the request for r step 1 has no buffer (or, where the device gives grants, no grant)")
		}
	}
	w.lo, w.hi = w.before.Addr(), w.after.Addr()+uintptr(w.after.Len())
	if !(w.before.Addr()+uintptr(w.before.Len()) <= addr && addr+size <= w.after.Addr()) {
		t.Fatalf("layout: guard [%#x+%d), result [%#x+%d), guard [%#x+%d): the result is not between its guards", w.before.Addr(), w.before.Len(), addr, size, w.after.Addr(), w.after.Len())
	}
	mr, ok := v.mem.Region(addr, size)
	if !ok {
		t.Fatal("the result has no region")
	}
	if grants && mr.RKey() == grantKey {
		t.Fatalf("the request carries the arena's rkey %#x, not a grant", grantKey)
	}
	fill(w.before.Bytes(), 0x3C)
	fill(w.after.Bytes(), 0xC3)
	w.snap = append([]byte(nil), w.bytes()...)

	// The honest peer streams all along.
	const streamed = 40
	honest.send("stream s uint8 %d %d 5", size, streamed)
	streamErr := make(chan error, 1)
	go func() {
		for step := int64(0); step < streamed; step++ {
			got, _, err := v.ch.Recv(ctx, "s", step)
			if err == nil {
				err = checkTensor(got, "uint8", tensor.Shape{size}, "s", step)
				_ = got.Release()
			}
			if err != nil {
				streamErr <- fmt.Errorf("stream step %d: %w", step, err)
				return
			}
		}
		streamErr <- nil
	}()

	type attempt struct {
		what string
		addr uintptr
		rkey uint32
	}
	var attempts []attempt
	if grants {
		attempts = []attempt{
			{"the grant's rkey into the result", addr, grantKey},
			{"the arena's rkey into the result", addr, mr.RKey()},
		}
		if unbounded == "" {
			attempts = append(attempts, attempt{"the grant's rkey into the next tensor", w.after.Addr(), grantKey})
		} else {
			t.Logf("not tried: the grant's rkey into the next tensor (%s)", unbounded)
		}
	} else {
		// The rkey the hostile peer sees in requests sent to it: its own
		// pool's arena's.
		own, err := hostileMem.Alloc(size, tensor.Host)
		if err != nil {
			t.Fatal(err)
		}
		ownMR, ok := hostileMem.Region(own.Addr(), own.Len())
		if !ok {
			t.Fatal("the hostile peer's pool has no region")
		}
		_ = own.Free()
		if ownMR.RKey() == mr.RKey() {
			t.Fatalf("the hostile peer's pool and the honest peer's results share rkey %#x", mr.RKey())
		}
		attempts = []attempt{
			{"its own arena's rkey into the honest result", addr, ownMR.RKey()},
			{"its own arena's rkey into the next tensor", w.after.Addr(), ownMR.RKey()},
		}
	}
	for _, a := range attempts {
		id := hostileConn(t, v, hostileMem, hostile)
		hostile.send("write %d %d %d %d %d %d", id, a.addr, a.rkey, size, 0x66, 1)
		code, err := strconv.Atoi(hostile.expect("status "))
		if err != nil {
			t.Fatal(err)
		}
		st := verbsio.Status(code)
		if !errors.Is(st.Err(), verbsio.ErrRemoteAccess) {
			t.Fatalf("%s: the hostile write completed with %v (%v), want an error matching verbsio.ErrRemoteAccess", a.what, st, st.Err())
		}
		w.unchanged(t, a.what, 0, 0)
		t.Logf("%s: refused at the hostile peer with %v", a.what, st)
	}

	honest.send("send r 1 uint8 %d", size)
	select {
	case r := <-res:
		if r.err != nil {
			t.Fatalf("the honest result: %v", r.err)
		}
		if err := checkTensor(r.t, "uint8", tensor.Shape{size}, "r", 1); err != nil {
			t.Fatalf("the honest result: %v", err)
		}
		_ = r.t.Release()
	case <-ctx.Done():
		t.Fatal("the honest result never came")
	}
	w.unchanged(t, "the honest write", addr, addr+size)
	if err := <-streamErr; err != nil {
		t.Fatal(err)
	}
	recv("r", 2)
}

// grantsUnbounded says why dev's grants do not keep a peer inside the
// granted range (windows forced on a device that does not enforce their
// bounds, as on Soft-RoCE), or "" where they do or the device gives none.
func grantsUnbounded(dev verbsio.Device) string {
	if d, ok := ibvdiag.Of(dev); ok && dev.Caps().Grants {
		return d.GrantsReason()
	}
	return ""
}

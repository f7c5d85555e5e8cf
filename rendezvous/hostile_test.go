package rendezvous

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"testing"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/internal/wire"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

// stubQP accepts every post and does nothing: the hostile-peer tests drive
// the channel's state machine by handing it frames and immediates directly.
type stubQP struct{ posted int }

func (q *stubQP) Endpoint() verbsio.Endpoint                      { return verbsio.Endpoint{Provider: "stub"} }
func (q *stubQP) Connect(context.Context, verbsio.Endpoint) error { return nil }
func (q *stubQP) PostSend(wrs []verbsio.SendWR) error             { q.posted += len(wrs); return nil }
func (q *stubQP) PostRecv([]verbsio.RecvWR) error                 { return nil }
func (q *stubQP) State() verbsio.QPState                          { return verbsio.QPReady }
func (q *stubQP) Close() error                                    { return nil }
func (stubMR) Addr() uintptr                                      { return 0 }
func (stubMR) Len() int                                           { return 0 }
func (stubMR) LKey() uint32                                       { return 1 }
func (stubMR) RKey() uint32                                       { return 2 }
func (stubMR) Access() verbsio.Access                             { return verbsio.AccessLocalWrite }
func (stubMR) Close() error                                       { return nil }
func stubRegion(*alloc.Arena) (verbsio.MemoryRegion, bool)        { return stubMR{}, true }

type stubMR struct{}

var (
	hostileOnce sync.Once
	hostilePool *alloc.Pool
	hostileErr  error
)

// stubPool is the pool of the stub channels' memory, made once.
func stubPool(t testing.TB) *alloc.Pool {
	hostileOnce.Do(func() {
		hostilePool, hostileErr = alloc.New(alloc.NewMmapSource(alloc.MmapOptions{}), alloc.WithLimit(64<<20))
	})
	if hostileErr != nil {
		t.Fatal(hostileErr)
	}
	return hostilePool
}

// hostileChannel is a connected channel over a stub queue pair, with one
// pending Recv ("k" step 0, request 1, name index 1) and one pending Send
// ("k" step 1), so that hostile frames reach every state.
func hostileChannel(t testing.TB) (*Channel, func()) {
	c, _, done := stubChannel(t, false)
	return c, done
}

// stubChannel is a connected channel on a stub queue pair that records
// the frames posted: in checksum mode with confirmations, or (eager) out
// of it and taking and sending EAGER frames. It has sent "k" step 1
// (eagerly, when eager) and, unless eager (a Recv pending keeps a Send
// from going eagerly), has a pending Recv of "k" step 0 with a result
// buffer.
func stubChannel(t testing.TB, eager bool) (*Channel, *probeQP, func()) {
	mem := PoolMemory(stubRegion, stubPool(t))
	const ring = 8
	slots := 4
	if eager {
		slots = 64 // the stub completes nothing: room for every frame a test posts
	}
	c := &Channel{
		opts: options{ring: ring, sendSlots: slots, maxStrings: 1 << 20, maxTensor: 1 << 20, checksum: !eager},
		mem:  mem, slot: wire.MaxFrame, peerSlot: wire.MaxFrame, provider: "stub", devName: "stub", peer: "hostile",
		pollDone: make(chan struct{}), byeSent: make(chan struct{}),
		state: stateConnected, credits: 1 << 20, sqMax: 1 << 20, threshold: 2, checksum: !eager, confirm: !eager,
	}
	if eager {
		c.opts.eagerMax = defaultEagerMax
		c.takesEager, c.eager = true, true
	} else {
		c.credits, c.sqMax = ring, 64
	}
	q := &probeQP{c: c}
	c.qp = q
	c.initHalves()
	c.log = slog.New(discard{})
	c.ctx, c.stop = context.WithCancel(context.Background())
	var err error
	if c.recvBuf, c.recvMR, err = c.allocRegistered(ring * c.slot); err != nil {
		t.Fatal(err)
	}
	if c.sendBuf, c.sendMR, err = c.allocRegistered(slots * c.slot); err != nil {
		t.Fatal(err)
	}
	for i := slots - 1; i >= 0; i-- {
		c.freeSlots = append(c.freeSlots, i)
	}
	c.recvSGEs = make([]verbsio.SGE, ring)
	// A cached meta-data makes the Recv allocate a result buffer up front.
	c.rcv.cache["k"], _ = tensor.MetaFor(tensor.Uint8, tensor.Shape{16})
	if !eager {
		c.RecvFunc(context.Background(), "k", 0, func(t *tensor.Tensor, _ Transfer, _ error) {
			if t != nil {
				_ = t.Release()
			}
		})
	}
	if err := c.Send("k", 1, stubTensor(t)); err != nil {
		t.Fatal(err)
	}
	return c, q, func() {
		var ds deliveries
		c.mu.Lock()
		c.failLocked(ErrClosed, &ds, stateClosed)
		c.mu.Unlock()
		ds.run()
		c.stop()
		if err := c.release(); err != nil {
			t.Fatal(err)
		}
	}
}

// stubTensor is a tensor of 16 bytes of the stub channels' pool.
func stubTensor(t testing.TB) *tensor.Tensor {
	t.Helper()
	meta, _ := tensor.MetaFor(tensor.Uint8, tensor.Shape{16})
	blk, err := stubPool(t).Alloc(16)
	if err != nil {
		t.Fatal(err)
	}
	src, err := tensor.New(meta, blk)
	if err != nil {
		t.Fatal(err)
	}
	return src
}

// feed hands the channel b as one received SEND, or as the immediate of a
// write when imm is set, as its completion goroutine would.
func feed(c *Channel, b []byte, imm *uint32) {
	var ds deliveries
	c.mu.Lock()
	if imm != nil {
		c.rcv.onWriteLocked(*imm, nil, &ds)
	} else {
		c.onFramesLocked(b, &ds)
	}
	c.flushLocked()
	c.mu.Unlock()
	ds.run()
}

func FuzzHostilePeer(f *testing.F) {
	var seeds []wire.Message
	m := wire.Message{Type: wire.TypeRequest, Flags: wire.ReqName | wire.ReqMeta, Req: 9, Step: 1, NameIndex: 1, Name: []byte("k"), Addr: 0x1000, RKey: 2, Capacity: 16}
	meta, _ := tensor.MetaFor(tensor.Uint8, tensor.Shape{16})
	m.Meta.SetMeta(meta)
	seeds = append(seeds, m)
	r := wire.Message{Type: wire.TypeMetaResponse, Flags: wire.RespChecksum, Req: 1, Checksum: 7}
	big, _ := tensor.MetaFor(tensor.Float32, tensor.Shape{1 << 30})
	r.Meta.SetMeta(big)
	seeds = append(seeds, r)
	r.Meta.SetMeta(meta)
	wf := wire.Message{Type: wire.TypeMetaResponse, Flags: wire.RespWriteFollows | wire.RespChecksum, Req: 1, Checksum: 3}
	small, _ := tensor.MetaFor(tensor.Uint8, tensor.Shape{8})
	wf.Meta.SetMeta(small)
	seeds = append(seeds, r, wf,
		wire.Message{Type: wire.TypeChecksum, Req: 1, Checksum: 1},
		wire.Message{Type: wire.TypeError, Req: 1, Code: wire.CodeSender, Text: []byte("x")},
		wire.Message{Type: wire.TypeCancel, Req: 9},
		wire.Message{Type: wire.TypeReRequest, Req: 9, Addr: 1, RKey: 2, Capacity: 1},
		wire.Message{Type: wire.TypeCredit, Credits: 100},
		wire.Message{Type: wire.TypeBye},
		wire.Message{Type: wire.TypeRequest, Req: 3, Step: 0, NameIndex: 77},
	)
	for i := range seeds {
		f.Add(seeds[i].Append(nil), false, uint32(0))
	}
	f.Add([]byte{}, true, uint32(1))
	f.Add([]byte{}, true, uint32(5))
	f.Fuzz(func(t *testing.T, b []byte, asImm bool, imm uint32) {
		before := hostilePoolBlocks()
		c, done := hostileChannel(t)
		// The frame as given, then a write for the pending request, so that
		// state the frame left behind is exercised too.
		if asImm {
			feed(c, nil, &imm)
		} else {
			feed(c, b, nil)
		}
		one := uint32(1)
		feed(c, nil, &one)
		if err := c.Err(); err != nil && !errors.Is(err, ErrProtocol) && !errors.Is(err, ErrClosed) {
			t.Fatalf("channel failed with an untyped error: %v", err)
		}
		done()
		if after := hostilePoolBlocks(); after != before {
			t.Fatalf("%d pool blocks live after the channel closed, %d before", after, before)
		}
	})
}

func hostilePoolBlocks() int {
	if hostilePool == nil {
		return 0
	}
	return hostilePool.Stats().Blocks
}

func TestHostileFramesFailTheChannel(t *testing.T) {
	cases := []struct {
		name string
		m    wire.Message
	}{
		{"meta for an unknown request", wire.Message{Type: wire.TypeMetaResponse, Flags: wire.RespFinal, Req: 99, Meta: wire.Meta{DType: tensor.Float32, Dead: true}}},
		{"hello on an open channel", wire.Message{Type: wire.TypeHello, Ring: 2, Slot: wire.MaxFrame}},
		{"undefined name index", wire.Message{Type: wire.TypeRequest, Req: 3, NameIndex: 77}},
		{"re-request of nothing", wire.Message{Type: wire.TypeReRequest, Req: 42}},
		{"confirm of nothing", wire.Message{Type: wire.TypeConfirm, Req: 42}},
		{"confirm of a request not written", wire.Message{Type: wire.TypeConfirm, Flags: wire.ConfirmBad, Req: 1}},
	}
	for _, tc := range cases {
		c, done := hostileChannel(t)
		feed(c, tc.m.Append(nil), nil)
		if err := c.Err(); !errors.Is(err, ErrProtocol) {
			t.Errorf("%s: channel error %v, want ErrProtocol", tc.name, err)
		}
		done()
	}
	// A write naming no request, and garbage.
	c, done := hostileChannel(t)
	imm := uint32(1234)
	feed(c, nil, &imm)
	if err := c.Err(); !errors.Is(err, ErrProtocol) {
		t.Errorf("stray write: %v, want ErrProtocol", err)
	}
	done()
	c, done = hostileChannel(t)
	feed(c, []byte{1, 2, 3, 4, 5, 6, 7, 8, 9}, nil)
	if err := c.Err(); !errors.Is(err, ErrProtocol) || !errors.Is(err, verbsio.ErrBadFrame) {
		t.Errorf("garbage: %v, want ErrProtocol and ErrBadFrame", err)
	}
	done()
}

func TestOversizedMetaIsRefused(t *testing.T) {
	c, done := hostileChannel(t)
	defer done()
	var got error
	ch := make(chan error, 1)
	c.RecvFunc(context.Background(), "huge", 0, func(_ *tensor.Tensor, _ Transfer, err error) { ch <- err })
	c.mu.Lock()
	idx := c.rcv.byKey[skey{"huge", 0}].idx
	c.mu.Unlock()
	r := wire.Message{Type: wire.TypeMetaResponse, Req: idx}
	big, _ := tensor.MetaFor(tensor.Float32, tensor.Shape{1 << 30})
	r.Meta.SetMeta(big)
	feed(c, r.Append(nil), nil)
	got = <-ch
	if !errors.Is(got, ErrTooLarge) {
		t.Fatalf("4 GiB announced against a 1 MiB limit: %v, want ErrTooLarge", got)
	}
}

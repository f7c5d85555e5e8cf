package visitor

import (
	"bytes"
	"context"
	"errors"
	"testing"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
	"github.com/gdrlink/gdrlink/verbsio/tcp"
)

const rwAccess = verbsio.AccessLocalWrite | verbsio.AccessRemoteWrite | verbsio.AccessRemoteRead

type mrSide struct {
	dev  verbsio.Device
	pd   verbsio.ProtectionDomain
	reg  *MemoryRegistration
	pool *alloc.Pool
}

func newMRSide(t *testing.T) *mrSide {
	t.Helper()
	dev, err := tcp.OpenDevice(verbsio.Config{}, tcp.Options{})
	if err != nil {
		t.Fatal(err)
	}
	s := &mrSide{dev: dev}
	if s.pd, err = dev.AllocPD(); err != nil {
		t.Fatal(err)
	}
	s.reg = NewMemoryRegistration(s.pd, rwAccess)
	s.pool, err = alloc.New(alloc.NewMmapSource(alloc.MmapOptions{}),
		alloc.WithName("mr-test"), alloc.WithVisitors(s.reg), alloc.WithInitialArena(1<<20))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := s.pool.Close(); err != nil {
			t.Errorf("closing the pool: %v", err)
		}
		if s.reg.deregistrations() != s.reg.registrations() {
			t.Errorf("%d registrations, %d deregistrations after the pool closed", s.reg.registrations(), s.reg.deregistrations())
		}
		if n := s.reg.Registered(); n != 0 {
			t.Errorf("%d registrations still held after the pool closed", n)
		}
		// The domain closes only if every region was deregistered.
		if err := s.pd.Close(); err != nil {
			t.Errorf("closing the protection domain: %v", err)
		}
		if err := dev.Close(); err != nil {
			t.Errorf("closing the device: %v", err)
		}
	})
	return s
}

func TestMemoryRegistrationOncePerArena(t *testing.T) {
	s := newMRSide(t)
	var blocks []alloc.Block
	for i := 0; i < 300; i++ {
		b, err := s.pool.Alloc(16<<10 + i*64)
		if err != nil {
			t.Fatal(err)
		}
		blocks = append(blocks, b)
	}
	arenas := ArenasOf(s.pool, blocks)
	if len(arenas) < 3 {
		t.Fatalf("only %d arenas: the test wants several", len(arenas))
	}
	if got := s.reg.registrations(); got != len(arenas) {
		t.Errorf("%d registrations for %d arenas and %d blocks, want one per arena", got, len(arenas), len(blocks))
	}
	if got := s.reg.Registered(); got != len(arenas) || got != s.pool.Stats().Arenas {
		t.Errorf("%d registrations held for %d arenas (%d in the pool's stats), want one per arena", got, len(arenas), s.pool.Stats().Arenas)
	}
	for _, b := range blocks {
		sge, mr, err := SGEOf(s.pool, b.Addr(), b.Len())
		if err != nil {
			t.Fatalf("SGEOf block %#x+%d: %v", b.Addr(), b.Len(), err)
		}
		a, _ := s.pool.ArenaOf(b.Addr())
		want, ok := MemoryRegionOf(a)
		if !ok || want != mr || sge.LKey != want.LKey() || sge.Addr != b.Addr() || int(sge.Length) != b.Len() {
			t.Fatalf("SGE %+v of block %#x+%d does not match its arena's region", sge, b.Addr(), b.Len())
		}
		if mine, _ := s.reg.RegionOf(a); mine != want {
			t.Fatal("RegionOf differs from MemoryRegionOf")
		}
		if mr.Addr() != a.Base() || mr.Len() != a.Size() || mr.Access() != rwAccess {
			t.Fatalf("region [%#x+%d %v] for %v", mr.Addr(), mr.Len(), mr.Access(), a)
		}
		rkey, err := RemoteKeyOf(s.pool, b.Addr(), b.Len())
		if err != nil || rkey != mr.RKey() {
			t.Fatalf("RemoteKeyOf = %#x, %v; want %#x", rkey, err, mr.RKey())
		}
	}
	for _, b := range blocks {
		if err := b.Free(); err != nil {
			t.Fatal(err)
		}
	}
	if _, _, err := SGEOf(s.pool, 0x10, 8); !errors.Is(err, ErrNoRegion) {
		t.Errorf("SGEOf of an address in no arena: %v, want ErrNoRegion", err)
	}
	a := arenas[0]
	if _, _, err := SGEOf(s.pool, a.Base()+uintptr(a.Size())-8, 16); !errors.Is(err, ErrNoRegion) {
		t.Errorf("SGEOf of a range past an arena's end: %v, want ErrNoRegion", err)
	}
}

// TestMemoryRegistrationTransfer writes a tensor of one pool straight into
// a tensor of another pool, on two tcp devices, with the keys the visitor
// registered: no registration per tensor, no staging copy.
func TestMemoryRegistrationTransfer(t *testing.T) {
	a, z := newMRSide(t), newMRSide(t)
	meta, err := tensor.MetaFor(tensor.Float32, tensor.Shape{128, 256})
	if err != nil {
		t.Fatal(err)
	}
	src, err := a.pool.NewTensor(meta)
	if err != nil {
		t.Fatal(err)
	}
	dst, err := z.pool.NewTensor(meta)
	if err != nil {
		t.Fatal(err)
	}
	sb, err := src.Bytes()
	if err != nil {
		t.Fatal(err)
	}
	db, err := dst.Bytes()
	if err != nil {
		t.Fatal(err)
	}
	for i := range sb {
		sb[i] = byte(i * 7)
	}
	qa, ca := mrQP(t, a)
	qz, _ := mrQP(t, z)
	ctx := context.Background()
	errc := make(chan error, 1)
	go func() { errc <- qz.Connect(ctx, qa.Endpoint()) }()
	if err := qa.Connect(ctx, qz.Endpoint()); err != nil {
		t.Fatal(err)
	}
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	sge, _, err := SGEOf(a.pool, src.Addr(), len(sb))
	if err != nil {
		t.Fatal(err)
	}
	rkey, err := RemoteKeyOf(z.pool, dst.Addr(), len(db))
	if err != nil {
		t.Fatal(err)
	}
	if err := qa.PostSend([]verbsio.SendWR{{WRID: 1, Op: verbsio.OpWrite, Signaled: true, SG: []verbsio.SGE{sge}, RemoteAddr: uint64(dst.Addr()), RKey: rkey}}); err != nil {
		t.Fatal(err)
	}
	out := make([]verbsio.Completion, 1)
	if _, err := ca.Wait(ctx, out); err != nil || out[0].Status != verbsio.StatusSuccess {
		t.Fatalf("write: %v %v", out[0].Status, err)
	}
	if !bytes.Equal(sb, db) {
		t.Error("the tensor written differs from its source")
	}
	if a.reg.registrations() != a.pool.Stats().Arenas || z.reg.registrations() != z.pool.Stats().Arenas {
		t.Error("tensors caused registrations beyond one per arena")
	}
	for _, x := range []*tensor.Tensor{src, dst} {
		if err := x.Release(); err != nil {
			t.Fatal(err)
		}
	}
}

func mrQP(t *testing.T, s *mrSide) (verbsio.QueuePair, verbsio.CompletionQueue) {
	t.Helper()
	cq, err := s.dev.CreateCQ(16)
	if err != nil {
		t.Fatal(err)
	}
	qp, err := s.pd.CreateQP(verbsio.QPConfig{SendCQ: cq, RecvCQ: cq})
	if err != nil {
		t.Fatal(err)
	}
	// Runs before the side's own cleanup, which closes the domain.
	t.Cleanup(func() {
		qp.Close()
		cq.Close()
	})
	return qp, cq
}

func TestMemoryRegistrationErrors(t *testing.T) {
	s := newMRSide(t)
	src := alloc.NewMmapSource(alloc.MmapOptions{})
	mem, err := src.Alloc(1 << 16)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Free(mem)
	a := testArena(t, 1, mem)
	reg := NewMemoryRegistration(s.pd, rwAccess)
	if err := reg.Release(a); !errors.Is(err, errNotVisited) {
		t.Errorf("Release before Visit: %v, want ErrNotVisited", err)
	}
	if err := reg.Visit(a); err != nil {
		t.Fatal(err)
	}
	if err := reg.Visit(a); !errors.Is(err, errAlreadyVisited) {
		t.Errorf("second Visit: %v, want ErrAlreadyVisited", err)
	}
	if err := reg.Release(a); err != nil {
		t.Fatal(err)
	}
	if _, ok := MemoryRegionOf(a); ok {
		t.Error("the arena still has a memory region after Release")
	}
	gpu := testArena(t, 2, &alloc.Region{Base: 0x7f0000000000, Size: 1 << 20, Device: tensor.GPUDevice(0), FD: -1})
	if err := reg.Visit(gpu); !errors.Is(err, errNotHostMemory) {
		t.Errorf("Visit of a GPU arena without a GPU hook: %v, want ErrNotHostMemory", err)
	}
	called := false
	withHook := newMemoryRegistration(s.pd, rwAccess, func(pd verbsio.ProtectionDomain, a *alloc.Arena, acc verbsio.Access) (verbsio.MemoryRegion, error) {
		called = true
		return pd.RegisterDMABuf(-1, 0, a.Size(), uint64(a.Base()), acc)
	})
	if err := withHook.Visit(gpu); !called || !errors.Is(err, verbsio.ErrNotSupported) {
		t.Errorf("Visit of a GPU arena through the hook: called %v, %v; want the provider's ErrNotSupported", called, err)
	}
	unmapped := testArena(t, 3, &alloc.Region{Base: 0x10000, Size: 1 << 16, Device: tensor.Host, FD: -1})
	if err := reg.Visit(unmapped); !errors.Is(err, verbsio.ErrBadAddress) {
		t.Errorf("Visit of unmapped memory: %v, want ErrBadAddress", err)
	}
}

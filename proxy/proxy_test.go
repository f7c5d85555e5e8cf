package proxy_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/gpusim"
	"github.com/gdrlink/gdrlink/proxy"
)

// rig is a simulated device, a pinned host pool registered with it, and a
// proxy over both.
type rig struct {
	sim  gpusim.Device
	pool *alloc.Pool
	px   *proxy.Proxy
}

// newPinnedPool is a pool of host memory registered as pinned with sim.
func newPinnedPool(sim gpusim.Device) (*alloc.Pool, error) {
	return alloc.New(alloc.NewMmapSource(alloc.MmapOptions{}), alloc.WithName("pinned-proxy"),
		alloc.WithVisitors(sim.HostRegisterVisitor()), alloc.WithInitialArena(8<<20), alloc.WithMaxArena(512<<20))
}

func newRig(t *testing.T, cfg gpusim.Config, opts ...proxy.Option) *rig {
	t.Helper()
	sim := gpusim.New(cfg)
	pool, err := newPinnedPool(sim)
	if err != nil {
		t.Fatal(err)
	}
	px, err := proxy.New(sim, pool, opts...)
	if err != nil {
		t.Fatal(err)
	}
	r := &rig{sim: sim, pool: pool, px: px}
	t.Cleanup(func() {
		if err := px.Close(); err != nil {
			t.Errorf("proxy close: %v", err)
		}
		if err := pool.Check(); err != nil {
			t.Errorf("pool check: %v", err)
		}
		if err := pool.Close(); err != nil {
			t.Errorf("pool close: %v", err)
		}
		if err := sim.Close(); err != nil {
			t.Errorf("device close: %v", err)
		}
	})
	return r
}

// host views n bytes of memory off the Go heap at addr.
func host(addr uintptr, n int) []byte {
	return unsafe.Slice((*byte)(*(*unsafe.Pointer)(unsafe.Pointer(&addr))), n)
}

func fill(b []byte, seed int) {
	x := uint32(seed)*2654435761 + 1
	for i := range b {
		x ^= x << 13
		x ^= x >> 17
		x ^= x << 5
		b[i] = byte(x)
	}
}

func (r *rig) alloc(t *testing.T, n int) proxy.DevicePtr {
	t.Helper()
	p, err := r.sim.Alloc(n)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.sim.Free(p) })
	return p
}

func (r *rig) inUse() int64 { return r.pool.Stats().InUse }

func TestPipelinedReceive256MiB(t *testing.T) {
	const size, chunk = 256 << 20, 4 << 20
	r := newRig(t, gpusim.Config{Bandwidth: 0})
	dst := r.alloc(t, size)
	want := make([]byte, size)
	fill(want, 1)

	// The hook observes copies; the first one starting while the rest of
	// the tensor has not been written is what pipelining means.
	firstCopy := make(chan struct{})
	var once sync.Once
	r.sim.FailCopies(func(c gpusim.CopyInfo) error {
		once.Do(func() { close(firstCopy) })
		return nil
	})
	var doneErr atomic.Value
	rc, err := r.px.Receive(dst, size, func(err error) { doneErr.Store(fmt.Sprint(err)) })
	if err != nil {
		t.Fatal(err)
	}
	if rc.Direct() || rc.Addr() == uintptr(dst) {
		t.Fatalf("direct %v, addr %#x: want a proxy tensor", rc.Direct(), rc.Addr())
	}
	buf := host(rc.Addr(), size)
	for off := 0; off < size; off += chunk {
		copy(buf[off:off+chunk], want[off:off+chunk]) // the "network" write
		if err := rc.ChunkArrived(off, chunk); err != nil {
			t.Fatal(err)
		}
		if off == 0 {
			select {
			case <-firstCopy:
			case <-time.After(30 * time.Second):
				t.Fatal("no host-to-device copy started after the first chunk arrived: not pipelined")
			}
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := rc.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	if got := doneErr.Load(); got != "<nil>" {
		t.Fatalf("done got %v", got)
	}
	got, err := r.sim.Peek(dst, size)
	if err != nil {
		t.Fatal(err)
	}
	for i := range got {
		if got[i] != want[i] {
			t.Fatalf("byte %d on the device is %d, sent %d", i, got[i], want[i])
		}
	}
	if st := r.sim.Stats(); st.BytesHtoD != size || st.Copies != size/chunk {
		t.Fatalf("device did %d copies of %d bytes, want %d of %d", st.Copies, st.BytesHtoD, size/chunk, size)
	}
	if n := r.inUse(); n != 0 {
		t.Fatalf("pool has %d bytes in use after the receive completed", n)
	}
}

func TestManyTensorsOutOfOrder(t *testing.T) {
	r := newRig(t, gpusim.Config{}, proxy.WithChunk(64<<10))
	rng := rand.New(rand.NewSource(7))
	type tens struct {
		dst  proxy.DevicePtr
		want []byte
		rc   *proxy.Receiver
	}
	type piece struct{ t, off, n int }
	var ts []*tens
	var pieces []piece
	var completed atomic.Int64
	for i := 0; i < 48; i++ {
		n := 1 + rng.Intn(700<<10)
		x := &tens{dst: r.alloc(t, n), want: make([]byte, n)}
		fill(x.want, i+10)
		rc, err := r.px.Receive(x.dst, n, func(err error) {
			if err != nil {
				t.Errorf("tensor %d: %v", i, err)
			}
			completed.Add(1)
		})
		if err != nil {
			t.Fatal(err)
		}
		x.rc = rc
		ts = append(ts, x)
		for off := 0; off < n; {
			c := min(n-off, 1+rng.Intn(100<<10))
			pieces = append(pieces, piece{i, off, c})
			off += c
		}
	}
	rng.Shuffle(len(pieces), func(i, j int) { pieces[i], pieces[j] = pieces[j], pieces[i] })
	// Four "completion queues" deliver the pieces concurrently.
	var wg sync.WaitGroup
	for w := 0; w < 4; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			for k := w; k < len(pieces); k += 4 {
				p := pieces[k]
				x := ts[p.t]
				copy(host(x.rc.Addr()+uintptr(p.off), p.n), x.want[p.off:p.off+p.n])
				if err := x.rc.ChunkArrived(p.off, p.n); err != nil {
					t.Errorf("tensor %d chunk %d: %v", p.t, p.off, err)
				}
			}
		}(w)
	}
	wg.Wait()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for i, x := range ts {
		if err := x.rc.Wait(ctx); err != nil {
			t.Fatalf("tensor %d: %v", i, err)
		}
		got, _ := r.sim.Peek(x.dst, len(x.want))
		for j := range got {
			if got[j] != x.want[j] {
				t.Fatalf("tensor %d byte %d: %d, want %d", i, j, got[j], x.want[j])
			}
		}
	}
	if completed.Load() != int64(len(ts)) {
		t.Fatalf("%d completions, want %d", completed.Load(), len(ts))
	}
	if n := r.inUse(); n != 0 {
		t.Fatalf("pool has %d bytes in use", n)
	}
}

func TestCopyFailureReturnsProxyMemory(t *testing.T) {
	r := newRig(t, gpusim.Config{})
	boom := errors.New("injected DMA fault")
	var bad atomic.Uintptr
	r.sim.FailCopies(func(c gpusim.CopyInfo) error {
		if c.Dst == bad.Load() {
			return boom
		}
		return nil
	})
	const n = 1 << 20
	good := r.alloc(t, n)
	badDst := r.alloc(t, n)
	bad.Store(uintptr(badDst) + 4096)
	var errs [2]error
	var rcs [2]*proxy.Receiver
	for i, dst := range []proxy.DevicePtr{good, badDst} {
		rc, err := r.px.Receive(dst, n, func(err error) { errs[i] = err })
		if err != nil {
			t.Fatal(err)
		}
		rcs[i] = rc
	}
	if r.inUse() < 2*n {
		t.Fatalf("pool has %d bytes in use with two receives open", r.inUse())
	}
	for _, rc := range rcs {
		for off := 0; off < n; off += 4096 {
			if err := rc.ChunkArrived(off, 4096); err != nil {
				t.Fatal(err)
			}
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := rcs[0].Wait(ctx); err != nil {
		t.Fatalf("unaffected receive: %v", err)
	}
	err := rcs[1].Wait(ctx)
	if !errors.Is(err, proxy.ErrCopyFailed) || !errors.Is(err, boom) {
		t.Fatalf("failed receive: %v, want ErrCopyFailed wrapping the fault", err)
	}
	if errs[0] != nil || !errors.Is(errs[1], proxy.ErrCopyFailed) {
		t.Fatalf("done callbacks got %v, %v", errs[0], errs[1])
	}
	if n := r.inUse(); n != 0 {
		t.Fatalf("pool has %d bytes in use after a failed copy", n)
	}
}

func TestDeviceLost(t *testing.T) {
	r := newRig(t, gpusim.Config{})
	const n = 1 << 20
	dst := r.alloc(t, n)
	var cbErr atomic.Value
	rc, err := r.px.Receive(dst, n, func(err error) { cbErr.Store(err) })
	if err != nil {
		t.Fatal(err)
	}
	if err := rc.ChunkArrived(0, n/2); err != nil {
		t.Fatal(err)
	}
	r.sim.Lose()
	err = rc.ChunkArrived(n/2, n/2)
	if !errors.Is(err, proxy.ErrDeviceLost) {
		t.Fatalf("chunk after loss: %v, want ErrDeviceLost", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := rc.Wait(ctx); !errors.Is(err, proxy.ErrDeviceLost) {
		t.Fatalf("Wait: %v, want ErrDeviceLost", err)
	}
	if e, _ := cbErr.Load().(error); !errors.Is(e, proxy.ErrDeviceLost) {
		t.Fatalf("done callback got %v", e)
	}
	if n := r.inUse(); n != 0 {
		t.Fatalf("pool has %d bytes in use after device loss", n)
	}
	if _, err := r.px.Receive(dst, n, nil); !errors.Is(err, proxy.ErrDeviceLost) {
		t.Fatalf("Receive on a lost device: %v", err)
	}
}

func TestBadInput(t *testing.T) {
	r := newRig(t, gpusim.Config{})
	const n = 64 << 10
	dst := r.alloc(t, n)
	hostMem := make([]byte, n)
	if _, err := r.px.Receive(proxy.DevicePtr(uintptr(unsafe.Pointer(&hostMem[0]))), n, nil); !errors.Is(err, proxy.ErrWrongMemory) {
		t.Fatalf("host memory as destination: %v, want ErrWrongMemory", err)
	}
	if _, err := r.px.Receive(dst, 0, nil); !errors.Is(err, proxy.ErrOutOfRange) {
		t.Fatalf("empty receive: %v", err)
	}
	rc, err := r.px.Receive(dst, n, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		off, n int
		want   error
	}{{-1, 10, proxy.ErrOutOfRange}, {0, 0, proxy.ErrOutOfRange}, {n - 10, 11, proxy.ErrOutOfRange}, {0, n + 1, proxy.ErrOutOfRange}} {
		if err := rc.ChunkArrived(c.off, c.n); !errors.Is(err, c.want) {
			t.Errorf("chunk [%d,+%d): %v, want %v", c.off, c.n, err, c.want)
		}
	}
	if err := rc.ChunkArrived(100, 100); err != nil {
		t.Fatal(err)
	}
	if err := rc.ChunkArrived(150, 100); !errors.Is(err, proxy.ErrBadChunk) {
		t.Fatalf("overlapping chunk: %v", err)
	}
	if err := rc.ChunkArrived(0, 100); err != nil {
		t.Fatal(err)
	}
	if err := rc.ChunkArrived(200, n-200); err != nil {
		t.Fatal(err)
	}
	if err := rc.ChunkArrived(0, 1); !errors.Is(err, proxy.ErrBadChunk) {
		t.Fatalf("chunk after completion: %v", err)
	}
	if err := rc.Wait(context.Background()); err != nil {
		t.Fatal(err)
	}

	// A pool of pageable memory is refused loudly.
	plain, err := alloc.New(alloc.NewMmapSource(alloc.MmapOptions{}))
	if err != nil {
		t.Fatal(err)
	}
	defer plain.Close()
	px2, err := proxy.New(r.sim, plain)
	if err != nil {
		t.Fatal(err)
	}
	defer px2.Close()
	if _, err := px2.Receive(dst, n, nil); !errors.Is(err, proxy.ErrWrongMemory) {
		t.Fatalf("pageable proxy pool: %v, want ErrWrongMemory", err)
	}
	if plain.Stats().InUse != 0 {
		t.Fatal("refused receive kept its block")
	}
}

func TestCloseAbortsOpenReceives(t *testing.T) {
	sim := gpusim.New(gpusim.Config{})
	defer sim.Close()
	pool, err := alloc.New(alloc.NewMmapSource(alloc.MmapOptions{}), alloc.WithVisitors(sim.HostRegisterVisitor()))
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	px, err := proxy.New(sim, pool)
	if err != nil {
		t.Fatal(err)
	}
	dst, _ := sim.Alloc(1 << 20)
	rc, err := px.Receive(dst, 1<<20, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := rc.ChunkArrived(0, 4096); err != nil {
		t.Fatal(err)
	}
	if err := px.Close(); err != nil {
		t.Fatal(err)
	}
	if err := rc.Err(); !errors.Is(err, proxy.ErrClosed) {
		t.Fatalf("open receive after Close: %v, want ErrClosed", err)
	}
	if pool.Stats().InUse != 0 {
		t.Fatal("Close left a proxy tensor in use")
	}
	if err := px.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if _, err := px.Receive(dst, 10, nil); !errors.Is(err, proxy.ErrClosed) {
		t.Fatalf("Receive after Close: %v", err)
	}
}

func TestStageDeviceToHost(t *testing.T) {
	r := newRig(t, gpusim.Config{}, proxy.WithChunk(1<<20))
	const n = 5<<20 + 123
	src := r.alloc(t, n)
	dev, _ := r.sim.Peek(src, n)
	fill(dev, 3)
	var mu sync.Mutex
	var chunks [][2]int
	st, err := r.px.Stage(src, n, func(off, c int) {
		mu.Lock()
		chunks = append(chunks, [2]int{off, c})
		mu.Unlock()
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Wait(context.Background()); err != nil {
		t.Fatal(err)
	}
	if len(chunks) != 6 || chunks[0] != [2]int{0, 1 << 20} || chunks[5] != [2]int{5 << 20, 123} {
		t.Fatalf("chunks ready: %v", chunks)
	}
	got := host(st.Block().Addr(), n)
	for i := range got {
		if got[i] != dev[i] {
			t.Fatalf("staged byte %d: %d, want %d", i, got[i], dev[i])
		}
	}
	if err := st.Release(); err != nil {
		t.Fatal(err)
	}
	if err := st.Release(); err != nil {
		t.Fatal(err)
	}
	if r.inUse() != 0 {
		t.Fatal("staged tensor not returned")
	}

	r.sim.FailCopies(func(c gpusim.CopyInfo) error {
		if c.Dir == gpusim.DeviceToHost && c.Src > uintptr(src) {
			return errors.New("injected")
		}
		return nil
	})
	st, err = r.px.Stage(src, n, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Wait(context.Background()); !errors.Is(err, proxy.ErrCopyFailed) {
		t.Fatalf("failed staging: %v", err)
	}
	_ = st.Release()
	if r.inUse() != 0 {
		t.Fatal("failed staging kept its tensor")
	}
	if _, err := r.px.Stage(proxy.DevicePtr(st.Block().Addr()), 10, nil, nil); !errors.Is(err, proxy.ErrWrongMemory) {
		t.Fatalf("staging from host memory: %v", err)
	}
}

type recordingFlusher struct {
	mu    sync.Mutex
	addrs []uintptr
	err   error
}

func (f *recordingFlusher) Flush(ctx context.Context, addr uintptr) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.addrs = append(f.addrs, addr)
	return f.err
}

func TestDirectModeAndFlush(t *testing.T) {
	cases := []struct {
		name    string
		flush   proxy.FlushMode
		ordered bool
		flushes int
	}{
		{"on", proxy.FlushOn, true, 1},
		{"off", proxy.FlushOff, false, 0},
		{"auto-unordered", proxy.FlushAuto, false, 1},
		{"auto-ordered", proxy.FlushAuto, true, 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			f := &recordingFlusher{}
			r := newRig(t, gpusim.Config{}, proxy.WithFlush(c.flush), proxy.WithDirect(f, c.ordered))
			dst := r.alloc(t, 8192)
			rc, err := r.px.Receive(dst, 8192, nil)
			if err != nil {
				t.Fatal(err)
			}
			if !rc.Direct() || rc.Addr() != uintptr(dst) {
				t.Fatalf("Direct receive writes at %#x (direct %v), want the GPU tensor %#x", rc.Addr(), rc.Direct(), dst)
			}
			if r.inUse() != 0 {
				t.Fatal("Direct receive took a proxy tensor")
			}
			if err := rc.ChunkArrived(0, 8192); err != nil {
				t.Fatal(err)
			}
			if err := rc.Wait(context.Background()); err != nil {
				t.Fatal(err)
			}
			if len(f.addrs) != c.flushes || (c.flushes == 1 && f.addrs[0] != uintptr(dst)) {
				t.Fatalf("flushes %#x, want %d at %#x", f.addrs, c.flushes, dst)
			}
		})
	}
	t.Run("no-flusher", func(t *testing.T) {
		r := newRig(t, gpusim.Config{}, proxy.WithDirect(nil, false), proxy.WithFlush(proxy.FlushOn))
		dst := r.alloc(t, 64)
		rc, _ := r.px.Receive(dst, 64, nil)
		if err := rc.ChunkArrived(0, 64); err == nil {
			t.Fatal("a Direct receive that needs a flush completed without a flusher")
		}
	})
}

func TestFlushSettingFromEnvironment(t *testing.T) {
	for _, c := range []struct {
		v    string
		want bool
		bad  bool
	}{{"0", false, false}, {"1", true, false}, {"auto", true, false}, {"sometimes", false, true}} {
		t.Setenv("GDRLINK_GDR_FLUSH", c.v)
		sim := gpusim.New(gpusim.Config{})
		pool, _ := alloc.New(alloc.NewMmapSource(alloc.MmapOptions{}))
		px, err := proxy.New(sim, pool)
		if c.bad {
			if !errors.Is(err, proxy.ErrBadFlushSetting) {
				t.Errorf("GDRLINK_GDR_FLUSH=%s: %v", c.v, err)
			}
		} else if err != nil {
			t.Errorf("GDRLINK_GDR_FLUSH=%s: %v", c.v, err)
		} else {
			if px.NeedsFlush() != c.want {
				t.Errorf("GDRLINK_GDR_FLUSH=%s: NeedsFlush=%v", c.v, px.NeedsFlush())
			}
			px.Close()
		}
		pool.Close()
		sim.Close()
	}
}

func TestParseFlushMode(t *testing.T) {
	for in, want := range map[string]proxy.FlushMode{"": proxy.FlushAuto, "auto": proxy.FlushAuto, "1": proxy.FlushOn, "ON": proxy.FlushOn, "0": proxy.FlushOff, "false": proxy.FlushOff} {
		if got, err := proxy.ParseFlushMode(in); err != nil || got != want {
			t.Errorf("ParseFlushMode(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	if _, err := proxy.ParseFlushMode("2"); !errors.Is(err, proxy.ErrBadFlushSetting) {
		t.Errorf("ParseFlushMode(2): %v", err)
	}
}

// A receive that fails while the transport is still writing its proxy
// tensor keeps the tensor until the transport lets go of it: the rest of
// the bytes reported, or Abort. Otherwise a NIC write still on its way
// could land in memory the pool has handed to someone else.
func TestFailureMidwayKeepsProxyUntilTransportLetsGo(t *testing.T) {
	for _, how := range []string{"rest arrives", "abort"} {
		t.Run(how, func(t *testing.T) {
			r := newRig(t, gpusim.Config{})
			const n = 1 << 20
			dst := r.alloc(t, n)
			rc, err := r.px.Receive(dst, n, nil)
			if err != nil {
				t.Fatal(err)
			}
			if err := rc.ChunkArrived(0, n/4); err != nil {
				t.Fatal(err)
			}
			r.sim.Lose()
			if err := rc.ChunkArrived(n/4, n/4); !errors.Is(err, proxy.ErrDeviceLost) {
				t.Fatalf("chunk after loss: %v, want ErrDeviceLost", err)
			}
			time.Sleep(20 * time.Millisecond)
			select {
			case <-rc.Done():
				t.Fatal("the receive ended while half the tensor was still to be written")
			default:
			}
			if r.inUse() < n {
				t.Fatalf("pool has %d bytes in use: the proxy tensor went back while the transport may write it", r.inUse())
			}
			if how == "abort" {
				rc.Abort(nil)
			} else {
				if err := rc.ChunkArrived(n/2, n/4); !errors.Is(err, proxy.ErrDeviceLost) {
					t.Fatalf("chunk after the failure: %v", err)
				}
				if err := rc.ChunkArrived(3*n/4, n/4); !errors.Is(err, proxy.ErrDeviceLost) {
					t.Fatalf("last chunk after the failure: %v", err)
				}
			}
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			if err := rc.Wait(ctx); !errors.Is(err, proxy.ErrDeviceLost) {
				t.Fatalf("Wait: %v, want the first failure, ErrDeviceLost", err)
			}
			if k := r.inUse(); k != 0 {
				t.Fatalf("pool has %d bytes in use after the receive ended", k)
			}
			if st := r.px.Stats(); st.Receives != 1 || st.Chunks < 2 {
				t.Fatalf("stats %+v", st)
			}
		})
	}
}

// Under the default GDRLINK_GDR_FLUSH=auto and with no loopback flusher, a
// Direct receive on a GPU below 9.0 whose driver flushes from the host
// flushes through the driver once; on 9.0 it does not flush at all.
func TestDirectFlushThroughDriver(t *testing.T) {
	for _, c := range []struct {
		name    string
		cc      int
		flushes int64
	}{
		{"ampere", 80, 1},
		{"hopper", 90, 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Setenv("GDRLINK_GDR_FLUSH", "auto")
			r := newRig(t, gpusim.Config{ComputeCapability: c.cc, HostFlush: true}, proxy.WithDirect(nil, false))
			dst := r.alloc(t, 4096)
			rc, err := r.px.Receive(dst, 4096, nil)
			if err != nil {
				t.Fatal(err)
			}
			if err := rc.ChunkArrived(0, 4096); err != nil {
				t.Fatal(err)
			}
			if err := rc.Wait(context.Background()); err != nil {
				t.Fatal(err)
			}
			if got := r.sim.Stats().RDMAFlushes; got != c.flushes {
				t.Fatalf("driver flushes %d, want %d", got, c.flushes)
			}
		})
	}
}

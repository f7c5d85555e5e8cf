package rendezvous

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/gpusim"
	"github.com/gdrlink/gdrlink/internal/wire"
	"github.com/gdrlink/gdrlink/proxy"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

// landingWatch wraps a Proxy to see what the channel tells its landings:
// how many chunks were handed on, when the last one landed, and when the
// device's first host-to-device copy started (from gpusim's copy hook).
type landingWatch struct {
	Proxy
	mu        sync.Mutex
	chunks    int
	landedAt  time.Time
	firstCopy time.Time
	// onChunk, if set, runs in ChunkLanded before the chunk is passed on,
	// with the chunk's number; it may block the channel's completions.
	onChunk func(i int)
}

func (w *landingWatch) reset() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.chunks, w.landedAt, w.firstCopy = 0, time.Time{}, time.Time{}
}

func (w *landingWatch) copyStarted(c gpusim.CopyInfo) error {
	if c.Dir == gpusim.HostToDevice {
		w.mu.Lock()
		if w.firstCopy.IsZero() {
			w.firstCopy = time.Now()
		}
		w.mu.Unlock()
	}
	return nil
}

func (w *landingWatch) Land(meta tensor.Meta, dev tensor.Device) (Landing, error) {
	l, err := w.Proxy.Land(meta, dev)
	if err != nil {
		return nil, err
	}
	return &watchedLanding{chunkedLanding: l.(chunkedLanding), w: w}, nil
}

type watchedLanding struct {
	chunkedLanding
	w *landingWatch
}

func (l *watchedLanding) Direct() bool {
	d, ok := l.chunkedLanding.(interface{ Direct() bool })
	return ok && d.Direct()
}

func (l *watchedLanding) ChunkLanded(off, n int) {
	l.w.mu.Lock()
	i := l.w.chunks
	l.w.chunks++
	f := l.w.onChunk
	l.w.mu.Unlock()
	if f != nil {
		f(i)
	}
	l.chunkedLanding.ChunkLanded(off, n)
}

func (l *watchedLanding) Landed(done func(*tensor.Tensor, error)) {
	l.w.mu.Lock()
	l.w.landedAt = time.Now()
	l.w.mu.Unlock()
	l.chunkedLanding.Landed(done)
}

// proxySide is a receiving side whose GPU results go through a proxy onto
// a simulated GPU the NIC cannot write.
type proxySide struct {
	*side
	gpu    gpusim.Device
	pinned *alloc.Pool
	px     *proxy.Proxy
	watch  *landingWatch
}

func openProxySide(provider, name string, opts ...Option) (*proxySide, error) {
	return openProxySideOn(provider, name, gpusim.Config{}, opts...)
}

// openProxySideOn is openProxySide with the simulated GPU's configuration.
func openProxySideOn(provider, name string, gcfg gpusim.Config, opts ...Option) (*proxySide, error) {
	cfg, err := verbsio.ConfigFromEnv()
	if err != nil {
		return nil, err
	}
	s := &side{}
	ps := &proxySide{side: s}
	fail := func(err error) (*proxySide, error) { _ = s.close(); return nil, err }
	if s.dev, err = verbsio.Open(provider, cfg); err != nil {
		return nil, err
	}
	if s.pd, err = s.dev.AllocPD(); err != nil {
		return fail(err)
	}
	if s.pool, err = alloc.New(alloc.NewMmapSource(alloc.MmapOptions{}), alloc.WithVisitors(registration(s.pd, 0)), alloc.WithName(name)); err != nil {
		return fail(err)
	}
	ps.gpu = gpusim.New(gcfg)
	s.after = append(s.after, ps.gpu.Close)
	if ps.pinned, err = alloc.New(alloc.NewMmapSource(alloc.MmapOptions{}),
		alloc.WithVisitors(ps.gpu.HostRegisterVisitor(), registration(s.pd, 0)), alloc.WithName(name+"-pinned")); err != nil {
		return fail(err)
	}
	s.after = append([]func() error{ps.pinned.Close}, s.after...)
	if ps.px, err = proxy.New(ps.gpu, ps.pinned); err != nil {
		return fail(err)
	}
	s.after = append([]func() error{ps.px.Close}, s.after...)
	gpuAlloc := func(n int, d tensor.Device) (tensor.Buffer, error) {
		p, err := ps.gpu.Alloc(n)
		if err != nil {
			return nil, err
		}
		return &simBuffer{gpu: ps.gpu, p: p, n: n, dev: d}, nil
	}
	ps.watch = &landingWatch{Proxy: ProxyPath(ps.px, gpuAlloc)}
	ps.gpu.FailCopies(ps.watch.copyStarted)
	s.mem = PoolMemory(regionOf, s.pool, ps.pinned)
	if s.ch, err = New(s.dev, s.pd, s.mem, append([]Option{WithName(name), WithProxy(ps.watch)}, opts...)...); err != nil {
		return fail(err)
	}
	return ps, nil
}

// proxyPair is a sending side a and a proxied receiving side b, connected.
func proxyPair(t *testing.T, provider string, aOpts, bOpts []Option) (*side, *proxySide) {
	t.Helper()
	a, err := openSideRails(provider, "a", nil, aOpts...)
	if err != nil {
		skipUnavailable(t, provider, err)
	}
	b, err := openProxySide(provider, "b", bOpts...)
	if err != nil {
		_ = a.close()
		skipUnavailable(t, provider, err)
	}
	t.Cleanup(func() {
		if err := b.close(); err != nil {
			t.Errorf("closing b: %v", err)
		}
		if err := a.close(); err != nil {
			t.Errorf("closing a: %v", err)
		}
	})
	connectChannels(t, a.ch, b.ch)
	return a, b
}

// checkOnGPU checks a proxied result's bytes on the simulated GPU.
func (b *proxySide) checkOnGPU(t *testing.T, got *tensor.Tensor, key string, step int64) {
	t.Helper()
	if !got.Device().IsGPU() {
		t.Fatalf("%s step %d: result on %s, want the GPU", key, step, got.Device())
	}
	onGPU, err := b.gpu.Peek(proxy.DevicePtr(got.Addr()), int(got.Meta().ByteSize))
	if err != nil {
		t.Fatal(err)
	}
	if err := checkFill(onGPU, seedOf(key, step)); err != nil {
		t.Fatalf("%s step %d on the GPU: %v", key, step, err)
	}
}

// waitPinnedIdle waits until no proxy tensor is out of the pinned pool.
func (b *proxySide) waitPinnedIdle(t *testing.T) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for b.pinned.Stats().InUse != 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if st := b.pinned.Stats(); st.InUse != 0 {
		t.Fatalf("%d bytes in %d blocks still out of the pinned pool", st.InUse, st.Blocks)
	}
}

// A 64 MiB result that lands in a proxy comes in 4 MiB chunks, each handed
// to the proxy as its write completes, so the copy to the GPU starts while
// the rest is on the wire. With the smallest ring the sender has three
// credits at a time for sixteen chunks: it must wait for credits to come
// back, and no chunk may find the receiver without a posted receive.
func TestProxyPipelined64MiB(t *testing.T) {
	const size, chunk = 64 << 20, 4 << 20
	forEachProvider(t, func(t *testing.T, provider string) {
		for _, ring := range []int{defaultRing, minRing} {
			t.Run(map[int]string{defaultRing: "ring128", minRing: "ring4"}[ring], func(t *testing.T) {
				a, b := proxyPair(t, provider, nil, []Option{WithRing(ring), WithProxyChunk(chunk)})
				ctx := recvCtx(t)
				for step := int64(0); step < 2; step++ { // a meta-data round trip, then a cached request
					b.watch.reset()
					gpuBefore, aBefore, bBefore := b.gpu.Stats(), a.ch.Stats(), b.ch.Stats()
					src, err := makeTensor(a.pool, "float32", tensor.Shape{size / 4}, "big", step)
					if err != nil {
						t.Fatal(err)
					}
					if err := a.ch.Send("big", step, src); err != nil {
						t.Fatal(err)
					}
					got, tr, err := b.ch.Recv(ctx, "big", step, OnDevice(tensor.GPUDevice(0)))
					if err != nil {
						t.Fatal(err)
					}
					if tr.Path != PathProxy || tr.Chunks != size/chunk || tr.MetaRoundTrip != (step == 0) {
						t.Fatalf("step %d: path %s in %d chunks, meta round trip %v; want proxy in %d", step, tr.Path, tr.Chunks, tr.MetaRoundTrip, size/chunk)
					}
					b.checkOnGPU(t, got, "big", step)
					_ = got.Release()
					// Each ChunkArrived queues one host-to-device copy.
					if d := b.gpu.Stats().Copies - gpuBefore.Copies; d != size/chunk {
						t.Fatalf("step %d: the proxy got %d ChunkArrived calls (copies), want %d", step, d, size/chunk)
					}
					if d := b.ch.Stats().ChunksIn - bBefore.ChunksIn; d != size/chunk {
						t.Fatalf("step %d: %d chunks in, want %d", step, d, size/chunk)
					}
					if d := a.ch.Stats().ChunksOut - aBefore.ChunksOut; d != size/chunk {
						t.Fatalf("step %d: %d chunks out, want %d", step, d, size/chunk)
					}
					b.watch.mu.Lock()
					chunks, first, last := b.watch.chunks, b.watch.firstCopy, b.watch.landedAt
					b.watch.mu.Unlock()
					if chunks != size/chunk-1 {
						t.Fatalf("step %d: %d chunks handed on before the last, want %d", step, chunks, size/chunk-1)
					}
					if first.IsZero() || last.IsZero() {
						t.Fatalf("step %d: first copy at %v, last chunk at %v", step, first, last)
					}
					t.Logf("step %d: first copy to the GPU started %v before the last chunk landed", step, last.Sub(first))
					// With the small ring the last chunk can only be
					// sent after credits came back from earlier chunks'
					// completions, which queued their copies first.
					if ring == minRing && !first.Before(last) {
						t.Fatalf("step %d: first copy started %v after the last chunk landed: not pipelined", step, first.Sub(last))
					}
					b.waitPinnedIdle(t)
				}
			})
		}
	})
}

// Small results and direct ones keep one write; WithProxyChunk(0) turns
// chunking off.
func TestProxyChunkOnlyWhenLarger(t *testing.T) {
	cases := []struct {
		name  string
		opt   int
		elems int64
		want  int
	}{
		{"smaller than a chunk", 1 << 20, 1 << 18, 0},
		{"exactly a chunk", 1 << 20, 1 << 18, 0},
		{"a chunk and one element", 1 << 20, 1<<18 + 1, 2},
		{"chunking off", 0, 1 << 20, 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			a, b := proxyPair(t, "tcp", nil, []Option{WithProxyChunk(c.opt)})
			ctx := recvCtx(t)
			src, _ := makeTensor(a.pool, "float32", tensor.Shape{c.elems}, "x", 0)
			if err := a.ch.Send("x", 0, src); err != nil {
				t.Fatal(err)
			}
			got, tr, err := b.ch.Recv(ctx, "x", 0, OnDevice(tensor.GPUDevice(0)))
			if err != nil {
				t.Fatal(err)
			}
			if tr.Chunks != c.want {
				t.Fatalf("%d chunks, want %d", tr.Chunks, c.want)
			}
			b.checkOnGPU(t, got, "x", 0)
			_ = got.Release()
			// A host result of the same size is one write whatever the
			// chunk.
			src, _ = makeTensor(a.pool, "float32", tensor.Shape{c.elems}, "h", 0)
			if err := a.ch.Send("h", 0, src); err != nil {
				t.Fatal(err)
			}
			got, tr, err = b.ch.Recv(ctx, "h", 0)
			if err != nil {
				t.Fatal(err)
			}
			if tr.Chunks != 0 || tr.Path != PathDirect {
				t.Fatalf("host result: %d chunks over %s", tr.Chunks, tr.Path)
			}
			_ = got.Release()
		})
	}
}

func TestProxyChunkOption(t *testing.T) {
	for _, n := range []int{-1, 1, 4095, 3 << 20, 1<<wire.MaxChunkShift + 1, 2 << 30} {
		var o options
		if err := WithProxyChunk(n)(&o); !errors.Is(err, ErrBadOption) {
			t.Errorf("WithProxyChunk(%d) = %v, want ErrBadOption", n, err)
		}
	}
	for n, shift := range map[int]uint8{0: 0, 4096: 12, 4 << 20: 22, 1 << 30: 30} {
		var o options
		if err := WithProxyChunk(n)(&o); err != nil || o.chunkShift != shift {
			t.Errorf("WithProxyChunk(%d): %v, shift %d, want %d", n, err, o.chunkShift, shift)
		}
	}
}

// Checksum mode verifies the whole tensor when the last chunk lands, and a
// corrupted one fails its Recv with the proxy memory back in the pool.
func TestProxyChunkedChecksum(t *testing.T) {
	corrupt := func(o *options) error {
		o.corrupt = func(key string, _ int64, b []byte) {
			if key == "corrupt" {
				b[len(b)/3] ^= 0x40 // in a middle chunk
			}
		}
		return nil
	}
	a, b := proxyPair(t, "tcp", []Option{WithChecksum(true), corrupt}, []Option{WithChecksum(true), WithProxyChunk(1 << 20)})
	ctx := recvCtx(t)
	const elems = 4 << 20 // 16 MiB in 16 chunks
	for step := int64(0); step < 2; step++ {
		for _, key := range []string{"clean", "corrupt"} {
			src, _ := makeTensor(a.pool, "float32", tensor.Shape{elems}, key, step)
			if err := a.ch.Send(key, step, src); err != nil {
				t.Fatal(err)
			}
		}
		got, tr, err := b.ch.Recv(ctx, "clean", step, OnDevice(tensor.GPUDevice(0)))
		if err != nil || !tr.Checksummed || tr.Chunks != 16 {
			t.Fatalf("clean step %d: %v (checksummed %v, %d chunks)", step, err, tr.Checksummed, tr.Chunks)
		}
		b.checkOnGPU(t, got, "clean", step)
		_ = got.Release()
		_, _, err = b.ch.Recv(ctx, "corrupt", step, OnDevice(tensor.GPUDevice(0)))
		if !errors.Is(err, ErrChecksum) {
			t.Fatalf("corrupted step %d: %v, want ErrChecksum", step, err)
		}
		b.waitPinnedIdle(t)
	}
	if st := b.ch.Stats(); st.ChecksumFailures != 2 {
		t.Fatalf("%d checksum failures, want 2", st.ChecksumFailures)
	}
}

// A copy to the GPU that fails part-way fails the Recv with the proxy's
// error once the rest has landed (the sender keeps writing the proxy tensor
// until then), returns the proxy tensor, and leaves the channel working.
func TestProxyChunkCopyFault(t *testing.T) {
	a, b := proxyPair(t, "tcp", nil, []Option{WithProxyChunk(1 << 20)})
	ctx := recvCtx(t)
	boom := errors.New("injected DMA fault")
	b.gpu.FailCopies(func(c gpusim.CopyInfo) error {
		if c.Seq == 3 {
			return boom
		}
		return nil
	})
	src, _ := makeTensor(a.pool, "float32", tensor.Shape{4 << 20}, "f", 0)
	if err := a.ch.Send("f", 0, src); err != nil {
		t.Fatal(err)
	}
	_, _, err := b.ch.Recv(ctx, "f", 0, OnDevice(tensor.GPUDevice(0)))
	if !errors.Is(err, proxy.ErrCopyFailed) || !errors.Is(err, boom) {
		t.Fatalf("Recv with a failed copy = %v, want proxy.ErrCopyFailed wrapping the fault", err)
	}
	b.waitPinnedIdle(t)
	if n := b.gpu.Stats().LiveAllocs; n != 0 {
		t.Fatalf("%d GPU allocations left after the failed receive", n)
	}
	src, _ = makeTensor(a.pool, "float32", tensor.Shape{4 << 20}, "f", 1)
	if err := a.ch.Send("f", 1, src); err != nil {
		t.Fatal(err)
	}
	got, tr, err := b.ch.Recv(ctx, "f", 1, OnDevice(tensor.GPUDevice(0)))
	if err != nil || tr.Chunks != 16 {
		t.Fatalf("Recv after the fault: %v, %d chunks", err, tr.Chunks)
	}
	b.checkOnGPU(t, got, "f", 1)
	_ = got.Release()
}

// A Recv withdrawn while its chunks are landing ends at once; the request
// stays until the last chunk (whose immediate must still name it), and the
// proxy tensor goes back then.
func TestProxyChunkCancelMidway(t *testing.T) {
	a, b := proxyPair(t, "tcp", nil, []Option{WithRing(minRing), WithProxyChunk(1 << 20)})
	release := make(chan struct{})
	reached := make(chan struct{})
	b.watch.onChunk = func(i int) {
		if i == 1 {
			close(reached)
			<-release
		}
	}
	src, _ := makeTensor(a.pool, "float32", tensor.Shape{4 << 20}, "c", 0)
	if err := a.ch.Send("c", 0, src); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	b.ch.RecvFunc(ctx, "c", 0, func(got *tensor.Tensor, _ Transfer, err error) {
		if got != nil {
			_ = got.Release()
		}
		errc <- err
	}, OnDevice(tensor.GPUDevice(0)))
	<-reached
	cancel()
	if err := <-errc; !errors.Is(err, ErrCancelled) {
		t.Fatalf("cancelled Recv = %v, want ErrCancelled", err)
	}
	b.watch.mu.Lock()
	b.watch.onChunk = nil
	b.watch.mu.Unlock()
	close(release)
	b.waitPinnedIdle(t)
	// The channel still works.
	src, _ = makeTensor(a.pool, "float32", tensor.Shape{4 << 20}, "c", 1)
	if err := a.ch.Send("c", 1, src); err != nil {
		t.Fatal(err)
	}
	got, tr, err := b.ch.Recv(recvCtx(t), "c", 1, OnDevice(tensor.GPUDevice(0)))
	if err != nil || tr.Chunks != 16 {
		t.Fatalf("Recv after the cancel: %v, %d chunks", err, tr.Chunks)
	}
	b.checkOnGPU(t, got, "c", 1)
	_ = got.Release()
	if err := b.ch.Err(); err != nil {
		t.Fatal(err)
	}
}

// The sending process dies while a proxied result's chunks are landing: the
// Recv fails with verbsio.ErrPeerLost, and the proxy tensor goes back to
// the pool once the channel is closed (until the queue pair is gone a write
// might still land in it).
func TestTwoProcessProxySenderKilled(t *testing.T) {
	forEachProvider(t, func(t *testing.T, provider string) {
		local, err := openProxySide(provider, "receiver", WithRing(minRing), WithProxyChunk(1<<20))
		if err != nil {
			skipUnavailable(t, provider, err)
		}
		p := startPeerOn(t, provider, local.side, nil, nil)
		ctx := recvCtx(t)
		// One whole transfer first.
		p.send("send big 0 uint8 %d", 8<<20)
		got, tr, err := local.ch.Recv(ctx, "big", 0, OnDevice(tensor.GPUDevice(0)))
		if err != nil || tr.Chunks != 8 {
			t.Fatalf("before the kill: %v, %d chunks", err, tr.Chunks)
		}
		local.checkOnGPU(t, got, "big", 0)
		_ = got.Release()

		reached := make(chan struct{})
		release := make(chan struct{})
		local.watch.reset()
		local.watch.onChunk = func(i int) {
			if i == 2 {
				close(reached)
				<-release
			}
		}
		errc := make(chan error, 1)
		local.ch.RecvFunc(ctx, "big", 1, func(got *tensor.Tensor, _ Transfer, err error) {
			if got != nil {
				_ = got.Release()
			}
			errc <- err
		}, OnDevice(tensor.GPUDevice(0)))
		p.send("send big 1 uint8 %d", 8<<20)
		select {
		case <-reached:
		case <-time.After(30 * time.Second):
			t.Fatal("the third chunk never landed")
		}
		if err := p.cmd.Process.Kill(); err != nil {
			t.Fatal(err)
		}
		<-p.done
		close(release)
		select {
		case err := <-errc:
			if !errors.Is(err, verbsio.ErrPeerLost) {
				t.Fatalf("Recv with the sender killed mid-stream = %v, want ErrPeerLost", err)
			}
			t.Logf("Recv: %v", err)
		case <-time.After(60 * time.Second):
			t.Fatal("Recv still pending a minute after the sender was killed")
		}
		local.watch.mu.Lock()
		local.watch.onChunk = nil
		local.watch.mu.Unlock()
		if err := local.ch.Close(); err != nil {
			t.Fatalf("close: %v", err)
		}
		local.waitPinnedIdle(t)
	})
}

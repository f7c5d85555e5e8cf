package rendezvous

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/gpusim"
	"github.com/gdrlink/gdrlink/proxy"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

// simPuller is a Puller over one simulated GPU that both channels of a
// test share, as two processes on one GPU would through IPC: a sender
// exports the buffers in exported, and a pull is a device-to-device copy
// from the exported buffer into the result, completed by an event.
type simPuller struct {
	gpu    gpusim.Device
	stream proxy.Stream

	ready    atomic.Bool
	failNext atomic.Bool
	// gate, when set, holds each pull until it is closed.
	gate atomic.Pointer[chan struct{}]

	mu       sync.Mutex
	exported map[uintptr]bool
	pulls    int
}

func newSimPuller(t *testing.T, gpu gpusim.Device) *simPuller {
	st, err := gpu.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = st.Close() })
	p := &simPuller{gpu: gpu, stream: st, exported: map[uintptr]bool{}}
	p.ready.Store(true)
	return p
}

func (p *simPuller) Ready(dev tensor.Device) bool { return p.ready.Load() && dev.IsGPU() }

func (p *simPuller) Export(src tensor.Buffer, n int) (PullRef, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.exported[src.Addr()] || n > src.Len() {
		return PullRef{}, false
	}
	return PullRef{Arena: uint64(src.Addr()), Offset: 0, Size: int64(n), Handle: []byte("simulated")}, true
}

func (p *simPuller) Alloc(n int, dev tensor.Device) (tensor.Buffer, error) {
	d, err := p.gpu.Alloc(n)
	if err != nil {
		return nil, err
	}
	return &simBuffer{gpu: p.gpu, p: d, n: n, dev: dev}, nil
}

func (p *simPuller) Pull(ref PullRef, dst tensor.Buffer, done func(error)) {
	p.mu.Lock()
	p.pulls++
	p.mu.Unlock()
	go func() {
		if g := p.gate.Load(); g != nil {
			<-*g
		}
		if p.failNext.Swap(false) {
			done(errors.New("injected pull failure"))
			return
		}
		src := proxy.DevicePtr(ref.Arena + ref.Offset)
		if err := p.gpu.(interface {
			CopyDtoDAsync(dst, src proxy.DevicePtr, n int, st proxy.Stream) error
		}).CopyDtoDAsync(proxy.DevicePtr(dst.Addr()), src, int(ref.Size), p.stream); err != nil {
			done(err)
			return
		}
		ev, err := p.gpu.RecordEvent(p.stream)
		if err != nil {
			done(err)
			return
		}
		defer ev.Close()
		done(ev.Wait(context.Background()))
	}()
}

// trackedBuffer counts its Free: the source of a Send goes back through it.
type trackedBuffer struct {
	*simBuffer
	freed *atomic.Int32
}

func (b trackedBuffer) Free() error { b.freed.Add(1); return b.simBuffer.Free() }

// pullRig is a sender a and a receiver b on one provider, both with the
// simulated GPU's puller; b also lands results through a proxy, for the
// tensors that are not pulled.
type pullRig struct {
	a, b   *Channel
	gpu    gpusim.Device
	pa, pb *simPuller
	stream proxy.Stream
	pinned *alloc.Pool
	freed  atomic.Int32
}

func newPullRig(t *testing.T, provider string) *pullRig {
	r := &pullRig{gpu: gpusim.New(gpusim.Config{Shareable: true})}
	t.Cleanup(func() { _ = r.gpu.Close() })
	r.pa, r.pb = newSimPuller(t, r.gpu), newSimPuller(t, r.gpu)
	open := func(name string, opts ...Option) (*Channel, verbsio.ProtectionDomain, func() error) {
		dev, err := verbsio.Open(provider, verbsio.DefaultConfig())
		if err != nil {
			skipUnavailable(t, provider, err)
		}
		pd, err := dev.AllocPD()
		if err != nil {
			t.Fatal(err)
		}
		host, err := alloc.New(alloc.NewMmapSource(alloc.MmapOptions{}), alloc.WithVisitors(registration(pd, 0)), alloc.WithName(name))
		if err != nil {
			t.Fatal(err)
		}
		pinned, err := alloc.New(alloc.NewMmapSource(alloc.MmapOptions{}),
			alloc.WithVisitors(r.gpu.HostRegisterVisitor(), registration(pd, 0)), alloc.WithName(name+" pinned"))
		if err != nil {
			t.Fatal(err)
		}
		px, err := proxy.New(r.gpu, pinned, proxy.WithChunk(1<<20))
		if err != nil {
			t.Fatal(err)
		}
		r.pinned = pinned
		pools := []*alloc.Pool{host, pinned}
		opts = append(opts, WithProxy(ProxyPath(px, r.pb.Alloc)))
		closers := []func() error{px.Close, pinned.Close}
		ch, err := New(dev, pd, PoolMemory(regionOf, pools...), append([]Option{WithName(name)}, opts...)...)
		if err != nil {
			t.Fatal(err)
		}
		return ch, pd, func() error {
			errs := []error{ch.Close()}
			for _, f := range closers {
				errs = append(errs, f())
			}
			return errors.Join(append(errs, host.Close(), pd.Close(), dev.Close())...)
		}
	}
	var closeA, closeB func() error
	r.a, _, closeA = open("a", WithPull(r.pa))
	r.b, _, closeB = open("b", WithPull(r.pb))
	t.Cleanup(func() {
		if err := errors.Join(closeA(), closeB()); err != nil {
			t.Error(err)
		}
	})
	st, err := r.gpu.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = st.Close() })
	r.stream = st
	connectChannels(t, r.a, r.b)
	return r
}

// gpuTensor is an exported (or not) GPU tensor of n bytes holding the
// pattern of key and step.
func (r *pullRig) gpuTensor(t *testing.T, n int, key string, step int64, export bool) *tensor.Tensor {
	t.Helper()
	p, err := r.gpu.Alloc(n)
	if err != nil {
		t.Fatal(err)
	}
	host := make([]byte, n)
	fill(host, seedOf(key, step))
	blk, err := r.pinned.Alloc(n)
	if err != nil {
		t.Fatal(err)
	}
	copy(blk.Bytes(), host)
	if err := r.gpu.CopyHtoDAsync(p, blk.Addr(), n, r.stream); err != nil {
		t.Fatal(err)
	}
	if err := r.stream.Synchronize(); err != nil {
		t.Fatal(err)
	}
	_ = blk.Free()
	if export {
		r.pa.mu.Lock()
		r.pa.exported[uintptr(p)] = true
		r.pa.mu.Unlock()
	}
	meta, _ := tensor.MetaFor(tensor.Uint8, tensor.Shape{int64(n)})
	src, err := tensor.New(meta, trackedBuffer{&simBuffer{gpu: r.gpu, p: p, n: n, dev: tensor.GPUDevice(0)}, &r.freed})
	if err != nil {
		t.Fatal(err)
	}
	return src
}

// check reads a GPU result back and compares it with the pattern.
func (r *pullRig) check(got *tensor.Tensor, key string, step int64) error {
	b, err := r.gpu.Peek(proxy.DevicePtr(got.Addr()), int(got.Meta().ByteSize))
	if err != nil {
		return err
	}
	return checkFill(b, seedOf(key, step))
}

// waitPullStarted waits until the receiver's puller took its first pull.
func (r *pullRig) waitPullStarted(t *testing.T) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		r.pb.mu.Lock()
		n := r.pb.pulls
		r.pb.mu.Unlock()
		if n == 1 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("the pull never started")
		}
	}
}

// waitFreed waits until n sources went back.
func (r *pullRig) waitFreed(t *testing.T, n int32) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for r.freed.Load() < n && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	if got := r.freed.Load(); got != n {
		t.Fatalf("%d sources given back, want %d", got, n)
	}
}

// A GPU result is pulled from the sender's exported GPU tensor (PathPull),
// the source going back once the receiver confirms; a source the sender did
// not export, and a Recv into host memory, go as before.
func TestPull(t *testing.T) {
	forEachProvider(t, func(t *testing.T, provider string) {
		r := newPullRig(t, provider)
		ctx := recvCtx(t)
		for step := int64(0); step < 3; step++ {
			if err := r.a.Send("w", step, r.gpuTensor(t, 3<<20+5, "w", step, true)); err != nil {
				t.Fatal(err)
			}
			got, tr, err := r.b.Recv(ctx, "w", step, OnDevice(tensor.GPUDevice(0)))
			if err != nil {
				t.Fatal(err)
			}
			if tr.Path != PathPull || tr.Path.String() != "cuda-ipc" || tr.Bytes != 3<<20+5 || !got.Device().IsGPU() {
				t.Fatalf("step %d: path %s, %d bytes, on %s; want cuda-ipc, %d bytes, on the GPU", step, tr.Path, tr.Bytes, got.Device(), 3<<20+5)
			}
			if err := r.check(got, "w", step); err != nil {
				t.Fatalf("step %d: %v", step, err)
			}
			_ = got.Release()
		}
		r.waitFreed(t, 3)
		// Not exported: written through the proxy. Into host memory: no
		// pull is offered.
		if err := r.a.Send("w", 9, r.gpuTensor(t, 4096, "w", 9, false)); err != nil {
			t.Fatal(err)
		}
		got, tr, err := r.b.Recv(ctx, "w", 9, OnDevice(tensor.GPUDevice(0)))
		if err != nil || tr.Path != PathProxy {
			t.Fatalf("unexported source: path %s, %v; want proxy", tr.Path, err)
		}
		if err := r.check(got, "w", 9); err != nil {
			t.Fatal(err)
		}
		_ = got.Release()
		if err := r.a.Send("h", 0, r.gpuTensor(t, 4096, "h", 0, true)); err != nil {
			t.Fatal(err)
		}
		got, tr, err = r.b.Recv(ctx, "h", 0)
		if err != nil || tr.Path == PathPull {
			t.Fatalf("host result: path %s, %v; want no pull", tr.Path, err)
		}
		if err := checkTensor(got, "uint8", tensor.Shape{4096}, "h", 0); err != nil {
			t.Fatal(err)
		}
		_ = got.Release()
		r.waitFreed(t, 5)
		sa, sb := r.a.Stats(), r.b.Stats()
		if sa.PullsOut != 3 || sb.PullsIn != 3 || sb.PullsOut != 0 || sa.PullsIn != 0 {
			t.Errorf("pulls out %d in %d (sender), in %d out %d (receiver); want 3 each way and none back", sa.PullsOut, sa.PullsIn, sb.PullsIn, sb.PullsOut)
		}
		if r.pb.pulls != 3 {
			t.Errorf("%d pulls made, want 3", r.pb.pulls)
		}
	})
}

// A pull that fails fails its Recv, and the sender keeps the tensor: the
// next Recv of the same key and step, without a pull, gets it written.
// Nothing is lost.
func TestPullFailureLosesNothing(t *testing.T) {
	r := newPullRig(t, "tcp")
	ctx := recvCtx(t)
	if err := r.a.Send("x", 0, r.gpuTensor(t, 1<<20, "x", 0, true)); err != nil {
		t.Fatal(err)
	}
	r.pb.failNext.Store(true)
	if _, _, err := r.b.Recv(ctx, "x", 0, OnDevice(tensor.GPUDevice(0))); err == nil || !strings.Contains(err.Error(), "injected pull failure") {
		t.Fatalf("Recv with a failing pull = %v, want the pull's error", err)
	}
	if r.freed.Load() != 0 {
		t.Fatal("the source went back though the pull failed")
	}
	r.pb.ready.Store(false) // as the front door sets the pair BAD
	got, tr, err := r.b.Recv(ctx, "x", 0, OnDevice(tensor.GPUDevice(0)))
	if err != nil || tr.Path != PathProxy {
		t.Fatalf("second Recv: path %s, %v; want proxy", tr.Path, err)
	}
	if err := r.check(got, "x", 0); err != nil {
		t.Fatal(err)
	}
	_ = got.Release()
	r.waitFreed(t, 1)
}

// A Recv given up while its pull copies returns at once; the copy ends
// before its buffer goes back, the sender is told the tensor was not
// taken, and the next Recv pulls it.
func TestPullCancelledWhileCopying(t *testing.T) {
	r := newPullRig(t, "onnode")
	gate := make(chan struct{})
	r.pb.gate.Store(&gate)
	if err := r.a.Send("c", 0, r.gpuTensor(t, 1<<20, "c", 0, true)); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		_, _, err := r.b.Recv(ctx, "c", 0, OnDevice(tensor.GPUDevice(0)))
		done <- err
	}()
	r.waitPullStarted(t)
	cancel()
	select {
	case err := <-done:
		if !errors.Is(err, ErrCancelled) {
			t.Fatalf("cancelled Recv = %v, want ErrCancelled", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the cancelled Recv waited for its copy")
	}
	close(gate)
	r.pb.gate.Store(nil)
	got, tr, err := r.b.Recv(recvCtx(t), "c", 0, OnDevice(tensor.GPUDevice(0)))
	if err != nil || tr.Path != PathPull {
		t.Fatalf("Recv after the cancel: path %s, %v; want cuda-ipc", tr.Path, err)
	}
	if err := r.check(got, "c", 0); err != nil {
		t.Fatal(err)
	}
	_ = got.Release()
	r.waitFreed(t, 1)
}

// Closing a channel whose pull still copies waits for the copy before its
// memory goes back; the Recv fails with the close.
func TestPullCloseWhileCopying(t *testing.T) {
	r := newPullRig(t, "tcp")
	gate := make(chan struct{})
	r.pb.gate.Store(&gate)
	if err := r.a.Send("k", 0, r.gpuTensor(t, 64<<10, "k", 0, true)); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		_, _, err := r.b.Recv(recvCtx(t), "k", 0, OnDevice(tensor.GPUDevice(0)))
		done <- err
	}()
	r.waitPullStarted(t)
	closed := make(chan error, 1)
	go func() { closed <- r.b.Close() }()
	select {
	case err := <-closed:
		t.Fatalf("Close returned (%v) while a pull still copied into the channel's memory", err)
	case <-time.After(200 * time.Millisecond):
	}
	close(gate)
	select {
	case err := <-closed:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Close did not return after the copy ended")
	}
	if err := <-done; !errors.Is(err, ErrClosed) {
		t.Fatalf("Recv ended by Close = %v, want ErrClosed", err)
	}
}

// A peer without a Puller never sees ReqPull or HelloPull: GPU results
// from it come through the proxy.
func TestPullNeedsBothPeers(t *testing.T) {
	gpu := gpusim.New(gpusim.Config{})
	t.Cleanup(func() { _ = gpu.Close() })
	a, err := openSideRails("tcp", "a", nil)
	if err != nil {
		skipUnavailable(t, "tcp", err)
	}
	t.Cleanup(func() { _ = a.close() })
	pb := newSimPuller(t, gpu)
	dev, err := verbsio.Open("tcp", verbsio.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	pd, err := dev.AllocPD()
	if err != nil {
		t.Fatal(err)
	}
	pinned, err := alloc.New(alloc.NewMmapSource(alloc.MmapOptions{}),
		alloc.WithVisitors(gpu.HostRegisterVisitor(), registration(pd, 0)), alloc.WithName("pinned"))
	if err != nil {
		t.Fatal(err)
	}
	px, err := proxy.New(gpu, pinned)
	if err != nil {
		t.Fatal(err)
	}
	c, err := New(dev, pd, PoolMemory(regionOf, pinned), WithName("c"), WithPull(pb), WithProxy(ProxyPath(px, pb.Alloc)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := errors.Join(c.Close(), px.Close(), pinned.Close(), pd.Close(), dev.Close()); err != nil {
			t.Error(err)
		}
	})
	connectChannels(t, a.ch, c)
	if c.pull {
		t.Fatal("the pull path is on with a peer that has no Puller")
	}
	src, _ := makeTensor(a.pool, "float32", tensor.Shape{256}, "p", 0)
	if err := a.ch.Send("p", 0, src); err != nil {
		t.Fatal(err)
	}
	got, tr, err := c.Recv(recvCtx(t), "p", 0, OnDevice(tensor.GPUDevice(0)))
	if err != nil || tr.Path != PathProxy {
		t.Fatalf("path %s, %v; want proxy", tr.Path, err)
	}
	_ = got.Release()
	if pb.pulls != 0 || c.Stats().PullsIn != 0 {
		t.Fatalf("%d pulls with a peer that cannot offer them", pb.pulls)
	}
}

package rendezvous

import (
	"fmt"
	"sync"

	"github.com/gdrlink/gdrlink/proxy"
	"github.com/gdrlink/gdrlink/tensor"
)

// ProxyPath lands GPU results through p (package proxy): the NIC writes the
// proxy's pinned tensor (or, when p's policy says Direct, the GPU memory
// itself) and p copies it to device memory from gpuAlloc. It also stages GPU
// tensors to be sent into pinned tensors (its Stage method, see WithProxy).
// p's pool must be one of the channel's Memory pools, so its arenas are
// registered with the channel's protection domain. Its landings take their
// bytes as they land (ChunkLanded, see Landing): a result larger than the
// channel's proxy chunk (WithProxyChunk) is copied to the device chunk by
// chunk as the chunks land (proxy.Receiver.ChunkArrived).
func ProxyPath(p *proxy.Proxy, gpuAlloc func(n int, dev tensor.Device) (tensor.Buffer, error)) Proxy {
	return &proxyPath{p: p, alloc: gpuAlloc}
}

type proxyPath struct {
	p     *proxy.Proxy
	alloc func(n int, dev tensor.Device) (tensor.Buffer, error)
}

func (pp *proxyPath) Land(meta tensor.Meta, dev tensor.Device) (Landing, error) {
	n := int(meta.ByteSize)
	dst, err := pp.alloc(n, dev)
	if err != nil {
		return nil, err
	}
	l := &landing{meta: meta, dst: dst}
	rc, err := pp.p.Receive(proxy.DevicePtr(dst.Addr()), n, l.finished)
	if err != nil {
		_ = dst.Free()
		return nil, err
	}
	l.rc = rc
	return l, nil
}

// landing is one proxied result: the proxy's receiver and the device memory
// it fills.
type landing struct {
	meta tensor.Meta
	dst  tensor.Buffer
	rc   *proxy.Receiver

	mu   sync.Mutex
	done func(*tensor.Tensor, error)
	told int // bytes reported through ChunkLanded
	// ended: the receive failed and ended before Landed (the rest was
	// reported or the landing freed); endErr is its error.
	ended  bool
	endErr error
}

var (
	_ chunkedLanding = (*landing)(nil)
	_ stager         = (*proxyPath)(nil)
)

// Bytes is the pinned proxy tensor the NIC writes, nil when the NIC writes
// the GPU directly.
func (l *landing) Bytes() []byte {
	if l.rc.Direct() {
		return nil
	}
	return l.rc.Block().Bytes()
}

func (l *landing) Addr() uintptr { return l.rc.Addr() }
func (l *landing) Len() int      { return int(l.meta.ByteSize) }

func (l *landing) Device() tensor.Device {
	if l.rc.Direct() {
		return l.dst.Device()
	}
	return tensor.Device{Kind: tensor.PinnedHost}
}

// Direct reports whether the NIC writes the GPU itself.
func (l *landing) Direct() bool { return l.rc.Direct() }

// Free abandons the landing: the proxy tensor goes back, and so does the
// device memory once the proxy is done with it.
func (l *landing) Free() error {
	l.rc.Abort(ErrCancelled)
	return nil
}

// ChunkLanded queues the chunk's copy to the device. A failure (the copy
// could not be queued) is the receive's; the proxy keeps the proxy tensor
// until Landed or Free, and Landed's done reports it.
func (l *landing) ChunkLanded(off, n int) {
	l.mu.Lock()
	l.told = max(l.told, off+n)
	l.mu.Unlock()
	_ = l.rc.ChunkArrived(off, n)
}

// Landed reports the bytes not reported yet (all of them without chunks);
// done runs once the tensor is on the device or with the failure.
func (l *landing) Landed(done func(*tensor.Tensor, error)) {
	l.mu.Lock()
	if l.ended {
		err := l.endErr
		l.mu.Unlock()
		done(nil, err)
		return
	}
	l.done = done
	told := l.told
	l.mu.Unlock()
	n := int(l.meta.ByteSize)
	if told >= n {
		l.rc.Abort(fmt.Errorf("%w: the whole tensor was reported before its last chunk", ErrProtocol))
		return
	}
	if err := l.rc.ChunkArrived(told, n-told); err != nil {
		l.rc.Abort(err) // ends the receive if the failure did not
	}
}

// finished is the proxy's completion: the bytes are on the device, or the
// receive failed.
func (l *landing) finished(err error) {
	l.mu.Lock()
	done := l.done
	l.done = nil
	if done == nil && err != nil {
		l.ended, l.endErr = true, err // Landed may still come and report it
	}
	l.mu.Unlock()
	var t *tensor.Tensor
	if err == nil {
		t, err = tensor.New(l.meta, l.dst)
	}
	if err != nil {
		_ = l.dst.Free()
	}
	if done != nil {
		done(t, err)
	} else if t != nil {
		_ = t.Release()
	}
}

func (pp *proxyPath) Stage(src tensor.Buffer, n int, done func(tensor.Buffer, error)) {
	sb := &stagedBuffer{n: n, ready: make(chan struct{})}
	st, err := pp.p.Stage(proxy.DevicePtr(src.Addr()), n, nil, func(err error) {
		<-sb.ready
		if err != nil {
			_ = sb.st.Release()
			done(nil, err)
			return
		}
		done(sb, nil)
	})
	if err != nil {
		close(sb.ready)
		done(nil, err)
		return
	}
	sb.st = st
	close(sb.ready)
}

// stagedBuffer is a staged copy of a device tensor in the proxy's pinned
// pool.
type stagedBuffer struct {
	st    *proxy.Staged
	n     int
	ready chan struct{}
}

func (b *stagedBuffer) Bytes() []byte         { return b.st.Block().Bytes() }
func (b *stagedBuffer) Addr() uintptr         { return b.st.Block().Addr() }
func (b *stagedBuffer) Len() int              { return b.n }
func (b *stagedBuffer) Device() tensor.Device { return tensor.Device{Kind: tensor.PinnedHost} }
func (b *stagedBuffer) Free() error           { return b.st.Release() }

package rendezvous

import (
	"errors"
	"sync/atomic"
	"testing"

	"github.com/gdrlink/gdrlink/tensor"
)

// hostProxy stands in for the proxy path: it checks what it is handed and
// gives the host tensor back as the "device" result.
type hostProxy struct{ calls atomic.Int32 }

func (p *hostProxy) ToDevice(host *tensor.Tensor, dev tensor.Device, done func(*tensor.Tensor, error)) {
	p.calls.Add(1)
	if host.Device() != tensor.Host || !dev.IsGPU() {
		done(nil, errors.New("proxy handed a non-host tensor or a non-GPU target"))
		return
	}
	done(host, nil)
}

func TestGPUResultGoesThroughProxy(t *testing.T) {
	px := &hostProxy{}
	a, b := pair(t, "tcp", WithProxy(px))
	ctx := recvCtx(t)
	for step := int64(0); step < 2; step++ {
		src, _ := makeTensor(a.pool, "float32", tensor.Shape{64}, "act", step)
		if err := a.ch.Send("act", step, src); err != nil {
			t.Fatal(err)
		}
		got, tr, err := b.ch.Recv(ctx, "act", step, OnDevice(tensor.GPUDevice(0)))
		if err != nil {
			t.Fatal(err)
		}
		if tr.Path != PathProxy {
			t.Fatalf("step %d: path %s, want proxy (the pool has no GPU memory)", step, tr.Path)
		}
		if err := checkTensor(got, "float32", tensor.Shape{64}, "act", step); err != nil {
			t.Fatal(err)
		}
		_ = got.Release()
	}
	if px.calls.Load() != 2 {
		t.Fatalf("proxy called %d times, want 2", px.calls.Load())
	}
}

func TestGPUResultWithoutPathFails(t *testing.T) {
	a, b := pair(t, "tcp")
	ctx := recvCtx(t)
	src, _ := makeTensor(a.pool, "float32", tensor.Shape{64}, "act", 0)
	if err := a.ch.Send("act", 0, src); err != nil {
		t.Fatal(err)
	}
	_, _, err := b.ch.Recv(ctx, "act", 0, OnDevice(tensor.GPUDevice(0)))
	if !errors.Is(err, ErrNoPath) {
		t.Fatalf("Recv onto a GPU with no registered GPU memory and no proxy = %v, want ErrNoPath", err)
	}
	// The sender's tensor is kept for a later request of the same step.
	got, _, err := b.ch.Recv(ctx, "act", 0)
	if err != nil {
		t.Fatal(err)
	}
	_ = got.Release()
}

package gorgonia

import (
	"context"
	"errors"
	"testing"

	"github.com/gdrlink/gdrlink"
	"github.com/gdrlink/gdrlink/tensor"
	gt "gorgonia.org/tensor"
)

// TestDeviceDenseRealGPU views a tensor of GPU 0's pool: the Dense's
// memory is the tensor's device pointer. It needs a GPU and libcuda.
func TestDeviceDenseRealGPU(t *testing.T) {
	g, err := gdrlink.Join(context.Background(), gdrlink.WithRank(0, 1), gdrlink.WithGPU(0))
	if err != nil {
		t.Skipf("no GPU 0 with CUDA here: %v", err)
	}
	defer g.Close()
	x, err := g.NewTensorOn(tensor.GPUDevice(0), tensor.Float32, 64, 32)
	if err != nil {
		t.Skipf("no GPU tensor: %v", err)
	}
	defer x.Release()
	if _, err := Dense(x); !errors.Is(err, ErrDevice) {
		t.Fatalf("Dense of a GPU tensor: err %v, want ErrDevice", err)
	}
	d, err := DeviceDense(x, deviceEngine{})
	if err != nil {
		t.Fatal(err)
	}
	if d.Uintptr() == 0 || d.Uintptr() != x.Addr() || d.MemSize() != 64*32*4 {
		t.Fatalf("Dense memory %#x+%d, tensor %#x+%d", d.Uintptr(), d.MemSize(), x.Addr(), x.Meta().ByteSize)
	}
	if !d.Shape().Eq(gt.Shape{64, 32}) {
		t.Fatalf("shape %v", d.Shape())
	}
}

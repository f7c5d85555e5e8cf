package gorgonia

import (
	"errors"
	"testing"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/tensor"
	gt "gorgonia.org/tensor"
)

func newPool(t *testing.T) *alloc.Pool {
	t.Helper()
	p, err := alloc.New(alloc.NewMmapSource(alloc.MmapOptions{}))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

func newTensor(t *testing.T, p *alloc.Pool, dt tensor.DType, shape ...int64) *tensor.Tensor {
	t.Helper()
	m, err := tensor.MetaFor(dt, shape)
	if err != nil {
		t.Fatal(err)
	}
	x, err := p.NewTensor(m)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { x.Release() })
	return x
}

// TestSharedBothWays writes through the Dense and reads the pool tensor,
// then writes the pool tensor and reads through the Dense, for each
// float and int type gorgonia has.
func TestSharedBothWays(t *testing.T) {
	p := newPool(t)
	t.Run("float32", func(t *testing.T) { sharedBothWays[float32](t, p, tensor.Float32, gt.Float32) })
	t.Run("float64", func(t *testing.T) { sharedBothWays[float64](t, p, tensor.Float64, gt.Float64) })
	t.Run("int32", func(t *testing.T) { sharedBothWays[int32](t, p, tensor.Int32, gt.Int32) })
	t.Run("int64", func(t *testing.T) { sharedBothWays[int64](t, p, tensor.Int64, gt.Int64) })
	t.Run("uint8", func(t *testing.T) { sharedBothWays[uint8](t, p, tensor.Uint8, gt.Uint8) })
}

func sharedBothWays[T int32 | int64 | uint8 | float32 | float64](t *testing.T, p *alloc.Pool, dt tensor.DType, want gt.Dtype) {
	x := newTensor(t, p, dt, 2, 3)
	d, err := Dense(x)
	if err != nil {
		t.Fatal(err)
	}
	if d.Dtype() != want {
		t.Fatalf("dtype %v, want %v", d.Dtype(), want)
	}
	if !d.Shape().Eq(gt.Shape{2, 3}) {
		t.Fatalf("shape %v, want (2, 3)", d.Shape())
	}
	if d.Uintptr() != x.Addr() {
		t.Fatalf("Dense backing at %#x, pool tensor at %#x", d.Uintptr(), x.Addr())
	}
	v, err := tensor.View[T](x)
	if err != nil {
		t.Fatal(err)
	}
	// Dense → pool tensor.
	if err := d.SetAt(T(7), 1, 2); err != nil {
		t.Fatal(err)
	}
	if v[5] != 7 {
		t.Fatalf("pool tensor element 5 = %v after Dense.SetAt(7, 1, 2)", v[5])
	}
	// An arithmetic op in place through gorgonia's engine.
	for i := range v {
		v[i] = T(i)
	}
	if _, err := d.Add(d, gt.UseUnsafe()); err != nil {
		t.Fatal(err)
	}
	for i := range v {
		if v[i] != T(2*i) {
			t.Fatalf("after in-place Add, pool element %d = %v, want %v", i, v[i], T(2*i))
		}
	}
	// pool tensor → Dense.
	v[3] = 42
	got, err := d.At(1, 0)
	if err != nil {
		t.Fatal(err)
	}
	if got.(T) != 42 {
		t.Fatalf("Dense.At(1, 0) = %v after pool write of 42", got)
	}
}

func TestDTypeMapping(t *testing.T) {
	for _, dt := range tensor.DTypes() {
		g, err := DType(dt)
		switch dt {
		case tensor.Float16, tensor.BFloat16, tensor.String:
			if !errors.Is(err, ErrDType) {
				t.Errorf("%s: err %v, want ErrDType", dt, err)
			}
		default:
			if err != nil {
				t.Errorf("%s: %v", dt, err)
				continue
			}
			if int(g.Size()) != dt.Size() {
				t.Errorf("%s maps to %v of %d bytes, want %d", dt, g, g.Size(), dt.Size())
			}
		}
	}
	p := newPool(t)
	for _, dt := range []tensor.DType{tensor.Float16, tensor.BFloat16} {
		if _, err := Dense(newTensor(t, p, dt, 4)); !errors.Is(err, ErrDType) {
			t.Errorf("Dense of %s: err %v, want ErrDType", dt, err)
		}
	}
}

func TestShapes(t *testing.T) {
	p := newPool(t)
	for _, shape := range [][]int64{{5}, {2, 3, 4}, {1, 1, 1, 1, 7}} {
		d, err := Dense(newTensor(t, p, tensor.Float32, shape...))
		if err != nil {
			t.Fatalf("%v: %v", shape, err)
		}
		if len(d.Shape()) != len(shape) {
			t.Fatalf("%v became %v", shape, d.Shape())
		}
		for i := range shape {
			if d.Shape()[i] != int(shape[i]) {
				t.Fatalf("%v became %v", shape, d.Shape())
			}
		}
	}
	if d, err := Dense(newTensor(t, p, tensor.Float64)); err != nil || d.Size() != 1 {
		t.Fatalf("scalar: %v, %v", d, err)
	}
	if _, err := Dense(newTensor(t, p, tensor.Float32, 3, 0)); !errors.Is(err, ErrShape) {
		t.Fatalf("empty tensor: err %v, want ErrShape", err)
	}
	if _, err := Dense(tensor.Dead(tensor.Float32, tensor.Shape{2})); !errors.Is(err, ErrShape) {
		t.Fatalf("dead tensor: err %v, want ErrShape", err)
	}
	x := newTensor(t, p, tensor.Float32, 2)
	x.Release()
	if _, err := Dense(x); !errors.Is(err, tensor.ErrReleased) {
		t.Fatalf("released tensor: err %v, want tensor.ErrReleased", err)
	}
}

func TestBool(t *testing.T) {
	p := newPool(t)
	x := newTensor(t, p, tensor.Bool, 3)
	b, _ := x.Bytes()
	b[1] = 1
	d, err := Dense(x)
	if err != nil {
		t.Fatal(err)
	}
	if got := d.Bools(); got[0] || !got[1] || got[2] {
		t.Fatalf("bools %v, want [false true false]", got)
	}
	b[2] = 9
	if _, err := Dense(x); !errors.Is(err, ErrDType) {
		t.Fatalf("bool byte 9: err %v, want ErrDType", err)
	}
}

// gpuBuffer stands in for device memory: an address with no host view.
type gpuBuffer struct{ addr uintptr }

func (b gpuBuffer) Bytes() []byte         { return nil }
func (b gpuBuffer) Addr() uintptr         { return b.addr }
func (b gpuBuffer) Len() int              { return 1 << 20 }
func (b gpuBuffer) Device() tensor.Device { return tensor.GPUDevice(0) }
func (b gpuBuffer) Free() error           { return nil }

// deviceEngine is an engine whose memory the CPU cannot touch, as
// gorgonia.org/cu's is.
type deviceEngine struct{ gt.StdEng }

func (deviceEngine) AllocAccessible() bool { return false }

func TestDeviceDense(t *testing.T) {
	m, _ := tensor.MetaFor(tensor.Float32, tensor.Shape{4, 8})
	const ptr = 0x7f0000200000 // never dereferenced
	x, err := tensor.New(m, gpuBuffer{addr: ptr})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Dense(x); !errors.Is(err, ErrDevice) {
		t.Fatalf("Dense of a GPU tensor: err %v, want ErrDevice", err)
	}
	if _, err := DeviceDense(x, gt.StdEng{}); !errors.Is(err, ErrDevice) {
		t.Fatalf("DeviceDense with the CPU engine: err %v, want ErrDevice", err)
	}
	if _, err := DeviceDense(x, nil); !errors.Is(err, ErrDevice) {
		t.Fatalf("DeviceDense with no engine: err %v, want ErrDevice", err)
	}
	d, err := DeviceDense(x, deviceEngine{})
	if err != nil {
		t.Fatal(err)
	}
	if d.Uintptr() != ptr || d.MemSize() != 4*8*4 {
		t.Fatalf("Dense memory %#x+%d, want %#x+%d", d.Uintptr(), d.MemSize(), uintptr(ptr), 4*8*4)
	}
	if !d.Shape().Eq(gt.Shape{4, 8}) || d.Dtype() != gt.Float32 || d.IsNativelyAccessible() {
		t.Fatalf("Dense %v %v accessible=%v", d.Shape(), d.Dtype(), d.IsNativelyAccessible())
	}
	mem, err := MemoryOf(x)
	if err != nil || mem.Uintptr() != ptr || mem.MemSize() != 128 {
		t.Fatalf("MemoryOf: %+v, %v", mem, err)
	}
	p := newPool(t)
	if _, err := DeviceDense(newTensor(t, p, tensor.Float32, 2), deviceEngine{}); !errors.Is(err, ErrDevice) {
		t.Fatalf("DeviceDense of a host tensor: err %v, want ErrDevice", err)
	}
}

package tensor

import (
	"errors"
	"math"
	"testing"
	"unsafe"
)

// hostBuffer is a Buffer over Go memory for tests: a tensor test needs bytes,
// not registered memory. gpu makes it pretend to be device memory.
type hostBuffer struct {
	b     []byte
	gpu   bool
	frees int
}

func (h *hostBuffer) Bytes() []byte {
	if h.gpu {
		return nil
	}
	return h.b
}

func (h *hostBuffer) Addr() uintptr {
	if len(h.b) == 0 {
		return 0
	}
	return uintptr(unsafe.Pointer(&h.b[0]))
}

func (h *hostBuffer) Len() int { return len(h.b) }

func (h *hostBuffer) Device() Device {
	if h.gpu {
		return GPUDevice(0)
	}
	return Host
}

func (h *hostBuffer) Free() error { h.frees++; return nil }

func TestDTypeTable(t *testing.T) {
	tests := []struct {
		dt      DType
		name    string
		size    int
		dmaable bool
	}{
		{Bool, "bool", 1, true},
		{Int8, "int8", 1, true},
		{Int16, "int16", 2, true},
		{Int32, "int32", 4, true},
		{Int64, "int64", 8, true},
		{Uint8, "uint8", 1, true},
		{Uint16, "uint16", 2, true},
		{Uint32, "uint32", 4, true},
		{Uint64, "uint64", 8, true},
		{Float16, "float16", 2, true},
		{BFloat16, "bfloat16", 2, true},
		{Float32, "float32", 4, true},
		{Float64, "float64", 8, true},
		{Complex64, "complex64", 8, true},
		{Complex128, "complex128", 16, true},
		{String, "string", 0, false},
	}
	if got := len(DTypes()); got != len(tests) {
		t.Fatalf("DTypes() has %d types, table has %d", got, len(tests))
	}
	for i, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if DTypes()[i] != tc.dt {
				t.Errorf("DTypes()[%d] = %v, want %v", i, DTypes()[i], tc.dt)
			}
			if !tc.dt.valid() {
				t.Errorf("%v not valid", tc.dt)
			}
			if got := tc.dt.String(); got != tc.name {
				t.Errorf("String() = %q, want %q", got, tc.name)
			}
			if got := tc.dt.Size(); got != tc.size {
				t.Errorf("Size() = %d, want %d", got, tc.size)
			}
			if got := tc.dt.DMAable(); got != tc.dmaable {
				t.Errorf("DMAable() = %v, want %v", got, tc.dmaable)
			}
			back, err := ParseDType(tc.name)
			if err != nil || back != tc.dt {
				t.Errorf("ParseDType(%q) = %v, %v; want %v", tc.name, back, err, tc.dt)
			}
		})
	}
}

func TestDTypeInvalid(t *testing.T) {
	for _, dt := range []DType{Invalid, numDTypes, 200, 255} {
		if dt.valid() || dt.DMAable() || dt.Size() != 0 {
			t.Errorf("%v: Valid=%v DMAable=%v Size=%d, want false false 0", dt, dt.valid(), dt.DMAable(), dt.Size())
		}
	}
	if got := DType(200).String(); got != "DType(200)" {
		t.Errorf("String() = %q", got)
	}
	for _, s := range []string{"", "invalid", "Float32", "float", "f32", "float32 "} {
		if dt, err := ParseDType(s); !errors.Is(err, ErrBadDType) {
			t.Errorf("ParseDType(%q) = %v, %v; want ErrBadDType", s, dt, err)
		}
	}
}

func TestShapeNumElements(t *testing.T) {
	tests := []struct {
		name  string
		shape Shape
		want  int64
		err   error
	}{
		{"nil scalar", nil, 1, nil},
		{"empty scalar", Shape{}, 1, nil},
		{"vector", Shape{7}, 7, nil},
		{"matrix", Shape{2, 3}, 6, nil},
		{"zero dim", Shape{4, 0, 1 << 62}, 0, nil},
		{"max", Shape{math.MaxInt64}, math.MaxInt64, nil},
		{"2^62*2", Shape{1 << 62, 2}, 0, ErrBadShape},
		{"overflow 64 bits", Shape{1 << 32, 1 << 32}, 0, ErrBadShape},
		{"negative", Shape{2, -1}, 0, ErrBadShape},
		{"negative after zero", Shape{0, -3}, 0, ErrBadShape},
		{"rank max", make(Shape, MaxRank), 0, nil},
		{"rank too high", make(Shape, MaxRank+1), 0, ErrBadShape},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			n, err := tc.shape.NumElements()
			if tc.err != nil {
				if !errors.Is(err, tc.err) {
					t.Fatalf("NumElements(%v) = %d, %v; want %v", tc.shape, n, err, tc.err)
				}
				return
			}
			if err != nil || n != tc.want {
				t.Fatalf("NumElements(%v) = %d, %v; want %d", tc.shape, n, err, tc.want)
			}
		})
	}
}

func TestShapeCloneEqualString(t *testing.T) {
	s := Shape{2, 3, 4}
	c := s.clone()
	c[0] = 9
	if s[0] != 2 {
		t.Fatal("Clone shares memory")
	}
	if !s.equal(Shape{2, 3, 4}) || s.equal(c) || s.equal(Shape{2, 3}) {
		t.Fatal("Equal is wrong")
	}
	if Shape(nil).clone() != nil {
		t.Fatal("Clone of nil is not nil")
	}
	if !Shape(nil).equal(Shape{}) {
		t.Fatal("nil and empty shapes differ")
	}
	if got := s.String(); got != "[2 3 4]" {
		t.Fatalf("String() = %q", got)
	}
}

func TestMetaFor(t *testing.T) {
	tests := []struct {
		name  string
		dt    DType
		shape Shape
		size  int64
		err   error
	}{
		{"float32 2x3", Float32, Shape{2, 3}, 24, nil},
		{"scalar complex128", Complex128, nil, 16, nil},
		{"empty", Int64, Shape{0, 5}, 0, nil},
		{"bfloat16", BFloat16, Shape{1024}, 2048, nil},
		{"invalid dtype", Invalid, Shape{1}, 0, ErrBadDType},
		{"unknown dtype", DType(99), Shape{1}, 0, ErrBadDType},
		{"string", String, Shape{1}, 0, ErrNotDMAable},
		{"negative dim", Float32, Shape{-1}, 0, ErrBadShape},
		{"bytes overflow", Float64, Shape{1 << 61}, 0, ErrBadShape},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			m, err := MetaFor(tc.dt, tc.shape)
			if tc.err != nil {
				if !errors.Is(err, tc.err) {
					t.Fatalf("MetaFor = %v, %v; want %v", m, err, tc.err)
				}
				return
			}
			if err != nil || m.ByteSize != tc.size || m.DType != tc.dt || !m.Shape.equal(tc.shape) || m.IsDead {
				t.Fatalf("MetaFor = %+v, %v; want %d bytes", m, err, tc.size)
			}
			if err := m.Validate(); err != nil {
				t.Fatalf("Validate of MetaFor's result: %v", err)
			}
		})
	}
	shape := Shape{2, 2}
	m, _ := MetaFor(Float32, shape)
	shape[0] = 7
	if m.Shape[0] != 2 {
		t.Fatal("MetaFor kept the caller's shape slice")
	}
}

func TestMetaValidate(t *testing.T) {
	enc := int64(stringsEncodedLen([]string{"a", "bc"}))
	tests := []struct {
		name string
		m    Meta
		err  error
	}{
		{"ok", Meta{DType: Int32, Shape: Shape{3}, ByteSize: 12}, nil},
		{"empty", Meta{DType: Int32, Shape: Shape{0}}, nil},
		{"bad dtype", Meta{DType: Invalid, Shape: Shape{1}, ByteSize: 1}, ErrBadDType},
		{"bad shape", Meta{DType: Int8, Shape: Shape{-2}}, ErrBadShape},
		{"negative size", Meta{DType: Int8, Shape: Shape{0}, ByteSize: -1}, ErrSizeMismatch},
		{"size too small", Meta{DType: Int32, Shape: Shape{3}, ByteSize: 11}, ErrSizeMismatch},
		{"size too large", Meta{DType: Int32, Shape: Shape{3}, ByteSize: 13}, ErrSizeMismatch},
		{"byte overflow", Meta{DType: Float64, Shape: Shape{1 << 61}, ByteSize: 0}, ErrSizeMismatch},
		{"dead", Meta{DType: Float32, Shape: Shape{1000}, IsDead: true}, nil},
		{"dead with bytes", Meta{DType: Float32, Shape: Shape{1}, IsDead: true, ByteSize: 4}, ErrSizeMismatch},
		{"dead string", Meta{DType: String, Shape: Shape{5}, IsDead: true}, nil},
		{"dead bad shape", Meta{DType: Float32, Shape: Shape{-1}, IsDead: true}, ErrBadShape},
		{"string", Meta{DType: String, Shape: Shape{2}, ByteSize: enc}, nil},
		{"string longer encoding", Meta{DType: String, Shape: Shape{2}, ByteSize: 1 << 40}, nil},
		{"string shortest", Meta{DType: String, Shape: Shape{3}, ByteSize: 5}, nil},
		{"string too short", Meta{DType: String, Shape: Shape{3}, ByteSize: 4}, ErrSizeMismatch},
		{"string zero", Meta{DType: String, Shape: Shape{1}}, ErrSizeMismatch},
		{"string empty shape", Meta{DType: String, Shape: Shape{0}, ByteSize: 2}, nil},
		{"string huge count", Meta{DType: String, Shape: Shape{math.MaxInt64}, ByteSize: math.MaxInt64}, ErrSizeMismatch},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.m.Validate()
			if tc.err == nil && err != nil || tc.err != nil && !errors.Is(err, tc.err) {
				t.Fatalf("Validate(%v) = %v, want %v", tc.m, err, tc.err)
			}
		})
	}
}

func TestMetaEqualString(t *testing.T) {
	a := Meta{DType: Float32, Shape: Shape{2, 3}, ByteSize: 24}
	if !a.Equal(Meta{DType: Float32, Shape: Shape{2, 3}, ByteSize: 24}) {
		t.Fatal("equal metas differ")
	}
	for _, b := range []Meta{
		{DType: Int32, Shape: Shape{2, 3}, ByteSize: 24},
		{DType: Float32, Shape: Shape{3, 2}, ByteSize: 24},
		{DType: Float32, Shape: Shape{2, 3}, ByteSize: 25},
		{DType: Float32, Shape: Shape{2, 3}, IsDead: true, ByteSize: 24},
	} {
		if a.Equal(b) {
			t.Errorf("%v equals %v", a, b)
		}
	}
	if got := a.String(); got != "float32[2 3] 24 B" {
		t.Errorf("String() = %q", got)
	}
	if got := (Meta{DType: Int8, Shape: Shape{1}, IsDead: true}).String(); got != "int8[1] dead" {
		t.Errorf("String() = %q", got)
	}
}

func TestDevice(t *testing.T) {
	for _, tc := range []struct {
		d     Device
		s     string
		isGPU bool
	}{
		{Host, "cpu", false},
		{Device{Kind: PinnedHost}, "pinned", false},
		{GPUDevice(3), "gpu:3", true},
		{Device{Kind: 9}, "DeviceKind(9)", false},
	} {
		if tc.d.String() != tc.s || tc.d.IsGPU() != tc.isGPU {
			t.Errorf("%#v: String %q IsGPU %v; want %q %v", tc.d, tc.d.String(), tc.d.IsGPU(), tc.s, tc.isGPU)
		}
	}
}

func TestNew(t *testing.T) {
	m, _ := MetaFor(Float32, Shape{2, 2})
	tests := []struct {
		name string
		meta Meta
		buf  Buffer
		err  error
	}{
		{"exact", m, &hostBuffer{b: make([]byte, 16)}, nil},
		{"larger", m, &hostBuffer{b: make([]byte, 64)}, nil},
		{"too small", m, &hostBuffer{b: make([]byte, 15)}, ErrSizeMismatch},
		{"nil buffer", m, nil, ErrSizeMismatch},
		{"invalid meta", Meta{DType: Float32, Shape: Shape{2}, ByteSize: 7}, &hostBuffer{b: make([]byte, 8)}, ErrSizeMismatch},
		{"string meta", Meta{DType: String, Shape: Shape{1}, ByteSize: 3}, &hostBuffer{b: make([]byte, 8)}, ErrNotDMAable},
		{"dead nil buffer", Meta{DType: Float32, Shape: Shape{9}, IsDead: true}, nil, nil},
		{"empty nil buffer", Meta{DType: Float32, Shape: Shape{0}}, nil, nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			x, err := New(tc.meta, tc.buf)
			if tc.err != nil {
				if !errors.Is(err, tc.err) || x != nil {
					t.Fatalf("New = %v, %v; want %v", x, err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatalf("New: %v", err)
			}
			if !x.Meta().Equal(tc.meta) {
				t.Fatalf("Meta() = %v, want %v", x.Meta(), tc.meta)
			}
		})
	}
}

func TestTensorBytesAndViews(t *testing.T) {
	m, _ := MetaFor(Float32, Shape{2, 2})
	buf := &hostBuffer{b: make([]byte, 32)}
	shape := Shape{2, 2}
	m.Shape = shape
	x, err := New(m, buf)
	if err != nil {
		t.Fatal(err)
	}
	shape[0] = 5
	if !x.Meta().Shape.equal(Shape{2, 2}) {
		t.Fatal("New kept the caller's shape slice")
	}
	if x.Meta().DType != Float32 || x.Meta().ByteSize != 16 || x.Meta().IsDead || x.Device() != Host || x.Buffer() != buf || x.Addr() != buf.Addr() {
		t.Fatalf("accessors wrong: %v %d %v %v", x.Meta().DType, x.Meta().ByteSize, x.Meta().IsDead, x.Device())
	}
	b, err := x.Bytes()
	if err != nil || len(b) != 16 {
		t.Fatalf("Bytes = %d bytes, %v; want 16", len(b), err)
	}
	f, err := View[float32](x)
	if err != nil || len(f) != 4 {
		t.Fatalf("Float32s = %v, %v", f, err)
	}
	f[3] = 1.5
	if got := *(*float32)(unsafe.Pointer(&buf.b[12])); got != 1.5 {
		t.Fatalf("Float32s does not share the buffer: %v", got)
	}
	if _, err := View[float64](x); !errors.Is(err, ErrBadDType) {
		t.Fatalf("Float64s of float32 = %v, want ErrBadDType", err)
	}
	if _, err := View[uint16](x); !errors.Is(err, ErrBadDType) {
		t.Fatalf("View[uint16] of float32 = %v, want ErrBadDType", err)
	}
	if _, err := x.Strings(); !errors.Is(err, ErrBadDType) {
		t.Fatalf("Strings of float32 = %v, want ErrBadDType", err)
	}
	if err := x.Release(); err != nil {
		t.Fatal(err)
	}
	if err := x.Release(); !errors.Is(err, ErrReleased) {
		t.Fatalf("second Release = %v, want ErrReleased", err)
	}
	if buf.frees != 1 {
		t.Fatalf("buffer freed %d times, want 1", buf.frees)
	}
	if _, err := x.Bytes(); !errors.Is(err, ErrReleased) {
		t.Fatalf("Bytes after Release = %v", err)
	}
	if _, err := View[float32](x); !errors.Is(err, ErrReleased) {
		t.Fatalf("Float32s after Release = %v", err)
	}
}

func TestViewTypes(t *testing.T) {
	check := func(t *testing.T, dt DType, n int, view func(*Tensor) (int, error)) {
		t.Helper()
		m, err := MetaFor(dt, Shape{int64(n)})
		if err != nil {
			t.Fatal(err)
		}
		x, err := New(m, &hostBuffer{b: make([]byte, m.ByteSize)})
		if err != nil {
			t.Fatal(err)
		}
		got, err := view(x)
		if err != nil || got != n {
			t.Fatalf("%v view: %d elements, %v; want %d", dt, got, err, n)
		}
	}
	check(t, Float64, 3, func(x *Tensor) (int, error) { v, err := View[float64](x); return len(v), err })
	check(t, Int32, 5, func(x *Tensor) (int, error) { v, err := View[int32](x); return len(v), err })
	check(t, Int64, 2, func(x *Tensor) (int, error) { v, err := View[int64](x); return len(v), err })
	check(t, Complex128, 2, func(x *Tensor) (int, error) { v, err := View[complex128](x); return len(v), err })
	check(t, Float16, 6, func(x *Tensor) (int, error) { v, err := View[uint16](x); return len(v), err })
	check(t, BFloat16, 6, func(x *Tensor) (int, error) { v, err := View[uint16](x); return len(v), err })
	check(t, Uint8, 9, func(x *Tensor) (int, error) { v, err := View[uint8](x); return len(v), err })

	for _, dt := range DTypes() {
		if dt == Bool || dt == String || dt == Float16 || dt == BFloat16 {
			continue
		}
		if got := dtypeOfName(dt); got != dt {
			t.Errorf("DTypeOf for %v = %v", dt, got)
		}
	}

	// A view of a misaligned buffer must fail, not build a misaligned slice.
	m, _ := MetaFor(Float64, Shape{2})
	raw := make([]byte, 24)
	x, err := New(m, &hostBuffer{b: raw[1:]})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := View[float64](x); !errors.Is(err, ErrMisaligned) {
		t.Fatalf("misaligned view = %v, want ErrMisaligned", err)
	}
	// Dead and empty tensors view as empty slices.
	if v, err := View[float32](Dead(Float32, Shape{4})); err != nil || len(v) != 0 {
		t.Fatalf("view of dead tensor = %v, %v", v, err)
	}
}

// dtypeOfName instantiates DTypeOf for the Go type named like dt.
func dtypeOfName(dt DType) DType {
	switch dt {
	case Int8:
		return DTypeOf[int8]()
	case Int16:
		return DTypeOf[int16]()
	case Int32:
		return DTypeOf[int32]()
	case Int64:
		return DTypeOf[int64]()
	case Uint8:
		return DTypeOf[uint8]()
	case Uint16:
		return DTypeOf[uint16]()
	case Uint32:
		return DTypeOf[uint32]()
	case Uint64:
		return DTypeOf[uint64]()
	case Float32:
		return DTypeOf[float32]()
	case Float64:
		return DTypeOf[float64]()
	case Complex64:
		return DTypeOf[complex64]()
	case Complex128:
		return DTypeOf[complex128]()
	}
	return Invalid
}

func TestTensorGPUBuffer(t *testing.T) {
	m, _ := MetaFor(Int8, Shape{8})
	buf := &hostBuffer{b: make([]byte, 8), gpu: true}
	x, err := New(m, buf)
	if err != nil {
		t.Fatal(err)
	}
	if x.Device() != GPUDevice(0) || x.Addr() == 0 {
		t.Fatalf("Device %v Addr %#x", x.Device(), x.Addr())
	}
	if _, err := x.Bytes(); !errors.Is(err, ErrNotDMAable) {
		t.Fatalf("Bytes of GPU tensor = %v, want ErrNotDMAable", err)
	}
	if _, err := View[int8](x); !errors.Is(err, ErrNotDMAable) {
		t.Fatalf("View of GPU tensor = %v, want ErrNotDMAable", err)
	}
	if err := x.Release(); err != nil || buf.frees != 1 {
		t.Fatalf("Release = %v, frees %d", err, buf.frees)
	}
}

func TestStringsTensor(t *testing.T) {
	vals := []string{"alpha", "", "γ"}
	x, err := NewStrings(Shape{3}, vals)
	if err != nil {
		t.Fatal(err)
	}
	if x.Meta().DType != String || x.Meta().ByteSize != int64(stringsEncodedLen(vals)) || x.Device() != Host || x.Buffer() != nil || x.Addr() != 0 {
		t.Fatalf("string tensor: %v, device %v", x.Meta(), x.Device())
	}
	if err := x.Meta().Validate(); err != nil {
		t.Fatalf("Validate: %v", err)
	}
	got, err := x.Strings()
	if err != nil || len(got) != 3 || got[0] != "alpha" || got[2] != "γ" {
		t.Fatalf("Strings = %q, %v", got, err)
	}
	if _, err := x.Bytes(); !errors.Is(err, ErrNotDMAable) {
		t.Fatalf("Bytes of string tensor = %v, want ErrNotDMAable", err)
	}
	if _, err := NewStrings(Shape{2, 2}, vals); !errors.Is(err, ErrSizeMismatch) {
		t.Fatalf("NewStrings with 3 values for 4 elements = %v", err)
	}
	if _, err := NewStrings(Shape{-1}, nil); !errors.Is(err, ErrBadShape) {
		t.Fatalf("NewStrings with a bad shape = %v", err)
	}
	if err := x.Release(); err != nil {
		t.Fatal(err)
	}
	if err := x.Release(); !errors.Is(err, ErrReleased) {
		t.Fatalf("second Release = %v", err)
	}
	if _, err := x.Strings(); !errors.Is(err, ErrReleased) {
		t.Fatalf("Strings after Release = %v", err)
	}
}

func TestDead(t *testing.T) {
	x := Dead(Float32, Shape{3})
	if !x.Meta().IsDead || x.Meta().ByteSize != 0 || x.Buffer() != nil {
		t.Fatalf("Dead: %v", x.Meta())
	}
	if err := x.Meta().Validate(); err != nil {
		t.Fatal(err)
	}
	if b, err := x.Bytes(); err != nil || len(b) != 0 {
		t.Fatalf("Bytes of dead = %v, %v", b, err)
	}
	if err := x.Release(); err != nil {
		t.Fatal(err)
	}
	if err := x.Release(); !errors.Is(err, ErrReleased) {
		t.Fatalf("second Release = %v", err)
	}
}

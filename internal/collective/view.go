package collective

import (
	"github.com/gdrlink/gdrlink/tensor"
)

// view is a piece of a tensor's buffer: its bytes [off, off+n). It lies in
// the same registered arena as the tensor, so a Link sends it without a
// copy; freeing it frees nothing.
type view struct {
	b    []byte
	addr uintptr
	dev  tensor.Device
}

func (v *view) Bytes() []byte         { return v.b }
func (v *view) Addr() uintptr         { return v.addr }
func (v *view) Len() int              { return len(v.b) }
func (v *view) Device() tensor.Device { return v.dev }
func (v *view) Free() error           { return nil }

// piece returns the bytes [off, off+n) of t as a tensor of t's element
// type, for sending. t is a checked host tensor.
func piece(t *tensor.Tensor, off, n int64) (*tensor.Tensor, error) {
	b, err := t.Bytes()
	if err != nil {
		return nil, err
	}
	dt := t.Meta().DType
	m, err := tensor.MetaFor(dt, tensor.Shape{n / int64(dt.Size())})
	if err != nil {
		return nil, err
	}
	return tensor.New(m, &view{b: b[off : off+n : off+n], addr: t.Addr() + uintptr(off), dev: t.Device()})
}

package wire_test

import (
	"fmt"

	"github.com/gdrlink/gdrlink/internal/wire"
	"github.com/gdrlink/gdrlink/tensor"
)

// A receiver asks for a tensor it has seen before: the name travels as its
// index, and the cached meta-data says what the result buffer was sized for.
func Example() {
	meta, _ := tensor.MetaFor(tensor.Float32, tensor.Shape{128, 64})
	req := wire.Message{Type: wire.TypeRequest, Flags: wire.ReqMeta, Req: 17, Step: 3, NameIndex: 5,
		Addr: 0x7f0012340000, RKey: 0x51, Capacity: uint64(meta.ByteSize)}
	req.Meta.SetMeta(meta)
	frame := req.Append(make([]byte, 0, wire.MaxFrame))

	var got wire.Message
	n, err := wire.Decode(frame, &got)
	if err != nil {
		panic(err)
	}
	fmt.Println(got.Type, n, "bytes, request", got.Req, "step", got.Step, "meta", got.Meta.Tensor())
	// Output: TENSOR_REQUEST 72 bytes, request 17 step 3 meta float32[128 64] 32768 B
}

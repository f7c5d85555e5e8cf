package tensor_test

import (
	"errors"
	"fmt"

	"github.com/gdrlink/gdrlink/tensor"
)

func ExampleMetaFor() {
	m, err := tensor.MetaFor(tensor.Float32, tensor.Shape{2, 3})
	if err != nil {
		panic(err)
	}
	fmt.Println(m)
	_, err = tensor.MetaFor(tensor.Float32, tensor.Shape{2, -3})
	fmt.Println(errors.Is(err, tensor.ErrBadShape))
	// Output:
	// float32[2 3] 24 B
	// true
}

func ExampleAppendStrings() {
	vals := []string{"ab", "", "c"}
	enc := encodeSized(vals)
	fmt.Println(len(enc) == tensor.StringsEncodedLen(vals))
	fmt.Printf("% x\n", enc)
	// Output:
	// true
	// 01 03 02 00 01 61 62 63
}

// encodeSized encodes into a buffer sized in advance, as a sender does into
// the registered memory of the byte size it announced.
func encodeSized(vals []string) []byte {
	buf := make([]byte, 0, tensor.StringsEncodedLen(vals))
	return tensor.AppendStrings(buf, vals)
}

func ExampleDecodeStrings() {
	enc := tensor.AppendStrings(nil, []string{"alpha", "beta"})
	vals, err := tensor.DecodeStrings(enc, 2, 1<<20)
	fmt.Println(vals, err)
	_, err = tensor.DecodeStrings(enc[:len(enc)-1], 2, 1<<20)
	fmt.Println(errors.Is(err, tensor.ErrTruncated), err)
	// Output:
	// [alpha beta] <nil>
	// true tensor: truncated encoding: data at offset 4 has 8 bytes, lengths announce 9
}

func ExampleNewStrings() {
	t, err := tensor.NewStrings(tensor.Shape{2}, []string{"hello", "world"})
	if err != nil {
		panic(err)
	}
	fmt.Println(t.Meta())
	wire := tensor.AppendStrings(nil, []string{"hello", "world"})
	back, err := tensor.DecodeStringTensor(t.Meta(), wire, 0)
	if err != nil {
		panic(err)
	}
	vals, _ := back.Strings()
	fmt.Println(vals)
	// Output:
	// string[2] 14 B
	// [hello world]
}

func ExampleParseDType() {
	dt, err := tensor.ParseDType("bfloat16")
	fmt.Println(dt, dt.Size(), dt.DMAable(), err)
	// Output: bfloat16 2 true <nil>
}

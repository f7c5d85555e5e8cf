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
	t, _ := tensor.NewStrings(tensor.Shape{3}, vals)
	fmt.Println(int64(len(enc)) == t.Meta().ByteSize)
	fmt.Printf("% x\n", enc)
	// Output:
	// true
	// 01 03 02 00 01 61 62 63
}

// encodeSized encodes into a buffer sized in advance, as a sender does into
// the registered memory of the byte size it announced (a String tensor's
// ByteSize is the size of its encoding).
func encodeSized(vals []string) []byte {
	t, err := tensor.NewStrings(tensor.Shape{int64(len(vals))}, vals)
	if err != nil {
		panic(err)
	}
	buf := make([]byte, 0, t.Meta().ByteSize)
	return tensor.AppendStrings(buf, vals)
}

func ExampleDecodeStringTensor() {
	vals := []string{"alpha", "beta"}
	t, _ := tensor.NewStrings(tensor.Shape{2}, vals)
	enc := tensor.AppendStrings(nil, vals)
	back, err := tensor.DecodeStringTensor(t.Meta(), enc, 1<<20)
	got, _ := back.Strings()
	fmt.Println(got, err)
	// A peer that announces one byte less than its strings need.
	short := t.Meta()
	short.ByteSize--
	_, err = tensor.DecodeStringTensor(short, enc[:len(enc)-1], 1<<20)
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

package main

import (
	"bytes"
	"fmt"
	"hash/fnv"
	"slices"
	"strings"

	"github.com/gdrlink/gdrlink/tensor"
)

// The stream's contents are a pattern of key and step, so the receiver can
// check every byte without being told what was sent.

func seedOf(key string, step int64) byte {
	h := fnv.New32a()
	fmt.Fprintf(h, "%s/%d", key, step)
	return byte(h.Sum32())
}

func patternByte(seed byte, i int) byte { return seed + byte(i*7) + byte(i>>8) }

func stringsOf(n int64, key string, step int64) []string {
	vals := make([]string, n)
	seed := seedOf(key, step)
	for i := range vals {
		vals[i] = fmt.Sprintf("%s#%d:%s", key, step, strings.Repeat(string(rune('a'+(int(seed)+i)%26)), i%7))
	}
	return vals
}

func makeTensor(newTensor func(tensor.DType, ...int64) (*tensor.Tensor, error), kind string, shape tensor.Shape, key string, step int64) (*tensor.Tensor, error) {
	if d, ok := strings.CutPrefix(kind, "dead:"); ok {
		dt, err := tensor.ParseDType(d)
		if err != nil {
			return nil, err
		}
		return tensor.Dead(dt, shape), nil
	}
	dt, err := tensor.ParseDType(kind)
	if err != nil {
		return nil, err
	}
	if dt == tensor.String {
		n, err := shape.NumElements()
		if err != nil {
			return nil, err
		}
		return tensor.NewStrings(shape, stringsOf(n, key, step))
	}
	t, err := newTensor(dt, shape...)
	if err != nil {
		return nil, err
	}
	b, err := t.Bytes()
	if err != nil {
		_ = t.Release()
		return nil, err
	}
	fillPattern(b, seedOf(key, step))
	return t, nil
}

func checkTensor(t *tensor.Tensor, kind string, shape tensor.Shape, key string, step int64) error {
	if d, ok := strings.CutPrefix(kind, "dead:"); ok {
		if !t.Meta().IsDead || t.Meta().DType.String() != d || !slices.Equal(t.Meta().Shape, shape) {
			return fmt.Errorf("got %v, want a dead %s%v", t.Meta(), d, shape)
		}
		return nil
	}
	if kind == "string" {
		got, err := t.Strings()
		if err != nil {
			return err
		}
		n, _ := shape.NumElements()
		want := stringsOf(n, key, step)
		if len(got) != len(want) || !slices.Equal(t.Meta().Shape, shape) {
			return fmt.Errorf("got %v, want string%v", t.Meta(), shape)
		}
		for i := range want {
			if got[i] != want[i] {
				return fmt.Errorf("string %d is %q, want %q", i, got[i], want[i])
			}
		}
		return nil
	}
	dt, err := tensor.ParseDType(kind)
	if err != nil {
		return err
	}
	meta, err := tensor.MetaFor(dt, shape)
	if err != nil {
		return err
	}
	if !t.Meta().Equal(meta) {
		return fmt.Errorf("got %v, want %v", t.Meta(), meta)
	}
	b, err := t.Bytes()
	if err != nil {
		return err
	}
	seed := seedOf(key, step)
	first := b[:min(len(b), patternPeriod)]
	for i := range first {
		if b[i] != patternByte(seed, i) {
			return fmt.Errorf("byte %d of %d is %#x, want %#x", i, len(b), b[i], patternByte(seed, i))
		}
	}
	for off := len(first); off < len(b); off += len(first) {
		chunk := b[off:min(len(b), off+len(first))]
		if !bytes.Equal(chunk, first[:len(chunk)]) {
			return fmt.Errorf("bytes %d..%d differ from the pattern", off, off+len(chunk))
		}
	}
	return nil
}

// patternPeriod is the period of patternByte in i.
const patternPeriod = 1 << 16

// fillPattern writes the pattern once and copies it over the rest.
func fillPattern(b []byte, seed byte) {
	n := min(len(b), patternPeriod)
	for i := 0; i < n; i++ {
		b[i] = patternByte(seed, i)
	}
	for k := n; k < len(b); k *= 2 {
		copy(b[k:], b[:k])
	}
}

package tensor

import (
	"encoding/binary"
	"fmt"
	"math/bits"
)

// stringsVersion is the version byte that starts every string encoding this
// package writes. A decoder rejects any other version with ErrCorrupt.
const stringsVersion = 1

// The wire encoding of a String tensor's elements, version 1:
//
//	version  1 byte, stringsVersion
//	count    uvarint, the number of elements
//	lengths  count uvarints, the byte length of each element
//	data     the elements' bytes, concatenated, nothing after them
//
// Uvarints are encoding/binary's, in their shortest form: a decoder rejects
// padded ones, so every value has exactly one encoding and decoding then
// re-encoding gives back the same bytes.

// stringsEncodedLen is the exact size in bytes of the wire encoding of vals:
// AppendStrings appends exactly this many bytes.
func stringsEncodedLen(vals []string) int {
	n := 1 + uvarintLen(uint64(len(vals)))
	for _, s := range vals {
		n += uvarintLen(uint64(len(s))) + len(s)
	}
	return n
}

// AppendStrings appends the wire encoding of vals to b and returns the
// extended slice. It allocates only when b lacks the capacity for
// the encoding's size more bytes: that size is the ByteSize of the
// tensor NewStrings makes of vals.
func AppendStrings(b []byte, vals []string) []byte {
	if need := stringsEncodedLen(vals); cap(b)-len(b) < need {
		nb := make([]byte, len(b), len(b)+need)
		copy(nb, b)
		b = nb
	}
	b = append(b, stringsVersion)
	b = binary.AppendUvarint(b, uint64(len(vals)))
	for _, s := range vals {
		b = binary.AppendUvarint(b, uint64(len(s)))
	}
	for _, s := range vals {
		b = append(b, s...)
	}
	return b
}

// decodeStrings decodes a wire encoding that must be the whole of b.
//
// wantCount is the number of elements the tensor's shape holds; an encoding
// with another count fails with ErrCorrupt. A negative wantCount accepts any
// count. maxBytes caps what the result may hold: at most maxBytes elements
// and maxBytes bytes of strings in total; maxBytes <= 0 means no cap other
// than the input itself.
//
// Errors wrap ErrTruncated (the input ends inside the header, or before the
// data its lengths announce), ErrOversized (a count or length larger than the
// rest of the input could hold, or more than maxBytes elements or bytes) or
// ErrCorrupt (an unknown version, a padded or overflowing uvarint, a count
// other than wantCount, bytes after the data), and say at which offset. The
// decoder allocates at most the result's slice (bounded by len(b) elements)
// and one copy of the data section, never what a corrupt header claims.
func decodeStrings(b []byte, wantCount int64, maxBytes int) ([]string, error) {
	if len(b) == 0 {
		return nil, fmt.Errorf("%w: no version byte at offset 0", ErrTruncated)
	}
	if b[0] != stringsVersion {
		return nil, fmt.Errorf("%w: version %d at offset 0, want %d", ErrCorrupt, b[0], stringsVersion)
	}
	off := 1
	count, err := readUvarint(b, &off, "element count")
	if err != nil {
		return nil, err
	}
	// Each element takes at least one byte for its length.
	if count > uint64(len(b)-off) {
		return nil, fmt.Errorf("%w: element count %d at offset 1 exceeds the %d bytes left", ErrOversized, count, len(b)-off)
	}
	if maxBytes > 0 && count > uint64(maxBytes) {
		return nil, fmt.Errorf("%w: element count %d at offset 1, limit %d", ErrOversized, count, maxBytes)
	}
	if wantCount >= 0 && count != uint64(wantCount) {
		return nil, fmt.Errorf("%w: element count %d at offset 1, shape holds %d", ErrCorrupt, count, wantCount)
	}
	lensAt := off
	var total uint64
	for i := uint64(0); i < count; i++ {
		at := off
		n, err := readUvarint(b, &off, "length")
		if err != nil {
			return nil, err
		}
		if left := uint64(len(b) - off); n > left {
			return nil, fmt.Errorf("%w: length %d of element %d at offset %d exceeds the %d bytes left", ErrOversized, n, i, at, left)
		}
		total += n // no wrap: total <= len(b) before, n <= len(b)
		if total > uint64(len(b)) {
			return nil, fmt.Errorf("%w: lengths up to element %d at offset %d announce %d bytes of data, the input has %d bytes", ErrTruncated, i, at, total, len(b))
		}
		if maxBytes > 0 && total > uint64(maxBytes) {
			return nil, fmt.Errorf("%w: length %d of element %d at offset %d brings the data to %d bytes, limit %d", ErrOversized, n, i, at, total, maxBytes)
		}
	}
	data := b[off:]
	switch {
	case uint64(len(data)) < total:
		return nil, fmt.Errorf("%w: data at offset %d has %d bytes, lengths announce %d", ErrTruncated, off, len(data), total)
	case uint64(len(data)) > total:
		return nil, fmt.Errorf("%w: %d trailing bytes at offset %d", ErrCorrupt, uint64(len(data))-total, uint64(off)+total)
	}
	out := make([]string, count)
	all := string(data) // one copy; the elements share it
	pos := 0
	for i, at := 0, lensAt; i < len(out); i++ {
		n, w := binary.Uvarint(b[at:]) // validated above
		at += w
		out[i] = all[pos : pos+int(n)]
		pos += int(n)
	}
	return out, nil
}

// DecodeStringTensor decodes the wire encoding b of a String tensor whose
// meta-data the receiver holds: b must be meta.ByteSize bytes and hold exactly
// as many elements as meta.Shape. maxBytes caps what the result may hold: at
// most maxBytes elements and maxBytes bytes of strings in total; maxBytes <= 0
// means no cap other than the input itself.
//
// A malformed encoding fails with an error wrapping ErrTruncated (the input
// ends inside the header, or before the data its lengths announce),
// ErrOversized (a count or length larger than the rest of the input could
// hold, or beyond maxBytes) or ErrCorrupt (an unknown version, a padded or
// overflowing uvarint, a count other than the shape's, bytes after the
// data), saying at which offset. The decoder allocates at most the result's
// slice (bounded by len(b) elements) and one copy of the data section, never
// what a corrupt header claims.
func DecodeStringTensor(meta Meta, b []byte, maxBytes int) (*Tensor, error) {
	if meta.DType != String {
		return nil, fmt.Errorf("%w: %s tensor has no string encoding", ErrBadDType, meta.DType)
	}
	if meta.IsDead {
		return nil, fmt.Errorf("%w: dead tensor carries no encoding", ErrSizeMismatch)
	}
	n, err := meta.Shape.NumElements()
	if err != nil {
		return nil, err
	}
	if int64(len(b)) != meta.ByteSize {
		return nil, fmt.Errorf("%w: encoding of %s has %d bytes", ErrSizeMismatch, meta, len(b))
	}
	vals, err := decodeStrings(b, n, maxBytes)
	if err != nil {
		return nil, err
	}
	return NewStrings(meta.Shape, vals)
}

// readUvarint reads a shortest-form uvarint at *off and advances *off.
func readUvarint(b []byte, off *int, what string) (uint64, error) {
	v, n := binary.Uvarint(b[*off:])
	switch {
	case n == 0:
		return 0, fmt.Errorf("%w: %s at offset %d ends after %d bytes", ErrTruncated, what, *off, len(b)-*off)
	case n < 0:
		return 0, fmt.Errorf("%w: %s at offset %d overflows 64 bits", ErrCorrupt, what, *off)
	case n != uvarintLen(v):
		return 0, fmt.Errorf("%w: %s at offset %d is padded to %d bytes", ErrCorrupt, what, *off, n)
	}
	*off += n
	return v, nil
}

// uvarintLen is the size of v's shortest uvarint encoding.
func uvarintLen(v uint64) int {
	return (bits.Len64(v|1) + 6) / 7
}

package tensor

import (
	"bytes"
	"encoding/binary"
	"errors"
	"runtime"
	"strings"
	"testing"
)

func TestStringsRoundTrip(t *testing.T) {
	long := strings.Repeat("x", 300) // a two-byte length
	for _, vals := range [][]string{
		nil,
		{""},
		{"a"},
		{"", "", ""},
		{"hello", "", "wörld", long},
		{string([]byte{0, 1, 0xff})},
		make([]string, 200), // a two-byte count
	} {
		n := stringsEncodedLen(vals)
		prefix := []byte("pre")
		enc := AppendStrings(prefix, vals)
		if len(enc) != len(prefix)+n {
			t.Fatalf("%q: appended %d bytes, StringsEncodedLen says %d", vals, len(enc)-len(prefix), n)
		}
		if !bytes.Equal(enc[:3], []byte("pre")) {
			t.Fatalf("prefix overwritten: %q", enc[:3])
		}
		got, err := decodeStrings(enc[3:], int64(len(vals)), 0)
		if err != nil {
			t.Fatalf("%q: %v", vals, err)
		}
		if len(got) != len(vals) {
			t.Fatalf("decoded %d strings, want %d", len(got), len(vals))
		}
		for i := range vals {
			if got[i] != vals[i] {
				t.Fatalf("element %d = %q, want %q", i, got[i], vals[i])
			}
		}
		if _, err := decodeStrings(enc[3:], -1, 0); err != nil {
			t.Fatalf("any count: %v", err)
		}
	}
}

func TestStringsLayout(t *testing.T) {
	got := AppendStrings(nil, []string{"ab", "", "c"})
	want := []byte{stringsVersion, 3, 2, 0, 1, 'a', 'b', 'c'}
	if !bytes.Equal(got, want) {
		t.Fatalf("encoding = %v, want %v", got, want)
	}
}

func TestAppendStringsNoAlloc(t *testing.T) {
	vals := []string{"one", "two", "three"}
	buf := make([]byte, 0, stringsEncodedLen(vals))
	allocs := testing.AllocsPerRun(100, func() { buf = AppendStrings(buf[:0], vals) })
	if allocs != 0 {
		t.Fatalf("AppendStrings into a large enough buffer allocated %v times", allocs)
	}
}

func TestDecodeStringsErrors(t *testing.T) {
	uv := func(v uint64) []byte { return binary.AppendUvarint(nil, v) }
	cat := func(parts ...[]byte) []byte { return bytes.Join(parts, nil) }
	v := []byte{stringsVersion}
	tests := []struct {
		name     string
		in       []byte
		want     int64
		maxBytes int
		err      error
		offset   string
	}{
		{"empty", nil, -1, 0, ErrTruncated, "offset 0"},
		{"version only", v, -1, 0, ErrTruncated, "offset 1"},
		{"bad version", []byte{2, 0}, -1, 0, ErrCorrupt, "offset 0"},
		{"version zero", []byte{0, 0}, -1, 0, ErrCorrupt, "offset 0"},
		{"count cut", cat(v, []byte{0x80}), -1, 0, ErrTruncated, "offset 1"},
		{"count padded", cat(v, []byte{0x80, 0x00}), -1, 0, ErrCorrupt, "offset 1"},
		{"count overflows", cat(v, bytes.Repeat([]byte{0xff}, 10), []byte{1}), -1, 0, ErrCorrupt, "offset 1"},
		{"count beyond input", cat(v, uv(5), []byte{0, 0}), -1, 0, ErrOversized, "offset 1"},
		{"count huge", cat(v, uv(1<<62)), -1, 0, ErrOversized, "offset 1"},
		{"count mismatch", cat(v, uv(1), uv(0)), 2, 0, ErrCorrupt, "offset 1"},
		{"count mismatch zero", cat(v, uv(0)), 1, 0, ErrCorrupt, "offset 1"},
		{"length cut", cat(v, uv(2), uv(0), []byte{0x80}), -1, 0, ErrTruncated, "offset 3"},
		{"length padded", cat(v, uv(1), []byte{0x81, 0x00}, []byte("a")), -1, 0, ErrCorrupt, "offset 2"},
		{"length beyond input", cat(v, uv(1), uv(4), []byte("abc")), -1, 0, ErrOversized, "offset 2"},
		{"length huge", cat(v, uv(1), uv(1<<63), []byte("abc")), -1, 0, ErrOversized, "offset 2"},
		{"data cut", cat(v, uv(3), uv(2), uv(2), uv(2), []byte("aabbc")), -1, 0, ErrTruncated, "offset 5"},
		{"trailing", cat(v, uv(1), uv(1), []byte("ab")), -1, 0, ErrCorrupt, "offset 4"},
		{"trailing after empty", cat(v, uv(0), []byte{0}), -1, 0, ErrCorrupt, "offset 2"},
		{"count over maxBytes", cat(v, uv(4), uv(0), uv(0), uv(0), uv(0)), -1, 3, ErrOversized, "offset 1"},
		{"over maxBytes", cat(v, uv(2), uv(3), uv(3), []byte("abcdef")), -1, 5, ErrOversized, "offset 3"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := decodeStrings(tc.in, tc.want, tc.maxBytes)
			if !errors.Is(err, tc.err) {
				t.Fatalf("DecodeStrings(%v) = %q, %v; want %v", tc.in, got, err, tc.err)
			}
			if !strings.Contains(err.Error(), tc.offset) {
				t.Fatalf("error %q does not name %s", err, tc.offset)
			}
		})
	}
	// At exactly maxBytes it decodes.
	enc := AppendStrings(nil, []string{"abc", "de"})
	if _, err := decodeStrings(enc, 2, 5); err != nil {
		t.Fatalf("at maxBytes: %v", err)
	}
}

func TestDecodeStringsDoesNotTrustCount(t *testing.T) {
	// A header claiming many elements in a few bytes must fail without the
	// decoder allocating for them: 2^24 claimed strings would be 256 MiB of
	// string headers if it trusted the count, 2^40 would not fit at all.
	for _, claim := range []uint64{1 << 24, 1 << 40} {
		in := binary.AppendUvarint([]byte{stringsVersion}, claim)
		in = append(in, make([]byte, 6)...)
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		const runs = 10
		for range runs {
			if _, err := decodeStrings(in, -1, 0); !errors.Is(err, ErrOversized) {
				t.Fatalf("claim %d: err = %v", claim, err)
			}
		}
		runtime.ReadMemStats(&after)
		if perRun := (after.TotalAlloc - before.TotalAlloc) / runs; perRun > 64<<10 {
			t.Fatalf("rejecting a claim of %d strings allocated %d bytes a run", claim, perRun)
		}
	}
}

func TestDecodeStringTensor(t *testing.T) {
	vals := []string{"a", "bb", "ccc", ""}
	src, err := NewStrings(Shape{2, 2}, vals)
	if err != nil {
		t.Fatal(err)
	}
	enc := AppendStrings(nil, vals)
	x, err := DecodeStringTensor(src.Meta(), enc, 0)
	if err != nil {
		t.Fatal(err)
	}
	if !x.Meta().Equal(src.Meta()) {
		t.Fatalf("meta %v, want %v", x.Meta(), src.Meta())
	}
	got, _ := x.Strings()
	if strings.Join(got, ",") != "a,bb,ccc," {
		t.Fatalf("strings %q", got)
	}
	bad := src.Meta()
	bad.Shape = Shape{3}
	if _, err := DecodeStringTensor(bad, enc, 0); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("count mismatch = %v, want ErrCorrupt", err)
	}
	if _, err := DecodeStringTensor(src.Meta(), enc[:len(enc)-1], 0); !errors.Is(err, ErrSizeMismatch) {
		t.Fatalf("short input = %v, want ErrSizeMismatch", err)
	}
	if _, err := DecodeStringTensor(Meta{DType: Int8, Shape: Shape{1}, ByteSize: 1}, []byte{0}, 0); !errors.Is(err, ErrBadDType) {
		t.Fatalf("int8 = %v, want ErrBadDType", err)
	}
	if _, err := DecodeStringTensor(Meta{DType: String, Shape: Shape{1}, IsDead: true}, nil, 0); !errors.Is(err, ErrSizeMismatch) {
		t.Fatalf("dead = %v, want ErrSizeMismatch", err)
	}
	if _, err := DecodeStringTensor(Meta{DType: String, Shape: Shape{-1}}, nil, 0); !errors.Is(err, ErrBadShape) {
		t.Fatalf("bad shape = %v, want ErrBadShape", err)
	}
}

func TestUvarintLen(t *testing.T) {
	for _, v := range []uint64{0, 1, 127, 128, 16383, 16384, 1<<35 - 1, 1 << 35, 1<<63 - 1, 1 << 63, ^uint64(0)} {
		if got, want := uvarintLen(v), len(binary.AppendUvarint(nil, v)); got != want {
			t.Errorf("uvarintLen(%d) = %d, want %d", v, got, want)
		}
	}
}

func FuzzDecodeStrings(f *testing.F) {
	f.Add(AppendStrings(nil, nil))
	f.Add(AppendStrings(nil, []string{"a", "", "hello"}))
	f.Add([]byte{stringsVersion, 0x80, 0x00})
	f.Fuzz(func(t *testing.T, in []byte) {
		vals, err := decodeStrings(in, -1, 1<<20)
		if err != nil {
			if !errors.Is(err, ErrTruncated) && !errors.Is(err, ErrOversized) && !errors.Is(err, ErrCorrupt) {
				t.Fatalf("untyped error: %v", err)
			}
			if vals != nil {
				t.Fatalf("values with an error: %q", vals)
			}
			return
		}
		if n := stringsEncodedLen(vals); n != len(in) {
			t.Fatalf("StringsEncodedLen = %d, input was %d bytes", n, len(in))
		}
		out := AppendStrings(nil, vals)
		if !bytes.Equal(out, in) {
			t.Fatalf("re-encoding differs:\n in %x\nout %x", in, out)
		}
		again, err := decodeStrings(out, int64(len(vals)), 1<<20)
		if err != nil || len(again) != len(vals) {
			t.Fatalf("decoding the re-encoding: %d strings, %v", len(again), err)
		}
	})
}

func benchStrings() []string {
	vals := make([]string, 1024)
	for i := range vals {
		vals[i] = strings.Repeat("v", i%64)
	}
	return vals
}

func BenchmarkAppendStrings(b *testing.B) {
	vals := benchStrings()
	buf := make([]byte, 0, stringsEncodedLen(vals))
	b.SetBytes(int64(cap(buf)))
	b.ReportAllocs()
	for b.Loop() {
		buf = AppendStrings(buf[:0], vals)
	}
}

func BenchmarkDecodeStrings(b *testing.B) {
	vals := benchStrings()
	enc := AppendStrings(nil, vals)
	b.SetBytes(int64(len(enc)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := decodeStrings(enc, int64(len(vals)), 0); err != nil {
			b.Fatal(err)
		}
	}
}

package wire

import (
	"bytes"
	"encoding/binary"
	"errors"
	"testing"

	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

func metaOf(t testing.TB, dt tensor.DType, shape ...int64) Meta {
	t.Helper()
	tm, err := tensor.MetaFor(dt, shape)
	if err != nil {
		t.Fatal(err)
	}
	var w Meta
	w.SetMeta(tm)
	return w
}

// samples is one valid message of each type and flag combination.
func samples(t testing.TB) []Message {
	hello := Message{Type: TypeHello, Flags: HelloChecksum, Ring: 64, Slot: MaxFrame, Text: []byte("rank-1"), Host: []byte("boot-id"), NumEndpoints: 2}
	hello.Endpoints[0] = Endpoint{Provider: []byte("tcp"), Host: []byte("boot-id"), Data: []byte("127.0.0.1:4000")}
	hello.Endpoints[1] = Endpoint{Provider: []byte("tcp"), Host: []byte("boot-id"), Data: []byte{1, 2, 3}}
	return []Message{
		{Type: TypeRequest, Credits: 3, Flags: ReqName | ReqMeta, Req: 7, Step: 42, NameIndex: 1, Name: []byte("layer0/weights"), Addr: 0x7f0000001000, RKey: 0x1234, Capacity: 24, Meta: metaOf(t, tensor.Float32, 2, 3)},
		{Type: TypeRequest, Req: 8, Step: -1, NameIndex: 9, Flags: ReqExact},
		{Type: TypeRequest, Flags: ReqMeta, Req: 1 << 31, Step: 1, NameIndex: 2, Meta: metaOf(t, tensor.Int8)},
		{Type: TypeRequest, Flags: ReqMeta | ReqRails, Req: 5, Step: 2, NameIndex: 3, Addr: 0x2000, RKey: 1, Capacity: 64, NumRailKeys: 2, RailKeys: [MaxRailKeys]uint32{7, 8}, Meta: metaOf(t, tensor.Float32, 16)},
		{Type: TypeMetaResponse, Req: 7, Meta: metaOf(t, tensor.Complex128, 4, 0, 5)},
		{Type: TypeMetaResponse, Flags: RespFinal, Req: 7, Meta: Meta{DType: tensor.Float32, Dead: true, Rank: 1, Dims: [tensor.MaxRank]int64{3}}},
		{Type: TypeMetaResponse, Flags: RespChecksum, Req: 9, Checksum: 0xdeadbeef, Meta: metaOf(t, tensor.BFloat16, 1024)},
		{Type: TypeMetaResponse, Flags: RespChecksum | RespWriteFollows, Req: 10, Checksum: 1, Meta: metaOf(t, tensor.Float32, 8)},
		{Type: TypeReRequest, Credits: 1, Req: 7, Addr: 0x1000, RKey: 5, Capacity: 4096},
		{Type: TypeReRequest, Req: 8, Addr: 0x1000, RKey: 5, Capacity: 4096, NumRailKeys: 3, RailKeys: [MaxRailKeys]uint32{1, 2, 3}},
		{Type: TypeError, Req: 7, Code: CodeSender, Text: []byte("no such tensor")},
		{Type: TypeError, Req: 7, Code: 999},
		{Type: TypeCredit, Credits: 32},
		{Type: TypeChecksum, Req: 3, Checksum: 1},
		{Type: TypeCancel, Req: 3},
		{Type: TypeBye},
		hello,
		{Type: TypeRequest, Flags: ReqMeta | ReqExact | ReqChunks, Req: 11, Step: 3, NameIndex: 4, Addr: 0x7f0000400000, RKey: 9, Capacity: 64 << 20, Meta: metaOf(t, tensor.Float32, 16<<20), ChunkShift: 22},
		{Type: TypeReRequest, Req: 12, Addr: 0x1000, RKey: 5, Capacity: 8 << 20, ChunkShift: 22},
		{Type: TypeCancel, Req: 4, Code: CodeTooLarge},
		{Type: TypeBye, Flags: ByeImms, Imms: 0xfffffffe},
		{Type: TypeBye, Credits: 2, Flags: ByeImms},
		{Type: TypeConfirm, Credits: 1, Req: 13},
		{Type: TypeConfirm, Flags: ConfirmBad, Req: 0xffffffff},
		func() Message { h := hello; h.Flags = HelloChecksum | HelloChecksumAuto | HelloConfirm; return h }(),
		{Type: TypeRequest, Flags: ReqMeta | ReqExact | ReqPull, Req: 14, Step: 5, NameIndex: 6, Addr: 0x7f0000800000, RKey: 3, Capacity: 4096, Meta: metaOf(t, tensor.Float32, 1024)},
		{Type: TypeMetaResponse, Flags: RespPull, Req: 14, Meta: metaOf(t, tensor.Float32, 1024), PullArena: 3, PullOffset: 1 << 20, PullHandle: bytes.Repeat([]byte{0xab}, 73)},
		func() Message { h := hello; h.Flags = HelloConfirm | HelloPull; return h }(),
		{Type: TypeEager, Credits: 2, Step: 77, Name: []byte("grad/layer1"), Meta: metaOf(t, tensor.Float32, 2, 3), Data: bytes.Repeat([]byte{0x5a}, 24)},
		{Type: TypeEager, Step: -3, Name: []byte("x"), Meta: metaOf(t, tensor.Uint8, 4000), Data: make([]byte, 4000)},
		{Type: TypeTaken, Credits: 1, Count: 0xfffffff0},
		func() Message { h := hello; h.Flags = HelloEager; h.Slot = MaxFrame; return h }(),
		{Type: TypeBye, Flags: ByeImms | ByeEagers, Imms: 3, Eagers: 0xffffffff},
		{Type: TypeEager, Flags: EagerChecksum, Step: 78, Name: []byte("grad/layer2"), Meta: metaOf(t, tensor.Float32, 4), Checksum: 0xc0ffee01, Data: bytes.Repeat([]byte{0xa5}, 16)},
		func() Message {
			h := hello
			h.Flags = HelloChecksum | HelloConfirm | HelloEager | HelloEagerChecksum
			h.Slot = MaxFrame
			return h
		}(),
	}
}

func TestRoundTrip(t *testing.T) {
	for _, m := range samples(t) {
		b := m.Append(nil)
		if len(b) != m.Len() {
			t.Fatalf("%s: Append wrote %d bytes, Len says %d", m.Type, len(b), m.Len())
		}
		if err := m.Check(); err != nil {
			t.Fatalf("%s: Check: %v", m.Type, err)
		}
		var d Message
		n, err := Decode(b, &d)
		if err != nil {
			t.Fatalf("%s: Decode: %v", m.Type, err)
		}
		if n != len(b) {
			t.Fatalf("%s: Decode took %d of %d bytes", m.Type, n, len(b))
		}
		if again := d.Append(nil); !bytes.Equal(again, b) {
			t.Fatalf("%s: re-encoding differs:\n%x\n%x", m.Type, b, again)
		}
		if d.Type != m.Type || d.Req != m.Req || d.Credits != m.Credits || d.Flags != m.Flags {
			t.Fatalf("%s: decoded header %+v", m.Type, d)
		}
	}
}

func TestBatch(t *testing.T) {
	var b []byte
	ms := samples(t)
	for i := range ms {
		b = ms[i].Append(b)
	}
	var d Message
	for i := 0; len(b) > 0; i++ {
		n, err := Decode(b, &d)
		if err != nil {
			t.Fatalf("frame %d: %v", i, err)
		}
		if d.Type != ms[i].Type {
			t.Fatalf("frame %d is %s, want %s", i, d.Type, ms[i].Type)
		}
		b = b[n:]
	}
}

func TestMetaConversions(t *testing.T) {
	tm, _ := tensor.MetaFor(tensor.Float64, tensor.Shape{3, 5})
	var w Meta
	w.SetMeta(tm)
	if !w.Equal(tm) {
		t.Fatal("Equal after SetMeta is false")
	}
	back := w.Tensor()
	if !back.Equal(tm) {
		t.Fatalf("Tensor() = %v, want %v", back, tm)
	}
	back.Shape[0] = 4
	if w.Dims[0] != 3 {
		t.Fatal("Tensor() shares memory with the wire meta-data")
	}
	other, _ := tensor.MetaFor(tensor.Float64, tensor.Shape{5, 3})
	if w.Equal(other) {
		t.Fatal("Equal ignores the shape")
	}
}

func TestDecodeRejects(t *testing.T) {
	good := func(i int) []byte { s := samples(t); return s[i].Append(nil) }
	le := binary.LittleEndian
	setLen := func(b []byte) []byte { le.PutUint32(b[4:], uint32(len(b))); return b }
	cases := []struct {
		name string
		in   []byte
		want error
	}{
		{"empty", nil, ErrTruncated},
		{"short header", []byte{1, 1, 0}, ErrTruncated},
		{"version", func() []byte { b := good(0); b[0] = 2; return b }(), ErrVersion},
		{"type 0", func() []byte { b := good(0); b[1] = 0; return b }(), ErrType},
		{"type high", func() []byte { b := good(0); b[1] = byte(numTypes); return b }(), ErrType},
		{"length short", func() []byte { b := good(0); le.PutUint32(b[4:], 4); return b }(), ErrLength},
		{"length huge", func() []byte { b := good(0); le.PutUint32(b[4:], MaxFrame+1); return b }(), ErrLength},
		{"length past input", func() []byte { b := good(0); return b[:len(b)-1] }(), ErrTruncated},
		{"body cut", func() []byte { b := good(0); return setLen(b[:len(b)-3]) }(), ErrTruncated},
		{"trailing in frame", func() []byte { b := append(good(14), 0); return setLen(b) }(), ErrLength},
		{"re-request trailing 0", func() []byte { b := append(good(8), 0); return setLen(b) }(), ErrField},
		{"re-request two trailing", func() []byte { b := append(good(18), 0); return setLen(b) }(), ErrLength},
		{"re-request chunk too small", func() []byte { b := good(18); b[len(b)-1] = MinChunkShift - 1; return b }(), ErrField},
		{"request chunk too big", func() []byte { b := good(17); b[len(b)-1] = MaxChunkShift + 1; return b }(), ErrField},
		{"request chunk missing", func() []byte { b := good(17); return setLen(b[:len(b)-1]) }(), ErrTruncated},
		{"request flags", func() []byte { b := good(1); b[8] = 0x80; return b }(), ErrFlags},
		{"name index 0", func() []byte { b := good(1); le.PutUint32(b[8+1+4+8:], 0); return b }(), ErrField},
		{"empty name", func() []byte {
			m := samples(t)[0]
			m.Name = nil
			return m.Append(nil)
		}(), ErrField},
		{"long name", func() []byte {
			m := samples(t)[0]
			m.Name = bytes.Repeat([]byte("x"), MaxName+1)
			return m.Append(nil)
		}(), ErrLength},
		{"bad dtype", func() []byte {
			m := samples(t)[4]
			m.Meta.DType = 200
			return m.Append(nil)
		}(), ErrMeta},
		{"size mismatch", func() []byte {
			m := samples(t)[4]
			m.Meta.ByteSize = 1
			return m.Append(nil)
		}(), ErrMeta},
		{"negative dim", func() []byte {
			m := samples(t)[4]
			m.Meta.Dims[0] = -1
			return m.Append(nil)
		}(), ErrMeta},
		{"rank too big", func() []byte { b := good(4); b[8+1+4+2] = tensor.MaxRank + 1; return b }(), ErrMeta},
		{"meta flags", func() []byte { b := good(4); b[8+1+4+1] = 2; return b }(), ErrFlags},
		{"dead with bytes", func() []byte {
			m := samples(t)[5]
			m.Meta.ByteSize = 12
			return m.Append(nil)
		}(), ErrMeta},
		{"response flags", func() []byte { b := good(4); b[8] = 0x10; return b }(), ErrFlags},
		{"final and write follows", func() []byte { b := good(4); b[8] = RespFinal | RespWriteFollows; return b }(), ErrFlags},
		{"hello flags", func() []byte { b := good(16); b[8] = 0x40; return b }(), ErrFlags},
		{"eager flags", func() []byte { b := good(28); b[8] = 2; return b }(), ErrFlags},
		{"eager checksum missing", func() []byte { b := good(28); b[8] = EagerChecksum; return b }(), ErrLength},
		{"eager empty name", func() []byte {
			m := samples(t)[28]
			m.Name = nil
			return m.Append(nil)
		}(), ErrField},
		{"eager data short", func() []byte { b := good(28); return setLen(b[:len(b)-1]) }(), ErrLength},
		{"eager data long", func() []byte { b := append(good(28), 0); return setLen(b) }(), ErrLength},
		{"eager dead", func() []byte {
			m := samples(t)[28]
			m.Meta.Dead, m.Meta.ByteSize, m.Data = true, 0, nil
			return m.Append(nil)
		}(), ErrField},
		{"eager strings", func() []byte {
			m := samples(t)[28]
			m.Meta = Meta{DType: tensor.String, Rank: 1, Dims: [tensor.MaxRank]int64{1}, ByteSize: 24}
			return m.Append(nil)
		}(), ErrField},
		{"taken cut", func() []byte { b := good(30); return setLen(b[:len(b)-1]) }(), ErrTruncated},
		{"taken trailing", func() []byte { b := append(good(30), 0); return setLen(b) }(), ErrLength},
		{"confirm flags", func() []byte { b := good(23); b[8] = 0x02; return b }(), ErrFlags},
		{"confirm cut", func() []byte { b := good(22); return setLen(b[:len(b)-1]) }(), ErrTruncated},
		{"confirm trailing", func() []byte { b := append(good(22), 0); return setLen(b) }(), ErrLength},
		{"cancel trailing code 0", func() []byte { b := append(good(14), 0, 0); return setLen(b) }(), ErrField},
		{"cancel code and trailing", func() []byte { b := append(good(19), 0); return setLen(b) }(), ErrLength},
		{"bye flags 0", func() []byte { b := append(good(15), 0); return setLen(b) }(), ErrFlags},
		{"bye unknown flags", func() []byte { b := good(20); b[8] = 0x04 | ByeImms; return b }(), ErrFlags},
		{"bye eagers cut", func() []byte { b := good(32); return setLen(b[:len(b)-1]) }(), ErrTruncated},
		{"bye eagers trailing", func() []byte { b := append(good(32), 0); return setLen(b) }(), ErrLength},
		{"bye imms cut", func() []byte { b := good(20); return setLen(b[:len(b)-1]) }(), ErrTruncated},
		{"bye trailing", func() []byte { b := append(good(20), 0); return setLen(b) }(), ErrLength},
		{"pull with a checksum", func() []byte {
			m := samples(t)[26]
			m.Flags |= RespChecksum
			return m.Append(nil)
		}(), ErrFlags},
		{"pull of a dead tensor", func() []byte {
			m := samples(t)[26]
			m.Meta = samples(t)[5].Meta
			return m.Append(nil)
		}(), ErrField},
		{"pull handle too long", func() []byte {
			m := samples(t)[26]
			m.PullHandle = make([]byte, MaxPullHandle+1)
			return m.Append(nil)
		}(), ErrLength},
		{"pull handle cut", func() []byte { b := good(26); return setLen(b[:len(b)-1]) }(), ErrTruncated},
		{"no rail keys with ReqRails", func() []byte {
			m := samples(t)[3]
			m.NumRailKeys = 0
			return m.Append(nil)
		}(), ErrLength},
		{"too many rail keys", func() []byte {
			b := good(9)
			b[8+4+8+4+8] = MaxRailKeys + 1
			return b
		}(), ErrLength},
		{"too many endpoints", func() []byte {
			m := samples(t)[16]
			b := m.Append(nil)
			off := 8 + 1 + 2 + 4 + 2 + len(m.Text) + 2 + len(m.Host)
			b[off] = MaxEndpoints + 1
			return b
		}(), ErrLength},
	}
	for _, c := range cases {
		var d Message
		n, err := Decode(c.in, &d)
		if !errors.Is(err, c.want) {
			t.Errorf("%s: Decode = %d, %v; want %v", c.name, n, err, c.want)
			continue
		}
		if !errors.Is(err, verbsio.ErrBadFrame) {
			t.Errorf("%s: %v does not match verbsio.ErrBadFrame", c.name, err)
		}
	}
}

// Frames without a chunk size are the frames of the first release: a
// request or re-request with ChunkShift 0 encodes as before, and a peer
// that never asks for chunks never sends the new bytes.
func TestChunkShiftOptional(t *testing.T) {
	ms := samples(t)
	for _, i := range []int{17, 18} {
		with := ms[i]
		without := with
		without.ChunkShift = 0
		without.Flags &^= ReqChunks
		if d := with.Len() - without.Len(); d != 1 {
			t.Fatalf("%s: the chunk size takes %d bytes, want 1", with.Type, d)
		}
		var d Message
		d.ChunkShift = 7 // must be cleared by a frame without one
		if _, err := Decode(without.Append(nil), &d); err != nil || d.ChunkShift != 0 {
			t.Fatalf("%s without a chunk size: %v, ChunkShift %d", with.Type, err, d.ChunkShift)
		}
		if _, err := Decode(with.Append(nil), &d); err != nil || d.ChunkShift != 22 {
			t.Fatalf("%s with a chunk size: %v, ChunkShift %d", with.Type, err, d.ChunkShift)
		}
	}
	// The re-request sample of the first release still decodes unchanged.
	if b := ms[8].Append(nil); len(b) != 8+4+8+4+8+1 {
		t.Fatalf("re-request without a chunk size is %d bytes", len(b))
	}
}

// A CANCEL without a reason and a BYE without a count are the frames of
// the first release, byte for byte; the reason and the count decode when
// present and are cleared when not.
func TestCancelCodeAndByeImmsOptional(t *testing.T) {
	if b := (&Message{Type: TypeCancel, Req: 3}).Append(nil); !bytes.Equal(b, []byte{Version, byte(TypeCancel), 0, 0, 12, 0, 0, 0, 3, 0, 0, 0}) {
		t.Fatalf("CANCEL without a code: %x", b)
	}
	if b := (&Message{Type: TypeBye}).Append(nil); !bytes.Equal(b, []byte{Version, byte(TypeBye), 0, 0, 8, 0, 0, 0}) {
		t.Fatalf("BYE without a count: %x", b)
	}
	ms := samples(t)
	var d Message
	d.Code, d.Imms, d.Flags = CodeInternal, 9, 9 // cleared by frames without them
	if _, err := Decode(ms[14].Append(nil), &d); err != nil || d.Code != 0 {
		t.Fatalf("CANCEL without a code: %v, code %v", err, d.Code)
	}
	if _, err := Decode(ms[19].Append(nil), &d); err != nil || d.Code != CodeTooLarge || d.Code.String() != "too large" {
		t.Fatalf("CANCEL with a code: %v, code %v", err, d.Code)
	}
	if _, err := Decode(ms[20].Append(nil), &d); err != nil || d.Flags != ByeImms || d.Imms != 0xfffffffe {
		t.Fatalf("BYE with a count: %v, %+v", err, d)
	}
	if _, err := Decode(ms[15].Append(nil), &d); err != nil || d.Flags != 0 || d.Imms != 0 {
		t.Fatalf("BYE without a count: %v, flags %#x imms %d", err, d.Flags, d.Imms)
	}
}

func TestCheckRejectsOversized(t *testing.T) {
	m := Message{Type: TypeError, Req: 1, Code: CodeSender, Text: bytes.Repeat([]byte("e"), MaxText+1)}
	if err := m.Check(); !errors.Is(err, ErrLength) {
		t.Fatalf("Check of a long message = %v, want ErrLength", err)
	}
}

func TestNoAllocs(t *testing.T) {
	ms := samples(t)
	buf := make([]byte, 0, MaxFrame)
	var d Message
	for i := range ms {
		m := &ms[i]
		if a := testing.AllocsPerRun(50, func() { buf = m.Append(buf[:0]) }); a != 0 {
			t.Errorf("%s: Append allocates %v times", m.Type, a)
		}
		if a := testing.AllocsPerRun(50, func() {
			if _, err := Decode(buf, &d); err != nil {
				t.Fatal(err)
			}
		}); a != 0 {
			t.Errorf("%s: Decode allocates %v times", m.Type, a)
		}
	}
}

func TestStrings(t *testing.T) {
	if TypeRequest.String() != "TENSOR_REQUEST" || Type(77).String() != "Type(77)" {
		t.Fatal("Type.String")
	}
	if CodeSender.String() != "sender error" || Code(500).String() != "Code(500)" {
		t.Fatal("Code.String")
	}
}

func FuzzDecode(f *testing.F) {
	for _, m := range samples(f) {
		f.Add(m.Append(nil))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		var m Message
		n, err := Decode(b, &m)
		if err != nil {
			if !errors.Is(err, verbsio.ErrBadFrame) {
				t.Fatalf("error %v does not match ErrBadFrame", err)
			}
			return
		}
		if n < HeaderLen || n > len(b) {
			t.Fatalf("Decode took %d bytes of %d", n, len(b))
		}
		if m.Len() != n {
			t.Fatalf("Len() = %d, frame is %d bytes", m.Len(), n)
		}
		if again := m.Append(nil); !bytes.Equal(again, b[:n]) {
			t.Fatalf("re-encoding differs:\n%x\n%x", b[:n], again)
		}
		if err := m.Check(); err != nil {
			t.Fatalf("Check of a decoded frame: %v", err)
		}
	})
}

func BenchmarkAppendRequest(b *testing.B) {
	m := samples(b)[2]
	buf := make([]byte, 0, MaxFrame)
	b.ReportAllocs()
	for b.Loop() {
		buf = m.Append(buf[:0])
	}
	b.SetBytes(int64(len(buf)))
}

func BenchmarkDecodeRequest(b *testing.B) {
	m := samples(b)[2]
	buf := m.Append(nil)
	var d Message
	b.ReportAllocs()
	for b.Loop() {
		if _, err := Decode(buf, &d); err != nil {
			b.Fatal(err)
		}
	}
	b.SetBytes(int64(len(buf)))
}

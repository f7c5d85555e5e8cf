package onnode

import (
	"bytes"
	"errors"
	"testing"

	"github.com/gdrlink/gdrlink/verbsio"
)

// FuzzParseRecord: whatever a peer writes into the ring, parsing either
// fails with ErrBadFrame or yields a record inside the published bytes that
// re-encodes to the same bytes.
func FuzzParseRecord(f *testing.F) {
	f.Add(appendRecord(nil, record{Kind: recWriteImm, Imm: 7, N: 4096, Payload: []byte{1, 0, 0, 0}}))
	f.Add(appendRecord(nil, record{Kind: recSend, Flags: flagMore, Imm: 3, N: 5, Payload: []byte("hello")}))
	f.Add(appendRecord(nil, record{Kind: recPad, Size: 64}))
	f.Add(appendRecord(nil, record{Kind: recError, Imm: uint32(verbsio.StatusRemoteAccess)}))
	f.Add([]byte{16, 0, 0, 0, 9})
	f.Fuzz(func(t *testing.T, b []byte) {
		r, err := parseRecord(b)
		if err != nil {
			if !errors.Is(err, verbsio.ErrBadFrame) {
				t.Fatalf("error %v does not wrap ErrBadFrame", err)
			}
			return
		}
		if int(r.Size) > len(b) || r.Size < recHeader || r.Size%16 != 0 {
			t.Fatalf("record size %d of %d bytes", r.Size, len(b))
		}
		if r.Kind == recSend {
			if int(r.N) != len(r.Payload) {
				t.Fatalf("payload %d, N %d", len(r.Payload), r.N)
			}
			again := appendRecord(nil, r)
			if !bytes.Equal(again[:recHeader+r.N], b[:recHeader+r.N]) || len(again) != int(r.Size) {
				t.Fatalf("re-encoding differs: %x vs %x", again, b[:r.Size])
			}
		}
	})
}

// FuzzParseEndpoint: endpoint data from the bootstrap round-trips or fails
// with ErrBadFrame.
func FuzzParseEndpoint(f *testing.F) {
	f.Add(endpointData{PID: 42, Name: "gdrlink-onnode-42-00ff"}.Append(nil))
	f.Add([]byte{1, 0, 0, 0, 0, 0})
	f.Fuzz(func(t *testing.T, b []byte) {
		e, err := parseEndpointData(b)
		if err != nil {
			if !errors.Is(err, verbsio.ErrBadFrame) {
				t.Fatal(err)
			}
			return
		}
		if again := e.Append(nil); !bytes.Equal(again, b) || len(again) != e.Len() {
			t.Fatalf("round trip %x -> %x", b, again)
		}
	})
}

// FuzzParseHello: a connecting peer's hello round-trips or fails with
// ErrBadFrame.
func FuzzParseHello(f *testing.F) {
	f.Add(hello{PID: 1, Probe: 0x7f0000001000, RingSize: ringData, Name: "a", PeerName: "b"}.Append(nil))
	f.Add([]byte{1, 1})
	f.Fuzz(func(t *testing.T, b []byte) {
		h, err := parseHello(b)
		if err != nil {
			if !errors.Is(err, verbsio.ErrBadFrame) {
				t.Fatal(err)
			}
			return
		}
		if again := h.Append(nil); !bytes.Equal(again, b) || len(again) != h.Len() {
			t.Fatalf("round trip %x -> %x", b, again)
		}
	})
}

// FuzzParseControl: control messages round-trip or fail with ErrBadFrame.
func FuzzParseControl(f *testing.F) {
	f.Add(control{Kind: msgFDReq, RKey: 0x401}.Append(nil))
	f.Add(control{Kind: msgFDResp, RKey: 0x401, OK: true}.Append(nil))
	f.Add(control{Kind: msgAck, RKey: 9}.Append(nil))
	f.Fuzz(func(t *testing.T, b []byte) {
		c, err := parseControl(b)
		if err != nil {
			if !errors.Is(err, verbsio.ErrBadFrame) {
				t.Fatal(err)
			}
			return
		}
		if again := c.Append(nil); !bytes.Equal(again, b) || len(again) != c.Len() {
			t.Fatalf("round trip %x -> %x", b, again)
		}
	})
}

// FuzzParseMapsLine: any line either fails or gives a sane range.
func FuzzParseMapsLine(f *testing.F) {
	f.Add("7f1c2a400000-7f1c2a600000 rw-s 00000000 00:01 2052 /memfd:gdrlink (deleted)")
	f.Add("55d0c8a00000-55d0c8a21000 rw-p 00000000 00:00 0 [heap]")
	f.Add("0-1 r--p 0 0:0 0")
	f.Fuzz(func(t *testing.T, line string) {
		m, err := parseMapsLine(line)
		if err != nil {
			if !errors.Is(err, errMapsLine) {
				t.Fatal(err)
			}
			return
		}
		if m.End < m.Start || len(m.Perms) != 4 {
			t.Fatalf("%+v from %q", m, line)
		}
	})
}

func TestMappingsCovering(t *testing.T) {
	maps := []byte("1000-3000 rw-p 00000000 00:00 0\n3000-5000 rw-s 00002000 00:01 77 /memfd:x (deleted)\n6000-7000 rw-p 00000000 00:00 0\n")
	for _, c := range []struct {
		addr, n uint64
		want    int
		ok      bool
	}{
		{0x1000, 0x1000, 1, true},
		{0x2000, 0x2000, 2, true},
		{0x3800, 0x100, 1, true},
		{0x4000, 0x2000, 0, false},
		{0x500, 0x1000, 0, false},
		{^uint64(0) - 4, 16, 0, false},
	} {
		ms, err := mappingsCovering(maps, c.addr, c.n)
		if (err == nil) != c.ok || len(ms) != c.want {
			t.Errorf("%#x+%#x: %d mappings, %v", c.addr, c.n, len(ms), err)
		}
	}
}

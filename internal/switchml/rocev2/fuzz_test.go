package rocev2

import (
	"bytes"
	"encoding/binary"
	"testing"
)

// FuzzParseFrame parses arbitrary bytes as an IPv4 RoCEv2 packet; what parses
// must re-append to the same bytes (when its UDP checksum and pad are zero,
// as this package writes them, and so are the BTH's reserved bits) and measure what it appends.
func FuzzParseFrame(f *testing.F) {
	for _, v := range loadVectors(f)[3:9] {
		f.Add(v.frame)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		ip, p, err := ParseFrame(b)
		if err != nil {
			return
		}
		total := int(binary.BigEndian.Uint16(b[2:]))
		out, err := AppendFrame(nil, &ip, &p)
		if err != nil {
			t.Fatalf("parsed packet does not append: %v", err)
		}
		if len(out) != total || len(out) != FrameLen(&p) {
			t.Fatalf("appended %d bytes, parsed %d, FrameLen %d", len(out), total, FrameLen(&p))
		}
		padZero := bytes.Count(b[total-ICRCLen-p.pad():total-ICRCLen], []byte{0}) == p.pad()
		// Reserved BTH bits are ignored on receipt and written as 0.
		reservedZero := b[IPv4Len+UDPLen+4]&0x3f == 0 && b[IPv4Len+UDPLen+8]&0x7f == 0
		if b[26] == 0 && b[27] == 0 && padZero && reservedZero && !bytes.Equal(out, b[:total]) {
			t.Fatalf("re-appended\n%x\nparsed\n%x", out, b[:total])
		}
	})
}

// FuzzParseTransport parses arbitrary bytes as a UDP payload; what parses
// measures its own length.
func FuzzParseTransport(f *testing.F) {
	for _, v := range loadVectors(f)[3:9] {
		f.Add(v.frame[IPv4Len+UDPLen:])
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		p, err := ParseTransport(b)
		if err != nil {
			return
		}
		if p.Len() != len(b) {
			t.Fatalf("Len %d for %d bytes", p.Len(), len(b))
		}
	})
}

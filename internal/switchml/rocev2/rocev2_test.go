package rocev2

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"hash/crc32"
	"net/netip"
	"os"
	"reflect"
	"strconv"
	"strings"
	"testing"
)

type vector struct {
	name   string
	ip     IPv4
	pkt    Packet
	udpSum bool
	frame  []byte
}

// loadVectors reads testdata/scapy.txt, written by Scapy's RoCE layer.
func loadVectors(t testing.TB) []vector {
	t.Helper()
	f, err := os.Open("testdata/scapy.txt")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var vs []vector
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		v := vector{name: fields[0]}
		num := func(s string) uint64 {
			n, err := strconv.ParseUint(s, 16, 64)
			if err != nil {
				t.Fatalf("%s: %v", v.name, err)
			}
			return n
		}
		for _, kv := range fields[1:] {
			k, s, _ := strings.Cut(kv, "=")
			switch k {
			case "src", "dst":
				a := netip.MustParseAddr(s).As4()
				if k == "src" {
					v.ip.Src = a
				} else {
					v.ip.Dst = a
				}
			case "payload":
				if s != "-" {
					v.pkt.Payload, _ = hex.DecodeString(s)
				}
			case "frame":
				v.frame, _ = hex.DecodeString(s)
			default:
				n := num(s)
				switch k {
				case "op":
					v.pkt.Opcode = Opcode(n)
				case "se":
					v.pkt.Solicited = n != 0
				case "mig":
					v.pkt.MigReq = n != 0
				case "pkey":
					v.pkt.PKey = uint16(n)
				case "fecn":
					v.pkt.FECN = n != 0
				case "becn":
					v.pkt.BECN = n != 0
				case "dqpn":
					v.pkt.DestQP = uint32(n)
				case "ackreq":
					v.pkt.AckReq = n != 0
				case "psn":
					v.pkt.PSN = uint32(n)
				case "va":
					v.pkt.VA = n
				case "rkey":
					v.pkt.RKey = uint32(n)
				case "dmalen":
					v.pkt.DMALen = uint32(n)
				case "imm":
					v.pkt.Imm = uint32(n)
				case "tos":
					v.ip.TOS = uint8(n)
				case "ttl":
					v.ip.TTL = uint8(n)
				case "id":
					v.ip.ID = uint16(n)
				case "df":
					v.ip.DontFragment = n != 0
				case "sport":
					v.ip.SrcPort = uint16(n)
				case "udpsum":
					v.udpSum = n != 0
				default:
					t.Fatalf("%s: unknown field %q", v.name, k)
				}
			}
		}
		vs = append(vs, v)
	}
	if len(vs) < 10 {
		t.Fatalf("%d vectors", len(vs))
	}
	return vs
}

func samePacket(a, b Packet) bool {
	eq := bytes.Equal(a.Payload, b.Payload)
	a.Payload, b.Payload = nil, nil
	return eq && reflect.DeepEqual(a, b)
}

// TestScapyVectors parses the packets Scapy built (accepting their ICRC) and
// emits the same bytes from the same fields.
func TestScapyVectors(t *testing.T) {
	for _, v := range loadVectors(t) {
		ip, p, err := ParseFrame(v.frame)
		if err != nil {
			t.Errorf("%s: %v", v.name, err)
			continue
		}
		if ip != v.ip || !samePacket(p, v.pkt) {
			t.Errorf("%s: parsed %+v %+v, want %+v %+v", v.name, ip, p, v.ip, v.pkt)
		}
		got, err := AppendFrame(nil, &v.ip, &v.pkt)
		if err != nil {
			t.Errorf("%s: %v", v.name, err)
			continue
		}
		want := v.frame
		if v.udpSum {
			// Scapy filled in the UDP checksum, which we leave 0: the
			// ICRC, which masks it, must still be the same.
			want = bytes.Clone(want)
			if binary.BigEndian.Uint16(want[26:]) == 0 {
				t.Fatalf("%s: no UDP checksum in the vector", v.name)
			}
			want[26], want[27] = 0, 0
		}
		if !bytes.Equal(got, want) {
			t.Errorf("%s: emitted\n%x\nwant\n%x", v.name, got, want)
		}
		if len(got) != FrameLen(&v.pkt) || len(got)-IPv4Len-UDPLen != v.pkt.Len() {
			t.Errorf("%s: %d bytes, FrameLen %d", v.name, len(got), FrameLen(&v.pkt))
		}
	}
}

// TestICRCMask changes each header byte of a frame in turn: a change in a
// masked field (TOS, TTL, IPv4 and UDP checksums, BTH byte 4) keeps the
// ICRC, any other change breaks it.
func TestICRCMask(t *testing.T) {
	v := loadVectors(t)[0]
	masked := map[int]bool{1: true, 8: true, 10: true, 11: true, 26: true, 27: true, 28 + 4: true}
	for i := range IPv4Len + UDPLen + BTHLen + RETHLen {
		f := bytes.Clone(v.frame)
		f[i] ^= 0x01
		t2 := icrc(f[:28], f[28:len(f)-4])
		t1 := icrc(v.frame[:28], v.frame[28:len(v.frame)-4])
		if masked[i] != (t1 == t2) {
			t.Errorf("byte %d: masked %v but ICRC %s", i, masked[i], map[bool]string{true: "kept", false: "changed"}[t1 == t2])
		}
	}
	// The seed of rxe_icrc.c is the CRC state after 8 bytes of ones.
	if s := ^crc32.ChecksumIEEE(bytes.Repeat([]byte{0xff}, 8)); s != 0xdebb20e3 {
		t.Errorf("state after 8 bytes of ones %#x, want 0xdebb20e3", s)
	}
}

// TestParseErrors feeds broken packets; each must give its typed error.
func TestParseErrors(t *testing.T) {
	v := loadVectors(t)[3] // only-imm-256
	good := v.frame
	mod := func(f func(b []byte) []byte) []byte { return f(bytes.Clone(good)) }
	fixsum := func(b []byte) []byte {
		b[10], b[11] = 0, 0
		binary.BigEndian.PutUint16(b[10:], ipChecksum(b[:20]))
		return b
	}
	cases := []struct {
		name  string
		frame []byte
		want  error
	}{
		{"empty", nil, ErrTruncated},
		{"short ip", good[:19], ErrTruncated},
		{"ipv6", mod(func(b []byte) []byte { b[0] = 0x65; return b }), ErrVersion},
		{"options", mod(func(b []byte) []byte { b[0] = 0x46; return b }), ErrVersion},
		{"total beyond", good[:len(good)-1], ErrTruncated},
		{"ip checksum", mod(func(b []byte) []byte { b[12] ^= 1; return b }), ErrChecksum},
		{"tcp", mod(func(b []byte) []byte { b[9] = 6; return fixsum(b) }), ErrNotRoCE},
		{"fragment", mod(func(b []byte) []byte { b[7] = 1; return fixsum(b) }), ErrNotRoCE},
		{"port", mod(func(b []byte) []byte { b[23] ^= 1; return b }), ErrNotRoCE},
		{"udp length", mod(func(b []byte) []byte { b[25] ^= 4; return b }), ErrLength},
		{"opcode rc", mod(func(b []byte) []byte { b[28] = 0x0b; return b }), ErrOpcode},
		{"tver", mod(func(b []byte) []byte { b[29] |= 1; return b }), ErrVersion},
		{"pad beyond payload", func() []byte {
			b := bytes.Clone(loadVectors(t)[8].frame) // empty-only
			b[29] |= 0x10
			return b
		}(), ErrLength},
		{"payload not whole words", mod(func(b []byte) []byte {
			b = b[:len(b)-1]
			binary.BigEndian.PutUint16(b[2:], uint16(len(b)))
			binary.BigEndian.PutUint16(b[24:], uint16(len(b)-20))
			return fixsum(b)
		}), ErrLength},
		{"icrc", mod(func(b []byte) []byte { b[len(b)-1] ^= 1; return b }), ErrICRC},
		{"payload", mod(func(b []byte) []byte { b[60] ^= 1; return b }), ErrICRC},
		{"no room for reth", mod(func(b []byte) []byte {
			b = b[:28+BTHLen+8]
			binary.BigEndian.PutUint16(b[2:], uint16(len(b)))
			binary.BigEndian.PutUint16(b[24:], uint16(len(b)-20))
			return fixsum(b)
		}), ErrTruncated},
	}
	for _, c := range cases {
		if _, _, err := ParseFrame(c.frame); !errors.Is(err, c.want) {
			t.Errorf("%s: %v, want %v", c.name, err, c.want)
		}
	}
	if _, err := ParseTransport(make([]byte, 15)); !errors.Is(err, ErrTruncated) {
		t.Errorf("short transport: %v", err)
	}
	for _, p := range []Packet{{Opcode: 0x04}, {Opcode: WriteOnly, PSN: 1 << 24}, {Opcode: WriteOnly, DestQP: 1 << 24}, {Opcode: WriteOnly, Payload: make([]byte, 70000)}} {
		if _, err := AppendFrame(nil, &IPv4{}, &p); err == nil {
			t.Errorf("AppendFrame(%v, PSN %#x, QPN %#x, %d bytes): no error", p.Opcode, p.PSN, p.DestQP, len(p.Payload))
		}
	}
}

// TestRoundTrip writes every opcode with payloads of every pad and parses
// them back.
func TestRoundTrip(t *testing.T) {
	ip := IPv4{Src: [4]byte{127, 0, 0, 1}, Dst: [4]byte{127, 0, 0, 1}, TTL: 64, ID: 77, DontFragment: true, SrcPort: 50000}
	for op := WriteFirst; op <= WriteOnlyWithImm; op++ {
		for n := range 9 {
			p := Packet{Opcode: op, PKey: DefaultPKey, DestQP: 0x123, PSN: 0xfffffe, Payload: bytes.Repeat([]byte{byte(n)}, n)}
			if op.HasRETH() {
				p.VA, p.RKey, p.DMALen = 0x1122334455667788, 0x99aabbcc, uint32(n)
			}
			if op.HasImm() {
				p.Imm = 0xcafef00d
			}
			f, err := AppendFrame([]byte{0xee}, &ip, &p)
			if err != nil {
				t.Fatal(err)
			}
			ip2, p2, err := ParseFrame(f[1:])
			if err != nil || ip2 != ip || !samePacket(p, p2) {
				t.Fatalf("%v %d bytes: %v, %+v %+v", op, n, err, ip2, p2)
			}
		}
	}
	if WriteOnlyWithImm.String() != "UC_RDMA_WRITE_ONLY_WITH_IMMEDIATE" || Opcode(4).String() != "opcode(0x04)" {
		t.Errorf("names %v %v", WriteOnlyWithImm, Opcode(4))
	}
}

// TestUDP: AppendUDP writes what AppendFrame writes after the IP and UDP
// headers, and CheckICRC accepts it under the same header fields and
// refuses it under others.
func TestUDP(t *testing.T) {
	for _, v := range loadVectors(t) {
		u, err := AppendUDP(nil, &v.ip, &v.pkt)
		if err != nil {
			t.Fatal(err)
		}
		f, _ := AppendFrame(nil, &v.ip, &v.pkt)
		if !bytes.Equal(u, f[IPv4Len+UDPLen:]) {
			t.Fatalf("%s: AppendUDP differs from AppendFrame's UDP payload", v.name)
		}
		if err := CheckICRC(&v.ip, u); err != nil {
			t.Fatalf("%s: %v", v.name, err)
		}
		other := v.ip
		other.TTL++
		other.TOS ^= 0xff
		if err := CheckICRC(&other, u); err != nil {
			t.Fatalf("%s: masked fields changed: %v", v.name, err)
		}
		other.ID++
		if err := CheckICRC(&other, u); !errors.Is(err, ErrICRC) {
			t.Fatalf("%s: another IP ID: %v", v.name, err)
		}
	}
	if err := CheckICRC(&IPv4{}, make([]byte, 15)); !errors.Is(err, ErrTruncated) {
		t.Fatalf("short: %v", err)
	}
}

func TestWriteWithImmOpcode(t *testing.T) {
	for _, c := range []struct {
		n    int
		want []Opcode
	}{
		{1, []Opcode{WriteOnlyWithImm}},
		{2, []Opcode{WriteFirst, WriteLastWithImm}},
		{4, []Opcode{WriteFirst, WriteMiddle, WriteMiddle, WriteLastWithImm}},
	} {
		for k, want := range c.want {
			if got := WriteWithImmOpcode(k, c.n); got != want {
				t.Errorf("packet %d of %d: %v, want %v", k, c.n, got, want)
			}
		}
	}
}

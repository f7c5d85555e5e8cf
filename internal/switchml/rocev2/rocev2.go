// Package rocev2 reads and writes the RoCEv2 packets of unreliable-connected
// (UC) RDMA WRITEs: IPv4, UDP to port 4791, the base transport header (BTH),
// the RDMA extended transport header (RETH) on the first packet of a write,
// the immediate data (ImmDt) on the last packet of a write with immediate,
// the payload with its pad to a multiple of 4 bytes, and the invariant CRC
// (ICRC). It is what lets an aggregator that is not a verbs endpoint speak to
// workers' queue pairs, as a SwitchML switch does.
//
// # The invariant CRC
//
// The ICRC is the IEEE 802.3 CRC-32 (reflected polynomial 0xEDB88320, initial
// value all ones, final complement; hash/crc32's ChecksumIEEE) over, in order:
//
//   - 8 bytes of 0xFF standing for the InfiniBand local route header that
//     RoCEv2 does not carry;
//   - the IPv4 header (20 bytes, no options) with Type of Service, Time to
//     Live and Header Checksum replaced by all ones;
//   - the UDP header with its Checksum replaced by all ones;
//   - the BTH with its byte 4 (FECN, BECN and the 6 reserved bits, "resv8a"
//     in InfiniBand) replaced by all ones;
//   - the other transport headers, the payload and the pad, unchanged.
//
// The 4 result bytes follow the pad, least significant byte first (the order
// in which Linux's Soft-RoCE, rxe, stores the complemented CRC it computes
// with crc32_le on a little-endian host, and in which Scapy's RoCE layer
// packs it). The fields masked are those that routers may change on the way
// (the InfiniBand Architecture Specification's RoCEv2 annex, A17, defines
// the ICRC this way); the rules were taken from rxe_icrc.c in the Linux
// kernel (rxe_icrc_hdr: the 0xdebb20e3 seed is the CRC state after the 8
// bytes of ones; tos, ttl and check of the IPv4 header, check of the UDP
// header and the BTH's resv8a byte set to ones) and cross-checked against
// Scapy's scapy/contrib/roce.py (BTH.compute_icrc), an implementation
// written independently of rxe: the test vectors in testdata/scapy.txt were
// produced by Scapy (testdata/scapy_vectors.py) and this package must parse
// them, accept their ICRC and emit the same bytes. Scapy has no RETH or
// ImmDt layer: their layout is checked by Wireshark's InfiniBand dissector,
// which decodes the frames this package writes (TestWireshark; Wireshark 4.0
// does not check the ICRC).
//
// IPv6 (whose ICRC masks traffic class, flow label and hop limit) is not
// handled: frames are IPv4, as those of Soft-RoCE over an IPv4-mapped GID.
package rocev2

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
)

// Port is the UDP destination port of RoCEv2.
const Port = 4791

// Header sizes in bytes.
const (
	IPv4Len = 20
	UDPLen  = 8
	BTHLen  = 12
	RETHLen = 16
	ImmLen  = 4
	ICRCLen = 4
)

// DefaultPKey is the default partition key.
const DefaultPKey = 0xffff

// Errors of the package; every parse error wraps one of them.
var (
	// ErrTruncated means the bytes end before a header, the payload or
	// the ICRC does.
	ErrTruncated = errors.New("rocev2: truncated packet")
	// ErrOpcode means a BTH opcode other than a UC RDMA WRITE.
	ErrOpcode = errors.New("rocev2: unsupported opcode")
	// ErrVersion means an IP version other than 4, IPv4 options, or a BTH
	// transport version other than 0.
	ErrVersion = errors.New("rocev2: unsupported version")
	// ErrNotRoCE means an IPv4 packet that is not UDP to port 4791, or a
	// fragment.
	ErrNotRoCE = errors.New("rocev2: not a RoCEv2 packet")
	// ErrLength means lengths that disagree: the IPv4 total length or the
	// UDP length with the bytes, a pad count longer than the payload, a
	// field too large for the header that carries it.
	ErrLength = errors.New("rocev2: inconsistent length")
	// ErrChecksum means a wrong IPv4 header checksum.
	ErrChecksum = errors.New("rocev2: bad IPv4 header checksum")
	// ErrICRC means a wrong invariant CRC.
	ErrICRC = errors.New("rocev2: bad ICRC")
)

// Opcode is a BTH opcode.
type Opcode uint8

// The UC RDMA WRITE opcodes.
const (
	WriteFirst       Opcode = 0x26
	WriteMiddle      Opcode = 0x27
	WriteLast        Opcode = 0x28
	WriteLastWithImm Opcode = 0x29
	WriteOnly        Opcode = 0x2a
	WriteOnlyWithImm Opcode = 0x2b
	firstWrite              = WriteFirst
	lastWrite               = WriteOnlyWithImm
	maxPSN                  = 1<<24 - 1
	maxQPN                  = 1<<24 - 1
)

var opNames = [...]string{"WRITE_FIRST", "WRITE_MIDDLE", "WRITE_LAST", "WRITE_LAST_WITH_IMMEDIATE", "WRITE_ONLY", "WRITE_ONLY_WITH_IMMEDIATE"}

// String names the opcode as the InfiniBand specification does, prefixed
// with UC_.
func (o Opcode) String() string {
	if o.Valid() {
		return "UC_RDMA_" + opNames[o-firstWrite]
	}
	return fmt.Sprintf("opcode(%#02x)", uint8(o))
}

// Valid says whether the package handles o: a UC RDMA WRITE.
func (o Opcode) Valid() bool { return o >= firstWrite && o <= lastWrite }

// HasRETH says whether packets with o carry an RETH (FIRST and ONLY).
func (o Opcode) HasRETH() bool { return o == WriteFirst || o == WriteOnly || o == WriteOnlyWithImm }

// HasImm says whether packets with o carry immediate data.
func (o Opcode) HasImm() bool { return o == WriteLastWithImm || o == WriteOnlyWithImm }

// WriteWithImmOpcode is the opcode of packet k of a write with immediate
// of n packets: ONLY for one packet, else FIRST, MIDDLE..., LAST.
func WriteWithImmOpcode(k, n int) Opcode {
	switch {
	case n == 1:
		return WriteOnlyWithImm
	case k == 0:
		return WriteFirst
	case k == n-1:
		return WriteLastWithImm
	}
	return WriteMiddle
}

// Starts says whether o begins a message (FIRST or ONLY).
func (o Opcode) Starts() bool { return o.HasRETH() }

// Ends says whether o ends a message (LAST or ONLY, with or without
// immediate).
func (o Opcode) Ends() bool { return o != WriteFirst && o != WriteMiddle }

// Packet is the transport part of one RoCEv2 packet: BTH, RETH, ImmDt and
// payload. The pad and the ICRC are derived when it is written.
type Packet struct {
	Opcode    Opcode
	Solicited bool   // BTH SE
	MigReq    bool   // BTH M
	PKey      uint16 // partition key; DefaultPKey in most fabrics
	FECN      bool   // forward congestion notification (ECN marked)
	BECN      bool   // backward congestion notification
	DestQP    uint32 // destination queue pair number, 24 bits
	AckReq    bool   // BTH A
	PSN       uint32 // packet sequence number, 24 bits

	// RETH, on FIRST and ONLY packets.
	VA     uint64 // virtual address of the write
	RKey   uint32 // remote key
	DMALen uint32 // length of the whole message in bytes

	Imm uint32 // immediate data, on *_WITH_IMMEDIATE packets

	// Payload is the data carried, without the pad. A parsed packet's
	// payload aliases the parsed bytes.
	Payload []byte
}

func (p *Packet) pad() int { return -len(p.Payload) & 3 }

func (p *Packet) headersLen() int {
	n := BTHLen
	if p.Opcode.HasRETH() {
		n += RETHLen
	}
	if p.Opcode.HasImm() {
		n += ImmLen
	}
	return n
}

// Len is the length of the packet as a UDP payload: headers, payload, pad
// and ICRC.
func (p *Packet) Len() int { return p.headersLen() + len(p.Payload) + p.pad() + ICRCLen }

// check reports a packet that cannot be written.
func (p *Packet) check() error {
	switch {
	case !p.Opcode.Valid():
		return fmt.Errorf("%w: %v", ErrOpcode, p.Opcode)
	case p.DestQP > maxQPN:
		return fmt.Errorf("%w: QPN %#x beyond 24 bits", ErrLength, p.DestQP)
	case p.PSN > maxPSN:
		return fmt.Errorf("%w: PSN %#x beyond 24 bits", ErrLength, p.PSN)
	}
	return nil
}

// appendTransport appends BTH, RETH, ImmDt, payload, pad, and 4 zero bytes
// for the ICRC.
func (p *Packet) appendTransport(b []byte) []byte {
	b1 := uint8(p.pad()) << 4
	if p.Solicited {
		b1 |= 0x80
	}
	if p.MigReq {
		b1 |= 0x40
	}
	qp := p.DestQP
	if p.FECN {
		qp |= 1 << 31
	}
	if p.BECN {
		qp |= 1 << 30
	}
	psn := p.PSN
	if p.AckReq {
		psn |= 1 << 31
	}
	b = append(b, uint8(p.Opcode), b1)
	b = binary.BigEndian.AppendUint16(b, p.PKey)
	b = binary.BigEndian.AppendUint32(b, qp)
	b = binary.BigEndian.AppendUint32(b, psn)
	if p.Opcode.HasRETH() {
		b = binary.BigEndian.AppendUint64(b, p.VA)
		b = binary.BigEndian.AppendUint32(b, p.RKey)
		b = binary.BigEndian.AppendUint32(b, p.DMALen)
	}
	if p.Opcode.HasImm() {
		b = binary.BigEndian.AppendUint32(b, p.Imm)
	}
	b = append(b, p.Payload...)
	return append(b, make([]byte, p.pad()+ICRCLen)...)
}

// ParseTransport parses a UDP payload: BTH, RETH, ImmDt, payload, pad and
// ICRC. It cannot check the ICRC, which covers the IP and UDP headers too;
// ParseFrame does.
func ParseTransport(b []byte) (Packet, error) {
	var p Packet
	if len(b) < BTHLen+ICRCLen {
		return p, fmt.Errorf("%w: %d bytes, a BTH and an ICRC need %d", ErrTruncated, len(b), BTHLen+ICRCLen)
	}
	p.Opcode = Opcode(b[0])
	if !p.Opcode.Valid() {
		return p, fmt.Errorf("%w: %v", ErrOpcode, p.Opcode)
	}
	if v := b[1] & 0xf; v != 0 {
		return p, fmt.Errorf("%w: BTH transport version %d", ErrVersion, v)
	}
	p.Solicited = b[1]&0x80 != 0
	p.MigReq = b[1]&0x40 != 0
	pad := int(b[1] >> 4 & 3)
	p.PKey = binary.BigEndian.Uint16(b[2:])
	qp := binary.BigEndian.Uint32(b[4:])
	p.FECN, p.BECN, p.DestQP = qp&(1<<31) != 0, qp&(1<<30) != 0, qp&maxQPN
	psn := binary.BigEndian.Uint32(b[8:])
	p.AckReq, p.PSN = psn&(1<<31) != 0, psn&maxPSN
	n := p.headersLen()
	if len(b) < n+ICRCLen {
		return p, fmt.Errorf("%w: %d bytes, the headers of %v and an ICRC need %d", ErrTruncated, len(b), p.Opcode, n+ICRCLen)
	}
	if p.Opcode.HasRETH() {
		p.VA = binary.BigEndian.Uint64(b[BTHLen:])
		p.RKey = binary.BigEndian.Uint32(b[BTHLen+8:])
		p.DMALen = binary.BigEndian.Uint32(b[BTHLen+12:])
	}
	if p.Opcode.HasImm() {
		p.Imm = binary.BigEndian.Uint32(b[n-ImmLen:])
	}
	data := b[n : len(b)-ICRCLen]
	if pad > len(data) || len(data)&3 != 0 {
		return p, fmt.Errorf("%w: pad count %d with %d payload and pad bytes (a multiple of 4 is due)", ErrLength, pad, len(data))
	}
	p.Payload = data[: len(data)-pad : len(data)-pad]
	return p, nil
}

// IPv4 holds the fields of the IPv4 and UDP headers of a RoCEv2 packet that
// are not derived from the packet (lengths and checksums are).
type IPv4 struct {
	Src, Dst     [4]byte
	TOS          uint8 // DSCP and ECN
	TTL          uint8
	ID           uint16
	DontFragment bool
	SrcPort      uint16 // UDP source port (entropy for ECMP); the destination is Port
}

// FrameLen is the length of p as an IPv4 packet.
func FrameLen(p *Packet) int { return IPv4Len + UDPLen + p.Len() }

// AppendFrame appends p as an IPv4 packet: IPv4 header with its checksum,
// UDP header (checksum 0, as RoCEv2 senders write it), transport headers,
// payload, pad and ICRC.
func AppendFrame(b []byte, ip *IPv4, p *Packet) ([]byte, error) {
	if err := p.check(); err != nil {
		return b, err
	}
	total := FrameLen(p)
	if total > 0xffff {
		return b, fmt.Errorf("%w: %d-byte IPv4 packet", ErrLength, total)
	}
	start := len(b)
	b = appendHeaders(b, ip, total)
	b = p.appendTransport(b)
	frame := b[start:]
	binary.LittleEndian.PutUint32(frame[len(frame)-ICRCLen:], icrc(frame[:IPv4Len+UDPLen], frame[IPv4Len+UDPLen:len(frame)-ICRCLen]))
	return b, nil
}

// appendHeaders appends the IPv4 header (with its checksum) and the UDP
// header (checksum 0) of a total-byte packet.
func appendHeaders(b []byte, ip *IPv4, total int) []byte {
	start := len(b)
	b = append(b, 0x45, ip.TOS)
	b = binary.BigEndian.AppendUint16(b, uint16(total))
	b = binary.BigEndian.AppendUint16(b, ip.ID)
	var frag uint16
	if ip.DontFragment {
		frag = 0x4000
	}
	b = binary.BigEndian.AppendUint16(b, frag)
	b = append(b, ip.TTL, 17, 0, 0)
	b = append(b, ip.Src[:]...)
	b = append(b, ip.Dst[:]...)
	binary.BigEndian.PutUint16(b[start+10:], ipChecksum(b[start:start+IPv4Len]))
	b = binary.BigEndian.AppendUint16(b, ip.SrcPort)
	b = binary.BigEndian.AppendUint16(b, Port)
	b = binary.BigEndian.AppendUint16(b, uint16(total-IPv4Len))
	return append(b, 0, 0)
}

// AppendUDP appends p as a UDP payload (transport headers, payload, pad and
// ICRC), the ICRC computed for the IPv4 and UDP headers that ip describes.
// It is for senders that hand packets to a UDP socket, whose kernel writes
// those headers: they must match (Linux writes IP ID 0 on the
// don't-fragment packets of an unconnected socket, as Soft-RoCE does).
func AppendUDP(b []byte, ip *IPv4, p *Packet) ([]byte, error) {
	if err := p.check(); err != nil {
		return b, err
	}
	total := FrameLen(p)
	if total > 0xffff {
		return b, fmt.Errorf("%w: %d-byte IPv4 packet", ErrLength, total)
	}
	var h [IPv4Len + UDPLen]byte
	start := len(b)
	b = p.appendTransport(b)
	t := b[start:]
	binary.LittleEndian.PutUint32(t[len(t)-ICRCLen:], icrc(appendHeaders(h[:0], ip, total), t[:len(t)-ICRCLen]))
	return b, nil
}

// CheckICRC checks the ICRC of a UDP payload received from a UDP socket,
// given the IPv4 and UDP header fields it came with (the masked ones, TOS
// and TTL, do not matter; the IP ID and the don't-fragment flag do, and a
// UDP socket does not report them: Soft-RoCE sends ID 0 with DF set).
func CheckICRC(ip *IPv4, payload []byte) error {
	if len(payload) < BTHLen+ICRCLen {
		return fmt.Errorf("%w: %d bytes, a BTH and an ICRC need %d", ErrTruncated, len(payload), BTHLen+ICRCLen)
	}
	total := IPv4Len + UDPLen + len(payload)
	if total > 0xffff {
		return fmt.Errorf("%w: %d-byte IPv4 packet", ErrLength, total)
	}
	var h [IPv4Len + UDPLen]byte
	want := icrc(appendHeaders(h[:0], ip, total), payload[:len(payload)-ICRCLen])
	if got := binary.LittleEndian.Uint32(payload[len(payload)-ICRCLen:]); got != want {
		return fmt.Errorf("%w: %#08x, computed %#08x", ErrICRC, got, want)
	}
	return nil
}

// ParseFrame parses an IPv4 packet carrying RoCEv2 and checks its IPv4 header
// checksum and its ICRC. The UDP checksum is not checked (RoCEv2 senders
// usually leave it 0). The packet's payload aliases b.
func ParseFrame(b []byte) (IPv4, Packet, error) {
	var ip IPv4
	if len(b) < IPv4Len {
		return ip, Packet{}, fmt.Errorf("%w: %d bytes, an IPv4 header needs %d", ErrTruncated, len(b), IPv4Len)
	}
	if b[0]>>4 != 4 {
		return ip, Packet{}, fmt.Errorf("%w: IP version %d", ErrVersion, b[0]>>4)
	}
	if b[0]&0xf != 5 {
		return ip, Packet{}, fmt.Errorf("%w: IPv4 header of %d words (options)", ErrVersion, b[0]&0xf)
	}
	total := int(binary.BigEndian.Uint16(b[2:]))
	if total < IPv4Len || total > len(b) {
		return ip, Packet{}, fmt.Errorf("%w: IPv4 total length %d, %d bytes", ErrTruncated, total, len(b))
	}
	b = b[:total]
	if ipChecksum(b[:IPv4Len]) != 0 {
		return ip, Packet{}, ErrChecksum
	}
	frag := binary.BigEndian.Uint16(b[6:])
	if b[9] != 17 || frag&0x3fff != 0 {
		return ip, Packet{}, fmt.Errorf("%w: protocol %d, fragment field %#04x", ErrNotRoCE, b[9], frag)
	}
	ip.TOS, ip.ID, ip.DontFragment, ip.TTL = b[1], binary.BigEndian.Uint16(b[4:]), frag&0x4000 != 0, b[8]
	copy(ip.Src[:], b[12:16])
	copy(ip.Dst[:], b[16:20])
	if total < IPv4Len+UDPLen {
		return ip, Packet{}, fmt.Errorf("%w: %d bytes, a UDP header needs %d", ErrTruncated, total, IPv4Len+UDPLen)
	}
	udp := b[IPv4Len:]
	ip.SrcPort = binary.BigEndian.Uint16(udp)
	if dp := binary.BigEndian.Uint16(udp[2:]); dp != Port {
		return ip, Packet{}, fmt.Errorf("%w: UDP port %d", ErrNotRoCE, dp)
	}
	if ul := int(binary.BigEndian.Uint16(udp[4:])); ul != len(udp) {
		return ip, Packet{}, fmt.Errorf("%w: UDP length %d in a %d-byte IPv4 payload", ErrLength, ul, len(udp))
	}
	p, err := ParseTransport(udp[UDPLen:])
	if err != nil {
		return ip, p, err
	}
	want := icrc(b[:IPv4Len+UDPLen], b[IPv4Len+UDPLen:len(b)-ICRCLen])
	if got := binary.LittleEndian.Uint32(b[len(b)-ICRCLen:]); got != want {
		return ip, p, fmt.Errorf("%w: %#08x, computed %#08x", ErrICRC, got, want)
	}
	return ip, p, nil
}

// icrc computes the invariant CRC of a packet from its IPv4 and UDP headers
// (28 bytes, taken as they are on the wire) and its transport part up to the
// ICRC (headers, payload and pad; at least a BTH). The result is written
// least significant byte first.
func icrc(ipudp, transport []byte) uint32 {
	var ps [8 + IPv4Len + UDPLen + BTHLen]byte
	for i := range 8 {
		ps[i] = 0xff
	}
	copy(ps[8:], ipudp[:IPv4Len+UDPLen])
	ps[8+1] = 0xff                                // TOS
	ps[8+8] = 0xff                                // TTL
	ps[8+10], ps[8+11] = 0xff, 0xff               // header checksum
	ps[8+IPv4Len+6], ps[8+IPv4Len+7] = 0xff, 0xff // UDP checksum
	copy(ps[8+IPv4Len+UDPLen:], transport[:BTHLen])
	ps[8+IPv4Len+UDPLen+4] = 0xff // FECN, BECN, resv6
	// The masked headers byte by byte, as crc32.Update(0, IEEETable, ps)
	// would: handing ps to Update would move it to the heap, an
	// allocation per packet.
	crc := ^uint32(0)
	for _, b := range ps {
		crc = crc32.IEEETable[byte(crc)^b] ^ crc>>8
	}
	return crc32.Update(^crc, crc32.IEEETable, transport[BTHLen:])
}

// ipChecksum is the Internet checksum of an IPv4 header; over a header whose
// checksum field is filled in, it is 0 when the header is intact.
func ipChecksum(h []byte) uint16 {
	var s uint32
	for i := 0; i+1 < len(h); i += 2 {
		s += uint32(binary.BigEndian.Uint16(h[i:]))
	}
	for s > 0xffff {
		s = s&0xffff + s>>16
	}
	return ^uint16(s)
}

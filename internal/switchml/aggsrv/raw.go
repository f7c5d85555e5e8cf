package aggsrv

import (
	"encoding/binary"
	"fmt"
	"net"

	"golang.org/x/net/bpf"
	"golang.org/x/net/ipv4"

	"github.com/gdrlink/gdrlink/internal/switchml/rocev2"
)

// RawMode says where the server reads data packets (Config.RawIPv4).
type RawMode int

// The ways of reading data packets.
const (
	// RawOff reads from the UDP data socket: the ICRC is checked
	// assuming IP ID 0 and don't-fragment (see the package doc).
	RawOff RawMode = iota
	// RawAuto reads from a raw IPv4 socket where the process may open
	// one (CAP_NET_RAW), else as RawOff; the logger says which.
	RawAuto
	// RawOn reads from a raw IPv4 socket; New fails without one.
	RawOn
)

// String names the mode as ParseRawMode reads it.
func (m RawMode) String() string {
	switch m {
	case RawOff:
		return "off"
	case RawAuto:
		return "auto"
	case RawOn:
		return "on"
	}
	return fmt.Sprintf("RawMode(%d)", int(m))
}

// ParseRawMode reads "off", "auto" or "on".
func ParseRawMode(s string) (RawMode, error) {
	for _, m := range []RawMode{RawOff, RawAuto, RawOn} {
		if s == m.String() {
			return m, nil
		}
	}
	return RawOff, fmt.Errorf("aggsrv: raw IPv4 mode %q: want off, auto or on", s)
}

// listenRaw opens a raw IPv4 socket for UDP bound to local: the kernel
// hands it a copy of every UDP datagram to that address, IPv4 header
// included, after the firewall's input hooks and reassembly; a socket
// filter keeps those to port. The UDP socket bound to the same port
// must stay open: it owns the port, so that the kernel sends no ICMP port
// unreachable for the datagrams (dropAll keeps its queue empty).
func listenRaw(local net.IP, port uint16) (*net.IPConn, *ipv4.PacketConn, error) {
	c, err := net.ListenIP("ip4:udp", &net.IPAddr{IP: local})
	if err != nil {
		return nil, nil, fmt.Errorf("aggsrv: raw IPv4 socket on %v: %w", local, err)
	}
	filter, err := bpf.Assemble([]bpf.Instruction{
		bpf.LoadMemShift{Off: 0},          // X = IPv4 header length
		bpf.LoadIndirect{Off: 2, Size: 2}, // A = UDP destination port
		bpf.JumpIf{Cond: bpf.JumpEqual, Val: uint32(port), SkipFalse: 1},
		bpf.RetConstant{Val: 1 << 16}, // keep the whole packet
		bpf.RetConstant{Val: 0},       // not ours
	})
	pc := ipv4.NewPacketConn(c)
	if err == nil {
		err = pc.SetBPF(filter)
	}
	if err != nil {
		c.Close()
		return nil, nil, fmt.Errorf("aggsrv: filtering the raw IPv4 socket: %w", err)
	}
	// Bursts of every worker's packets arrive at once; the default
	// buffer holds a few hundred.
	c.SetReadBuffer(4 << 20)
	return c, pc, nil
}

// dropAll attaches a filter that drops every datagram to c: the UDP data
// socket keeps its port while the raw socket reads the packets (the
// kernel counts the datagrams dropped there as UDP input errors).
func dropAll(c *net.UDPConn) error {
	f, err := bpf.Assemble([]bpf.Instruction{bpf.RetConstant{Val: 0}})
	if err == nil {
		err = ipv4.NewPacketConn(c).SetBPF(f)
	}
	if err != nil {
		return fmt.Errorf("aggsrv: filtering the UDP data socket: %w", err)
	}
	return nil
}

// parseRaw reads an IPv4 packet as a raw socket returns it: the fields
// of its IPv4 and UDP headers that the ICRC covers, and the UDP payload.
// It refuses a packet to a UDP port other than port, one with IPv4
// options (the ICRC is defined for a 20-byte header), a fragment and a
// truncated one. The pseudo header keeps destination port 4791 (see
// Server.packet).
func parseRaw(b []byte, port uint16) (rocev2.IPv4, []byte, bool) {
	var ip rocev2.IPv4
	if len(b) < rocev2.IPv4Len+rocev2.UDPLen || b[0] != 0x45 || b[9] != 17 {
		return ip, nil, false
	}
	total := int(binary.BigEndian.Uint16(b[2:]))
	frag := binary.BigEndian.Uint16(b[6:])
	if total > len(b) || total < rocev2.IPv4Len+rocev2.UDPLen || frag&0x3fff != 0 {
		return ip, nil, false
	}
	udp := b[rocev2.IPv4Len:total]
	ulen := int(binary.BigEndian.Uint16(udp[4:]))
	if binary.BigEndian.Uint16(udp[2:]) != port || ulen != len(udp) {
		return ip, nil, false
	}
	ip.TOS, ip.ID, ip.DontFragment, ip.TTL = b[1], binary.BigEndian.Uint16(b[4:]), frag&0x4000 != 0, b[8]
	copy(ip.Src[:], b[12:16])
	copy(ip.Dst[:], b[16:20])
	ip.SrcPort = binary.BigEndian.Uint16(udp)
	return ip, udp[rocev2.UDPLen:], true
}

// ListenRoCE makes a server at host as a RoCEv2 peer of verbs devices:
// its control endpoint on a free TCP port of host, its data on UDP
// rocev2.Port, read from a raw IPv4 socket (RawOn), with the rest of cfg.
// It returns the control endpoint's address for the workers.
func ListenRoCE(host string, cfg Config) (*Server, net.Addr, error) {
	cl, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		return nil, nil, err
	}
	dc, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.ParseIP(host), Port: rocev2.Port})
	if err != nil {
		cl.Close()
		return nil, nil, err
	}
	cfg.Control, cfg.Data, cfg.RawIPv4 = cl, dc, RawOn
	s, err := New(cfg)
	if err != nil {
		cl.Close()
		dc.Close()
		return nil, nil, err
	}
	return s, cl.Addr(), nil
}

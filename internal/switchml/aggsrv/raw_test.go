package aggsrv

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gdrlink/gdrlink/internal/jobauth"
	"github.com/gdrlink/gdrlink/internal/switchml/agg"
	"github.com/gdrlink/gdrlink/internal/switchml/rocev2"
)

// rawFrame is a one-packet message of worker w as an IPv4 packet to
// server port port: its ICRC computed for IP ID icrcID (and destination
// port 4791, as on the wire of real NICs), and carrying IP ID wireID.
func rawFrame(t *testing.T, w *worker, port uint16, icrcID, wireID uint16, data []byte) []byte {
	t.Helper()
	p := rocev2.Packet{Opcode: rocev2.WriteOnlyWithImm, DestQP: w.as.QPNs[0], PSN: w.psn, PKey: rocev2.DefaultPKey,
		VA: 0x10000, RKey: uint32(2 * w.as.Base), DMALen: uint32(len(data)), Imm: 0x01020304, Payload: data}
	ip := rocev2.IPv4{Src: w.ip, Dst: w.as.Addr, ID: icrcID, DontFragment: true, TTL: 64,
		SrcPort: uint16(w.sock.LocalAddr().(*net.UDPAddr).Port)}
	f, err := rocev2.AppendFrame(nil, &ip, &p)
	if err != nil {
		t.Fatal(err)
	}
	binary.BigEndian.PutUint16(f[4:], wireID)
	binary.BigEndian.PutUint16(f[10:], 0)
	var sum uint32
	for i := 0; i < rocev2.IPv4Len; i += 2 {
		sum += uint32(binary.BigEndian.Uint16(f[i:]))
	}
	for sum > 0xffff {
		sum = sum>>16 + sum&0xffff
	}
	binary.BigEndian.PutUint16(f[10:], ^uint16(sum))
	binary.BigEndian.PutUint16(f[rocev2.IPv4Len+2:], port) // the UDP checksum is 0
	return f
}

// TestRawICRC sends hand-made RoCEv2 packets with a chosen IP ID through
// a raw socket (IP_HDRINCL) on loopback, as Soft-RoCE and NICs write IDs
// of their own: read from a raw IPv4 socket, the server accepts a packet
// only when its ICRC covers the ID it carries, and adds it once; read
// from the UDP socket, it can only assume ID 0. It needs CAP_NET_RAW.
func TestRawICRC(t *testing.T) {
	send, err := unix.Socket(unix.AF_INET, unix.SOCK_RAW, unix.IPPROTO_RAW)
	if errors.Is(err, unix.EPERM) || errors.Is(err, unix.EACCES) {
		t.Skip("needs CAP_NET_RAW (root) for raw sockets: the IP-ID-aware ICRC check is not tested")
	}
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(send)
	const id = 0xbeef
	for _, c := range []struct {
		mode RawMode
		// the (ICRC's ID, wire ID) of packets refused and of the
		// packet accepted
		bad  [][2]uint16
		good [2]uint16
	}{
		{RawOn, [][2]uint16{{0, id}, {id, 0}, {id + 1, id}}, [2]uint16{id, id}},
		{RawOff, [][2]uint16{{id, id}}, [2]uint16{0, id}},
	} {
		t.Run(c.mode.String(), func(t *testing.T) {
			key, _, _ := jobauth.Generate()
			cl, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			// The data socket at an address of its own: the raw
			// socket takes every UDP datagram to its address and
			// port, and other tests' processes on 127.0.0.1 may send
			// to a port this one reuses (make test saw two such
			// datagrams counted as BadPackets).
			dc, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 201)})
			if err != nil {
				t.Fatal(err)
			}
			ws, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 2)})
			if err != nil {
				t.Fatal(err)
			}
			defer ws.Close()
			s, err := New(Config{Key: key, Control: cl, Data: dc, PeerPort: uint16(ws.LocalAddr().(*net.UDPAddr).Port), Seed: 1, RawIPv4: c.mode})
			if err != nil {
				t.Fatal(err)
			}
			if s.RawIPv4() != (c.mode == RawOn) {
				t.Fatalf("RawIPv4() = %v in mode %v", s.RawIPv4(), c.mode)
			}
			go s.Serve()
			defer s.Close()
			w := &worker{t: t, ip: [4]byte{127, 0, 0, 2}, sock: ws, agg: dc.LocalAddr().(*net.UDPAddr).AddrPort()}
			if err := w.setup(key, cl.Addr().String(), 1, 1); err != nil {
				t.Fatal(err)
			}
			defer w.ctl.Close()
			port := uint16(w.agg.Port())
			data := bytes.Repeat([]byte{1, 2, 3, 4}, agg.SlotSmall/4)
			to := &unix.SockaddrInet4{Addr: [4]byte{127, 0, 0, 201}}
			wait := func(what string, ok func(Stats) bool) {
				t.Helper()
				for deadline := time.Now().Add(10 * time.Second); !ok(s.Stats()); time.Sleep(5 * time.Millisecond) {
					if time.Now().After(deadline) {
						t.Fatalf("%s: counters %+v", what, s.Stats())
					}
				}
			}
			for i, ids := range c.bad {
				if err := unix.Sendto(send, rawFrame(t, w, port, ids[0], ids[1], data), 0, to); err != nil {
					t.Fatal(err)
				}
				wait("a packet with the ICRC of ID "+hex16(ids[0])+" and ID "+hex16(ids[1]), func(st Stats) bool { return st.BadICRC == uint64(i+1) })
			}
			// A packet whose payload changed after its ICRC was made.
			f := rawFrame(t, w, port, c.good[0], c.good[1], data)
			f[rocev2.IPv4Len+rocev2.UDPLen+rocev2.BTHLen+rocev2.RETHLen+rocev2.ImmLen] ^= 0x10
			if err := unix.Sendto(send, f, 0, to); err != nil {
				t.Fatal(err)
			}
			wait("a corrupted payload", func(st Stats) bool { return st.BadICRC == uint64(len(c.bad)+1) })
			if err := unix.Sendto(send, rawFrame(t, w, port, c.good[0], c.good[1], data), 0, to); err != nil {
				t.Fatal(err)
			}
			buf := make([]byte, 2048)
			ws.SetReadDeadline(time.Now().Add(10 * time.Second))
			n, _, err := ws.ReadFromUDPAddrPort(buf)
			if err != nil {
				t.Fatalf("no reply to the packet with the right ICRC: %v (counters %+v)", err, s.Stats())
			}
			p, err := rocev2.ParseTransport(buf[:n])
			if err != nil || !bytes.Equal(p.Payload, data) || p.Imm != 0x01020304 {
				t.Fatalf("reply %+v: %v", p, err)
			}
			st := s.Stats()
			if st.Applied != 1 || st.BadICRC != uint64(len(c.bad)+1) || st.BadPackets != 0 {
				t.Fatalf("counters %+v: want 1 packet added and %d refused", st, len(c.bad)+1)
			}
			t.Logf("%v: %d packets refused for their ICRC, the one with ICRC over ID %s and ID %s on the wire added", c.mode, st.BadICRC, hex16(c.good[0]), hex16(c.good[1]))
		})
	}
}

func hex16(v uint16) string { return fmt.Sprintf("%#04x", v) }

// TestParseRaw: what the raw reader refuses.
func TestParseRaw(t *testing.T) {
	p := rocev2.Packet{Opcode: rocev2.WriteOnly, DestQP: 1, PKey: rocev2.DefaultPKey, DMALen: 4, Payload: []byte{1, 2, 3, 4}}
	f, err := rocev2.AppendFrame(nil, &rocev2.IPv4{Src: [4]byte{10, 0, 0, 1}, Dst: [4]byte{10, 0, 0, 2}, ID: 77, DontFragment: true, SrcPort: 999}, &p)
	if err != nil {
		t.Fatal(err)
	}
	ip, payload, ok := parseRaw(f, rocev2.Port)
	if !ok || ip.ID != 77 || !ip.DontFragment || ip.SrcPort != 999 || ip.Src != [4]byte{10, 0, 0, 1} || len(payload) != p.Len() {
		t.Fatalf("parseRaw: %+v, %d bytes, %v", ip, len(payload), ok)
	}
	if err := rocev2.CheckICRC(&ip, payload); err != nil {
		t.Fatal(err)
	}
	for name, change := range map[string]func(b []byte) []byte{
		"other port":  func(b []byte) []byte { b[22]++; return b },
		"options":     func(b []byte) []byte { b[0] = 0x46; return b },
		"fragment":    func(b []byte) []byte { b[6] |= 0x20; return b },
		"truncated":   func(b []byte) []byte { return b[:len(b)-1] },
		"udp length":  func(b []byte) []byte { b[25]++; return b },
		"not udp":     func(b []byte) []byte { b[9] = 6; return b },
		"short":       func(b []byte) []byte { return b[:27] },
		"ipv4 length": func(b []byte) []byte { b[3] = 10; return b },
	} {
		if _, _, ok := parseRaw(change(append([]byte(nil), f...)), rocev2.Port); ok {
			t.Errorf("%s: accepted", name)
		}
	}
}

package aggsrv

import (
	"encoding/binary"
	"errors"
	"net"
	"os"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gdrlink/gdrlink/internal/jobauth"
	"github.com/gdrlink/gdrlink/internal/switchml/agg"
	"github.com/gdrlink/gdrlink/internal/switchml/rocev2"
)

// TestICRCOnTheWire captures, with a raw socket, the IPv4 packets that the
// kernel actually sent for the aggregator's replies and for a worker's UDP
// socket set up the same way (don't-fragment), and checks their ICRC over
// the headers as they were on the wire: this is what shows that Linux writes
// IP ID 0 there, the ID the ICRC is computed for. It needs root (a raw
// socket).
func TestICRCOnTheWire(t *testing.T) {
	raw, err := unix.Socket(unix.AF_INET, unix.SOCK_RAW, unix.IPPROTO_UDP)
	if errors.Is(err, unix.EPERM) || errors.Is(err, unix.EACCES) {
		t.Skip("needs root for a raw socket (CAP_NET_RAW): the on-the-wire ICRC check is skipped")
	}
	if err != nil {
		t.Fatal(err)
	}
	rf := os.NewFile(uintptr(raw), "raw")
	defer rf.Close()
	unix.SetsockoptTimeval(raw, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &unix.Timeval{Sec: 0, Usec: 200000})

	key, _, _ := jobauth.Generate()
	cl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dc, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	ws, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 2)})
	if err != nil {
		t.Fatal(err)
	}
	defer ws.Close()
	wport := ws.LocalAddr().(*net.UDPAddr).Port
	s, err := New(Config{Key: key, Control: cl, Data: dc, PeerPort: uint16(wport), Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	go s.Serve()
	defer s.Close()
	// The worker's socket sets don't-fragment as the server's does.
	rc, _ := ws.SyscallConn()
	rc.Control(func(fd uintptr) {
		err = unix.SetsockoptInt(int(fd), unix.IPPROTO_IP, unix.IP_MTU_DISCOVER, unix.IP_PMTUDISC_DO)
	})
	if err != nil {
		t.Fatal(err)
	}
	w := &worker{t: t, rank: 0, ip: [4]byte{127, 0, 0, 2}, sock: ws, agg: dc.LocalAddr().(*net.UDPAddr).AddrPort()}
	if err := w.setup(key, cl.Addr().String(), 1, 2); err != nil {
		t.Fatal(err)
	}
	defer w.ctl.Close()
	aport := uint16(w.agg.Port())
	d := make([]byte, 2*agg.SlotSmall)
	for i := range d {
		d[i] = byte(i)
	}
	// Send one 2-slot message by hand (no loss) and read the reply.
	for k := range 2 {
		p := rocev2.Packet{DestQP: w.as.QPNs[0], PSN: w.psn + uint32(k), PKey: rocev2.DefaultPKey, Payload: d[k*agg.SlotSmall : (k+1)*agg.SlotSmall]}
		if k == 0 {
			p.Opcode, p.VA, p.RKey, p.DMALen = rocev2.WriteFirst, 0x10000, uint32(2*w.as.Base), 2*agg.SlotSmall
		} else {
			p.Opcode, p.Imm = rocev2.WriteLastWithImm, 0x11223344
		}
		ip := rocev2.IPv4{Src: w.ip, Dst: w.as.Addr, DontFragment: true, SrcPort: uint16(wport)}
		b, _ := rocev2.AppendUDP(nil, &ip, &p)
		if _, err := ws.WriteToUDPAddrPort(b, w.agg); err != nil {
			t.Fatal(err)
		}
	}
	// Every UDP packet between the two ports, as the kernel sent it.
	seen := map[string]int{}
	buf := make([]byte, 1<<16)
	deadline := time.Now().Add(10 * time.Second)
	for seen["reply"] < 2 || seen["request"] < 2 {
		if time.Now().After(deadline) {
			t.Fatalf("captured %v", seen)
		}
		n, err := rf.Read(buf)
		if err != nil {
			continue
		}
		f := buf[:n]
		if n < 28 || f[9] != 17 {
			continue
		}
		sp, dp := binary.BigEndian.Uint16(f[20:]), binary.BigEndian.Uint16(f[22:])
		var kind string
		switch {
		case sp == aport && dp == uint16(wport):
			kind = "reply"
		case sp == uint16(wport) && dp == aport:
			kind = "request"
		default:
			continue
		}
		// ParseFrame wants destination port 4791, as on the wire of
		// real NICs; the ICRC was computed for it.
		g := append([]byte(nil), f...)
		binary.BigEndian.PutUint16(g[22:], rocev2.Port)
		if _, _, err := rocev2.ParseFrame(g); err != nil {
			t.Fatalf("%s as sent (IP ID %#x, flags %#x): %v", kind, binary.BigEndian.Uint16(f[4:]), f[6], err)
		}
		seen[kind]++
	}
	t.Logf("ICRC right on the wire: %v", seen)
}

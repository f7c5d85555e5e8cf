package worker

import (
	"net/netip"
	"testing"

	"github.com/gdrlink/gdrlink/internal/switchml/rocev2"
)

// FuzzHandle feeds arbitrary datagrams to the reply path: no panic, and
// nothing but a whole, well-formed reply for the awaited address is taken.
func FuzzHandle(f *testing.F) {
	local := [4]byte{127, 0, 0, 2}
	from := netip.MustParseAddrPort("127.0.0.1:4791")
	ip := rocev2.IPv4{Src: from.Addr().As4(), Dst: local, DontFragment: true, SrcPort: from.Port()}
	for _, op := range []rocev2.Opcode{rocev2.WriteOnlyWithImm, rocev2.WriteFirst, rocev2.WriteLastWithImm, rocev2.WriteMiddle} {
		p := rocev2.Packet{Opcode: op, DestQP: 0x1000, PKey: rocev2.DefaultPKey, Payload: make([]byte, 256)}
		if op.HasRETH() {
			p.VA, p.DMALen = vaBase+1<<20, 256
		}
		b, err := rocev2.AppendUDP(nil, &ip, &p)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		q := &qp{qpn: 0x1000, result: make(chan reply, 1), want: vaBase + 1<<20}
		w := &Worker{cfg: Config{Local: local, SlotBytes: 256, MsgSlots: 1}, msgB: 256}
		u := &udpLink{w: w, byQPN: map[uint32]*qp{q.qpn: q}}
		u.handle(b, from)
		select {
		case r := <-q.result:
			if len(r.buf) != 256 || r.va != q.want && q.want != 0 {
				t.Fatalf("took a reply of %d bytes at %#x", len(r.buf), r.va)
			}
		default:
		}
	})
}

package rocev2_test

import (
	"fmt"

	"github.com/gdrlink/gdrlink/internal/switchml/rocev2"
)

// A one-packet RDMA WRITE WITH IMMEDIATE, written as an IPv4 packet and read
// back (the ICRC checked on the way).
func Example() {
	ip := rocev2.IPv4{Src: [4]byte{10, 0, 0, 1}, Dst: [4]byte{10, 0, 0, 2}, TTL: 64, DontFragment: true, SrcPort: 49152}
	p := rocev2.Packet{
		Opcode: rocev2.WriteOnlyWithImm, PKey: rocev2.DefaultPKey, DestQP: 0x11, PSN: 7,
		VA: 0x1000, RKey: 0x2a, DMALen: 4, Imm: 0x7f000000, Payload: []byte{1, 2, 3, 4},
	}
	frame, err := rocev2.AppendFrame(nil, &ip, &p)
	if err != nil {
		panic(err)
	}
	_, q, err := rocev2.ParseFrame(frame)
	fmt.Println(len(frame), q.Opcode, q.RKey, q.Imm == p.Imm, err)
	// Output: 68 UC_RDMA_WRITE_ONLY_WITH_IMMEDIATE 42 true <nil>
}

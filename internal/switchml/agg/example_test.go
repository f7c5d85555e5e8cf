package agg_test

import (
	"encoding/binary"
	"fmt"

	"github.com/gdrlink/gdrlink/internal/switchml/agg"
	"github.com/gdrlink/gdrlink/internal/switchml/rocev2"
)

// Two workers each write one 256-byte slot; the second write completes the
// slot and the aggregator answers both with the sum.
func Example() {
	a := agg.New(1)
	_, eps, _ := a.AddJob(agg.Job{Base: 0, Slots: 4, SlotBytes: agg.SlotSmall, Workers: []agg.Worker{
		{QPNs: []uint32{0x100}, PSNs: []uint32{0}, RKey: 0xa},
		{QPNs: []uint32{0x200}, PSNs: []uint32{0}, RKey: 0xb},
	}})
	var out []agg.Reply
	for w, v := range []uint32{3, 4} {
		payload := make([]byte, agg.SlotSmall)
		binary.LittleEndian.PutUint32(payload, v)
		p := rocev2.Packet{Opcode: rocev2.WriteOnlyWithImm, DestQP: eps[w][0].QPN, PSN: 0,
			VA: 0x5000, RKey: 2*1 + 0, DMALen: agg.SlotSmall, Imm: uint32(w+1) << 24, Payload: payload}
		out, _ = a.Handle(&p, out)
	}
	for _, r := range out {
		fmt.Printf("worker %d: QPN %#x rkey %#x sum %d immediate %#x\n", r.Worker, r.Packet.DestQP,
			r.Packet.RKey, binary.LittleEndian.Uint32(r.Packet.Payload), r.Packet.Imm)
	}
	// Output:
	// worker 0: QPN 0x100 rkey 0xa sum 7 immediate 0x2000000
	// worker 1: QPN 0x200 rkey 0xb sum 7 immediate 0x2000000
}

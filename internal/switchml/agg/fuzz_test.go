package agg

import (
	"testing"

	"github.com/gdrlink/gdrlink/internal/switchml/rocev2"
)

// FuzzHandle drives a 3-worker job with packets made from the input, 8
// bytes each: worker, opcode, PSN step, pool index, slots, payload size,
// immediate. Whatever comes, the aggregator must not panic, and its sets
// must stay consistent.
func FuzzHandle(f *testing.F) {
	f.Add([]byte{0, 4, 0, 8, 1, 0, 1, 2, 1, 4, 0, 8, 1, 0, 3, 4, 2, 4, 0, 8, 1, 0, 5, 6})
	f.Add([]byte{0, 0, 0, 8, 2, 0, 0, 0, 0, 3, 1, 0, 0, 0, 9, 9, 0, 1, 0, 0, 0, 0, 0, 0, 0, 2, 5, 0, 0, 0, 1, 1})
	f.Fuzz(func(t *testing.T, data []byte) {
		a := New(3)
		spec := Job{Base: 4, Slots: 4, SlotBytes: SlotSmall}
		for w := range 3 {
			spec.Workers = append(spec.Workers, Worker{QPNs: []uint32{uint32(w)}, PSNs: []uint32{0}})
		}
		_, eps, err := a.AddJob(spec)
		if err != nil {
			t.Fatal(err)
		}
		psn := make([]uint32, 3)
		payload := make([]byte, 2*SlotSmall)
		var out []Reply
		for len(data) >= 8 {
			op := data[:8]
			data = data[8:]
			w := int(op[0]) % 3
			p := rocev2.Packet{
				Opcode: rocev2.WriteFirst + rocev2.Opcode(op[1]%6),
				DestQP: eps[w][0].QPN,
				PSN:    (psn[w] + uint32(op[2]%4) - 1) & psnMask,
				RKey:   uint32(op[3]),
				DMALen: uint32(op[4]) * SlotSmall / 2,
				Imm:    uint32(op[6])<<8 | uint32(op[7]),
			}
			psn[w] = (p.PSN + 1) & psnMask
			if op[5]%8 != 0 {
				p.Payload = payload[:int(op[5])*2]
			} else {
				p.Payload = payload[:SlotSmall]
			}
			payload[op[6]] ^= op[7]
			out, _ = a.Handle(&p, out[:0])
			for _, rp := range out {
				if len(rp.Packet.Payload) != SlotSmall {
					t.Fatalf("reply packet of %d bytes", len(rp.Packet.Payload))
				}
			}
			checkInvariants(t, a)
		}
	})
}

package ibverbs

import (
	"testing"

	"github.com/gdrlink/gdrlink/internal/ibv"
	"github.com/gdrlink/gdrlink/verbsio"
)

// TestSendRetirement checks how completions retire outstanding sends:
// a successful completion retires the unsignaled requests before it, even
// when every request has the same ID; failures retire one request each.
func TestSendRetirement(t *testing.T) {
	q := &qp{state: verbsio.QPReady, sends: newRing(8), recvs: newRing(8)}
	for i := 0; i < 4; i++ {
		q.sends.push(posted{wrid: 0, op: verbsio.OpWrite, signaled: i == 3})
	}
	if op := q.complete(&ibv.WC{WRID: 0, Opcode: ibv.WCRDMAWrite}, false, verbsio.StatusSuccess); op != verbsio.OpWrite {
		t.Errorf("op %s", op)
	}
	if q.sends.size != 0 {
		t.Fatalf("%d sends left after the signaled one completed", q.sends.size)
	}
	q.sends.push(posted{wrid: 1, op: verbsio.OpWrite})
	q.sends.push(posted{wrid: 2, op: verbsio.OpWriteImm, signaled: true})
	q.sends.push(posted{wrid: 3, op: verbsio.OpSend})
	// The first fails (its opcode in the completion is undefined).
	if op := q.complete(&ibv.WC{WRID: 1, Opcode: 99}, false, verbsio.StatusRemoteAccess); op != verbsio.OpWrite || q.sends.size != 2 {
		t.Fatalf("failed write: op %s, %d left", op, q.sends.size)
	}
	if q.state != verbsio.QPError {
		t.Errorf("state %s after a failed completion", q.state)
	}
	if op := q.complete(&ibv.WC{WRID: 2, Opcode: 99}, false, verbsio.StatusFlushed); op != verbsio.OpWriteImm || q.sends.size != 1 {
		t.Fatalf("flushed write-imm: op %s, %d left", op, q.sends.size)
	}
	if op := q.complete(&ibv.WC{WRID: 3, Opcode: 99}, false, verbsio.StatusFlushed); op != verbsio.OpSend || q.sends.size != 0 {
		t.Fatalf("flushed send: op %s, %d left", op, q.sends.size)
	}
	// Receives retire in order; the opcode says whether an immediate came.
	q.recvs.push(posted{wrid: 7, op: verbsio.OpRecv})
	q.recvs.push(posted{wrid: 8, op: verbsio.OpRecv})
	if op := q.complete(&ibv.WC{WRID: 7, Opcode: ibv.WCRecvRDMAImm}, true, verbsio.StatusSuccess); op != verbsio.OpRecvImm || q.recvs.size != 1 {
		t.Fatalf("receive with immediate: op %s, %d left", op, q.recvs.size)
	}
	if op := q.complete(&ibv.WC{WRID: 8, Opcode: ibv.WCRecv}, true, verbsio.StatusSuccess); op != verbsio.OpRecv || q.recvs.size != 0 {
		t.Fatalf("receive: op %s, %d left", op, q.recvs.size)
	}
	// A completion nobody posted (the device's word against ours) leaves
	// the ring empty rather than corrupt.
	if op := q.complete(&ibv.WC{WRID: 9, Opcode: ibv.WCSend}, false, verbsio.StatusSuccess); op != verbsio.OpSend || q.sends.size != 0 {
		t.Fatalf("unknown completion: op %s, %d left", op, q.sends.size)
	}
}

func TestRingWraps(t *testing.T) {
	r := newRing(3)
	for i := 0; i < 10; i++ {
		r.push(posted{wrid: uint64(i)})
		if p, ok := r.front(); !ok || p.wrid != uint64(i) {
			t.Fatalf("front %+v %v", p, ok)
		}
		r.pop()
	}
	if r.free() != 3 {
		t.Fatalf("free %d", r.free())
	}
	r.pop0()
	if r.size != 0 {
		t.Fatal("pop0 of an empty ring")
	}
}

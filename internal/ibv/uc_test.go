package ibv

import (
	"bytes"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// TestUCWriteImm connects two unreliable-connected queue pairs, checks that
// they reach RTS with UC's attribute masks, and sends one RDMA WRITE WITH
// IMMEDIATE of 3000 bytes (three packets at MTU 1024): the bytes land in
// the target region and the receiver's completion carries the immediate
// and the length. A second write at a different offset checks that a
// receive work request is consumed per immediate.
func TestUCWriteImm(t *testing.T) {
	c := testDevice(t)
	pd, err := c.AllocPD()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pd.Close() })
	const size = 1 << 14
	mem, err := unix.Mmap(-1, 0, 2*size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Munmap(mem) })
	base := uintptr(unsafe.Pointer(&mem[0]))
	mr, err := pd.RegMR(base, 2*size, AccessLocalWrite|AccessRemoteWrite)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { mr.Close() })
	tgt, src := mem[:size], mem[size:]
	for i := range src {
		src[i] = byte(i*7 + 1)
	}
	l := newLoop(t, c, pd, true)
	for i, q := range l.qp {
		if !q.UC() {
			t.Fatalf("queue pair %d is not UC", i)
		}
		if st, err := q.State(); err != nil || st != QPSRTS {
			t.Fatalf("queue pair %d: state %d, %v; want RTS", i, st, err)
		}
	}
	for k, w := range []struct {
		off, n int
		imm    uint32
	}{{0, 3000, 0x81828384}, {4096, 1024, 0x01020304}} {
		if _, err := l.qp[1].PostRecv([]RecvWR{{WRID: uint64(100 + k)}}, nil); err != nil {
			t.Fatal(err)
		}
		wr := SendWR{WRID: uint64(k + 1), Opcode: WRWriteImm, Flags: SendSignaled, NumSGE: 1,
			RemoteAddr: uint64(base) + uint64(w.off), RKey: mr.RKey(), Imm: w.imm}
		if _, err := l.qp[0].PostSend([]SendWR{wr}, []SGE{{Addr: uint64(base + size), Length: uint32(w.n), LKey: mr.LKey()}}); err != nil {
			t.Fatal(err)
		}
		var got []WC
		wc := make([]WC, 2)
		for deadline := time.Now().Add(30 * time.Second); len(got) < 2 && time.Now().Before(deadline); {
			n, err := l.cq.Poll(wc)
			if err != nil {
				t.Fatal(err)
			}
			got = append(got, wc[:n]...)
			if n == 0 {
				time.Sleep(20 * time.Microsecond)
			}
		}
		if len(got) != 2 {
			t.Fatalf("write %d: %d completions, want 2 (send and receive): %+v", k, len(got), got)
		}
		for _, c := range got {
			if c.Status != WCSuccess {
				t.Fatalf("write %d: completion %+v", k, c)
			}
			if c.WRID != uint64(100+k) {
				continue
			}
			if c.Opcode != WCRecvRDMAImm || c.Flags&WCWithImm == 0 || c.Imm != w.imm || int(c.ByteLen) != w.n || c.QPNum != l.qp[1].QPN() {
				t.Errorf("write %d: receive completion %+v, want immediate %#x, %d bytes on qp %d", k, c, w.imm, w.n, l.qp[1].QPN())
			}
		}
		if !bytes.Equal(tgt[w.off:w.off+w.n], src[:w.n]) {
			t.Errorf("write %d: the target does not hold the source bytes", k)
		}
		if w.off+w.n < size && tgt[w.off+w.n] != 0 {
			t.Errorf("write %d: a byte past the write changed", k)
		}
	}
}

package onnode

import (
	"errors"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gdrlink/gdrlink/verbsio"
)

// TestHostileRing: garbage in a queue pair's incoming ring moves it to the
// error state with ErrBadFrame; nothing panics and nothing is delivered.
func TestHostileRing(t *testing.T) {
	for name, rec := range map[string][]byte{
		"bad size":     {0x20, 0, 0, 0, recSend, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 0, 0},
		"unknown kind": {0x10, 0, 0, 0, 99, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},
		"size past":    {0xf0, 0xff, 0xff, 0, recPad, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},
	} {
		t.Run(name, func(t *testing.T) {
			a, b := loopback(t, Options{}, 0)
			if err := b.qp.PostRecv([]verbsio.RecvWR{{WRID: 3}}); err != nil {
				t.Fatal(err)
			}
			// a writes straight into b's ring, as a hostile peer could.
			q := a.qp.(*qp)
			q.sendMu.Lock()
			copy(q.out.data[q.tail&(ringData-1):], rec)
			q.tail += 16
			store64(q.out.mem, offTail, q.tail)
			q.sendMu.Unlock()
			c := waitOne(t, b.rcq, 5*time.Second)
			if c.WRID != 3 || c.Status != verbsio.StatusRemoteOperation {
				t.Fatalf("receive after a bad record: %+v", c)
			}
			if err := lastError(b.qp); !errors.Is(err, verbsio.ErrBadFrame) {
				t.Fatalf("lastError %v, want ErrBadFrame", err)
			}
		})
	}
}

// TestTruncatedTarget: a peer that shrinks the file under its region after
// the sender mapped it gets a remote access error, not a crashed sender.
func TestTruncatedTarget(t *testing.T) {
	a, b := loopback(t, Options{Mechanism: MechSHM}, 0)
	src, err := a.register("anon", 1<<16, verbsio.AccessLocalWrite, 7)
	if err != nil {
		t.Fatal(err)
	}
	dst, err := b.register("memfd", 1<<16, rw, 0)
	if err != nil {
		t.Fatal(err)
	}
	write := func() verbsio.Completion {
		t.Helper()
		err := a.qp.PostSend([]verbsio.SendWR{{WRID: 1, Op: verbsio.OpWrite, Signaled: true, RemoteAddr: uint64(dst.Addr()), RKey: dst.RKey(),
			SG: []verbsio.SGE{{Addr: src.Addr(), Length: 1 << 16, LKey: src.LKey()}}}})
		if err != nil {
			t.Fatal(err)
		}
		return waitOne(t, a.scq, 5*time.Second)
	}
	if c := write(); c.Status != verbsio.StatusSuccess {
		t.Fatalf("first write %+v", c)
	}
	if len(a.qp.(*qp).fileMaps) != 1 {
		t.Fatal("target not mapped by the sender")
	}
	// Unmap b's view first (b would fault too), then shrink the file.
	m := b.mems[dst.RKey()]
	if err := unix.Ftruncate(m.fd, 0); err != nil {
		t.Fatal(err)
	}
	if c := write(); c.Status != verbsio.StatusRemoteAccess {
		t.Fatalf("write into a truncated file: %+v", c)
	}
	if err := unix.Ftruncate(m.fd, 1<<16); err != nil { // b's view is whole again
		t.Fatal(err)
	}
}

// TestBadLocalKeys: local keys that do not cover the SGE, or regions without
// local write for a read's destination, complete with StatusLocalProtection
// and nothing moves.
func TestBadLocalKeys(t *testing.T) {
	a, b := loopback(t, Options{}, 0)
	src, err := a.register("memfd", 4096, verbsio.AccessLocalWrite, 7)
	if err != nil {
		t.Fatal(err)
	}
	ro, err := a.register("memfd", 4096, verbsio.AccessRemoteRead, 7)
	if err != nil {
		t.Fatal(err)
	}
	dst, err := b.register("memfd", 4096, rw, 0)
	if err != nil {
		t.Fatal(err)
	}
	for name, wr := range map[string]verbsio.SendWR{
		"wrong lkey":    {Op: verbsio.OpWrite, SG: []verbsio.SGE{{Addr: src.Addr(), Length: 64, LKey: src.LKey() + 1}}},
		"past the end":  {Op: verbsio.OpWrite, SG: []verbsio.SGE{{Addr: src.Addr() + 4000, Length: 200, LKey: src.LKey()}}},
		"read into r/o": {Op: verbsio.OpRead, SG: []verbsio.SGE{{Addr: ro.Addr(), Length: 64, LKey: ro.LKey()}}},
	} {
		wr.RemoteAddr, wr.RKey, wr.WRID = uint64(dst.Addr()), dst.RKey(), 5
		if err := a.qp.PostSend([]verbsio.SendWR{wr}); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if c := waitOne(t, a.scq, 5*time.Second); c.Status != verbsio.StatusLocalProtection {
			t.Errorf("%s: %+v", name, c)
		}
		for i, v := range b.mems[dst.RKey()].b {
			if v != 0 {
				t.Fatalf("%s: target byte %d changed", name, i)
			}
		}
		if err := a.newQP(); err != nil {
			t.Fatal(err)
		}
		if err := b.newQP(); err != nil {
			t.Fatal(err)
		}
		connectLocal(t, a, b)
	}
}

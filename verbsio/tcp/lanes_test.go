package tcp_test

import (
	"bytes"
	"context"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/gdrlink/gdrlink/verbsio"
	"github.com/gdrlink/gdrlink/verbsio/tcp"
	"github.com/gdrlink/gdrlink/verbsio/verbstest"
)

// TestConformanceFourLanes runs the suite with four connections per queue
// pair on both sides, so writes of a megabyte and more are striped.
func TestConformanceFourLanes(t *testing.T) {
	t.Setenv("GDRLINK_TCP_LANES", "4")
	key, env := jobKey(t)
	verbstest.Run(t, verbstest.Harness{Provider: "tcp", Config: verbsio.Config{JobKey: key}, PeerEnv: []string{env}})
}

// TestStripedWriteImm checks that a striped write with immediate completes
// at the receiver only once every stripe landed, with the whole length, and
// that a send posted after it finds the write's bytes in place.
func TestStripedWriteImm(t *testing.T) {
	const n = 1<<20 + 3
	a, z := openLaneSide(t, 3), openLaneSide(t, 3) // striped: 3 lanes, stripes from 64 KiB
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := z.qp.PostRecv([]verbsio.RecvWR{{WRID: 1}, {WRID: 2, SG: []verbsio.SGE{{Addr: z.mr.Addr() + n, Length: 64, LKey: z.mr.LKey()}}}}); err != nil {
		t.Fatal(err)
	}
	errc := make(chan error, 1)
	go func() { errc <- z.qp.Connect(ctx, a.qp.Endpoint()) }()
	if err := a.qp.Connect(ctx, z.qp.Endpoint()); err != nil {
		t.Fatal(err)
	}
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	for i := range a.mem[:n] {
		a.mem[i] = byte(i*13 + i>>12)
	}
	copy(a.mem[n:], "after")
	err := a.qp.PostSend([]verbsio.SendWR{
		{WRID: 10, Op: verbsio.OpWriteImm, Imm: 99, Signaled: true, SG: []verbsio.SGE{{Addr: a.mr.Addr(), Length: n, LKey: a.mr.LKey()}}, RemoteAddr: uint64(z.mr.Addr()), RKey: z.mr.RKey()},
		{WRID: 11, Op: verbsio.OpSend, Signaled: true, SG: []verbsio.SGE{{Addr: a.mr.Addr() + n, Length: 5, LKey: a.mr.LKey()}}},
	})
	if err != nil {
		t.Fatal(err)
	}
	var got []verbsio.Completion
	buf := make([]verbsio.Completion, 8)
	for len(got) < 2 {
		k, err := z.cq.Wait(ctx, buf)
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range buf[:k] {
			got = append(got, c)
			if c.WRID == 1 && !bytes.Equal(z.mem[:n], a.mem[:n]) {
				t.Fatal("the immediate completed before every stripe landed")
			}
		}
	}
	if got[0].WRID != 1 || got[0].Op != verbsio.OpRecvImm || got[0].Imm != 99 || got[0].ByteLen != n || got[0].Status != verbsio.StatusSuccess {
		t.Errorf("first receive completion %+v, want recv-imm 99 of %d bytes", got[0], n)
	}
	if got[1].WRID != 2 || got[1].Op != verbsio.OpRecv || got[1].ByteLen != 5 || string(z.mem[n:n+5]) != "after" {
		t.Errorf("second receive completion %+v", got[1])
	}
	for sent := 0; sent < 2; {
		k, err := a.cq.Wait(ctx, buf)
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range buf[:k] {
			if c.Status != verbsio.StatusSuccess || c.WRID != uint64(10+sent) {
				t.Errorf("sender completion %+v", c)
			}
			sent++
		}
	}
}

// TestStripedRemoteAccess checks the striped path's error handling: a
// striped write one byte past the end of the target region completes with
// StatusRemoteAccess, lands nowhere, and fails the queue pair.
func TestStripedRemoteAccess(t *testing.T) {
	opt := tcp.Options{Lanes: 3, StripeMin: 64 << 10}
	const n = 1 << 20
	var devs [2]verbsio.Device
	var qps [2]verbsio.QueuePair
	var cqs [2]verbsio.CompletionQueue
	var mems [2][]byte
	var mrs [2]verbsio.MemoryRegion
	for i := range devs {
		var err error
		if devs[i], err = tcp.OpenDevice(verbsio.Config{}, opt); err != nil {
			t.Fatal(err)
		}
		pd, _ := devs[i].AllocPD()
		cqs[i], _ = devs[i].CreateCQ(64)
		if qps[i], err = pd.CreateQP(verbsio.QPConfig{SendCQ: cqs[i], RecvCQ: cqs[i]}); err != nil {
			t.Fatal(err)
		}
		// The target registers the middle of three regions' worth of memory.
		if mems[i], err = unix.Mmap(-1, 0, 3*n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS); err != nil {
			t.Fatal(err)
		}
		for j := range mems[i] {
			mems[i][j] = 0xA5
		}
		if mrs[i], err = pd.RegisterMemory(uintptr(unsafe.Pointer(&mems[i][n])), n, verbsio.AccessLocalWrite|verbsio.AccessRemoteWrite); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			qps[i].Close()
			mrs[i].Close()
			cqs[i].Close()
			pd.Close()
			devs[i].Close()
			unix.Munmap(mems[i])
		})
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	errc := make(chan error, 1)
	go func() { errc <- qps[1].Connect(ctx, qps[0].Endpoint()) }()
	if err := qps[0].Connect(ctx, qps[1].Endpoint()); err != nil {
		t.Fatal(err)
	}
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	for i := n; i < 2*n; i++ {
		mems[0][i] = byte(i)
	}
	err := qps[0].PostSend([]verbsio.SendWR{
		{WRID: 1, Op: verbsio.OpWrite, SG: []verbsio.SGE{{Addr: mrs[0].Addr(), Length: n, LKey: mrs[0].LKey()}}, RemoteAddr: uint64(mrs[1].Addr()) + 1, RKey: mrs[1].RKey()},
		{WRID: 2, Op: verbsio.OpWrite, Signaled: true, SG: []verbsio.SGE{{Addr: mrs[0].Addr(), Length: 16, LKey: mrs[0].LKey()}}, RemoteAddr: uint64(mrs[1].Addr()), RKey: mrs[1].RKey()},
	})
	if err != nil {
		t.Fatal(err)
	}
	var got []verbsio.Completion
	buf := make([]verbsio.Completion, 4)
	for len(got) < 2 {
		k, err := cqs[0].Wait(ctx, buf)
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, buf[:k]...)
	}
	if got[0].WRID != 1 || got[0].Status != verbsio.StatusRemoteAccess || got[1].WRID != 2 || got[1].Status != verbsio.StatusFlushed {
		t.Errorf("completions %+v, want WRID 1 remote access error then WRID 2 flushed", got)
	}
	// Stripes inside the region may have landed (as parts of a failed RDMA
	// write may); nothing outside it.
	for j, b := range mems[1] {
		if (j < n || j >= 2*n) && b != 0xA5 {
			t.Fatalf("byte %d outside the target region changed", j-n)
		}
	}
	if st := qps[0].State(); st != verbsio.QPError {
		t.Errorf("state %v, want error", st)
	}
}

package tcp_test

import (
	"context"
	"hash/crc32"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/gdrlink/gdrlink/verbsio"
	"github.com/gdrlink/gdrlink/verbsio/tcp"
)

// TestChecksumWrites checks verbsio.WriteChecksummer on tcp queue pairs:
// with it on, the receive completion of a write with immediate carries
// the CRC-32C of the bytes that landed (small writes, applied by a polling
// waiter, and large ones, read in pieces); with it off, or for a write
// striped over several lanes, none.
func TestChecksumWrites(t *testing.T) {
	castagnoli := crc32.MakeTable(crc32.Castagnoli)
	for _, tc := range []struct {
		name  string
		lanes int
		on    bool
	}{{"one-lane", 1, true}, {"off", 1, false}, {"striped", 3, true}} {
		t.Run(tc.name, func(t *testing.T) {
			a, z := openLaneSide(t, tc.lanes), openLaneSide(t, tc.lanes)
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			errc := make(chan error, 1)
			go func() { errc <- z.qp.Connect(ctx, a.qp.Endpoint()) }()
			if err := a.qp.Connect(ctx, z.qp.Endpoint()); err != nil {
				t.Fatal(err)
			}
			if err := <-errc; err != nil {
				t.Fatal(err)
			}
			sum, ok := z.qp.(verbsio.WriteChecksummer)
			if !ok {
				t.Fatal("tcp queue pair is no verbsio.WriteChecksummer")
			}
			sum.ChecksumWrites(tc.on)
			for i := range a.mem {
				a.mem[i] = byte(i*29 + i>>10)
			}
			for i, n := range []int{100, sumWriteBig} {
				if err := z.qp.PostRecv([]verbsio.RecvWR{{WRID: uint64(i)}}); err != nil {
					t.Fatal(err)
				}
				off := 7 * i // a payload not at the region's start
				err := a.qp.PostSend([]verbsio.SendWR{{WRID: uint64(i), Op: verbsio.OpWriteImm, Imm: uint32(i), Signaled: true,
					SG:         []verbsio.SGE{{Addr: a.mr.Addr() + uintptr(off), Length: uint32(n), LKey: a.mr.LKey()}},
					RemoteAddr: uint64(z.mr.Addr()) + uint64(off), RKey: z.mr.RKey()}})
				if err != nil {
					t.Fatal(err)
				}
				c := waitOne(ctx, t, z.cq)
				if c.Status != verbsio.StatusSuccess || c.Op != verbsio.OpRecvImm || int(c.ByteLen) != n {
					t.Fatalf("%d bytes: receive completion %+v", n, c)
				}
				want := crc32.Checksum(a.mem[off:off+n], castagnoli)
				if landed := crc32.Checksum(z.mem[off:off+n], castagnoli); landed != want {
					t.Fatalf("%d bytes: the write landed wrong", n)
				}
				striped := tc.lanes > 1 && n >= laneStripeMin
				switch {
				case tc.on && !striped && (!c.HasChecksum || c.Checksum != want):
					t.Errorf("%d bytes: checksum %#x (set %v), want %#x", n, c.Checksum, c.HasChecksum, want)
				case (!tc.on || striped) && c.HasChecksum:
					t.Errorf("%d bytes (checksums on %v, striped %v): a checksum %#x came", n, tc.on, striped, c.Checksum)
				}
				if s := waitOne(ctx, t, a.cq); s.Status != verbsio.StatusSuccess {
					t.Fatalf("sender completion %+v", s)
				}
			}
		})
	}
}

const (
	sumWriteBig   = 3<<20 + 5 // larger than the provider's piece, not a multiple of it
	laneStripeMin = 64 << 10
)

// laneSide is one end of a test queue pair: a device of its own with the
// given lanes (writes of laneStripeMin and more striped over them), a
// completion queue, and 4 MiB of registered memory.
type laneSide struct {
	qp  verbsio.QueuePair
	cq  verbsio.CompletionQueue
	mr  verbsio.MemoryRegion
	mem []byte
}

func openLaneSide(t *testing.T, lanes int) *laneSide {
	t.Helper()
	dev, err := tcp.OpenDevice(verbsio.Config{}, tcp.Options{Lanes: lanes, StripeMin: laneStripeMin})
	if err != nil {
		t.Fatal(err)
	}
	pd, _ := dev.AllocPD()
	s := &laneSide{}
	s.cq, _ = dev.CreateCQ(16)
	if s.qp, err = pd.CreateQP(verbsio.QPConfig{SendCQ: s.cq, RecvCQ: s.cq}); err != nil {
		t.Fatal(err)
	}
	if s.mem, err = unix.Mmap(-1, 0, 4<<20, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS); err != nil {
		t.Fatal(err)
	}
	if s.mr, err = pd.RegisterMemory(uintptr(unsafe.Pointer(&s.mem[0])), len(s.mem), verbsio.AccessLocalWrite|verbsio.AccessRemoteWrite); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		s.qp.Close()
		s.mr.Close()
		s.cq.Close()
		pd.Close()
		dev.Close()
		unix.Munmap(s.mem)
	})
	return s
}

func waitOne(ctx context.Context, t *testing.T, cq verbsio.CompletionQueue) verbsio.Completion {
	t.Helper()
	buf := make([]verbsio.Completion, 1)
	if _, err := cq.Wait(ctx, buf); err != nil {
		t.Fatal(err)
	}
	return buf[0]
}

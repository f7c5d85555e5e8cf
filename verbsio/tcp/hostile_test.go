package tcp

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/gdrlink/gdrlink/verbsio"
)

// target is a queue pair with one registered page between two guard pages,
// for tests that play a hostile peer with raw frames.
type target struct {
	dev  *device
	pd   verbsio.ProtectionDomain
	cq   verbsio.CompletionQueue
	qp   *qp
	mem  []byte // guard page, region page, guard page
	mr   verbsio.MemoryRegion
	page int
}

const guardByte = 0xA5

func newTarget(t testing.TB, access verbsio.Access) *target {
	t.Helper()
	return newTargetRNR(t, access, 50*time.Millisecond)
}

// newTargetRNR is newTarget with how long a send waits for a receive.
// poller plays a CompletionQueue.Wait that polls the queue pair's lanes
// (see poll.go) for the whole test, racing the lanes' goroutines: every
// hostile frame meets whichever reader takes it first, and must be refused
// the same way by both.
func (tg *target) poller(t testing.TB) {
	done := make(chan struct{})
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		for {
			select {
			case <-done:
				return
			default:
			}
			tg.qp.poll(true)
			time.Sleep(20 * time.Microsecond)
		}
	}()
	t.Cleanup(func() {
		close(done)
		<-stopped
	})
}

func newTargetRNR(t testing.TB, access verbsio.Access, rnr time.Duration) *target {
	t.Helper()
	dev, err := openDevice(verbsio.Config{}, Options{RNRTimeout: rnr})
	if err != nil {
		t.Fatal(err)
	}
	tg := &target{dev: dev, page: unix.Getpagesize()}
	t.Cleanup(func() {
		if err := dev.Close(); err != nil {
			t.Errorf("closing the device: %v", err)
		}
	})
	if tg.pd, err = dev.AllocPD(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tg.pd.Close() })
	if tg.mem, err = unix.Mmap(-1, 0, 3*tg.page, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Munmap(tg.mem) })
	for i := range tg.mem {
		tg.mem[i] = guardByte
	}
	if tg.mr, err = tg.pd.RegisterMemory(uintptr(unsafe.Pointer(&tg.mem[tg.page])), tg.page, access); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tg.mr.Close() })
	if tg.cq, err = dev.CreateCQ(64); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tg.cq.Close() })
	q, err := tg.pd.CreateQP(verbsio.QPConfig{SendCQ: tg.cq, RecvCQ: tg.cq})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { q.Close() })
	tg.qp = q.(*qp)
	tg.poller(t)
	return tg
}

// dial opens a raw lane to the target's queue pair.
func (tg *target) dial(t testing.TB) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", tg.dev.Info().Address)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	c.SetDeadline(time.Now().Add(10 * time.Second))
	h := hello{lanes: 1, dstQP: tg.qp.id, dstNonce: tg.qp.nonce, srcQP: 4242, srcNonce: 1}
	if _, err := c.Write(h.Append(nil)); err != nil {
		t.Fatal(err)
	}
	var ans [1]byte
	if _, err := io.ReadFull(c, ans[:]); err != nil || ans[0] != helloOK {
		t.Fatalf("hello answer %d, %v", ans[0], err)
	}
	return c
}

func (tg *target) base() uint64 { return uint64(tg.mr.Addr()) }

// intact checks that the guard pages and, when region is set, the region
// hold their fill.
func (tg *target) intact(t testing.TB, region bool) {
	t.Helper()
	for i, b := range tg.mem {
		inRegion := i >= tg.page && i < 2*tg.page
		if (!inRegion || region) && b != guardByte {
			t.Fatalf("byte %d (page %d) = %#x: memory changed", i, i/tg.page, b)
		}
	}
}

func readResponse(t testing.TB, c net.Conn) header {
	t.Helper()
	var b [headerLen]byte
	if _, err := io.ReadFull(c, b[:]); err != nil {
		t.Fatalf("reading the response: %v", err)
	}
	h, err := parseHeader(b[:])
	if err != nil {
		t.Fatalf("response: %v", err)
	}
	return h
}

func expectClosed(t testing.TB, c net.Conn) {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	n, err := c.Read(make([]byte, 64))
	if err == nil || errors.Is(err, unix.ETIMEDOUT) || n > 0 {
		t.Fatalf("connection still open after a malformed frame (read %d, %v)", n, err)
	}
}

func frame(h header, payload []byte) []byte {
	h.length = uint32(len(payload))
	return append(h.Append(nil), payload...)
}

func TestHostileRemoteAccess(t *testing.T) {
	payload := bytes.Repeat([]byte{0x11}, 100)
	cases := []struct {
		name   string
		access verbsio.Access
		h      func(tg *target) header
	}{
		{"WrongRKey", verbsio.AccessLocalWrite | verbsio.AccessRemoteWrite, func(tg *target) header {
			return header{op: opWrite, raddr: tg.base(), rkey: tg.mr.RKey() ^ 0x10000}
		}},
		{"LKeyAsRKey", verbsio.AccessLocalWrite | verbsio.AccessRemoteWrite, func(tg *target) header {
			return header{op: opWrite, raddr: tg.base(), rkey: tg.mr.LKey()}
		}},
		{"OnePastTheEnd", verbsio.AccessLocalWrite | verbsio.AccessRemoteWrite, func(tg *target) header {
			return header{op: opWrite, raddr: tg.base() + uint64(tg.page) - 99, rkey: tg.mr.RKey()}
		}},
		{"BeforeTheStart", verbsio.AccessLocalWrite | verbsio.AccessRemoteWrite, func(tg *target) header {
			return header{op: opWrite, raddr: tg.base() - 1, rkey: tg.mr.RKey()}
		}},
		{"ReadOnlyRegion", verbsio.AccessLocalWrite | verbsio.AccessRemoteRead, func(tg *target) header {
			return header{op: opWrite, raddr: tg.base(), rkey: tg.mr.RKey()}
		}},
		{"ReadOnlyRegionImm", verbsio.AccessLocalWrite | verbsio.AccessRemoteRead, func(tg *target) header {
			return header{op: opWriteImm, flags: flagLast, total: 100, imm: 5, raddr: tg.base(), rkey: tg.mr.RKey()}
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			tg := newTarget(t, tc.access)
			if tc.h(tg).op == opWriteImm {
				// A receive is there, so the failure is the access alone.
				if err := tg.qp.PostRecv([]verbsio.RecvWR{{WRID: 1}}); err != nil {
					t.Fatal(err)
				}
			}
			c := tg.dial(t)
			h := tc.h(tg)
			h.token = 77
			if _, err := c.Write(frame(h, payload)); err != nil {
				t.Fatal(err)
			}
			r := readResponse(t, c)
			if r.op != opNak || r.status != verbsio.StatusRemoteAccess || r.token != 77 {
				t.Fatalf("response %+v, want a nak with remote access error for token 77", r)
			}
			tg.intact(t, true)
			// The payload was skipped, not parsed as frames: the stream
			// is still in step and a valid write lands.
			if tc.access&verbsio.AccessRemoteWrite != 0 {
				good := header{op: opWrite, token: 78, raddr: tg.base() + 10, rkey: tg.mr.RKey()}
				c.Write(frame(good, payload))
				if r := readResponse(t, c); r.op != opAck || r.token != 78 {
					t.Fatalf("response to a valid write %+v", r)
				}
				if !bytes.Equal(tg.mem[tg.page+10:tg.page+110], payload) || tg.mem[tg.page+9] != guardByte || tg.mem[tg.page+110] != guardByte {
					t.Fatal("valid write after the nak did not land exactly")
				}
			}
		})
	}
}

func TestHostileReadWithoutAccess(t *testing.T) {
	tg := newTarget(t, verbsio.AccessLocalWrite|verbsio.AccessRemoteWrite)
	c := tg.dial(t)
	c.Write(header{op: opReadReq, token: 5, length: 16, raddr: tg.base(), rkey: tg.mr.RKey()}.appendTo())
	if r := readResponse(t, c); r.op != opNak || r.status != verbsio.StatusRemoteAccess || r.token != 5 {
		t.Fatalf("response %+v, want a remote access nak", r)
	}
}

func (h header) appendTo() []byte { return h.Append(nil) }

func TestHostileMalformed(t *testing.T) {
	cases := []struct {
		name string
		data func(tg *target) []byte
	}{
		{"UnknownOpcode", func(tg *target) []byte {
			b := header{op: opWrite, raddr: tg.base(), rkey: tg.mr.RKey()}.appendTo()
			b[1] = 99
			return b
		}},
		{"AbsurdLength", func(tg *target) []byte {
			b := header{op: opWrite, raddr: tg.base(), rkey: tg.mr.RKey()}.appendTo()
			binary.BigEndian.PutUint32(b[4:], 0xFFFFFFFF)
			return append(b, make([]byte, 4096)...)
		}},
		{"BadVersion", func(tg *target) []byte {
			b := header{op: opWrite, length: 8, raddr: tg.base(), rkey: tg.mr.RKey()}.appendTo()
			b[0] = 9
			return append(b, make([]byte, 8)...)
		}},
		{"WrappingAddress", func(tg *target) []byte {
			return append(header{op: opWrite, length: 16, raddr: ^uint64(0) - 3, rkey: tg.mr.RKey()}.appendTo(), make([]byte, 16)...)
		}},
		{"ResponseOnRequestLane", func(tg *target) []byte {
			return header{op: opAck, token: 1}.appendTo()
		}},
		{"ReservedBits", func(tg *target) []byte {
			b := header{op: opWrite, raddr: tg.base(), rkey: tg.mr.RKey()}.appendTo()
			b[39] = 1
			return b
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			tg := newTarget(t, verbsio.AccessLocalWrite|verbsio.AccessRemoteWrite)
			c := tg.dial(t)
			c.Write(tc.data(tg))
			expectClosed(t, c)
			tg.intact(t, true)
			deadline := time.Now().Add(5 * time.Second)
			for {
				tg.qp.mu.Lock()
				bad := tg.qp.lastBad
				tg.qp.mu.Unlock()
				if errors.Is(bad, verbsio.ErrBadFrame) {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("no ErrBadFrame recorded (last: %v)", bad)
				}
				time.Sleep(time.Millisecond)
			}
		})
	}
}

func TestHostileTruncated(t *testing.T) {
	tg := newTarget(t, verbsio.AccessLocalWrite|verbsio.AccessRemoteWrite)
	c := tg.dial(t)
	// Half a header, then the peer goes away.
	c.Write(header{op: opWrite, length: 64, raddr: tg.base(), rkey: tg.mr.RKey()}.appendTo()[:20])
	c.Close()
	// A torn payload may only have touched the region itself.
	c = tg.dial(t)
	c.Write(append(header{op: opWrite, length: 64, raddr: tg.base() + 100, rkey: tg.mr.RKey()}.appendTo(), make([]byte, 30)...))
	c.Close()
	time.Sleep(50 * time.Millisecond)
	tg.intact(t, false)
	for i := tg.page; i < 2*tg.page; i++ {
		if tg.mem[i] != guardByte && (i < tg.page+100 || i >= tg.page+130) {
			t.Fatalf("region byte %d outside the torn write's range changed", i-tg.page)
		}
	}
	// The queue pair was never connected to that peer, so it is unharmed.
	if st := tg.qp.State(); st != verbsio.QPInit {
		t.Errorf("state %v after a stranger's truncated frames, want init", st)
	}
}

func TestHostileHello(t *testing.T) {
	tg := newTarget(t, verbsio.AccessLocalWrite)
	for _, tc := range []struct {
		name string
		h    []byte
		want byte
	}{
		{"Garbage", bytes.Repeat([]byte{0xFF}, helloLen), helloMalformed},
		{"WrongNonce", (&hello{lanes: 1, dstQP: tg.qp.id, dstNonce: tg.qp.nonce + 1}).Append(nil), helloBadNonce},
		{"NoSuchQP", (&hello{lanes: 1, dstQP: tg.qp.id + 1000, dstNonce: tg.qp.nonce}).Append(nil), helloNoQP},
		// A peer of wire version 1 (no flagNoAck) is refused before any frame.
		{"Version1", func() []byte {
			b := (&hello{lanes: 1, dstQP: tg.qp.id, dstNonce: tg.qp.nonce}).Append(nil)
			b[4] = 1
			return b
		}(), helloMalformed},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := net.Dial("tcp", tg.dev.Info().Address)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			c.SetDeadline(time.Now().Add(10 * time.Second))
			c.Write(tc.h)
			var ans [1]byte
			if _, err := io.ReadFull(c, ans[:]); err != nil || ans[0] != tc.want {
				t.Fatalf("answer %d, %v; want %d", ans[0], err, tc.want)
			}
			expectClosed(t, c)
		})
	}
}

func TestRNRFailsSender(t *testing.T) {
	tg := newTarget(t, verbsio.AccessLocalWrite|verbsio.AccessRemoteWrite)
	c := tg.dial(t)
	c.Write(frame(header{op: opSend, token: 3}, []byte("hello")))
	if r := readResponse(t, c); r.op != opNak || r.status != verbsio.StatusRemoteOperation {
		t.Fatalf("send with no receive posted: response %+v, want a remote operation nak", r)
	}
	// The stream stays in step.
	c.Write(frame(header{op: opWrite, token: 4, raddr: tg.base(), rkey: tg.mr.RKey()}, []byte("x")))
	if r := readResponse(t, c); r.op != opAck || r.token != 4 {
		t.Fatalf("response %+v", r)
	}
}

func TestKeys(t *testing.T) {
	tg := newTarget(t, verbsio.AccessLocalWrite)
	seen := map[uint32]bool{}
	for i := 0; i < 64; i++ {
		mr, err := tg.pd.RegisterMemory(tg.mr.Addr(), 64, verbsio.AccessLocalWrite)
		if err != nil {
			t.Fatal(err)
		}
		defer mr.Close()
		if mr.LKey() == mr.RKey() {
			t.Errorf("lkey == rkey == %#x", mr.LKey())
		}
		for _, k := range []uint32{mr.LKey(), mr.RKey()} {
			if seen[k] || k == 0 {
				t.Fatalf("key %#x repeats or is zero", k)
			}
			seen[k] = true
		}
	}
}

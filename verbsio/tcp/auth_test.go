package tcp

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"runtime"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/gdrlink/gdrlink/internal/jobauth"
	"github.com/gdrlink/gdrlink/verbsio"
)

func newJobKey(t testing.TB) jobauth.Key {
	t.Helper()
	k, _, err := jobauth.Generate()
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// authSide is a device with a job key (or none), a queue pair and one
// registered page filled with fill.
type authSide struct {
	dev  *device
	pd   verbsio.ProtectionDomain
	cq   verbsio.CompletionQueue
	qp   *qp
	mem  []byte
	mr   verbsio.MemoryRegion
	fill byte
}

func openAuthSide(t *testing.T, key jobauth.Key, fill byte) *authSide {
	t.Helper()
	return openAuthSideConfig(t, verbsio.Config{JobKey: key.Bytes()}, fill)
}

// openAuthSideConfig is openAuthSide with the device's whole Config.
func openAuthSideConfig(t *testing.T, cfg verbsio.Config, fill byte) *authSide {
	t.Helper()
	dev, err := openDevice(cfg, Options{})
	if err != nil {
		t.Fatal(err)
	}
	s := &authSide{dev: dev, fill: fill}
	t.Cleanup(func() {
		if err := dev.Close(); err != nil {
			t.Errorf("closing the device: %v", err)
		}
	})
	if s.pd, err = dev.AllocPD(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.pd.Close() })
	if s.mem, err = unix.Mmap(-1, 0, unix.Getpagesize(), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Munmap(s.mem) })
	for i := range s.mem {
		s.mem[i] = fill
	}
	if s.mr, err = s.pd.RegisterMemory(uintptr(unsafe.Pointer(&s.mem[0])), len(s.mem), verbsio.AccessLocalWrite|verbsio.AccessRemoteWrite); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.mr.Close() })
	if s.cq, err = dev.CreateCQ(16); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.cq.Close() })
	q, err := s.pd.CreateQP(verbsio.QPConfig{SendCQ: s.cq, RecvCQ: s.cq})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { q.Close() })
	s.qp = q.(*qp)
	return s
}

// untouched checks that the side's page still holds its fill.
func (s *authSide) untouched(t *testing.T) {
	t.Helper()
	for i, b := range s.mem {
		if b != s.fill {
			t.Fatalf("byte %d of the page = %#x, want %#x: a peer's bytes reached it", i, b, s.fill)
		}
	}
}

// postRecv posts a receive into the first 64 bytes of the page.
func (s *authSide) postRecv(t *testing.T, wrid uint64) {
	t.Helper()
	if err := s.qp.PostRecv([]verbsio.RecvWR{{WRID: wrid, SG: []verbsio.SGE{{Addr: s.mr.Addr(), Length: 64, LKey: s.mr.LKey()}}}}); err != nil {
		t.Fatal(err)
	}
}

// refusals returns how many accepted connections the device refused and
// why it refused the last.
func (d *device) refusals() (uint64, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.refused, d.lastRefusal
}

// waitRefused waits until the device has refused at least n connections.
func waitRefused(t *testing.T, d *device, n uint64) error {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		k, why := d.refusals()
		if k >= n {
			return why
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d connections refused, want %d (last: %v)", k, n, why)
		}
	}
}

// connectBoth connects a and z to each other at once and returns each
// side's error.
func connectBoth(ctx context.Context, a, z *authSide) (errA, errZ error) {
	errc := make(chan error, 1)
	go func() { errc <- z.qp.Connect(ctx, a.qp.Endpoint()) }()
	errA = a.qp.Connect(ctx, z.qp.Endpoint())
	return errA, <-errc
}

// send sends the first n bytes of a's page to z's posted receive, and
// returns z's receive completion.
func send(t *testing.T, a, z *authSide, n int) verbsio.Completion {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := a.qp.PostSend([]verbsio.SendWR{{WRID: 7, Op: verbsio.OpSend, Signaled: true, SG: []verbsio.SGE{{Addr: a.mr.Addr(), Length: uint32(n), LKey: a.mr.LKey()}}}}); err != nil {
		t.Fatal(err)
	}
	var got []verbsio.Completion
	buf := make([]verbsio.Completion, 4)
	for len(got) < 1 {
		k, err := z.cq.Wait(ctx, buf)
		if err != nil {
			t.Fatalf("waiting for the receive: %v", err)
		}
		got = append(got, buf[:k]...)
	}
	if k, err := a.cq.Wait(ctx, buf); err != nil || k != 1 || buf[0].Status != verbsio.StatusSuccess {
		t.Fatalf("send completion %+v, %v", buf[:k], err)
	}
	return got[0]
}

// TestAuthWrongKey connects queue pairs of devices that do not share a
// key: both Connects fail at once with jobauth.ErrRefused, no lane reaches
// a queue pair and no byte moves.
func TestAuthWrongKey(t *testing.T) {
	for _, tc := range []struct {
		name   string
		ka, kz jobauth.Key
	}{
		{"DifferentKeys", newJobKey(t), newJobKey(t)},
		{"NoKeyAgainstKey", jobauth.Key{}, newJobKey(t)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, z := openAuthSide(t, tc.ka, 0x11), openAuthSide(t, tc.kz, 0x22)
			a.postRecv(t, 1)
			z.postRecv(t, 2)
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			start := time.Now()
			errA, errZ := connectBoth(ctx, a, z)
			took := time.Since(start)
			t.Logf("both Connects failed in %v:\n  a: %v\n  z: %v", took, errA, errZ)
			for _, err := range []error{errA, errZ} {
				if !errors.Is(err, jobauth.ErrRefused) || errors.Is(err, verbsio.ErrTimeout) {
					t.Errorf("Connect: %v, want an error wrapping jobauth.ErrRefused, not a timeout", err)
				}
			}
			if took > 5*time.Second {
				t.Errorf("refusals took %v to surface", took)
			}
			for _, s := range []*authSide{a, z} {
				if why := waitRefused(t, s.dev, 1); !errors.Is(why, jobauth.ErrRefused) {
					t.Errorf("the device's last refusal: %v, want jobauth.ErrRefused", why)
				}
				s.qp.mu.Lock()
				in := len(s.qp.in) + len(s.qp.inCount)
				s.qp.mu.Unlock()
				if in != 0 {
					t.Errorf("a lane of the other device reached the queue pair")
				}
				if st := s.qp.State(); st != verbsio.QPError {
					t.Errorf("state after a refused Connect %v, want error", st)
				}
				buf := make([]verbsio.Completion, 4)
				if k, _ := s.cq.Poll(buf); k != 1 || buf[0].Status != verbsio.StatusFlushed {
					t.Errorf("receive completions %+v, want the one receive flushed", buf[:k])
				}
				s.untouched(t)
			}
		})
	}
}

// TestAuthStranger has a process without the key, which knows both
// endpoints, forge a lane hello as if it were the connected peer's, with
// frames behind it: it is refused, and its bytes never reach the queue
// pair (its posted receive is still there, its memory unchanged), which
// goes on working with its real peer.
func TestAuthStranger(t *testing.T) {
	key := newJobKey(t)
	a, z := openAuthSide(t, key, 0x11), openAuthSide(t, key, 0x22)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if errA, errZ := connectBoth(ctx, a, z); errA != nil || errZ != nil {
		t.Fatalf("Connect: %v, %v", errA, errZ)
	}
	z.postRecv(t, 2)
	forged := hello{lanes: 1, dstQP: z.qp.id, dstNonce: z.qp.nonce, srcQP: a.qp.id, srcNonce: a.qp.nonce}
	stranger := func(t *testing.T, data []byte) []byte {
		c, err := net.Dial("tcp", z.dev.Info().Address)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(10 * time.Second))
		if _, err := c.Write(data); err != nil {
			t.Fatal(err)
		}
		got, err := io.ReadAll(c)
		if isTimeout(err) {
			t.Fatalf("the connection stayed open: %v", err)
		}
		return got
	}
	refusedBefore, _ := z.dev.refusals()
	t.Run("HelloThenWait", func(t *testing.T) {
		if got := stranger(t, forged.Append(nil)); !bytes.Equal(got, []byte{helloNeedKey}) {
			t.Errorf("answer to a hello without the handshake %v, want [%d] then the connection closed", got, helloNeedKey)
		}
	})
	t.Run("HelloAndFrames", func(t *testing.T) {
		b := forged.Append(nil)
		b = append(b, frame(header{op: opSend, token: 1}, []byte("forged send"))...)
		b = append(b, frame(header{op: opWrite, token: 2, raddr: uint64(z.mr.Addr()) + 100, rkey: z.mr.RKey()}, []byte("forged write"))...)
		// The device may answer that a key is needed, or reset the
		// connection before that byte arrives; never anything else.
		if got := stranger(t, b); len(got) > 1 || len(got) == 1 && got[0] != helloNeedKey {
			t.Errorf("the stranger read %v", got)
		}
	})
	if why := waitRefused(t, z.dev, refusedBefore+2); !errors.Is(why, jobauth.ErrRefused) {
		t.Errorf("the device's last refusal: %v, want jobauth.ErrRefused", why)
	}
	buf := make([]verbsio.Completion, 4)
	if k, _ := z.cq.Poll(buf); k != 0 {
		t.Fatalf("completions %+v after the stranger's frames, want none", buf[:k])
	}
	z.qp.mu.Lock()
	posted, lanes := len(z.qp.rq), len(z.qp.in)
	z.qp.mu.Unlock()
	if posted != 1 || lanes != 1 {
		t.Fatalf("%d receives posted and %d inbound lanes after the stranger, want 1 and 1", posted, lanes)
	}
	z.untouched(t)
	if st := z.qp.State(); st != verbsio.QPReady {
		t.Fatalf("state %v after the stranger, want ready", st)
	}
	// The real peer's bytes still land.
	copy(a.mem, "from the real peer")
	if c := send(t, a, z, 18); c.Status != verbsio.StatusSuccess || c.WRID != 2 || string(z.mem[:18]) != "from the real peer" {
		t.Fatalf("receive %+v holding %q", c, z.mem[:18])
	}
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// TestAuthFlood opens many idle connections that prove nothing to both
// devices: a legitimate Connect still completes at once, the goroutines
// they hold stay bounded, and return to the baseline once they close.
func TestAuthFlood(t *testing.T) {
	const flood = 200
	key := newJobKey(t)
	a, z := openAuthSide(t, key, 0x11), openAuthSide(t, key, 0x22)
	base := runtime.NumGoroutine()
	var idle []net.Conn
	defer func() {
		for _, c := range idle {
			c.Close()
		}
	}()
	for _, s := range []*authSide{a, z} {
		for range flood {
			c, err := net.Dial("tcp", s.dev.Info().Address)
			if err != nil {
				t.Fatalf("flood connection %d: %v", len(idle), err)
			}
			idle = append(idle, c)
		}
	}
	stats := func(d *device) (accepted uint64, unproven int, evicted uint64) {
		d.mu.Lock()
		defer d.mu.Unlock()
		return d.acceptSeq, d.unproven, d.evicted
	}
	for _, s := range []*authSide{a, z} {
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
			if n, _, _ := stats(s.dev); n >= flood {
				break
			}
			if time.Now().After(deadline) {
				t.Fatal("the flood was not accepted")
			}
		}
	}
	// The goroutines of evicted connections end just after them.
	bound := base + 2*maxUnproven + 4
	during := runtime.NumGoroutine()
	for deadline := time.Now().Add(5 * time.Second); during > bound && time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		during = runtime.NumGoroutine()
	}
	_, unproven, evicted := stats(z.dev)
	t.Logf("%d idle connections to each device: goroutines %d before, %d during; per device %d unproven held, %d evicted", flood, base, during, unproven, evicted)
	if unproven > maxUnproven || during > bound {
		t.Errorf("%d unproven connections held, %d goroutines more than before: want at most %d per device", unproven, during-base, maxUnproven)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	start := time.Now()
	errA, errZ := connectBoth(ctx, a, z)
	took := time.Since(start)
	t.Logf("Connect during the flood took %v", took)
	if errA != nil || errZ != nil {
		t.Fatalf("Connect during the flood: %v, %v", errA, errZ)
	}
	if took > 2*time.Second {
		t.Errorf("Connect during the flood took %v, want at most 2s", took)
	}
	z.postRecv(t, 3)
	copy(a.mem, "through the flood")
	if c := send(t, a, z, 17); c.Status != verbsio.StatusSuccess || string(z.mem[:17]) != "through the flood" {
		t.Fatalf("receive %+v holding %q", c, z.mem[:17])
	}
	for _, c := range idle {
		c.Close()
	}
	idle = nil
	a.qp.Close()
	z.qp.Close()
	after := runtime.NumGoroutine()
	for deadline := time.Now().Add(10 * time.Second); after > base && time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		after = runtime.NumGoroutine()
	}
	t.Logf("goroutines %d after the flood closed (baseline %d)", after, base)
	if after > base {
		t.Errorf("%d goroutines after the flood closed, baseline %d", after, base)
	}
	// A connection leaves the count when its handshake sees the close,
	// which may be just after its goroutine count above came down.
	for _, s := range []*authSide{a, z} {
		_, unproven, _ := stats(s.dev)
		for deadline := time.Now().Add(10 * time.Second); unproven != 0 && time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
			_, unproven, _ = stats(s.dev)
		}
		if unproven != 0 {
			t.Errorf("%d unproven connections still held 10s after the flood closed", unproven)
		}
	}
}

// TestOpenListenWithoutKey: without a job key a device listens on loopback
// only, unless Config.Insecure.
func TestOpenListenWithoutKey(t *testing.T) {
	key := newJobKey(t).Bytes()
	for _, tc := range []struct {
		name string
		cfg  verbsio.Config
		want error // nil: opens
	}{
		{"Default", verbsio.Config{}, nil},
		{"Loopback", verbsio.Config{ListenAddr: "127.0.0.1:0"}, nil},
		{"Localhost", verbsio.Config{ListenAddr: "localhost:0"}, nil},
		{"AnyAddress", verbsio.Config{ListenAddr: "0.0.0.0:0"}, jobauth.ErrInsecure},
		{"NoHost", verbsio.Config{ListenAddr: ":0"}, jobauth.ErrInsecure},
		{"AnyAddressInsecure", verbsio.Config{ListenAddr: "0.0.0.0:0", Insecure: true}, nil},
		{"AnyAddressWithKey", verbsio.Config{ListenAddr: "0.0.0.0:0", JobKey: key}, nil},
		{"ShortKey", verbsio.Config{JobKey: key[:16]}, jobauth.ErrBadKey},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dev, err := OpenDevice(tc.cfg, Options{})
			if tc.want == nil {
				if err != nil {
					t.Fatalf("Open: %v", err)
				}
				dev.Close()
				return
			}
			if err == nil {
				dev.Close()
			}
			if !errors.Is(err, tc.want) || !errors.Is(err, verbsio.ErrBadConfig) {
				t.Errorf("Open: %v, want an error wrapping %v and verbsio.ErrBadConfig", err, tc.want)
			}
		})
	}
}

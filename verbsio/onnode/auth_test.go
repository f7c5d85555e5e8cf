package onnode

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gdrlink/gdrlink/internal/jobauth"
	"github.com/gdrlink/gdrlink/verbsio"
)

// newKey is a fresh job key's material.
func newKey(t *testing.T) []byte {
	t.Helper()
	k, _, err := jobauth.Generate()
	if err != nil {
		t.Fatal(err)
	}
	return k.Bytes()
}

func keyedNode(t *testing.T, key []byte) *node {
	t.Helper()
	n, err := newNodeConfig(verbsio.Config{JobKey: key}, Options{Spin: defaultSpin})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(n.close)
	return n
}

// connectBoth connects n with the helper's queue pair from both sides at
// once and returns n's error, the helper's answer and how long it took.
func connectBoth(t *testing.T, n *node, p *peer, ep string) (error, []string, time.Duration) {
	t.Helper()
	remote, err := decodeEndpoint(ep)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	errc := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		errc <- n.qp.Connect(ctx, remote)
	}()
	lines := p.do("connect %s", encodeEndpoint(n.qp.Endpoint()))
	err = <-errc
	return err, lines, time.Since(start)
}

// acceptorName is the socket of the queue pair that accepts when n and the
// helper's endpoint ep connect: the greater name.
func acceptorName(t *testing.T, n *node, ep string) string {
	t.Helper()
	remote, err := decodeEndpoint(ep)
	if err != nil {
		t.Fatal(err)
	}
	ed, err := parseEndpointData(remote.Data)
	if err != nil {
		t.Fatal(err)
	}
	return max(n.qp.(*qp).name, ed.Name)
}

// fakePeer is an endpoint of process pid named "a": a queue pair connecting
// to it accepts ("a" sorts first) and waits for that process.
func fakePeer(n *node, pid int) verbsio.Endpoint {
	return verbsio.Endpoint{Provider: Name, Host: n.qp.(*qp).host, Data: endpointData{PID: uint32(pid), Name: "a"}.Append(nil)}
}

func peerPID(t *testing.T, p *peer) int {
	t.Helper()
	return int(atoi(t, p.one("pid", "pid")[0]))
}

// TestKeyedPair: two processes with the same key connect and move data,
// with each mechanism.
func TestKeyedPair(t *testing.T) {
	key := newKey(t)
	for _, mech := range []Mechanism{MechVM, MechSHM} {
		t.Run(mech.String(), func(t *testing.T) {
			n, p := keyedPair(t, mech, key)
			writeImm(t, n, p, mech, "memfd")
			sendRecv(t, n, p)
		})
	}
}

// TestStrangerGetsNothing: a third process of this user, without the key,
// connects to the accepting queue pair's socket before the peer does and
// sends nothing. It gets no descriptor and its connection is closed; the
// peers connect, and receives posted before stay pending until the peers'
// own writes complete them.
func TestStrangerGetsNothing(t *testing.T) {
	for name, key := range map[string][]byte{"key": newKey(t), "no key": nil} {
		t.Run(name, func(t *testing.T) {
			n := keyedNode(t, key)
			p := startPeerWith(t, peerOpts{key: key})
			s := startPeer(t, MechAuto)
			ep := p.one("ep", "ep")[0]
			dst, err := n.register("anon", 4096, rw, 0)
			if err != nil {
				t.Fatal(err)
			}
			if err := n.qp.PostRecv([]verbsio.RecvWR{{WRID: 7}}); err != nil {
				t.Fatal(err)
			}
			f := p.one("mr", "reg anon 4096 %d 0", rw)
			paddr, prkey := atoi(t, f[0]), atoi(t, f[1])
			p.ok("recv 8 %d 0 0", prkey)

			raw := s.one("raw", "rawdial %s", acceptorName(t, n, ep))[0]
			connect(t, n, p, []string{ep})
			if got := s.one("raw", "rawread %s 5000", raw); strings.Join(got, " ") != "0 0 true" {
				t.Fatalf("stranger read %q, want no bytes, no descriptor and a closed connection", got)
			}

			ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
			var c [1]verbsio.Completion
			if k, err := n.rcq.Wait(ctx, c[:]); err == nil {
				t.Fatalf("receive completed with nothing sent: %d %+v", k, c[0])
			}
			cancel()
			if got := p.do("wait 1 300"); len(got) != 1 || !strings.HasPrefix(got[0], "err ") {
				t.Fatalf("helper's receive completed with nothing sent: %q", got)
			}

			src, err := n.register("anon", 64, verbsio.AccessLocalWrite, 1)
			if err != nil {
				t.Fatal(err)
			}
			err = n.qp.PostSend([]verbsio.SendWR{{WRID: 1, Op: verbsio.OpWriteImm, Signaled: true, Imm: 0x1111, RemoteAddr: paddr, RKey: uint32(prkey),
				SG: []verbsio.SGE{{Addr: src.Addr(), Length: 64, LKey: src.LKey()}}}})
			if err != nil {
				t.Fatal(err)
			}
			if c := waitOne(t, n.scq, 5*time.Second); c.Status != verbsio.StatusSuccess {
				t.Fatalf("write: %+v", c)
			}
			if got, want := p.do("wait 1 5000"), fmt.Sprintf("comp 8 0 %d 64 %d true", verbsio.OpRecvImm, 0x1111); len(got) != 1 || got[0] != want {
				t.Fatalf("helper's receive %q, want %q", got, want)
			}
			p.one("comp", "writeimm %d 0 16 %d %d %d", prkey, dst.Addr(), dst.RKey(), 0x2222)
			if c := waitOne(t, n.rcq, 5*time.Second); c.WRID != 7 || c.Status != verbsio.StatusSuccess || c.Imm != 0x2222 {
				t.Fatalf("receive %+v, want WRID 7 with immediate 0x2222", c)
			}
		})
	}
}

// TestImpostorWithoutKey: a process that is the peer by its endpoint (pid)
// but lacks the key sends a well-formed hello with descriptors: it gets
// no descriptor, and Connect fails promptly with ErrRefused.
func TestImpostorWithoutKey(t *testing.T) {
	n := keyedNode(t, newKey(t))
	s := startPeer(t, MechAuto)
	fake := fakePeer(n, peerPID(t, s))
	errc := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		errc <- n.qp.Connect(ctx, fake)
	}()
	start := time.Now()
	name := n.qp.(*qp).name
	raw := s.one("raw", "rawdial %s", name)[0]
	s.ok("rawhello %s a %s", raw, name)
	// A refusal, for a peer without a key to read, then the end.
	if got := s.one("raw", "rawread %s 5000", raw); strings.Join(got, " ") != "5 0 false" {
		t.Fatalf("impostor read %q, want 5 bytes and no descriptor", got)
	}
	if got := s.one("raw", "rawread %s 5000", raw); strings.Join(got, " ") != "0 0 true" {
		t.Fatalf("impostor read %q, want a closed connection", got)
	}
	err := <-errc
	if !errors.Is(err, jobauth.ErrRefused) {
		t.Fatalf("Connect: %v, want ErrRefused", err)
	}
	if d := time.Since(start); d > 3*time.Second {
		t.Errorf("Connect failed after %v", d)
	}
}

// TestWrongKey: peers with different keys, or a key on one side only, fail
// to connect promptly, both with ErrRefused.
func TestWrongKey(t *testing.T) {
	k1, k2 := newKey(t), newKey(t)
	for name, keys := range map[string][2][]byte{"different": {k1, k2}, "here only": {k1, nil}, "there only": {nil, k2}} {
		t.Run(name, func(t *testing.T) {
			n := keyedNode(t, keys[0])
			p := startPeerWith(t, peerOpts{key: keys[1]})
			err, lines, d := connectBoth(t, n, p, p.one("ep", "ep")[0])
			t.Logf("here: %v; helper: %q", err, lines)
			if !errors.Is(err, jobauth.ErrRefused) {
				t.Errorf("Connect here: %v, want ErrRefused", err)
			}
			if len(lines) != 1 || !strings.Contains(lines[0], jobauth.ErrRefused.Error()) {
				t.Errorf("Connect in the helper: %q, want ErrRefused", lines)
			}
			if d > 3*time.Second {
				t.Errorf("Connect failed after %v", d)
			}
			if n.qp.State() != verbsio.QPInit {
				t.Errorf("state %s after a refused Connect", n.qp.State())
			}
		})
	}
}

// TestOtherUser: a process of another user, even with the key, is refused
// on both sides, naming its uid, and gets no descriptor.
func TestOtherUser(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root, to run the helper as uid 65534")
	}
	exe := exportedBinary(t)
	key := newKey(t)
	n := keyedNode(t, key)
	p := startPeerWith(t, peerOpts{key: key, exe: exe, cred: &syscall.Credential{Uid: 65534, Gid: 65534}})

	err, lines, d := connectBoth(t, n, p, p.one("ep", "ep")[0])
	t.Logf("here: %v; helper: %q", err, lines)
	if !errors.Is(err, verbsio.ErrRemoteAccess) || !strings.Contains(err.Error(), "uid 65534") {
		t.Errorf("Connect here: %v, want ErrRemoteAccess naming uid 65534", err)
	}
	if len(lines) != 1 || !strings.Contains(lines[0], verbsio.ErrRemoteAccess.Error()) || !strings.Contains(lines[0], "uid 0") {
		t.Errorf("Connect in the helper: %q, want ErrRemoteAccess naming uid 0", lines)
	}
	if d > 3*time.Second {
		t.Errorf("Connect failed after %v", d)
	}

	// The other user's process dials, as the peer this queue pair waits
	// for, with a well-formed hello.
	if err := n.newQP(); err != nil {
		t.Fatal(err)
	}
	fake := fakePeer(n, peerPID(t, p))
	errc := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		errc <- n.qp.Connect(ctx, fake)
	}()
	name := n.qp.(*qp).name
	raw := p.one("raw", "rawdial %s", name)[0]
	// The hello may find the connection closed already.
	if got := p.do("rawhello %s a %s", raw, name); len(got) > 0 && !strings.Contains(got[0], "broken pipe") && !strings.Contains(got[0], "reset by peer") {
		t.Fatalf("hello: %q", got)
	}
	if got := p.one("raw", "rawread %s 5000", raw); strings.Join(got, " ") != "0 0 true" {
		t.Fatalf("other user's read %q, want no bytes, no descriptor and a closed connection", got)
	}
	if err := <-errc; !errors.Is(err, verbsio.ErrRemoteAccess) || !strings.Contains(err.Error(), "uid 65534") {
		t.Fatalf("Connect: %v, want ErrRemoteAccess naming uid 65534", err)
	}
}

// exportedBinary copies the test binary where any user can run it (go
// test's build directory is its owner's only).
func exportedBinary(t *testing.T) string {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	dir, err := os.MkdirTemp("", "onnode-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	in, err := os.Open(self)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	exe := filepath.Join(dir, "onnode.test")
	out, err := os.OpenFile(exe, os.O_CREATE|os.O_WRONLY|os.O_EXCL, 0o755)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(out, in); err != nil {
		t.Fatal(err)
	}
	if err := out.Close(); err != nil {
		t.Fatal(err)
	}
	return exe
}

// TestAcceptFlood: 500 idle connections of another process queued on the
// accepting socket do not hold up the peer's.
func TestAcceptFlood(t *testing.T) {
	n := keyedNode(t, nil)
	p := startPeer(t, MechAuto)
	s := startPeer(t, MechAuto)
	ep := p.one("ep", "ep")[0]
	if got := s.one("flood", "flood %s 500", acceptorName(t, n, ep)); got[0] != "500" {
		t.Fatalf("flood connected %s of 500", got[0])
	}
	err, lines, d := connectBoth(t, n, p, ep)
	if err != nil || len(lines) != 0 {
		t.Fatalf("Connect: %v; helper: %q", err, lines)
	}
	if d > 2*time.Second {
		t.Errorf("Connect took %v behind the flood", d)
	}
	sendRecv(t, n, p)
}

// TestAcceptCap: connections of the peer's own process that stall take
// at most maxAccepting handshakes at once, each for acceptTimeout; one more
// is closed at once.
func TestAcceptCap(t *testing.T) {
	n := keyedNode(t, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	errc := make(chan error, 1)
	go func() { errc <- n.qp.Connect(ctx, fakePeer(n, os.Getpid())) }()
	name := "@" + n.qp.(*qp).name
	var idle []net.Conn
	defer func() {
		for _, c := range idle {
			c.Close()
		}
	}()
	start := time.Now()
	for range maxAccepting + 1 {
		c, err := net.Dial("unixpacket", name)
		if err != nil {
			t.Fatal(err)
		}
		idle = append(idle, c)
	}
	closedWithin := func(c net.Conn, d time.Duration) time.Duration {
		t.Helper()
		c.SetReadDeadline(time.Now().Add(d))
		var b [64]byte
		if k, err := c.Read(b[:]); !errors.Is(err, io.EOF) {
			t.Fatalf("read %d bytes, %v; want the connection closed", k, err)
		}
		return time.Since(start)
	}
	if d := closedWithin(idle[maxAccepting], 2*time.Second); d > 2*time.Second {
		t.Errorf("connection over the cap closed after %v", d)
	}
	if d := closedWithin(idle[0], acceptTimeout+3*time.Second); d < acceptTimeout-time.Second {
		t.Errorf("stalled handshake dropped after %v, before acceptTimeout %v", d, acceptTimeout)
	}
	select {
	case err := <-errc:
		t.Fatalf("Connect ended by stalled connections: %v", err)
	default:
	}
	cancel()
	if err := <-errc; !errors.Is(err, verbsio.ErrTimeout) {
		t.Fatalf("Connect: %v, want ErrTimeout", err)
	}
}

// TestRegionTableSealed: no peer can shrink the files it is given, nor
// map the region table writable.
func TestRegionTableSealed(t *testing.T) {
	n := keyedNode(t, nil)
	p := n.pd.(*pd)
	for what, fd := range map[string]int{"table": p.tableFD, "counters": n.qp.(*qp).ctrFD, "ring": n.qp.(*qp).inFD} {
		if err := unix.Ftruncate(fd, 0); !errors.Is(err, unix.EPERM) {
			t.Errorf("shrinking the %s: %v, want EPERM", what, err)
		}
		if err := checkSealed(fd, what); err != nil {
			t.Error(err)
		}
	}
	fd, mem, err := newMemfd("unsealed", 4096, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	defer unix.Munmap(mem)
	if err := checkSealed(fd, "unsealed"); !errors.Is(err, verbsio.ErrBadFrame) {
		t.Errorf("unsealed file: %v, want ErrBadFrame", err)
	}

	if seals, err := unix.FcntlInt(uintptr(p.tableFD), unix.F_GET_SEALS, 0); err != nil || seals&unix.F_SEAL_FUTURE_WRITE == 0 {
		t.Skipf("region table seals %#x (%v): this kernel has no F_SEAL_FUTURE_WRITE (Linux 5.1)", seals, err)
	}
	if _, err := unix.Mmap(p.tableFD, 0, tableBytes, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED); !errors.Is(err, unix.EPERM) {
		t.Errorf("writable mapping of the region table: %v, want EPERM", err)
	}
	m, err := unix.Mmap(p.tableFD, 0, tableBytes, unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(m)
	if err := unix.Mprotect(m, unix.PROT_READ|unix.PROT_WRITE); err == nil {
		t.Error("a read-only mapping of the region table became writable")
	}
	// Nor through a descriptor of its own, opened again read-write.
	fd2, err := unix.Open(fmt.Sprintf("/proc/self/fd/%d", p.tableFD), unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd2)
	if _, err := unix.Mmap(fd2, 0, tableBytes, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED); !errors.Is(err, unix.EPERM) {
		t.Errorf("writable mapping of the region table reopened read-write: %v, want EPERM", err)
	}
}

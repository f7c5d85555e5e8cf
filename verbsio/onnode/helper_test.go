package onnode

import (
	"bufio"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gdrlink/gdrlink/internal/offheap"
	"github.com/gdrlink/gdrlink/verbsio"
	"github.com/gdrlink/gdrlink/verbsio/verbstest"
)

// The tests run two real processes: the test binary re-executes itself with
// helperEnv set, and the copy obeys line commands on stdin.
const helperEnv = "GDRLINK_ONNODE_TEST_HELPER"

// testKeyEnv gives the helper its job key (the hex of the derived bytes);
// empty: none, whatever GDRLINK_JOB_KEY says.
const testKeyEnv = "GDRLINK_ONNODE_TEST_KEY"

func TestMain(m *testing.M) {
	verbstest.PeerMain()
	grantWriterMain()
	if os.Getenv(helperEnv) == "1" {
		os.Exit(runHelper(os.Stdin, os.Stdout))
	}
	os.Exit(m.Run())
}

// memory is test memory off the Go heap.
type memory struct {
	b  []byte
	fd int
}

func (m *memory) free() {
	unix.Munmap(m.b)
	if m.fd >= 0 {
		unix.Close(m.fd)
	}
}

// allocMemory makes size bytes of "anon", "thp" (anonymous, huge pages
// advised, 2 MiB aligned) or "memfd" (shared file) memory.
func allocMemory(kind string, size int) (*memory, error) {
	switch kind {
	case "anon":
		b, err := unix.Mmap(-1, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
		if err == nil {
			unix.Madvise(b, unix.MADV_NOHUGEPAGE)
		}
		return &memory{b: b, fd: -1}, err
	case "thp":
		const huge = 2 << 20
		raw, err := unix.Mmap(-1, 0, size+huge, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
		if err != nil {
			return nil, err
		}
		off := int((huge - offheap.Addr(raw)%huge) % huge)
		if off > 0 {
			unix.Munmap(raw[:off])
		}
		if tail := raw[off+size:]; len(tail) > 0 {
			unix.Munmap(tail)
		}
		b := raw[off : off+size : off+size]
		unix.Madvise(b, unix.MADV_HUGEPAGE)
		return &memory{b: b, fd: -1}, nil
	case "memfd":
		fd, b, err := newMemfd("gdrlink-onnode-test", size, 0)
		return &memory{b: b, fd: fd}, err
	}
	return nil, fmt.Errorf("memory kind %q", kind)
}

// node is one side: a device, a domain, one completion queue and a queue pair.
type node struct {
	dev  verbsio.Device
	pd   verbsio.ProtectionDomain
	scq  verbsio.CompletionQueue
	rcq  verbsio.CompletionQueue
	qp   verbsio.QueuePair
	mrs  map[uint32]verbsio.MemoryRegion
	mems map[uint32]*memory
	bufs []*memory
}

// envKey is the job key testKeyEnv gives, or nil.
func envKey() []byte {
	k, err := hex.DecodeString(os.Getenv(testKeyEnv))
	if err != nil || len(k) == 0 {
		return nil
	}
	return k
}

func newNode(opts Options) (*node, error) { return newNodeConfig(verbsio.Config{}, opts) }

func newNodeConfig(cfg verbsio.Config, opts Options) (*node, error) {
	d, err := OpenDevice(cfg, opts)
	if err != nil {
		return nil, err
	}
	n := &node{dev: d, mrs: map[uint32]verbsio.MemoryRegion{}, mems: map[uint32]*memory{}}
	if n.pd, err = d.AllocPD(); err != nil {
		return nil, err
	}
	if n.scq, err = d.CreateCQ(256); err != nil {
		return nil, err
	}
	if n.rcq, err = d.CreateCQ(256); err != nil {
		return nil, err
	}
	return n, n.newQP()
}

func (n *node) newQP() error {
	if n.qp != nil {
		n.qp.Close()
	}
	var err error
	n.qp, err = n.pd.CreateQP(verbsio.QPConfig{SendCQ: n.scq, RecvCQ: n.rcq, MaxSGE: 4, MaxInline: 256})
	return err
}

func (n *node) register(kind string, size int, access verbsio.Access, fill byte) (verbsio.MemoryRegion, error) {
	m, err := allocMemory(kind, size)
	if err != nil {
		return nil, err
	}
	for i := range m.b {
		m.b[i] = fill
	}
	mr, err := n.pd.RegisterMemory(offheap.Addr(m.b), size, access)
	if err != nil {
		m.free()
		return nil, err
	}
	n.mrs[mr.RKey()] = mr
	n.mems[mr.RKey()] = m
	return mr, nil
}

func (n *node) deregister(key uint32) {
	if mr := n.mrs[key]; mr != nil {
		mr.Close()
		n.mems[key].free()
		delete(n.mrs, key)
		delete(n.mems, key)
	}
}

func (n *node) close() {
	if n.qp != nil {
		n.qp.Close()
	}
	for k := range n.mrs {
		n.deregister(k)
	}
	n.scq.Close()
	n.rcq.Close()
	n.pd.Close()
	n.dev.Close()
}

func encodeEndpoint(e verbsio.Endpoint) string {
	return e.Provider + "," + e.Host + "," + hex.EncodeToString(e.Data)
}

func decodeEndpoint(s string) (verbsio.Endpoint, error) {
	f := strings.Split(s, ",")
	if len(f) != 3 {
		return verbsio.Endpoint{}, fmt.Errorf("endpoint %q", s)
	}
	d, err := hex.DecodeString(f[2])
	return verbsio.Endpoint{Provider: f[0], Host: f[1], Data: d}, err
}

func fmtCompletion(c verbsio.Completion) string {
	return fmt.Sprintf("comp %d %d %d %d %d %t", c.WRID, c.Status, c.Op, c.ByteLen, c.Imm, c.HasImm)
}

// runHelper is the peer process: it answers each command line with lines
// ending in "." (or "err ..." then ".").
func runHelper(in io.Reader, out io.Writer) int {
	opts := Options{Spin: defaultSpin}
	if m, err := parseMechanism(os.Getenv("GDRLINK_ONNODE_MECH")); err == nil {
		opts.Mechanism = m
	}
	n, err := newNodeConfig(verbsio.Config{JobKey: envKey()}, opts)
	if err != nil {
		fmt.Fprintf(out, "err %v\n.\n", err)
		return 1
	}
	var raws []*net.UnixConn // stranger's connections (rawdial, flood)
	defer func() {
		for _, c := range raws {
			c.Close()
		}
	}()
	w := bufio.NewWriter(out)
	say := func(f string, a ...any) { fmt.Fprintf(w, f+"\n", a...) }
	sc := bufio.NewScanner(in)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 0 {
			continue
		}
		arg := func(i int) int64 { v, _ := strconv.ParseInt(f[i], 0, 64); return v }
		switch f[0] {
		case "ep":
			say("ep %s", encodeEndpoint(n.qp.Endpoint()))
		case "newqp":
			if err := n.newQP(); err != nil {
				say("err %v", err)
			} else {
				say("ep %s", encodeEndpoint(n.qp.Endpoint()))
			}
		case "connect":
			e, err := decodeEndpoint(f[1])
			if err == nil {
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				err = n.qp.Connect(ctx, e)
				cancel()
			}
			if err != nil {
				say("err %v", err)
			}
		case "reg": // reg kind size access fill
			mr, err := n.register(f[1], int(arg(2)), verbsio.Access(arg(3)), byte(arg(4)))
			if err != nil {
				say("err %v", err)
			} else {
				say("mr %d %d %d", mr.Addr(), mr.RKey(), mr.Len())
			}
		case "dereg":
			n.deregister(uint32(arg(1)))
		case "check": // check rkey off len byte: first byte that differs, or -1
			m := n.mems[uint32(arg(1))]
			bad := -1
			for i, c := range m.b[arg(2) : arg(2)+arg(3)] {
				if c != byte(arg(4)) {
					bad = i
					break
				}
			}
			say("bad %d", bad)
		case "crc": // crc rkey off len
			m := n.mems[uint32(arg(1))]
			say("crc %d", crc32.ChecksumIEEE(m.b[arg(2):arg(2)+arg(3)]))
		case "recv": // recv wrid rkey off len
			mr := n.mrs[uint32(arg(2))]
			err := n.qp.PostRecv([]verbsio.RecvWR{{WRID: uint64(arg(1)), SG: []verbsio.SGE{{Addr: mr.Addr() + uintptr(arg(3)), Length: uint32(arg(4)), LKey: mr.LKey()}}}})
			if err != nil {
				say("err %v", err)
			}
		case "wait": // wait count timeout-ms
			ctx, cancel := context.WithTimeout(context.Background(), time.Duration(arg(2))*time.Millisecond)
			buf := make([]verbsio.Completion, 16)
			for got := 0; got < int(arg(1)); {
				k, err := n.rcq.Wait(ctx, buf)
				if err != nil {
					say("err %v", err)
					break
				}
				for _, c := range buf[:k] {
					say("%s", fmtCompletion(c))
				}
				got += k
			}
			cancel()
		case "writeimm": // writeimm lrkey loff len raddr rkey imm
			mr := n.mrs[uint32(arg(1))]
			wr := verbsio.SendWR{WRID: 1, Op: verbsio.OpWriteImm, Signaled: true, Imm: uint32(arg(6)), RemoteAddr: uint64(arg(4)), RKey: uint32(arg(5)),
				SG: []verbsio.SGE{{Addr: mr.Addr() + uintptr(arg(2)), Length: uint32(arg(3)), LKey: mr.LKey()}}}
			if err := n.qp.PostSend([]verbsio.SendWR{wr}); err != nil {
				say("err %v", err)
				break
			}
			buf := make([]verbsio.Completion, 1)
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			if _, err := n.scq.Wait(ctx, buf); err != nil {
				say("err %v", err)
			} else {
				say("%s", fmtCompletion(buf[0]))
			}
			cancel()
		case "burst": // burst lrkey len raddr rkey count: writes with immediates 0..count-1, the last signaled
			mr := n.mrs[uint32(arg(1))]
			count := int(arg(5))
			var err error
			for i := 0; i < count && err == nil; i++ {
				err = n.qp.PostSend([]verbsio.SendWR{{WRID: uint64(i), Op: verbsio.OpWriteImm, Imm: uint32(i), Signaled: i == count-1,
					RemoteAddr: uint64(arg(3)), RKey: uint32(arg(4)), SG: []verbsio.SGE{{Addr: mr.Addr(), Length: uint32(arg(2)), LKey: mr.LKey()}}}})
			}
			if err == nil {
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				buf := make([]verbsio.Completion, 1)
				if _, err = n.scq.Wait(ctx, buf); err == nil && buf[0].Status != verbsio.StatusSuccess {
					err = buf[0].Status.Err()
				}
				cancel()
			}
			if err != nil {
				say("err %v", err)
			}
		case "pong": // pong lkey raddr rkey size count: answer each immediate with one, from the second half of region lkey
			src := n.mrs[uint32(arg(1))]
			recvs := make([]verbsio.RecvWR, 64)
			err := n.qp.PostRecv(recvs)
			wr := []verbsio.SendWR{{Op: verbsio.OpWriteImm, RemoteAddr: uint64(arg(2)), RKey: uint32(arg(3)),
				SG: []verbsio.SGE{{Addr: src.Addr() + uintptr(src.Len()/2), Length: uint32(arg(4)), LKey: src.LKey()}}}}
			var c [1]verbsio.Completion
			for i := 0; i < int(arg(5)) && err == nil; i++ {
				if _, err = n.rcq.Wait(context.Background(), c[:]); err == nil {
					if err = n.qp.PostRecv(recvs[:1]); err == nil {
						err = n.qp.PostSend(wr)
					}
				}
			}
			if err != nil {
				say("err %v", err)
			}
		case "stall": // stall rkey addr len fill: announce a write, then make it on the next line ("go")
			q := n.qp.(*qp)
			rkey := uint32(arg(1))
			e, held, ok := readEntry(q.peerTable, q.peerCtr, int(rkey&(tableSlots-1)), true)
			if !ok || e.flags&flagValid == 0 || e.key != rkey {
				unhold(held)
				say("err entry of %#x not valid", rkey)
				break
			}
			say("held %d", rkey)
			say(".")
			w.Flush()
			if !sc.Scan() {
				unhold(held)
				return 1
			}
			src := make([]byte, arg(3))
			for i := range src {
				src[i] = byte(arg(4))
			}
			err := q.vmCopy(true, [][]byte{src}, uint64(arg(2)), len(src))
			unhold(held)
			say("wrote %v", err)
		case "poke": // poke slot value: set this side's write counter of the peer's slot
			atomic.StoreUint64(u64(n.qp.(*qp).peerCtr, int(arg(1))*counterSize), uint64(arg(2)))
		case "pid":
			say("pid %d", os.Getpid())
		case "rawdial", "flood": // rawdial name | flood name count: connect and send nothing
			count, k := 1, 0
			if f[0] == "flood" {
				count = int(arg(2))
			}
			for ; k < count; k++ {
				c, err := net.Dial("unixpacket", "@"+f[1])
				if err != nil {
					if f[0] == "rawdial" {
						say("err %v", err)
					}
					break
				}
				raws = append(raws, c.(*net.UnixConn))
			}
			if f[0] == "flood" {
				say("flood %d", k)
			} else if k == 1 {
				say("raw %d", len(raws)-1)
			}
		case "rawhello": // rawhello i name peername: a hello as from name, with four sealed memfds
			if err := rawHello(raws[arg(1)], f[2], f[3]); err != nil {
				say("err %v", err)
			}
		case "rawread": // rawread i timeout-ms: bytes (-1: none in time), descriptors, closed
			say("%s", rawRead(raws[arg(1)], time.Duration(arg(2))*time.Millisecond))
		case "die":
			w.Flush()
			syscall.Kill(os.Getpid(), syscall.SIGKILL)
		case "exit":
			n.close()
			say(".")
			w.Flush()
			return 0
		default:
			say("err unknown command %q", f[0])
		}
		say(".")
		w.Flush()
	}
	n.close()
	return 0
}

// rawHello sends on c what a queue pair named name would send to peer:
// its hello and four sealed memfds of the right sizes.
func rawHello(c *net.UnixConn, name, peer string) error {
	var fds []int
	defer func() { closeFDs(fds) }()
	for _, size := range []int{ringFile, 8, tableBytes, counterBytes} {
		fd, mem, err := newMemfd("stranger", size, sealsShared)
		if err != nil {
			return err
		}
		unix.Munmap(mem)
		fds = append(fds, fd)
	}
	h := hello{PID: uint32(os.Getpid()), RingSize: ringData, Name: name, PeerName: peer}
	_, _, err := c.WriteMsgUnix(h.Append(nil), unix.UnixRights(fds...), nil)
	return err
}

// rawRead reads one message from c within d and says "raw BYTES FDS
// CLOSED": BYTES is -1 when nothing came in time; the descriptors
// received are closed.
func rawRead(c *net.UnixConn, d time.Duration) string {
	c.SetReadDeadline(time.Now().Add(d))
	buf := make([]byte, 4096)
	oob := make([]byte, unix.CmsgSpace(16*4))
	n, oobn, _, _, err := c.ReadMsgUnix(buf, oob)
	fds := parseRights(oob[:oobn])
	closeFDs(fds)
	switch {
	case errors.Is(err, os.ErrDeadlineExceeded):
		return fmt.Sprintf("raw -1 %d false", len(fds))
	case err == nil && n == 0, errors.Is(err, io.EOF), errors.Is(err, syscall.ECONNRESET):
		return fmt.Sprintf("raw 0 %d true", len(fds))
	case err != nil:
		return fmt.Sprintf("raw -1 %d false %v", len(fds), err)
	}
	return fmt.Sprintf("raw %d %d false", n, len(fds))
}

// rawReadHex reads one message from c within d and says "rawhex HEX FDS
// CLOSED": HEX is the message ("-" when nothing came); the descriptors
// received are closed.
func rawReadHex(c *net.UnixConn, d time.Duration) string {
	c.SetReadDeadline(time.Now().Add(d))
	buf := make([]byte, 4096)
	oob := make([]byte, unix.CmsgSpace(16*4))
	n, oobn, _, _, err := c.ReadMsgUnix(buf, oob)
	fds := parseRights(oob[:oobn])
	closeFDs(fds)
	closed := err == nil && n == 0 || errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET)
	if n == 0 {
		return fmt.Sprintf("rawhex - %d %v", len(fds), closed)
	}
	return fmt.Sprintf("rawhex %x %d %v", buf[:n], len(fds), closed)
}

// peer is the helper process seen from the test.
type peer struct {
	t    testing.TB
	cmd  *exec.Cmd
	in   io.WriteCloser
	out  *bufio.Scanner
	mu   sync.Mutex
	dead bool
}

func startPeer(t testing.TB, mech Mechanism) *peer {
	t.Helper()
	return startPeerWith(t, peerOpts{mech: mech})
}

// peerOpts say how to start a helper.
type peerOpts struct {
	mech Mechanism
	key  []byte              // its job key; nil: none
	exe  string              // the binary; "": this test binary
	cred *syscall.Credential // run as another user (needs root)
}

func startPeerWith(t testing.TB, o peerOpts) *peer {
	t.Helper()
	exe := o.exe
	if exe == "" {
		var err error
		if exe, err = os.Executable(); err != nil {
			t.Fatal(err)
		}
	}
	cmd := exec.Command(exe, "-test.run=^$")
	cmd.Env = append(os.Environ(), helperEnv+"=1", "GDRLINK_ONNODE_MECH="+o.mech.String(), testKeyEnv+"="+hex.EncodeToString(o.key))
	if o.cred != nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: o.cred}
		cmd.Dir = os.TempDir()
	}
	cmd.Stderr = os.Stderr
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	outp, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &peer{t: t, cmd: cmd, in: in, out: bufio.NewScanner(outp)}
	t.Cleanup(func() {
		if !p.dead {
			fmt.Fprintln(p.in, "exit")
		}
		p.in.Close()
		done := make(chan struct{})
		go func() { cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			cmd.Process.Kill()
			<-done
			t.Errorf("helper process did not exit")
		}
	})
	return p
}

// do sends a command and returns its answer lines (without the final ".").
func (p *peer) do(format string, a ...any) []string {
	p.t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	fmt.Fprintf(p.in, format+"\n", a...)
	var lines []string
	for p.out.Scan() {
		l := p.out.Text()
		if l == "." {
			return lines
		}
		lines = append(lines, l)
	}
	p.t.Fatalf("helper ended during %q: %v", fmt.Sprintf(format, a...), p.out.Err())
	return nil
}

// one runs a command expected to answer one line starting with want and
// returns its fields after the first.
func (p *peer) one(want, format string, a ...any) []string {
	p.t.Helper()
	lines := p.do(format, a...)
	if len(lines) != 1 || !strings.HasPrefix(lines[0], want+" ") {
		p.t.Fatalf("%q answered %q, want a %q line", fmt.Sprintf(format, a...), lines, want)
	}
	return strings.Fields(lines[0])[1:]
}

func (p *peer) ok(format string, a ...any) {
	p.t.Helper()
	if lines := p.do(format, a...); len(lines) != 0 {
		p.t.Fatalf("%q answered %q", fmt.Sprintf(format, a...), lines)
	}
}

func atoi(t testing.TB, s string) uint64 {
	t.Helper()
	v, err := strconv.ParseUint(s, 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// connect connects n's queue pair with the helper's current one.
func connect(t testing.TB, n *node, p *peer, ep []string) {
	t.Helper()
	remote, err := decodeEndpoint(ep[0])
	if err != nil {
		t.Fatal(err)
	}
	errc := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		errc <- n.qp.Connect(ctx, remote)
	}()
	p.ok("connect %s", encodeEndpoint(n.qp.Endpoint()))
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
}

// pair starts a helper and connects a local node to it.
func pair(t testing.TB, mech Mechanism) (*node, *peer) {
	t.Helper()
	return keyedPair(t, mech, nil)
}

// keyedPair is pair with a job key on both sides.
func keyedPair(t testing.TB, mech Mechanism, key []byte) (*node, *peer) {
	t.Helper()
	n, err := newNodeConfig(verbsio.Config{JobKey: key}, Options{Mechanism: mech, Spin: defaultSpin})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(n.close)
	p := startPeerWith(t, peerOpts{mech: mech, key: key})
	connect(t, n, p, p.one("ep", "ep"))
	return n, p
}

// waitOne waits for one completion on cq.
func waitOne(t testing.TB, cq verbsio.CompletionQueue, d time.Duration) verbsio.Completion {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	var c [1]verbsio.Completion
	if _, err := cq.Wait(ctx, c[:]); err != nil {
		t.Fatalf("waiting for a completion: %v", err)
	}
	return c[0]
}

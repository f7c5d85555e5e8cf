package onnode

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gdrlink/gdrlink/internal/offheap"
	"github.com/gdrlink/gdrlink/verbsio"
)

// writerEnv turns a re-executed test binary into the writing peer of the
// two-process grant tests.
const writerEnv = "GDRLINK_ONNODE_GRANT_WRITER"

// writerMechEnv is the writing peer's Options.Mechanism ("shm" or "vm").
const writerMechEnv = "GDRLINK_ONNODE_GRANT_MECH"

// writerCmd is one command to the writing peer, a JSON object a line.
type writerCmd struct {
	Op       string // "qp", "connect", "write", "exit"
	ID       int
	Endpoint *verbsio.Endpoint
	Imm      bool
	ImmVal   uint32
	Addr     uint64
	RKey     uint32
	Len      int
	Fill     byte
}

type writerReply struct {
	Err      string
	ID       int
	Endpoint *verbsio.Endpoint
	Status   verbsio.Status
}

// grantWriterMain runs the writing peer when the process was started as
// one, and never returns then: an onnode device, queue pairs on request, and
// writes of a filled buffer to whatever address and rkey it is told, each
// answered with its completion's status.
func grantWriterMain() {
	if os.Getenv(writerEnv) == "" {
		return
	}
	if err := runWriter(os.Stdin, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "grant writer:", err)
		os.Exit(1)
	}
	os.Exit(0)
}

func runWriter(in io.Reader, out io.Writer) error {
	mech := MechSHM
	if os.Getenv(writerMechEnv) == "vm" {
		mech = MechVM
	}
	dev, err := OpenDevice(verbsio.Config{}, Options{Mechanism: mech})
	if err != nil {
		return err
	}
	defer dev.Close()
	pd, err := dev.AllocPD()
	if err != nil {
		return err
	}
	defer pd.Close()
	buf, err := unix.Mmap(-1, 0, 1<<16, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return err
	}
	defer unix.Munmap(buf)
	src, err := pd.RegisterMemory(offheap.Addr(buf), len(buf), verbsio.AccessLocalWrite)
	if err != nil {
		return err
	}
	defer src.Close()
	type wqp struct {
		qp verbsio.QueuePair
		cq verbsio.CompletionQueue
	}
	var qps []wqp
	defer func() {
		for _, q := range qps {
			q.qp.Close()
			q.cq.Close()
		}
	}()
	enc := json.NewEncoder(out)
	dec := json.NewDecoder(bufio.NewReader(in))
	enc.Encode(writerReply{})
	for {
		var c writerCmd
		if err := dec.Decode(&c); err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		}
		var rep writerReply
		err := func() error {
			switch c.Op {
			case "exit":
				return io.EOF
			case "qp":
				cq, err := dev.CreateCQ(16)
				if err != nil {
					return err
				}
				qp, err := pd.CreateQP(verbsio.QPConfig{SendCQ: cq, RecvCQ: cq})
				if err != nil {
					cq.Close()
					return err
				}
				qps = append(qps, wqp{qp, cq})
				ep := qp.Endpoint()
				rep.ID, rep.Endpoint = len(qps)-1, &ep
			case "connect":
				ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
				defer cancel()
				return qps[c.ID].qp.Connect(ctx, *c.Endpoint)
			case "write":
				for i := range buf[:c.Len] {
					buf[i] = c.Fill
				}
				wr := verbsio.SendWR{WRID: 1, Op: verbsio.OpWrite, Signaled: true, RemoteAddr: c.Addr, RKey: c.RKey,
					SG: []verbsio.SGE{{Addr: src.Addr(), Length: uint32(c.Len), LKey: src.LKey()}}}
				if c.Imm {
					wr.Op, wr.Imm = verbsio.OpWriteImm, c.ImmVal
				}
				q := qps[c.ID]
				if err := q.qp.PostSend([]verbsio.SendWR{wr}); err != nil {
					return err
				}
				ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
				defer cancel()
				var wc [1]verbsio.Completion
				if _, err := q.cq.Wait(ctx, wc[:]); err != nil {
					return err
				}
				rep.Status = wc[0].Status
			default:
				return fmt.Errorf("unknown command %q", c.Op)
			}
			return nil
		}()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			rep.Err = err.Error()
		}
		if err := enc.Encode(rep); err != nil {
			return err
		}
	}
}

// writerProc is the test's handle on a writing peer process.
type writerProc struct {
	cmd  *exec.Cmd
	in   io.WriteCloser
	dec  *json.Decoder
	done chan struct{}
}

func startWriter(t *testing.T, mech string) *writerProc {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe, "-test.run=^$")
	cmd.Env = append(os.Environ(), writerEnv+"=1", writerMechEnv+"="+mech)
	cmd.Stderr = os.Stderr
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	w := &writerProc{cmd: cmd, in: in, dec: json.NewDecoder(bufio.NewReader(out)), done: make(chan struct{})}
	go func() { cmd.Wait(); close(w.done) }()
	t.Cleanup(func() {
		w.in.Write([]byte(`{"Op":"exit"}` + "\n"))
		w.in.Close()
		select {
		case <-w.done:
		case <-time.After(10 * time.Second):
			cmd.Process.Kill()
			<-w.done
		}
	})
	var hello writerReply
	if err := w.dec.Decode(&hello); err != nil {
		t.Fatalf("the writer did not start: %v", err)
	}
	return w
}

func (w *writerProc) call(t *testing.T, c writerCmd) writerReply {
	t.Helper()
	b, _ := json.Marshal(c)
	if _, err := w.in.Write(append(b, '\n')); err != nil {
		t.Fatalf("writer %s: %v", c.Op, err)
	}
	var rep writerReply
	if err := w.dec.Decode(&rep); err != nil {
		t.Fatalf("writer %s: %v", c.Op, err)
	}
	if rep.Err != "" {
		t.Fatalf("writer %s: %s", c.Op, rep.Err)
	}
	return rep
}

// grantTarget is the granting side: a region of two pages (four 2 KiB
// "tensors" side by side, as in an arena) between two unregistered guard
// pages, all filled with targetFill. With memfd set the four pages are a
// shared mapping of a memfd (the writer maps the region's file: MechSHM),
// otherwise anonymous memory (process_vm_writev: MechVM).
type grantTarget struct {
	dev  verbsio.Device
	pd   verbsio.ProtectionDomain
	mem  []byte
	mr   verbsio.MemoryRegion
	page int
}

const targetFill = 0xA5

func newGrantTarget(t *testing.T, memfd bool) *grantTarget {
	t.Helper()
	g := &grantTarget{page: unix.Getpagesize()}
	var err error
	if g.dev, err = OpenDevice(verbsio.Config{}, Options{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { g.dev.Close() })
	if g.pd, err = g.dev.AllocPD(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { g.pd.Close() })
	if memfd {
		fd, err := unix.MemfdCreate("gdrlink-grant-test", unix.MFD_CLOEXEC)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { unix.Close(fd) })
		if err := unix.Ftruncate(fd, int64(4*g.page)); err != nil {
			t.Fatal(err)
		}
		if g.mem, err = unix.Mmap(fd, 0, 4*g.page, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED); err != nil {
			t.Fatal(err)
		}
	} else if g.mem, err = unix.Mmap(-1, 0, 4*g.page, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Munmap(g.mem) })
	for i := range g.mem {
		g.mem[i] = targetFill
	}
	// Registered with remote write, as the arenas are: grants must close
	// what the region's rkey would open.
	if g.mr, err = g.pd.RegisterMemory(offheap.Addr(g.mem[g.page:]), 2*g.page, verbsio.AccessLocalWrite|verbsio.AccessRemoteWrite); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { g.mr.Close() })
	if !g.dev.Caps().Grants {
		t.Fatal("onnode devices advertise no grants")
	}
	if _, ok := g.mr.(verbsio.Granter); !ok {
		t.Fatal("Caps.Grants is set but the region is no verbsio.Granter")
	}
	return g
}

// tensor returns the address of "tensor" i: 2 KiB from the region's
// start.
func (g *grantTarget) tensor(i int) uint64 { return uint64(g.mr.Addr()) + uint64(i*2048) }

// connect makes a queue pair here and one in the writer, connected, and
// returns both with this side's completion queue; 4 receives are posted
// here for writes with immediate.
func (g *grantTarget) connect(t *testing.T, w *writerProc) (verbsio.QueuePair, verbsio.CompletionQueue, int) {
	t.Helper()
	cq, err := g.dev.CreateCQ(16)
	if err != nil {
		t.Fatal(err)
	}
	qp, err := g.pd.CreateQP(verbsio.QPConfig{SendCQ: cq, RecvCQ: cq})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { qp.Close(); cq.Close() })
	if err := qp.PostRecv([]verbsio.RecvWR{{WRID: 1}, {WRID: 2}, {WRID: 3}, {WRID: 4}}); err != nil {
		t.Fatal(err)
	}
	rep := w.call(t, writerCmd{Op: "qp"})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	errc := make(chan error, 1)
	go func() { errc <- qp.Connect(ctx, *rep.Endpoint) }()
	ep := qp.Endpoint()
	w.call(t, writerCmd{Op: "connect", ID: rep.ID, Endpoint: &ep})
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	return qp, cq, rep.ID
}

func (g *grantTarget) grant(t *testing.T, tensor int, qp verbsio.QueuePair) verbsio.Grant {
	t.Helper()
	gr, err := g.mr.(verbsio.Granter).Grant(uintptr(g.tensor(tensor)), 2048, qp, 1)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { gr.Revoke() })
	return gr
}

// expect checks the whole mapping: targetFill everywhere but in the ranges
// given, which hold their fill.
func (g *grantTarget) expect(t *testing.T, ranges ...[3]int) {
	t.Helper()
	want := bytes.Repeat([]byte{targetFill}, len(g.mem))
	for _, r := range ranges {
		for i := r[0]; i < r[0]+r[1]; i++ {
			want[g.page+i] = byte(r[2])
		}
	}
	if i := firstDiff(g.mem, want); i >= 0 {
		t.Fatalf("byte %d of the mapping (region offset %d) is %#x, want %#x", i, i-g.page, g.mem[i], want[i])
	}
}

func firstDiff(a, b []byte) int {
	for i := range a {
		if a[i] != b[i] {
			return i
		}
	}
	return -1
}

// TestGrantTwoProcess has a peer process write through grants from a real
// queue pair: inside lands; outside by one byte, after the grant's write
// with immediate, from another queue pair, after Revoke, or with the
// region's rkey once it gives grants, the peer's write completes with
// StatusRemoteAccess and no byte of the mapping (guard pages included)
// changes. Both mechanisms: the writer maps the region's file (shm), or
// writes with process_vm_writev (vm).
func TestGrantTwoProcess(t *testing.T) {
	for _, c := range []struct {
		mech  string
		memfd bool
	}{{"shm", true}, {"vm", false}} {
		t.Run(c.mech, func(t *testing.T) { testGrantTwoProcess(t, c.mech, c.memfd) })
	}
}

func testGrantTwoProcess(t *testing.T, mech string, memfd bool) {
	w := startWriter(t, mech)
	g := newGrantTarget(t, memfd)
	write := func(id int, addr uint64, rkey uint32, n int, fill byte, imm bool) verbsio.Status {
		return w.call(t, writerCmd{Op: "write", ID: id, Addr: addr, RKey: rkey, Len: n, Fill: fill, Imm: imm, ImmVal: 77}).Status
	}
	refused := func(what string, st verbsio.Status) {
		t.Helper()
		if st != verbsio.StatusRemoteAccess {
			t.Fatalf("%s: the writer's completion is %v, want %v", what, st, verbsio.StatusRemoteAccess)
		}
	}

	// (a) inside lands, (c) and not again once the write with immediate
	// has completed.
	qp, cq, id := g.connect(t, w)
	gr := g.grant(t, 1, qp)
	if st := write(id, g.tensor(1), gr.RKey(), 1024, 0x11, false); st != verbsio.StatusSuccess {
		t.Fatalf("plain write inside the grant: %v", st)
	}
	if st := write(id, g.tensor(1)+1024, gr.RKey(), 1024, 0x12, true); st != verbsio.StatusSuccess {
		t.Fatalf("write with immediate inside the grant: %v", st)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var wc [1]verbsio.Completion
	if _, err := cq.Wait(ctx, wc[:]); err != nil || wc[0].Imm != 77 || wc[0].Status != verbsio.StatusSuccess {
		t.Fatalf("receive completion %+v, %v", wc[0], err)
	}
	landed := [][3]int{{2048, 1024, 0x11}, {3072, 1024, 0x12}}
	g.expect(t, landed...)
	refused("write through a used grant", write(id, g.tensor(1), gr.RKey(), 16, 0x13, false))
	g.expect(t, landed...)

	// (b) one byte before, one byte after.
	qp, _, id = g.connect(t, w)
	gr = g.grant(t, 2, qp)
	refused("one byte before the grant", write(id, g.tensor(2)-1, gr.RKey(), 16, 0x21, false))
	g.expect(t, landed...)
	qp, _, id = g.connect(t, w)
	gr = g.grant(t, 2, qp)
	refused("one byte after the grant", write(id, g.tensor(2)+2048-15, gr.RKey(), 16, 0x22, true))
	g.expect(t, landed...)

	// (d) a grant given to another queue pair; the writer's queue pair
	// that has it can use it.
	qpA, _, idA := g.connect(t, w)
	qpB, _, idB := g.connect(t, w)
	_ = qpA
	gr = g.grant(t, 2, qpB)
	refused("grant of another queue pair", write(idA, g.tensor(2), gr.RKey(), 16, 0x31, false))
	g.expect(t, landed...)
	if st := write(idB, g.tensor(2), gr.RKey(), 16, 0x32, false); st != verbsio.StatusSuccess {
		t.Fatalf("the same write from the queue pair the grant was given to: %v", st)
	}
	landed = append(landed, [3]int{4096, 16, 0x32})
	g.expect(t, landed...)

	// (e) a revoked grant.
	qp, _, id = g.connect(t, w)
	gr = g.grant(t, 3, qp)
	if err := gr.Revoke(); err != nil {
		t.Fatal(err)
	}
	refused("revoked grant", write(id, g.tensor(3), gr.RKey(), 16, 0x41, false))
	g.expect(t, landed...)

	// The region's own rkey, now that it gives grants: not into a
	// granted tensor, not into its neighbour.
	qp, _, id = g.connect(t, w)
	g.grant(t, 3, qp)
	refused("region rkey into a granted tensor", write(id, g.tensor(3), g.mr.RKey(), 16, 0x51, false))
	qp, _, id = g.connect(t, w)
	refused("region rkey into a neighbour", write(id, g.tensor(0), g.mr.RKey(), 16, 0x52, true))
	g.expect(t, landed...)
}

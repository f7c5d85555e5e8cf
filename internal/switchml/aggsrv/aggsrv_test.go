package aggsrv

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/internal/jobauth"
	"github.com/gdrlink/gdrlink/internal/switchml/agg"
	"github.com/gdrlink/gdrlink/internal/switchml/rocev2"
)

const childEnv = "GDRLINK_AGGSRV_TEST_SERVER"

func TestMain(m *testing.M) {
	if spec := os.Getenv(rxeWorkerEnv); spec != "" {
		if err := runRXEWorker(spec); err != nil {
			fmt.Fprintln(os.Stderr, "rxe worker:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	if os.Getenv(childEnv) == "1" {
		if err := runChild(); err != nil {
			fmt.Fprintln(os.Stderr, "aggregator child:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// runChild is the aggregator process of TestTwoProcesses: it serves until
// its standard input closes, then prints its counters.
func runChild() error {
	key, _, err := jobauth.FromEnv(os.Getenv)
	if err != nil {
		return err
	}
	peer, _ := strconv.Atoi(os.Getenv(childEnv + "_PEER_PORT"))
	// _ADDR, when set, is the address to serve on, with the data socket
	// at RoCEv2's port, and _RAW the Config.RawIPv4 mode (TestRXEWorkers).
	host, dport := "127.0.0.1", 0
	if a := os.Getenv(childEnv + "_ADDR"); a != "" {
		host, dport = a, rocev2.Port
	}
	drop, _ := strconv.ParseFloat(os.Getenv(childEnv+"_DROP"), 64)
	cl, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		return err
	}
	dc, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.ParseIP(host), Port: dport})
	if err != nil {
		return err
	}
	raw := RawOff
	if m := os.Getenv(childEnv + "_RAW"); m != "" {
		if raw, err = ParseRawMode(m); err != nil {
			return err
		}
	}
	s, err := New(Config{Key: key, Control: cl, Data: dc, PeerPort: uint16(peer), Seed: 7, SetupTimeout: 30 * time.Second, Drop: drop, RawIPv4: raw})
	if err != nil {
		return err
	}
	go s.Serve()
	fmt.Printf("ready %s %s\n", cl.Addr(), dc.LocalAddr())
	io.Copy(io.Discard, os.Stdin)
	st := s.Stats()
	if err := s.Close(); err != nil {
		return err
	}
	b, _ := json.Marshal(st)
	fmt.Printf("stats %s\n", b)
	return nil
}

// worker is a worker emulated with a UDP socket: it speaks RoCEv2 as a UC
// queue pair would.
type worker struct {
	t       *testing.T
	rank    int
	ip      [4]byte
	sock    *net.UDPConn
	ctl     net.Conn
	as      Assignment
	agg     netip.AddrPort
	psn     uint32 // next PSN sent
	rpsn    uint32 // next PSN expected in replies
	loss    *rand.Rand
	drops   int
	drained int
}

func (w *worker) setup(key jobauth.Key, control string, workers, slots int) error {
	c, err := net.Dial("tcp", control)
	if err != nil {
		return err
	}
	w.ctl = c
	if err := jobauth.Initiate(c, key, Purpose, uint32(w.rank), jobauth.EndsOf(c, true)); err != nil {
		return err
	}
	w.psn = uint32(1000 * (w.rank + 1))
	a := Announce{Job: "test-job", Workers: workers, Rank: w.rank, SlotBytes: agg.SlotSmall, Slots: slots, Addr: w.ip,
		RKey: uint32(0x700 + w.rank), QPNs: []uint32{uint32(0x40 + w.rank)}, PSNs: []uint32{w.psn}}
	if err := writeMessage(c, a.Append(nil)); err != nil {
		return err
	}
	body, err := readMessage(c)
	if err != nil {
		return err
	}
	if w.as, err = ParseAssignment(body); err != nil {
		return err
	}
	if w.as.Err != "" {
		return fmt.Errorf("%w: %s", ErrSetup, w.as.Err)
	}
	w.rpsn = w.as.PSNs[0]
	return nil
}

// allReduce sends one message of n slots (set s) and returns the result,
// resending the whole message until it comes.
func (w *worker) allReduce(data []byte, n, set int, imm uint32) ([]byte, uint32) {
	for attempt := 0; attempt < 50; attempt++ {
		for k := range n {
			p := rocev2.Packet{DestQP: w.as.QPNs[0], PSN: w.psn, PKey: rocev2.DefaultPKey, Payload: data[k*agg.SlotSmall : (k+1)*agg.SlotSmall]}
			w.psn = (w.psn + 1) & (1<<24 - 1)
			switch {
			case n == 1:
				p.Opcode = rocev2.WriteOnlyWithImm
			case k == 0:
				p.Opcode = rocev2.WriteFirst
			case k == n-1:
				p.Opcode = rocev2.WriteLastWithImm
			default:
				p.Opcode = rocev2.WriteMiddle
			}
			if k == 0 {
				p.VA, p.RKey, p.DMALen = 0x10000, uint32(2*w.as.Base+set), uint32(n*agg.SlotSmall)
			}
			if p.Opcode.HasImm() {
				p.Imm = imm
			}
			ip := rocev2.IPv4{Src: w.ip, Dst: w.as.Addr, DontFragment: true, SrcPort: uint16(w.sock.LocalAddr().(*net.UDPAddr).Port)}
			b, err := rocev2.AppendUDP(nil, &ip, &p)
			if err != nil {
				w.t.Error(err)
				return nil, 0
			}
			if w.loss.Float64() < 0.05 {
				w.drops++
				continue
			}
			if _, err := w.sock.WriteToUDPAddrPort(b, w.agg); err != nil {
				w.t.Error(err)
				return nil, 0
			}
		}
		if res, imm, ok := w.receive(n); ok {
			if attempt > 0 {
				w.drain()
			}
			return res, imm
		}
	}
	w.t.Errorf("worker %d: no result after 50 attempts", w.rank)
	return nil, 0
}

// drain discards replies until the reply path has been quiet for a while:
// after a retransmitted message's result, the aggregator may answer the
// retransmission with the result again (see package agg), and that second
// reply must not be taken for the next message's.
func (w *worker) drain() {
	buf := make([]byte, 2048)
	for {
		w.sock.SetReadDeadline(time.Now().Add(500 * time.Millisecond))
		if _, _, err := w.sock.ReadFromUDPAddrPort(buf); err != nil {
			return
		}
		w.drained++
	}
}

// receive is the UC responder: in-order packets of one message; a gap drops
// the rest; it gives up after a timeout.
func (w *worker) receive(n int) ([]byte, uint32, bool) {
	var res []byte
	active := false
	buf := make([]byte, 2048)
	for {
		w.sock.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
		m, _, err := w.sock.ReadFromUDPAddrPort(buf)
		if err != nil {
			return nil, 0, false
		}
		p, err := rocev2.ParseTransport(buf[:m])
		if err != nil {
			w.t.Errorf("reply: %v", err)
			return nil, 0, false
		}
		ip := rocev2.IPv4{Src: w.as.Addr, Dst: w.ip, DontFragment: true, SrcPort: w.agg.Port()}
		if err := rocev2.CheckICRC(&ip, buf[:m]); err != nil {
			w.t.Errorf("reply ICRC: %v", err)
		}
		if p.Opcode.Starts() {
			active, res = true, nil
			if p.RKey != uint32(0x700+w.rank) || p.VA != 0x10000 || p.DMALen != uint32(n*agg.SlotSmall) {
				w.t.Errorf("reply RETH %#x %#x %d", p.VA, p.RKey, p.DMALen)
			}
		} else if !active || p.PSN != w.rpsn {
			active = false
		}
		w.rpsn = (p.PSN + 1) & (1<<24 - 1)
		if !active {
			continue
		}
		if w.loss.Float64() < 0.03 { // a reply packet lost
			w.drops++
			active = false
			continue
		}
		res = append(res, p.Payload...)
		if p.Opcode.Ends() {
			return res, p.Imm, true
		}
	}
}

// TestTwoProcesses runs the aggregator in a second process and three
// workers here, over UDP on loopback, with packets lost both ways: every
// result is the exact sum, the job key guards setup, and the job ends when a
// worker leaves.
func TestTwoProcesses(t *testing.T) {
	key, secret, err := jobauth.Generate()
	if err != nil {
		t.Fatal(err)
	}
	const workers = 3
	ws := make([]*worker, workers)
	// Every worker receives on the same port, each on its own loopback
	// address, as RoCE NICs all listen on 4791.
	var port int
	for try := 0; ; try++ {
		ok := true
		for i := range ws {
			ip := [4]byte{127, 0, 0, byte(2 + i)}
			s, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IP(ip[:]), Port: port})
			if err != nil {
				ok = false
				break
			}
			port = s.LocalAddr().(*net.UDPAddr).Port
			ws[i] = &worker{t: t, rank: i, ip: ip, sock: s, loss: rand.New(rand.NewPCG(uint64(i), 1))}
		}
		if ok {
			break
		}
		for _, w := range ws {
			if w != nil {
				w.sock.Close()
			}
		}
		if try == 5 {
			t.Skip("could not bind one UDP port on 127.0.0.2-4")
		}
		port = 0
	}
	defer func() {
		for _, w := range ws {
			w.sock.Close()
		}
	}()

	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"=1", childEnv+"_PEER_PORT="+strconv.Itoa(port), jobauth.KeyEnv+"="+secret)
	stdin, _ := cmd.StdinPipe()
	stdout, _ := cmd.StdoutPipe()
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	out := bufio.NewScanner(stdout)
	if !out.Scan() {
		t.Fatal("the aggregator process said nothing")
	}
	f := strings.Fields(out.Text())
	if len(f) != 3 || f[0] != "ready" {
		t.Fatalf("aggregator: %q", out.Text())
	}
	control, data := f[1], netip.MustParseAddrPort(f[2])

	// A wrong key is refused before anything of the job travels.
	other, _, _ := jobauth.Generate()
	bad := &worker{t: t, rank: 0}
	if err := bad.setup(other, control, workers, 4); !errors.Is(err, jobauth.ErrRefused) {
		t.Fatalf("setup with another key: %v, want ErrRefused", err)
	}

	var wg sync.WaitGroup
	errs := make([]error, workers)
	for i, w := range ws {
		w.agg = data
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = w.setup(key, control, workers, 4)
		}()
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}

	// Messages of 3 slots, the sets alternating; each worker's data is
	// its rank plus the element index plus the message number.
	const msgs = 10
	results := make([][][]byte, workers)
	imms := make([][]uint32, workers)
	for i, w := range ws {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for m := range msgs {
				d := make([]byte, 3*agg.SlotSmall)
				for k := 0; k < len(d); k += 4 {
					binary.LittleEndian.PutUint32(d[k:], uint32(int32(i*1000+k/4-m*7)))
				}
				res, imm := w.allReduce(d, 3, m%2, uint32(i)<<24|uint32(m))
				results[i] = append(results[i], res)
				imms[i] = append(imms[i], imm)
			}
		}()
	}
	wg.Wait()
	if t.Failed() {
		t.FailNow()
	}
	drops, drained := 0, 0
	for i, w := range ws {
		drops += w.drops
		drained += w.drained
		for m := range msgs {
			res := results[i][m]
			for k := 0; k < len(res); k += 4 {
				want := int32(0)
				for r := range workers {
					want += int32(r*1000 + k/4 - m*7)
				}
				if got := int32(binary.LittleEndian.Uint32(res[k:])); got != want {
					t.Fatalf("worker %d message %d element %d: %d, want %d", i, m, k/4, got, want)
				}
			}
			if want := uint32(workers-1)<<24 | uint32(m); imms[i][m] != want {
				t.Fatalf("worker %d message %d: immediate %#x, want %#x", i, m, imms[i][m], want)
			}
		}
	}
	t.Logf("%d packets dropped on purpose, %d second replies drained", drops, drained)

	// One worker leaves: the job ends, the others are told its rank, and
	// their connections close.
	ws[0].ctl.Close()
	for _, w := range ws[1:] {
		w.ctl.SetReadDeadline(time.Now().Add(10 * time.Second))
		b, err := ReadMessage(w.ctl)
		if err != nil {
			t.Fatalf("worker %d's control connection after another left: %v, want an Ended message", w.rank, err)
		}
		if e, err := ParseEnded(b); err != nil || e.Rank != ws[0].rank {
			t.Fatalf("worker %d told %+v, %v; want rank %d ended", w.rank, e, err, ws[0].rank)
		}
		if _, err := w.ctl.Read(make([]byte, 1)); err != io.EOF {
			t.Fatalf("worker %d's control connection after the end notice: %v, want EOF", w.rank, err)
		}
	}
	stdin.Close()
	var st Stats
	for out.Scan() {
		if rest, ok := strings.CutPrefix(out.Text(), "stats "); ok {
			if err := json.Unmarshal([]byte(rest), &st); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := cmd.Wait(); err != nil {
		t.Fatalf("aggregator process: %v", err)
	}
	t.Logf("aggregator: %+v", st)
	if st.Completed < msgs || st.BadICRC != 0 || st.BadPackets != 0 || st.SendErrors != 0 || st.Jobs != 0 {
		t.Fatalf("aggregator counters: %+v", st)
	}
	if drops > 0 && st.Duplicates+st.Resent == 0 {
		t.Fatalf("%d packets lost and no retransmission seen: %+v", drops, st)
	}
}

// TestSetupRefusals: announces that disagree, or that the core cannot
// take, are refused with the reason.
func TestSetupRefusals(t *testing.T) {
	key, _, _ := jobauth.Generate()
	cl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dc, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	s, err := New(Config{Key: key, Control: cl, Data: dc, SetupTimeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	go s.Serve()
	defer s.Close()
	try := func(rank int, a Announce) (Assignment, error) {
		c, err := net.Dial("tcp", cl.Addr().String())
		if err != nil {
			return Assignment{}, err
		}
		defer c.Close()
		if err := jobauth.Initiate(c, key, Purpose, uint32(rank), jobauth.EndsOf(c, true)); err != nil {
			return Assignment{}, err
		}
		writeMessage(c, a.Append(nil))
		b, err := readMessage(c)
		if err != nil {
			return Assignment{}, err
		}
		return ParseAssignment(b)
	}
	base := Announce{Job: "j", Workers: 1, SlotBytes: 256, Slots: 4, QPNs: []uint32{1}, PSNs: []uint32{0}}
	for name, mod := range map[string]func(a *Announce){
		"rank not proven": func(a *Announce) { a.Workers, a.Rank = 2, 1 },
		"too many":        func(a *Announce) { a.Workers = 33 },
		"slot size":       func(a *Announce) { a.SlotBytes = 512 },
		"no slots":        func(a *Announce) { a.Slots = 0 },
		"alone too long":  func(a *Announce) { a.Workers, a.Job = 2, "waits" },
	} {
		a := base
		mod(&a)
		as, err := try(0, a)
		if err != nil || as.Err == "" {
			t.Errorf("%s: %v, assignment %+v", name, err, as)
		}
		t.Logf("%s: %s", name, as.Err)
	}
	as, err := try(0, base)
	if err != nil || as.Err != "" || len(as.QPNs) != 1 {
		t.Fatalf("good announce: %v %+v", err, as)
	}

	// Ranks that disagree on the slot count (their message sizes differ):
	// rank 0 waits for the others; rank 1's announce refuses the whole
	// job, so rank 0 hears it at once, not after the 2 s setup timeout,
	// and rank 2, announcing after, is refused at once too.
	three := Announce{Job: "mismatch", Workers: 3, SlotBytes: 256, Slots: 4, QPNs: []uint32{1}, PSNs: []uint32{0}}
	first := make(chan Assignment, 1)
	go func() {
		as, err := try(0, three)
		if err != nil {
			as.Err = "no answer: " + err.Error()
		}
		first <- as
	}()
	for announced := false; !announced; time.Sleep(time.Millisecond) {
		s.mu.Lock()
		announced = s.pending["mismatch"] != nil
		s.mu.Unlock()
	}
	start := time.Now()
	other := three
	other.Rank, other.Slots = 1, 8
	if as, err := try(1, other); err != nil || !strings.Contains(as.Err, "must agree") {
		t.Errorf("rank 1 with 8 slots against 4: %v, assignment %+v", err, as)
	}
	if as := <-first; !strings.Contains(as.Err, "must agree") || time.Since(start) > time.Second {
		t.Errorf("rank 0 after %v: %+v, want the refusal at once", time.Since(start), as)
	}
	late := three
	late.Rank = 2
	if as, err := try(2, late); err != nil || !strings.Contains(as.Err, "must agree") || time.Since(start) > time.Second {
		t.Errorf("rank 2 after the refusal (%v): %v, assignment %+v", time.Since(start), err, as)
	}
}

// TestControlCodec round-trips both messages.
func TestControlCodec(t *testing.T) {
	a := Announce{Job: "job-1", Workers: 32, Rank: 31, SlotBytes: 1024, Slots: 300, Addr: [4]byte{10, 1, 2, 3}, RKey: 0xdeadbeef, QPNs: []uint32{1, 2}, PSNs: []uint32{3, 4}}
	b := a.Append(nil)
	if len(b) != a.Len() {
		t.Fatalf("Len %d, appended %d", a.Len(), len(b))
	}
	a2, err := ParseAnnounce(b)
	if err != nil || fmt.Sprint(a2) != fmt.Sprint(a) {
		t.Fatalf("%v: %+v", err, a2)
	}
	s := Assignment{Base: 77, Addr: [4]byte{1, 2, 3, 4}, QPNs: []uint32{9}, PSNs: []uint32{8}}
	b = s.Append(nil)
	s2, err := ParseAssignment(b)
	if err != nil || len(b) != s.Len() || fmt.Sprint(s2) != fmt.Sprint(s) {
		t.Fatalf("%v: %+v", err, s2)
	}
	for i := range len(b) {
		if _, err := ParseAssignment(b[:i]); !errors.Is(err, ErrMessage) {
			t.Fatalf("assignment cut at %d: %v", i, err)
		}
	}
}

// FuzzAnnounce: what parses re-appends to the same bytes.
func FuzzAnnounce(f *testing.F) {
	a := Announce{Job: "j", Workers: 2, Rank: 1, SlotBytes: 256, Slots: 4, QPNs: []uint32{1}, PSNs: []uint32{2}}
	f.Add(a.Append(nil))
	f.Fuzz(func(t *testing.T, b []byte) {
		a, err := ParseAnnounce(b)
		if err != nil {
			return
		}
		if out := a.Append(nil); !bytes.Equal(out, b) || len(out) != a.Len() {
			t.Fatalf("re-appended %x, parsed %x", out, b)
		}
	})
}

// FuzzAssignment: what parses re-appends to the same bytes.
func FuzzAssignment(f *testing.F) {
	s := Assignment{Err: "no", Base: 3, QPNs: []uint32{1}, PSNs: []uint32{2}}
	f.Add(s.Append(nil))
	f.Fuzz(func(t *testing.T, b []byte) {
		s, err := ParseAssignment(b)
		if err != nil {
			return
		}
		if out := s.Append(nil); !bytes.Equal(out, b) || len(out) != s.Len() {
			t.Fatalf("re-appended %x, parsed %x", out, b)
		}
	})
}

// TestLeaveCodec: Leave round-trips and refuses truncation and trailing
// bytes; an Ended with Abandoned carries one trailing byte, one without
// none (as before Leave existed), and any other trailing byte is refused.
func TestLeaveCodec(t *testing.T) {
	l := Leave{Why: "pinned host copy: alloc: pool exhausted"}
	b := l.Append(nil)
	if l2, err := ParseLeave(b); err != nil || l2 != l {
		t.Fatalf("%v: %+v", err, l2)
	}
	for i := range len(b) {
		if _, err := ParseLeave(b[:i]); !errors.Is(err, ErrMessage) {
			t.Fatalf("leave cut at %d: %v", i, err)
		}
	}
	if _, err := ParseLeave(append(b, 0)); !errors.Is(err, ErrMessage) {
		t.Fatalf("leave with a byte more: %v", err)
	}
	if long := (&Leave{Why: strings.Repeat("x", 5000)}).Append(nil); len(long) != 3+maxWhy {
		t.Fatalf("a long reason appended as %d bytes, want %d", len(long), 3+maxWhy)
	}
	plain := (&Ended{Rank: 2, Why: "EOF"}).Append(nil)
	ab := (&Ended{Rank: 2, Why: "EOF", Abandoned: true}).Append(nil)
	if len(ab) != len(plain)+1 {
		t.Fatalf("abandoned Ended %x, plain %x: want one byte more", ab, plain)
	}
	if e, err := ParseEnded(ab); err != nil || !e.Abandoned || e.Why != "EOF" || e.Rank != 2 {
		t.Fatalf("abandoned Ended parsed as %+v, %v", e, err)
	}
	if e, err := ParseEnded(plain); err != nil || e.Abandoned {
		t.Fatalf("plain Ended parsed as %+v, %v", e, err)
	}
	for _, bad := range []byte{0, 2, 0xff} {
		if _, err := ParseEnded(append(slices.Clip(plain), bad)); !errors.Is(err, ErrMessage) {
			t.Fatalf("Ended with trailing byte %#x: %v", bad, err)
		}
	}
}

// FuzzLeave: what parses re-appends to the same bytes.
func FuzzLeave(f *testing.F) {
	f.Add((&Leave{Why: "pool exhausted"}).Append(nil))
	f.Fuzz(func(t *testing.T, b []byte) {
		l, err := ParseLeave(b)
		if err != nil {
			return
		}
		if out := l.Append(nil); !bytes.Equal(out, b) {
			t.Fatalf("re-appended %x, parsed %x", out, b)
		}
	})
}

// FuzzEnded: what parses re-appends to the same bytes.
func FuzzEnded(f *testing.F) {
	e := Ended{Rank: 3, Why: "EOF"}
	f.Add(e.Append(nil))
	f.Fuzz(func(t *testing.T, b []byte) {
		e, err := ParseEnded(b)
		if err != nil {
			return
		}
		if out := e.Append(nil); !bytes.Equal(out, b) {
			t.Fatalf("re-appended %x, parsed %x", out, b)
		}
	})
}

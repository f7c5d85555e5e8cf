package aggsrv

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/gdrlink/gdrlink/internal/ibv"
	"github.com/gdrlink/gdrlink/internal/jobauth"
	"github.com/gdrlink/gdrlink/internal/roceveth"
)

// rxeWorkerEnv makes the test binary a worker of TestRXEWorkers: the value
// is "RANK WORKERS DEVICE CONTROL".
const rxeWorkerEnv = "GDRLINK_AGGSRV_TEST_RXE_WORKER"

// rxeVA is where every worker of TestRXEWorkers maps its result region:
// the aggregator writes a message's result at the address its request
// named, the same on every worker, as SwitchML's clients do.
const rxeVA = 0x3e00_0000_0000

// The message shape of TestRXEWorkers: up to three 1 KiB packets at MTU
// 1024.
const (
	rxeSlotBytes = 1024
	rxeMaxSlots  = 3
	rxeMaxMsg    = rxeSlotBytes * rxeMaxSlots
	rxeRounds    = 40
)

// rxeData is worker r's int32 payload of round m.
func rxeData(r, m, size int) []byte {
	rng := rand.New(rand.NewPCG(uint64(r), uint64(m)))
	b := make([]byte, size)
	for i := 0; i < size; i += 4 {
		binary.LittleEndian.PutUint32(b[i:], uint32(rng.Int32N(1<<24)-1<<23))
	}
	return b
}

// rxeImm is worker r's immediate in round m: byte 3 is the round (the same
// on every worker, so its maximum names the round a reply belongs to),
// the others vary by worker as exponents would.
func rxeImm(r, m int) uint32 {
	return uint32(m&0xff)<<24 | uint32((r*37+m)&0xff)<<16 | uint32((r*11+3*m)&0xff)<<8 | uint32((255-r*5-m)&0xff)
}

// TestRXEWorkers: in the Soft-RoCE guest (GDRLINK_TEST_ROCE_VETH=1, as
// root), the aggregator runs as its own process in a network namespace
// joined to the root one by veth, whose root-side end has a Soft-RoCE
// device (the guest's rxe owns UDP 4791 in the root namespace). Three
// worker processes, each with its own address (GID) on that device, set
// the job up over the control endpoint and all-reduce int32 messages of
// three packets through real unreliable-connected queue pairs: RDMA WRITE
// WITH IMMEDIATE to the aggregator with rkey = pool index|set and the
// address of their result region (mapped at the same address in every
// worker), the reply arriving as the aggregator's UC write with immediate
// into that region. Each result must be the exact sum and the immediate
// the bytewise maximum. The aggregator reads a raw IPv4 socket and checks
// the ICRC of every request over the IP ID rxe wrote: none may fail. Five
// runs: lossless with three-packet messages, then with one-packet
// messages lossless, with 5% loss at the aggregator, with 5% loss on the
// link (nftables in the aggregator's namespace, both ways), and with 5%
// of the requests corrupted on the link (nftables rewrites 4 payload
// bytes on the way in): those must be counted as BadICRC, not added, and
// resent by the workers. Every run adds each worker's packets once. The last four runs' results are bitwise equal.
// Replies are told apart by byte 3 of the immediate, the round, the same
// on every worker; a second reply to a resent message is dropped.
func TestRXEWorkers(t *testing.T) {
	const workers = 3
	var addrs []string
	for r := range workers {
		addrs = append(addrs, fmt.Sprintf("10.234.0.%d/24", 10+r))
	}
	veth := roceveth.Setup(t, "sw", addrs, "10.234.0.2/24")
	dev := veth.Dev
	_, secret, err := jobauth.Generate()
	if err != nil {
		t.Fatal(err)
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	// The ICRC of rxe's requests covers the IPv4 identification field,
	// which rxe sets (__ip_select_ident) and a UDP socket does not show:
	// the aggregator reads a raw IPv4 socket to check it. Its replies'
	// ICRC is checked by the workers' rxe, which drops a packet whose
	// ICRC is wrong.
	type result struct {
		sums    []string
		stats   Stats
		resent  int
		nftRule string
	}
	// res is named: the deferred nft listing fills res.nftRule.
	runJob := func(name string, slots int, aggDrop string, link string) (res result) {
		t.Helper()
		if link != "" {
			undo := veth.Impair(link)
			defer func() {
				res.nftRule = undo()
				t.Logf("%s: nft counters:\n%s", name, res.nftRule)
			}()
		}
		agg := veth.Command(self, "-test.run=^$")
		agg.Env = append(os.Environ(), childEnv+"=1", childEnv+"_ADDR=10.234.0.2", childEnv+"_DROP="+aggDrop, childEnv+"_RAW=on", jobauth.KeyEnv+"="+secret)
		stdin, _ := agg.StdinPipe()
		stdout, _ := agg.StdoutPipe()
		agg.Stderr = os.Stderr
		if err := agg.Start(); err != nil {
			t.Fatal(err)
		}
		defer agg.Process.Kill()
		out := bufio.NewScanner(stdout)
		if !out.Scan() {
			t.Fatalf("%s: the aggregator process said nothing", name)
		}
		f := strings.Fields(out.Text())
		if len(f) != 3 || f[0] != "ready" {
			t.Fatalf("%s: aggregator: %q", name, out.Text())
		}
		// Every worker keeps its control connection (the job) open until
		// all have their results: one that left would end the job for a
		// worker still resending its last message.
		sums := make([]string, workers)
		errs := make([]error, workers)
		stdins := make([]io.WriteCloser, workers)
		var wg, results sync.WaitGroup
		var mu sync.Mutex
		for r := range workers {
			ctx, cancel := context.WithTimeout(context.Background(), 240*time.Second)
			defer cancel()
			c := exec.CommandContext(ctx, self, "-test.run=^$")
			c.Env = append(os.Environ(), rxeWorkerEnv+"="+fmt.Sprintf("%d %d %s %s %d", r, workers, dev, f[1], slots), jobauth.KeyEnv+"="+secret)
			stdins[r], _ = c.StdinPipe()
			wout, _ := c.StdoutPipe()
			var stderr strings.Builder
			c.Stderr = &stderr
			if err := c.Start(); err != nil {
				t.Fatal(err)
			}
			wg.Add(1)
			results.Add(1)
			go func() {
				defer wg.Done()
				got := false
				sc := bufio.NewScanner(wout)
				for sc.Scan() {
					if s, ok := strings.CutPrefix(sc.Text(), "result "); ok && !got {
						sums[r], got = s, true
						results.Done()
					} else {
						var sends, resent int
						if n, _ := fmt.Sscanf(sc.Text(), "sends %d resent %d", &sends, &resent); n == 2 {
							mu.Lock()
							res.resent += resent
							mu.Unlock()
						}
						t.Logf("%s: worker %d: %s", name, r, sc.Text())
					}
				}
				if !got {
					results.Done()
				}
				if err := c.Wait(); err != nil {
					errs[r] = fmt.Errorf("worker %d: %w: %s", r, err, stderr.String())
				}
			}()
		}
		results.Wait()
		for _, w := range stdins {
			w.Close()
		}
		wg.Wait()
		stdin.Close()
		gotStats := false
		for out.Scan() {
			t.Logf("%s: aggregator: %s", name, out.Text())
			if b, ok := strings.CutPrefix(out.Text(), "stats "); ok {
				gotStats = json.Unmarshal([]byte(b), &res.stats) == nil
			}
		}
		agg.Wait()
		if err := errors.Join(errs...); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if !gotStats {
			t.Fatalf("%s: the aggregator printed no counters", name)
		}
		res.sums = sums
		return res
	}
	// Loss runs use one-packet messages: with several packets, a lost
	// reply packet left the worker's rxe responder dropping every later
	// message of that queue pair (see the run's log).
	var first []string
	for _, c := range []struct {
		name  string
		slots int
		drop  string
		link  string
		equal bool
	}{{"lossless, 3-packet messages", 3, "0", "", false}, {"lossless", 1, "0", "", false},
		{"aggregator loss 5%", 1, "0.05", "", true}, {"link loss 5%", 1, "0", "loss", true},
		{"link corruption 5%", 1, "0", "corrupt", true}} {
		res := runJob(c.name, c.slots, c.drop, c.link)
		// The corruption is random (one packet in 20 on its way in): a
		// run where it touched no packet (about 1 in 500 with 120
		// requests) proves nothing either way and is run again, at most
		// twice.
		for try := 1; c.link == "corrupt" && try < 3 && res.stats.BadICRC == 0 && res.resent == 0; try++ {
			t.Logf("%s: no packet corrupted in run %d (nft:\n%s); again", c.name, try, res.nftRule)
			res = runJob(c.name, c.slots, c.drop, c.link)
		}
		sums, st := res.sums, res.stats
		t.Logf("%s: aggregator: %d packets added, %d duplicates, %d bad ICRC, %d unparsable; workers resent %d messages", c.name, st.Applied, st.Duplicates, st.BadICRC, st.BadPackets, res.resent)
		if want := uint64(rxeRounds * workers * c.slots); st.Applied != want {
			t.Errorf("%s: %d packets added, want %d: each worker's packet once", c.name, st.Applied, want)
		}
		if c.link == "corrupt" {
			if st.BadICRC == 0 || res.resent == 0 {
				t.Errorf("%s: %d packets failed their ICRC and the workers resent %d messages: the corruption did not show (nft:\n%s)", c.name, st.BadICRC, res.resent, res.nftRule)
			}
		} else if st.BadICRC != 0 || st.BadPackets != 0 {
			t.Errorf("%s: %d packets failed their ICRC, %d did not parse: want none (the raw socket's IP ID)", c.name, st.BadICRC, st.BadPackets)
		}
		for r, s := range sums {
			if s == "" || s != sums[0] {
				t.Errorf("%s: worker %d result %q, worker 0 %q", c.name, r, s, sums[0])
			}
		}
		if !c.equal {
			first = sums
		} else if sums[0] != first[0] {
			t.Errorf("%s: result %s differs from the lossless run's %s", c.name, sums[0], first[0])
		}
	}
}

// runRXEWorker is one worker process of TestRXEWorkers: it prints the
// SHA-256 of its results ("result HEX"), after checking each against the
// exact sum it computes from every worker's known input.
func runRXEWorker(spec string) error {
	f := strings.Fields(spec)
	if len(f) != 5 {
		return fmt.Errorf("spec %q", spec)
	}
	rank, _ := strconv.Atoi(f[0])
	workers, _ := strconv.Atoi(f[1])
	dev, control := f[2], f[3]
	slots, _ := strconv.Atoi(f[4])
	if slots < 1 || slots > rxeMaxSlots {
		return fmt.Errorf("%d slots", slots)
	}
	rxeMsg := slots * rxeSlotBytes
	key, _, err := jobauth.FromEnv(os.Getenv)
	if err != nil {
		return err
	}
	if err := ibv.Load(); err != nil {
		return err
	}
	c, err := ibv.Open(dev)
	if err != nil {
		return err
	}
	defer c.Close()
	myIP := [4]byte{10, 234, 0, byte(10 + rank)}
	gidx := -1
	pa, err := c.QueryPort(1)
	if err != nil {
		return err
	}
	for i := range pa.GIDTblLen {
		e, err := c.QueryGID(1, i)
		if err == nil && e.Type == ibv.GIDTypeRoCEv2 && [4]byte(e.GID[12:]) == myIP {
			gidx = i
		}
	}
	if gidx < 0 {
		return fmt.Errorf("%s has no RoCE v2 GID for %v", dev, myIP)
	}
	pd, err := c.AllocPD()
	if err != nil {
		return err
	}
	defer pd.Close()
	// The result region at the same address on every worker, two
	// halves that messages alternate (as their sets do: a second reply
	// to a resent message, arriving after the worker moved on, lands in
	// the other half), then the request buffer.
	mem, err := unix.MmapPtr(-1, 0, unsafe.Add(nil, rxeVA), 3*rxeMaxMsg, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE|unix.MAP_FIXED_NOREPLACE)
	if err != nil {
		return fmt.Errorf("mapping the result region at %#x: %w", rxeVA, err)
	}
	if uintptr(mem) != rxeVA {
		return fmt.Errorf("result region mapped at %p, not %#x", mem, rxeVA)
	}
	buf := unsafe.Slice((*byte)(mem), 3*rxeMaxMsg)
	req := buf[2*rxeMaxMsg : 2*rxeMaxMsg+rxeMsg]
	snap := make([]byte, rxeMsg)
	mr, err := pd.RegMR(rxeVA, 3*rxeMaxMsg, ibv.AccessLocalWrite|ibv.AccessRemoteWrite)
	if err != nil {
		return err
	}
	defer mr.Close()
	cq, err := c.CreateCQ(256)
	if err != nil {
		return err
	}
	defer cq.Close()
	qp, err := pd.CreateUCQP(cq, cq, ibv.QPCaps{MaxSendWR: 64, MaxRecvWR: 64, MaxSendSGE: 1, MaxRecvSGE: 1})
	if err != nil {
		return err
	}
	defer qp.Close()
	psn := uint32(rank*1000+12345) & (1<<24 - 1)

	// Job setup.
	conn, err := net.DialTimeout("tcp", control, 30*time.Second)
	if err != nil {
		return err
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(60 * time.Second))
	if err := jobauth.Initiate(conn, key, Purpose, uint32(rank), jobauth.EndsOf(conn, true)); err != nil {
		return err
	}
	a := Announce{Job: "rxe", Workers: workers, Rank: rank, SlotBytes: rxeSlotBytes, Slots: slots,
		Addr: myIP, RKey: mr.RKey(), QPNs: []uint32{qp.QPN()}, PSNs: []uint32{psn}}
	if err := writeMessage(conn, a.Append(nil)); err != nil {
		return err
	}
	b, err := readMessage(conn)
	if err != nil {
		return err
	}
	as, err := ParseAssignment(b)
	if err != nil {
		return err
	}
	if as.Err != "" || len(as.QPNs) != 1 {
		return fmt.Errorf("assignment %+v", as)
	}
	conn.SetDeadline(time.Time{})
	var dgid ibv.GID
	copy(dgid[10:], []byte{0xff, 0xff})
	copy(dgid[12:], as.Addr[:])
	if err := qp.ToInit(1, 0, ibv.AccessLocalWrite|ibv.AccessRemoteWrite); err != nil {
		return err
	}
	if err := qp.ToRTR(ibv.RTRAttr{DestQPN: as.QPNs[0], RQPSN: as.PSNs[0], MTU: 1024, Global: true, DGID: dgid,
		SGIDIndex: gidx, HopLimit: 64, Port: 1}); err != nil {
		return err
	}
	if err := qp.ToRTS(ibv.RTSAttr{SQPSN: psn}); err != nil {
		return err
	}
	recvs := make([]ibv.RecvWR, 32)
	for i := range recvs {
		recvs[i].WRID = 1 << 32
	}
	if _, err := qp.PostRecv(recvs, nil); err != nil {
		return err
	}

	h := sha256.New()
	sends, resent, stale := 0, 0, 0
	wc := make([]ibv.WC, 16)
	for m := range rxeRounds {
		copy(req, rxeData(rank, m, rxeMsg))
		want := make([]uint32, rxeMsg/4)
		var wantImm [4]byte
		for r := range workers {
			d := rxeData(r, m, rxeMsg)
			for i := range want {
				want[i] += binary.LittleEndian.Uint32(d[4*i:])
			}
			var im [4]byte
			binary.BigEndian.PutUint32(im[:], rxeImm(r, m))
			for k := range im {
				wantImm[k] = max(wantImm[k], im[k])
			}
		}
		wr := ibv.SendWR{WRID: uint64(m), Opcode: ibv.WRWriteImm, Flags: ibv.SendSignaled, NumSGE: 1,
			RemoteAddr: uint64(rxeVA + m&1*rxeMaxMsg), RKey: uint32(2*as.Base + m&1), Imm: rxeImm(rank, m)}
		done := false
		for try := 0; !done; try++ {
			if try > 200 {
				return fmt.Errorf("round %d: no result after %d sends (%d stale completions)", m, try, stale)
			}
			if try > 0 {
				resent++
			}
			if sends > 48 {
				return fmt.Errorf("round %d: %d send completions missing", m, sends)
			}
			if _, err := qp.PostSend([]ibv.SendWR{wr}, []ibv.SGE{{Addr: rxeVA + 2*rxeMaxMsg, Length: uint32(rxeMsg), LKey: mr.LKey()}}); err != nil {
				return err
			}
			sends++
			for deadline := time.Now().Add(300 * time.Millisecond); !done && time.Now().Before(deadline); {
				n, err := cq.Poll(wc)
				if err != nil {
					return err
				}
				if n == 0 {
					time.Sleep(50 * time.Microsecond)
				}
				for _, e := range wc[:n] {
					if e.Status != ibv.WCSuccess {
						return fmt.Errorf("round %d: completion %+v", m, e)
					}
					if e.WRID != 1<<32 {
						sends--
						continue
					}
					if _, err := qp.PostRecv(recvs[:1], nil); err != nil {
						return err
					}
					var got [4]byte
					binary.BigEndian.PutUint32(got[:], e.Imm)
					if done || e.Flags&ibv.WCWithImm == 0 || int(e.ByteLen) != rxeMsg || got[0] != byte(m) {
						stale++
						continue
					}
					if got != wantImm {
						return fmt.Errorf("round %d: immediate %x, want %x", m, got, wantImm)
					}
					off := m & 1 * rxeMaxMsg
					copy(snap, buf[off:off+rxeMsg])
					for i, v := range want {
						if g := binary.LittleEndian.Uint32(snap[4*i:]); g != v {
							return fmt.Errorf("round %d: element %d is %d, want %d", m, i, int32(g), int32(v))
						}
					}
					h.Write(snap)
					h.Write(got[:])
					done = true
				}
			}
		}
	}
	fmt.Printf("sends %d resent %d stale %d (gid index %d, qpn %d, aggregator qpn %d)\n", rxeRounds+resent, resent, stale, gidx, qp.QPN(), as.QPNs[0])
	fmt.Printf("result %s\n", hex.EncodeToString(h.Sum(nil)))
	io.Copy(io.Discard, os.Stdin)
	return nil
}

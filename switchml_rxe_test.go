package gdrlink

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/internal/jobauth"
	"github.com/gdrlink/gdrlink/internal/roceveth"
	"github.com/gdrlink/gdrlink/internal/switchml/aggsrv"
	"github.com/gdrlink/gdrlink/tensor"
)

// rxeAggEnv makes the test binary the aggregator of TestSwitchMLVerbsRXE:
// its value is the address to serve on; rxeAggEnv_DROP the share of
// packets it drops.
const rxeAggEnv = "GDRLINK_TEST_SWITCHML_RXE_AGG"

// runRXEAggregator serves at the address of rxeAggEnv (control on a free
// TCP port, data on RoCEv2's), prints "ready CONTROL", and serves until
// its standard input closes, then prints its counters. rxe's requests
// carry an IPv4 identification that their ICRC covers and a UDP socket
// does not show, so it reads a raw IPv4 socket to check their ICRC
// (aggsrv's package doc says more); the workers' rxe checks the ICRC of
// its replies.
func runRXEAggregator() error {
	key, _, err := jobauth.FromEnv(os.Getenv)
	if err != nil {
		return err
	}
	host := os.Getenv(rxeAggEnv)
	drop, _ := strconv.ParseFloat(os.Getenv(rxeAggEnv+"_DROP"), 64)
	// Drops by the core (a bad PSN, a set reused too early) go to the
	// test log: a lossless job has none.
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	s, ctl, err := aggsrv.ListenRoCE(host, aggsrv.Config{Key: key, Seed: 11, SetupTimeout: 60 * time.Second, Drop: drop, Logger: log})
	if err != nil {
		return err
	}
	go s.Serve()
	fmt.Printf("ready %s\n", ctl)
	io.Copy(io.Discard, os.Stdin)
	st := s.Stats()
	if err := s.Close(); err != nil {
		return err
	}
	b, _ := json.Marshal(st)
	fmt.Printf("stats %s\n", b)
	return nil
}

// The tensors of the rxe job: sizes not multiples of a message.
const (
	rxeFloats = 20_003
	rxeInts   = 12_011
)

// rxeF32 is rank r's float32 element i: a multiple of 1/4 below 2 in
// magnitude, so the block-floating-point sum of up to 8 ranks is exact.
func rxeF32(r, i int) float32 { return float32((r*7919+i*104729)%15-7) / 4 }

// rxeI32 is rank r's int32 element i, large enough that sums wrap.
func rxeI32(r, i int) int32 { return int32(uint32(r+1)*0x9e3779b1 + uint32(i)*0x85ebca6b) }

// switchmlRXEJob all-reduces a float32 and an int32 tensor through the
// aggregator, each result checked element by element against the exact
// sum computed here, and reports their digests and the transport.
func switchmlRXEJob(ctx context.Context, g *Group, rep *childReport) error {
	n, r := g.Size(), g.Rank()
	t, err := g.NewTensor(tensor.Float32, rxeFloats)
	if err != nil {
		return err
	}
	v, _ := tensor.View[float32](t)
	for i := range v {
		v[i] = rxeF32(r, i)
	}
	start := time.Now()
	cr, err := g.AllReduce(ctx, t, Sum)
	if err != nil {
		return err
	}
	if cr.Backend != "switchml" || len(cr.Links) != 1 || cr.Links[0].Provider != "switchml/verbs" {
		return fmt.Errorf("float32 report %+v: want backend switchml over verbs", cr)
	}
	rep.Paths = append(rep.Paths, fmt.Sprintf("float32 %d B in %v (%d messages, %d B sent)", cr.Bytes, time.Since(start).Round(time.Millisecond), cr.Links[0].Transfers, cr.Sent))
	for i := range v {
		var s float32
		for q := range n {
			s += rxeF32(q, i)
		}
		if v[i] != s {
			return fmt.Errorf("float32 element %d: %v, want %v", i, v[i], s)
		}
	}
	rep.Digests = append(rep.Digests, digest(t))
	_ = t.Release()

	x, err := g.NewTensor(tensor.Int32, rxeInts)
	if err != nil {
		return err
	}
	xv, _ := tensor.View[int32](x)
	for i := range xv {
		xv[i] = rxeI32(r, i)
	}
	start = time.Now()
	cr, err = g.AllReduce(ctx, x, Sum)
	if err != nil {
		return err
	}
	rep.Paths = append(rep.Paths, fmt.Sprintf("int32 %d B in %v (%d messages, %d B sent)", cr.Bytes, time.Since(start).Round(time.Millisecond), cr.Links[0].Transfers, cr.Sent))
	for i := range xv {
		var s int32
		for q := range n {
			s += rxeI32(q, i)
		}
		if xv[i] != s {
			return fmt.Errorf("int32 element %d: %d, want %d", i, xv[i], s)
		}
	}
	rep.Digests = append(rep.Digests, digest(x))
	return nil
}

// TestSwitchMLVerbsRXE: in the Soft-RoCE guest (GDRLINK_TEST_ROCE_VETH=1,
// as root), ranks joined through the front door all-reduce float32 and
// int32 tensors through an aggregator process in a network namespace of
// its own, joined to the root one by veth whose root-side end has a
// Soft-RoCE device, with GDRLINK_SWITCHML_TRANSPORT=verbs: the workers'
// UC queue pairs live on that device. 2, 4 and 8 ranks without loss (and
// 4 with four-packet messages, also without loss), then 4 ranks with 2%
// loss at the aggregator, with 5% loss on the link
// (nftables in the aggregator's namespace, both ways) and with 5% of the
// requests corrupted on the link (nftables rewrites 4 payload bytes on the
// way in). The aggregator reads a raw IPv4 socket and checks every
// request's ICRC over the IP ID rxe wrote: without corruption none fails;
// with it, the corrupted ones are counted as BadICRC and not added, and
// the workers resend: the aggregator adds as many packets as in the
// lossless run, each once. (Resends alone say little here: under
// emulation the lossless runs resend too, workers being late past the
// 50 ms timeout.) Every result is the exact sum, bitwise the same on every
// rank, and with loss or corruption bitwise the lossless one.
func TestSwitchMLVerbsRXE(t *testing.T) {
	veth := roceveth.Setup(t, "sv", []string{"10.235.0.10/24"}, "10.235.0.2/24")
	_, secret, err := jobauth.Generate()
	if err != nil {
		t.Fatal(err)
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	runJob := func(name string, size int, aggDrop, link, packets string) ([]childReport, aggsrv.Stats) {
		t.Helper()
		if link != "" {
			undo := veth.Impair(link)
			defer func() { t.Logf("%s: nft counters:\n%s", name, undo()) }()
		}
		agg := veth.Command(self, "-test.run=^$")
		agg.Env = append(os.Environ(), rxeAggEnv+"=10.235.0.2", rxeAggEnv+"_DROP="+aggDrop, jobauth.KeyEnv+"="+secret)
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
		if len(f) != 2 || f[0] != "ready" {
			t.Fatalf("%s: aggregator: %q", name, out.Text())
		}
		// A failed job ends the test inside j.wait: the aggregator's
		// counters are logged on the way out.
		waited := false
		defer func() {
			if waited {
				return
			}
			stdin.Close()
			for out.Scan() {
				t.Logf("%s: aggregator (the job failed): %s", name, out.Text())
			}
		}()
		start := time.Now()
		j := startJob(t, "switchml-rxe", size, "127.0.0.1", func(int) []string { return nil }, func(int) []string {
			env := []string{"GDRLINK_PROVIDER=tcp", "GDRLINK_AGGREGATOR=" + f[1], "GDRLINK_SWITCHML_TRANSPORT=verbs", "GDRLINK_JOB_KEY=" + secret}
			if packets != "" {
				env = append(env, "GDRLINK_SWITCHML_MSG_PACKETS="+packets)
			}
			return env
		})
		reps := j.wait(4 * time.Minute)
		took := time.Since(start)
		waited = true
		stdin.Close()
		var st aggsrv.Stats
		gotStats := false
		for out.Scan() {
			t.Logf("%s: aggregator: %s", name, out.Text())
			if b, ok := strings.CutPrefix(out.Text(), "stats "); ok {
				gotStats = json.Unmarshal([]byte(b), &st) == nil
			}
		}
		agg.Wait()
		if !gotStats {
			t.Fatalf("%s: the aggregator printed no counters", name)
		}
		t.Logf("%s: %d ranks in %v; rank 0: %v", name, size, took.Round(time.Millisecond), reps[0].Paths)
		for r, rep := range reps {
			if len(rep.Digests) != 2 {
				t.Fatalf("%s: rank %d: %d results", name, r, len(rep.Digests))
			}
			for i, d := range rep.Digests {
				if d != reps[0].Digests[i] {
					t.Errorf("%s: rank %d: result %d differs from rank 0's", name, r, i)
				}
			}
		}
		if link != "corrupt" && (st.BadICRC != 0 || st.BadPackets != 0) {
			t.Errorf("%s: %d packets failed their ICRC, %d did not parse: want none (the raw socket shows rxe's IP ID)", name, st.BadICRC, st.BadPackets)
		}
		return reps, st
	}
	var lossless4 []childReport
	var lossless4St aggsrv.Stats
	for _, size := range []int{2, 4, 8} {
		reps, st := runJob(fmt.Sprintf("lossless, %d ranks", size), size, "0", "", "")
		if size == 4 {
			lossless4, lossless4St = reps, st
		}
	}
	// Multi-packet messages, lossless (with loss the 6.1 kernel's rxe
	// stops a UC queue pair for good, so the library sends one-packet
	// messages there unless told otherwise): the workers' queue pairs
	// send RDMA WRITE FIRST, MIDDLE and LAST packets, the aggregator
	// writes four-packet replies, and the results are the lossless
	// one-packet run's bits.
	per := packetsPerMessage
	multi, multiSt := runJob("lossless, 4-packet messages, 4 ranks", 4, "0", "", "4")
	t.Logf("packets per rank per message: %.2f one-packet (%d in %d), %.2f four-packet (%d in %d)",
		per(lossless4St, 4), lossless4St.Applied, lossless4St.Completed, per(multiSt, 4), multiSt.Applied, multiSt.Completed)
	// Each queue pair's first message of a float tensor is one packet
	// (its exponents, no payload), so with these small tensors a little
	// over 3 per message: the payload packets are the one-packet run's,
	// in under half its messages.
	if multiSt.Applied < lossless4St.Applied || 2*multiSt.Completed >= lossless4St.Completed || per(multiSt, 4) < 3 {
		t.Errorf("4-packet messages: %d packets added in %d messages (%.2f per rank each), against %d in %d with one-packet messages",
			multiSt.Applied, multiSt.Completed, per(multiSt, 4), lossless4St.Applied, lossless4St.Completed)
	}
	for i, d := range multi[0].Digests {
		if d != lossless4[0].Digests[i] {
			t.Errorf("4-packet messages: result %d differs from the one-packet run's", i)
		}
	}
	for _, c := range []struct {
		name string
		drop string
		link string
	}{{"aggregator loss 2%, 4 ranks", "0.02", ""}, {"link loss 5% both ways, 4 ranks", "0", "loss"},
		{"link corruption 5% of requests, 4 ranks", "0", "corrupt"}} {
		reps, st := runJob(c.name, 4, c.drop, c.link, "")
		t.Logf("%s: aggregator: %d packets added (lossless %d), %d duplicates, %d results resent, %d bad ICRC",
			c.name, st.Applied, lossless4St.Applied, st.Duplicates, st.Resent, st.BadICRC)
		if c.link == "corrupt" && (st.BadICRC == 0 || st.Applied != lossless4St.Applied || st.Completed != lossless4St.Completed) {
			t.Errorf("%s: %d packets failed their ICRC; %d added and %d messages completed, against %d and %d lossless: want corrupted packets dropped, resent and each packet added once",
				c.name, st.BadICRC, st.Applied, st.Completed, lossless4St.Applied, lossless4St.Completed)
		}
		for i, d := range reps[0].Digests {
			if d != lossless4[0].Digests[i] {
				t.Errorf("%s: result %d differs from the lossless run's", c.name, i)
			}
		}
	}
}

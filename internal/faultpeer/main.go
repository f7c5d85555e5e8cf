// Command faultpeer is one side of the fault matrix (scripts/fault-matrix.sh):
// a rank of a job of two that streams tensors of known content through the
// front door while the script injects a fault, and prints one JSON line
// saying what it saw. Rank 1 sends, rank 0 receives and checks every byte.
// The job comes from the front door's variables (GDRLINK_RANK, GDRLINK_SIZE,
// GDRLINK_ROOT, GDRLINK_JOB_KEY, GDRLINK_PROVIDER, ...).
//
// Usage:
//
//	faultpeer [-steps 400] [-size 262144] [-pace 10ms] [-wait 60s] [-from 0]
//	faultpeer -flood HOST:PORT[,HOST:PORT...] -conns 2000 -hold 5s
//	faultpeer -row NAME -fault-at NS RECV.json SEND.json
//
// The report's times are Unix nanoseconds, so that the script can subtract
// the moment it injected the fault. -flood opens and holds idle
// connections (a stranger's flood); -row turns two reports into one line of
// the matrix.
package main

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"runtime"
	"strings"
	"time"

	"github.com/gdrlink/gdrlink"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

// report is what one rank prints when it ends.
type report struct {
	Rank int    `json:"rank"`
	Role string `json:"role"`
	// Steps is how many tensors the rank handled: sent, or received and
	// checked (good or not).
	Steps int `json:"steps"`
	// Verified counts received tensors whose every byte is right; Corrupt
	// those received as good whose bytes are not.
	Verified int `json:"verified"`
	Corrupt  int `json:"corrupt"`
	// Err is the first error, ErrAt when it was seen, LastOK when the last
	// step before it ended (Unix ns).
	Err   string `json:"err,omitempty"`
	ErrAt int64  `json:"err_at,omitempty"`
	// Lost is the error of a sender that died and came back (-rejoin):
	// the receiver went on; ErrAt is when it was seen.
	Lost   string `json:"lost,omitempty"`
	LastOK int64  `json:"last_ok,omitempty"`
	// Rejoins counts, at the receiver, the senders that came back as new
	// processes (RejoinedAt the last one, Unix ns); at a sender, 1 if it
	// is such a process.
	Rejoins    int   `json:"rejoins,omitempty"`
	RejoinedAt int64 `json:"rejoined_at,omitempty"`
	// Goroutines and FDs are counted before Join and after Close.
	GoroutinesBefore int `json:"goroutines_before"`
	GoroutinesAfter  int `json:"goroutines_after"`
	FDsBefore        int `json:"fds_before"`
	FDsAfter         int `json:"fds_after"`
	// Retransmits are the transport's, per provider, before Close.
	Retransmits map[string]uint64 `json:"retransmits,omitempty"`
	// Elapsed is how long the stream ran, in seconds.
	Elapsed float64 `json:"elapsed_s"`
}

func main() {
	steps := flag.Int("steps", 400, "tensors in the stream")
	size := flag.Int("size", 256<<10, "bytes per tensor")
	pace := flag.Duration("pace", 10*time.Millisecond, "pause between two sends")
	wait := flag.Duration("wait", 60*time.Second, "longest wait for one tensor, and for the final barrier")
	from := flag.Int("from", 0, "first step")
	rejoin := flag.Bool("rejoin", false, "receiver: when the sender dies, wait for a new sender process to rejoin and resume with it")
	flood := flag.String("flood", "", "open idle connections to these addresses instead (comma-separated)")
	conns := flag.Int("conns", 2000, "connections for -flood")
	hold := flag.Duration("hold", 5*time.Second, "how long -flood holds them")
	row := flag.String("row", "", "print the matrix row NAME of the two reports named as arguments")
	faultAt := flag.Int64("fault-at", 0, "when the fault was injected (Unix ns), for -row")
	deadline := flag.Duration("deadline", 3*time.Minute, "exit with status 3 after this long, whatever happens")
	flag.Parse()
	time.AfterFunc(*deadline, func() {
		fmt.Fprintln(os.Stderr, "faultpeer: deadline passed")
		os.Exit(3)
	})
	switch {
	case *flood != "":
		n, err := floodConns(strings.Split(*flood, ","), *conns, *hold)
		fmt.Printf("{\"flood_open\":%d}\n", n)
		if err != nil {
			fmt.Fprintln(os.Stderr, "faultpeer:", err)
		}
		return
	case *row == "header":
		fmt.Println(rowHeader)
		return
	case *row != "":
		if err := printRow(os.Stdout, *row, *faultAt, flag.Args()); err != nil {
			fmt.Fprintln(os.Stderr, "faultpeer:", err)
			os.Exit(1)
		}
		return
	}
	rep, err := run(*steps, *size, *pace, *wait, *from, *rejoin)
	if err != nil && rep.Err == "" {
		rep.Err, rep.ErrAt = err.Error(), time.Now().UnixNano()
	}
	out, _ := json.Marshal(rep)
	fmt.Println(string(out))
}

func run(steps, size int, pace, wait time.Duration, from int, rejoin bool) (rep report, err error) {
	rep = report{GoroutinesBefore: runtime.NumGoroutine(), FDsBefore: countFDs(), Role: "send"}
	if os.Getenv("GDRLINK_RANK") == "0" {
		rep.Role = "recv"
	}
	defer func() {
		// Close has returned: what it left behind.
		time.Sleep(100 * time.Millisecond)
		rep.GoroutinesAfter, rep.FDsAfter = runtime.NumGoroutine(), countFDs()
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	jctx, jcancel := context.WithTimeout(ctx, wait)
	var g *gdrlink.Group
	g, err = gdrlink.Join(jctx)
	jcancel()
	if err != nil {
		return rep, err
	}
	rep.Rank = g.Rank()
	start := time.Now()
	switch {
	case g.Rank() == 1 && g.Rejoined():
		rep.Rejoins = 1
		if from, err = resumeStep(ctx, g, wait); err == nil {
			err = send(g, steps, size, pace, from, &rep)
		}
	case g.Rank() == 1:
		err = send(g, steps, size, pace, from, &rep)
	default:
		err = recv(ctx, g, steps, size, wait, from, rejoin, &rep)
	}
	rep.Elapsed = time.Since(start).Seconds()
	if err != nil {
		rep.Err = err.Error()
		if rep.ErrAt == 0 {
			rep.ErrAt = time.Now().UnixNano()
		}
	} else {
		bctx, bcancel := context.WithTimeout(ctx, wait)
		err = g.Barrier(bctx)
		bcancel()
		if err != nil {
			rep.Err, rep.ErrAt = err.Error(), time.Now().UnixNano()
		}
	}
	rep.Retransmits = g.Stats().Retransmits
	if cerr := g.Close(); cerr != nil && err == nil {
		err = cerr
	}
	return rep, err
}

// fill writes the content of step into b: a sequence that differs per step
// and per position, so a rewritten, shifted or stale byte shows.
func fill(b []byte, step int) {
	x := uint64(step)*0x9e3779b97f4a7c15 + 1
	for i := range b {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		b[i] = byte(x)
	}
}

func send(g *gdrlink.Group, steps, size int, pace time.Duration, from int, rep *report) error {
	for i := from; i < steps; i++ {
		t, err := g.NewTensor(tensor.Uint8, int64(size))
		if err != nil {
			return err
		}
		b, err := t.Bytes()
		if err != nil {
			_ = t.Release()
			return err
		}
		fill(b, i)
		if err := g.Send(0, "stream", int64(i), t); err != nil {
			return err
		}
		rep.Steps++
		rep.LastOK = time.Now().UnixNano()
		if pace > 0 {
			time.Sleep(pace)
		}
	}
	return nil
}

// sendResume tells a sender that rejoined as incarnation inc the step to
// resume at.
func sendResume(g *gdrlink.Group, step int) error {
	t, err := g.NewTensor(tensor.Int64, 1)
	if err != nil {
		return err
	}
	b, _ := t.Bytes()
	binary.LittleEndian.PutUint64(b, uint64(step))
	return g.Send(1, "resume", 0, t) // a new process: its peer state is new too
}

// resumeStep is, in a sender that rejoined, the step the receiver wants
// next.
func resumeStep(ctx context.Context, g *gdrlink.Group, wait time.Duration) (int, error) {
	rctx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	t, _, err := g.Recv(rctx, 0, "resume", 0) // a new process: its peer state is new too
	if err != nil {
		return 0, fmt.Errorf("waiting for the step to resume at: %w", err)
	}
	defer t.Release()
	b, err := t.Bytes()
	if err != nil || len(b) != 8 {
		return 0, fmt.Errorf("resume tensor of %d bytes: %v", len(b), err)
	}
	return int(binary.LittleEndian.Uint64(b)), nil
}

func recv(ctx context.Context, g *gdrlink.Group, steps, size int, wait time.Duration, from int, rejoin bool, rep *report) error {
	senderInc := uint64(1) // the sender's incarnation, one more at each rejoin
	want := make([]byte, size)
	for i := from; i < steps; i++ {
		rctx, cancel := context.WithTimeout(ctx, wait)
		t, _, err := g.Recv(rctx, 1, "stream", int64(i))
		cancel()
		if err != nil && rejoin && errors.Is(err, verbsio.ErrPeerLost) {
			// The sender may come back as a new process: wait for it,
			// tell it where to resume, and go on.
			if rep.Lost == "" {
				rep.Lost, rep.ErrAt = fmt.Sprintf("step %d: %v", i, err), time.Now().UnixNano()
			}
			wctx, wcancel := context.WithTimeout(ctx, wait)
			inc, werr := g.WaitRejoin(wctx, 1, senderInc)
			wcancel()
			if werr != nil {
				return fmt.Errorf("step %d: %w (and no new sender: %w)", i, err, werr)
			}
			senderInc = inc
			if err := sendResume(g, i); err != nil {
				return err
			}
			rep.Rejoins++
			rep.RejoinedAt = time.Now().UnixNano()
			i--
			continue
		}
		if err != nil {
			return fmt.Errorf("step %d: %w", i, err)
		}
		b, err := t.Bytes()
		if err != nil {
			_ = t.Release()
			return err
		}
		fill(want, i)
		rep.Steps++
		if len(b) == size && string(b) == string(want) {
			rep.Verified++
		} else {
			rep.Corrupt++
		}
		_ = t.Release()
		rep.LastOK = time.Now().UnixNano()
	}
	return nil
}

// countFDs counts this process's open descriptors.
func countFDs() int {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return -1
	}
	return len(ents)
}

package rendezvous

import (
	"bufio"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

// peerEnv turns a re-executed test binary into the sending peer of the
// two-process tests.
const peerEnv = "GDRLINK_RDV_PEER"

func TestMain(m *testing.M) {
	if os.Getenv(peerEnv) != "" {
		os.Exit(peerMain(os.Stdin, os.Stdout))
	}
	os.Exit(m.Run())
}

// peerMain is the sending peer. It trades hellos on its standard streams,
// connects, then runs one command per input line:
//
//	send KEY STEP KIND DIM...      Send a patterned tensor (KIND: dtype, dead:DTYPE, string)
//	senderr KEY STEP TEXT...       SendError
//	many PREFIX NKEYS STEP KIND N  Send PREFIX0..PREFIX{NKEYS-1}, shape [N]
//	stream KEY KIND N COUNT MS     Send steps 0..COUNT-1 of shape [N], one per MS milliseconds
//	recv KEY KIND N COUNT          Recv and check steps 0..COUNT-1 of shape [N] in the background, then answer "recvd COUNT" or "recverr STEP ERROR"
//	race N                         SendFunc "t" steps 0..N-1, float32 [256], noting each done
//	report                         wait for the race's dones (closing after 3s), answer "report " and 1 (nil) or 0 per step
//	sendfn KEY STEP KIND DIM...    SendFunc a patterned tensor, noting its done
//	done KEY STEP                  wait for that done (10s at most), answer "done nil" or "done ERR"
//	stats                          answer "stats" and the channel's counters (Rewrites ConfirmsIn WritesOut ControlOut)
//	sync                           answer "ok"
//	quit                           close and exit
//
// GDRLINK_RDV_CHECKSUM=1 turns checksum mode on, =default leaves it to
// the provider's default; either way the peer corrupts (after the
// checksum is taken) every write of keys starting with "corrupt" and the
// first write of keys starting with "once".
func peerMain(in io.Reader, out io.Writer) int {
	provider := os.Getenv("GDRLINK_RDV_PROVIDER")
	var opts []Option
	if v := os.Getenv("GDRLINK_RDV_CHECKSUM"); v == "1" || v == "default" {
		if v == "1" {
			opts = append(opts, WithChecksum(true))
		}
		once := map[skey]bool{}
		opts = append(opts, func(o *options) error {
			o.corrupt = func(key string, step int64, b []byte) {
				first := !once[skey{key, step}]
				once[skey{key, step}] = true
				if strings.HasPrefix(key, "corrupt") || strings.HasPrefix(key, "once") && first {
					b[len(b)-1] ^= 0x01
				}
			}
			return nil
		})
	}
	if v := os.Getenv("GDRLINK_RDV_STRIPE_MIN"); v != "" {
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			fmt.Fprintf(out, "error GDRLINK_RDV_STRIPE_MIN: %v\n", err)
			return 1
		}
		opts = append(opts, withStripeMin(n))
	}
	if v := os.Getenv("GDRLINK_RDV_PEER_TIMEOUT"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil {
			fmt.Fprintf(out, "error GDRLINK_RDV_PEER_TIMEOUT: %v\n", err)
			return 1
		}
		opts = append(opts, WithPeerTimeout(d))
	}
	if v := os.Getenv("GDRLINK_RDV_KEEPALIVE"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil {
			fmt.Fprintf(out, "error GDRLINK_RDV_KEEPALIVE: %v\n", err)
			return 1
		}
		opts = append(opts, WithKeepalive(d))
	}
	fail := func(err error) int {
		fmt.Fprintf(out, "error %v\n", err)
		return 1
	}
	s, err := openSide(provider, "peer", opts...)
	if err != nil {
		return fail(err)
	}
	defer s.close()
	fmt.Fprintf(out, "hello %x\n", s.ch.Hello())
	sc := bufio.NewScanner(in)
	if !sc.Scan() {
		return fail(fmt.Errorf("no hello on stdin: %v", sc.Err()))
	}
	ph, err := hex.DecodeString(strings.TrimPrefix(sc.Text(), "hello "))
	if err != nil {
		return fail(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := s.ch.Connect(ctx, ph); err != nil {
		return fail(err)
	}
	fmt.Fprintln(out, "ready")
	send := func(key string, step int64, kind string, shape tensor.Shape) error {
		t, err := makeTensor(s.pool, kind, shape, key, step)
		if err != nil {
			return err
		}
		return s.ch.Send(key, step, t)
	}
	var raceErr []error
	var raceDone sync.WaitGroup
	dones := map[skey]chan error{}
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 0 {
			continue
		}
		ints := func(from int) []int64 {
			var v []int64
			for _, x := range f[from:] {
				n, _ := strconv.ParseInt(x, 10, 64)
				v = append(v, n)
			}
			return v
		}
		switch f[0] {
		case "send":
			step, _ := strconv.ParseInt(f[2], 10, 64)
			if err := send(f[1], step, f[3], tensor.Shape(ints(4))); err != nil {
				return fail(err)
			}
		case "senderr":
			step, _ := strconv.ParseInt(f[2], 10, 64)
			if err := s.ch.SendError(f[1], step, errors.New(strings.Join(f[3:], " "))); err != nil {
				return fail(err)
			}
		case "many":
			v := ints(2)
			nkeys, step, n := v[0], v[1], ints(5)[0]
			for i := int64(0); i < nkeys; i++ {
				if err := send(fmt.Sprint(f[1], i), step, f[4], tensor.Shape{n}); err != nil {
					return fail(err)
				}
			}
		case "stream":
			v := ints(3)
			n, count, ms := v[0], v[1], v[2]
			go func() {
				for step := int64(0); step < count; step++ {
					if err := send(f[1], step, f[2], tensor.Shape{n}); err != nil {
						fmt.Fprintf(os.Stderr, "stream: %v\n", err)
						return
					}
					time.Sleep(time.Duration(ms) * time.Millisecond)
				}
			}()
		case "recv":
			v := ints(3)
			go recvStream(s.ch, out, f[1], f[2], tensor.Shape{v[0]}, v[1])
		case "race":
			n := int(ints(1)[0])
			raceErr = make([]error, n)
			raceDone.Add(n)
			for i := 0; i < n; i++ {
				t, err := makeTensor(s.pool, "float32", tensor.Shape{256}, "t", int64(i))
				if err != nil {
					return fail(err)
				}
				if err := s.ch.SendFunc("t", int64(i), t, func(err error) { raceErr[i] = err; _ = t.Release(); raceDone.Done() }); err != nil {
					return fail(err)
				}
			}
		case "report":
			all := make(chan struct{})
			go func() { raceDone.Wait(); close(all) }()
			select {
			case <-all:
			case <-time.After(3 * time.Second):
				_ = s.ch.Close() // sends held for the queue pair end now
				<-all
			}
			var b strings.Builder
			for _, err := range raceErr {
				if err == nil {
					b.WriteByte('1')
				} else {
					b.WriteByte('0')
					fmt.Fprintf(os.Stderr, "race: %v\n", err)
				}
			}
			fmt.Fprintln(out, "report", b.String())
		case "sendfn":
			step, _ := strconv.ParseInt(f[2], 10, 64)
			t, err := makeTensor(s.pool, f[3], tensor.Shape(ints(4)), f[1], step)
			if err != nil {
				return fail(err)
			}
			ch := make(chan error, 1)
			dones[skey{f[1], step}] = ch
			if err := s.ch.SendFunc(f[1], step, t, func(err error) { _ = t.Release(); ch <- err }); err != nil {
				return fail(err)
			}
		case "done":
			step, _ := strconv.ParseInt(f[2], 10, 64)
			select {
			case err := <-dones[skey{f[1], step}]:
				var ce *ChecksumError
				switch {
				case err == nil:
					fmt.Fprintln(out, "done nil")
				case errors.As(err, &ce):
					fmt.Fprintf(out, "done checksum peer=%q tries=%d sending=%v: %v\n", ce.Peer, ce.Tries, ce.Sending, err)
				default:
					fmt.Fprintf(out, "done other: %v\n", err)
				}
			case <-time.After(10 * time.Second):
				fmt.Fprintln(out, "done none")
			}
		case "stats":
			st := s.ch.Stats()
			fmt.Fprintln(out, "stats", st.Rewrites, st.ConfirmsIn, st.WritesOut, st.ControlOut)
		case "sync":
			fmt.Fprintln(out, "ok")
		case "quit":
			return 0
		default:
			return fail(fmt.Errorf("unknown command %q", f[0]))
		}
	}
	return 0
}

// peerProc is the parent's handle on a sending peer process.
type peerProc struct {
	t     *testing.T
	cmd   *exec.Cmd
	in    io.WriteCloser
	lines chan string
	local *side
	done  chan struct{}
}

// startPeer opens the receiving side here and a sending peer process, and
// connects them.
func startPeer(t *testing.T, provider string, checksum bool) *peerProc {
	t.Helper()
	var opts []Option
	var env []string
	if checksum {
		// The write path's checksums (its corruptions are of writes):
		// the receiver takes no tensor eagerly (TestTwoProcessEagerChecksum
		// has those).
		opts = append(opts, WithChecksum(true), WithEager(0))
		env = append(env, "GDRLINK_RDV_CHECKSUM=1")
	}
	return startPeerWith(t, provider, nil, env, nil, opts...)
}

// startPeerWith is startPeer with the local devices' listen addresses, the
// peer's extra environment, and a command prefix for the peer (such as
// "ip netns exec NS").
func startPeerWith(t *testing.T, provider string, listen, env, wrap []string, opts ...Option) *peerProc {
	t.Helper()
	local, err := openSideRails(provider, "receiver", listen, opts...)
	if err != nil {
		skipUnavailable(t, provider, err)
	}
	return startPeerOn(t, provider, local, env, wrap)
}

// startPeerOn starts a sending peer process for the receiving side local
// (which it closes when the test ends) and connects them.
func startPeerOn(t *testing.T, provider string, local *side, env, wrap []string) *peerProc {
	t.Helper()
	p := launchProc(t, wrap, append([]string{peerEnv + "=1", "GDRLINK_RDV_PROVIDER=" + provider}, env...), local)
	hello := p.expect("hello ")
	ph, err := hex.DecodeString(hello)
	if err != nil {
		t.Fatal(err)
	}
	p.send("hello %x", local.ch.Hello())
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := local.ch.Connect(ctx, ph); err != nil {
		t.Fatalf("connect to the peer process: %v", err)
	}
	p.expect("ready")
	return p
}

// launchProc starts this test binary as a process of its own (after the
// command prefix wrap, with the extra environment env) and hands its
// output lines to the returned handle, whose local side is local. The
// process is stopped when the test ends.
func launchProc(t *testing.T, wrap, env []string, local *side) *peerProc {
	t.Helper()
	argv := append(append([]string{}, wrap...), os.Args[0], "-test.run=^$")
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Env = append(os.Environ(), env...)
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
	p := &peerProc{t: t, cmd: cmd, in: in, lines: make(chan string, 16), local: local, done: make(chan struct{})}
	go func() {
		sc := bufio.NewScanner(outp)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			p.lines <- sc.Text()
		}
		close(p.lines)
	}()
	go func() { _ = cmd.Wait(); close(p.done) }()
	t.Cleanup(p.stop)
	return p
}

func (p *peerProc) send(format string, args ...any) {
	p.t.Helper()
	if _, err := fmt.Fprintf(p.in, format+"\n", args...); err != nil {
		p.t.Fatalf("command to peer: %v", err)
	}
}

// expect waits for a line with the prefix and returns the rest.
func (p *peerProc) expect(prefix string) string {
	p.t.Helper()
	select {
	case l, ok := <-p.lines:
		if !ok {
			p.t.Fatalf("peer exited while %q was expected", prefix)
		}
		if !strings.HasPrefix(l, prefix) {
			p.t.Fatalf("peer said %q, expected %q", l, prefix)
		}
		return strings.TrimPrefix(l, prefix)
	case <-time.After(30 * time.Second):
		p.t.Fatalf("peer silent for 30s, expected %q", prefix)
	}
	return ""
}

func (p *peerProc) sync() {
	p.t.Helper()
	p.send("sync")
	p.expect("ok")
}

func (p *peerProc) stop() {
	_, _ = fmt.Fprintln(p.in, "quit")
	_ = p.in.Close()
	select {
	case <-p.done:
	case <-time.After(10 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
	if err := p.local.close(); err != nil {
		p.t.Errorf("closing the receiving side: %v", err)
	}
}

func TestTwoProcessEveryDType(t *testing.T) {
	forEachProvider(t, func(t *testing.T, provider string) {
		p := startPeerWith(t, provider, nil, nil, nil, WithEager(0)) // the request paths
		ctx := recvCtx(t)
		type item struct {
			key   string
			kind  string
			shape tensor.Shape
			path  Path
		}
		var items []item
		for _, dt := range tensor.DTypes() {
			path := PathDirect
			if dt == tensor.String {
				path = PathSerialized
			}
			items = append(items,
				item{"scalar-" + dt.String(), dt.String(), tensor.Shape{}, path},
				item{"matrix-" + dt.String(), dt.String(), tensor.Shape{3, 17}, path},
				item{"dead-" + dt.String(), "dead:" + dt.String(), tensor.Shape{2, 2}, PathNone})
			if dt != tensor.String {
				items = append(items, item{"empty-" + dt.String(), dt.String(), tensor.Shape{4, 0}, PathNone})
			}
		}
		for step := int64(0); step < 2; step++ {
			recvFirst := step == 0
			type res struct {
				it  item
				t   *tensor.Tensor
				tr  Transfer
				err error
			}
			results := make(chan res, len(items))
			recvAll := func() {
				for _, it := range items {
					b := p.local.ch
					b.RecvFunc(ctx, it.key, step, func(t *tensor.Tensor, tr Transfer, err error) { results <- res{it, t, tr, err} })
				}
			}
			if recvFirst {
				recvAll()
			}
			for _, it := range items {
				p.send("send %s %d %s %s", it.key, step, it.kind, dims(it.shape))
			}
			if !recvFirst {
				p.sync() // every Send is in before the first Recv
				recvAll()
			}
			for range items {
				r := <-results
				if r.err != nil {
					t.Fatalf("%s step %d: %v", r.it.key, step, r.err)
				}
				if err := checkTensor(r.t, r.it.kind, r.it.shape, r.it.key, step); err != nil {
					t.Fatalf("%s step %d: %v", r.it.key, step, err)
				}
				if r.tr.Path != r.it.path {
					t.Errorf("%s step %d went %s, want %s", r.it.key, step, r.tr.Path, r.it.path)
				}
				_ = r.t.Release()
			}
		}
		st := p.local.ch.Stats()
		t.Logf("stats: %+v", st)
		if st.Finals == 0 || st.WritesIn == 0 || st.MetaResponses == 0 {
			t.Fatalf("dead/empty, write and meta-data paths not all taken: %+v", st)
		}
	})
}

func dims(s tensor.Shape) string {
	var b strings.Builder
	for _, d := range s {
		fmt.Fprintf(&b, " %d", d)
	}
	return strings.TrimSpace(b.String())
}

func TestTwoProcessShapeChange(t *testing.T) {
	forEachProvider(t, func(t *testing.T, provider string) {
		p := startPeerWith(t, provider, nil, nil, nil, WithEager(0)) // the request paths
		ctx := recvCtx(t)
		shapes := []tensor.Shape{{64}, {64}, {64}, {128}, {128}, {128}}
		var before Stats
		for step, sh := range shapes {
			if step == 3 {
				before = p.local.ch.Stats()
			}
			p.send("send grad %d float32 %s", step, dims(sh))
			got, tr, err := p.local.ch.Recv(ctx, "grad", int64(step))
			if err != nil {
				t.Fatal(err)
			}
			if err := checkTensor(got, "float32", sh, "grad", int64(step)); err != nil {
				t.Fatalf("step %d: %v", step, err)
			}
			if want := step == 0 || step == 3; tr.MetaRoundTrip != want {
				t.Errorf("step %d: meta round trip %v, want %v", step, tr.MetaRoundTrip, want)
			}
			_ = got.Release()
		}
		after := p.local.ch.Stats()
		if d := after.MetaResponses - before.MetaResponses; d != 1 {
			t.Errorf("the shape change cost %d META_DATA_RESPONSEs, want exactly 1", d)
		}
		if d := after.ReRequests - before.ReRequests; d != 1 {
			t.Errorf("the shape change cost %d TENSOR_RE_REQUESTs, want exactly 1", d)
		}
	})
}

func TestTwoProcessThousandsOfRecvs(t *testing.T) {
	forEachProvider(t, func(t *testing.T, provider string) {
		p := startPeer(t, provider, false)
		ctx := recvCtx(t)
		const keys, steps = 1000, 3
		var wg sync.WaitGroup
		var mu sync.Mutex
		var firstErr error
		for step := int64(0); step < steps; step++ {
			for i := 0; i < keys; i++ {
				key := fmt.Sprint("k", i)
				wg.Add(1)
				p.local.ch.RecvFunc(ctx, key, step, func(got *tensor.Tensor, _ Transfer, err error) {
					defer wg.Done()
					if err == nil {
						err = checkTensor(got, "int32", tensor.Shape{33}, key, step)
						_ = got.Release()
					}
					if err != nil {
						mu.Lock()
						if firstErr == nil {
							firstErr = fmt.Errorf("%s step %d: %w", key, step, err)
						}
						mu.Unlock()
					}
				})
			}
		}
		for step := steps - 1; step >= 0; step-- {
			p.send("many k %d %d int32 33", keys, step)
		}
		wg.Wait()
		if firstErr != nil {
			t.Fatal(firstErr)
		}
		st := p.local.ch.Stats()
		if st.NameDefs != keys {
			t.Errorf("%d full names sent, want %d (later requests use indexes)", st.NameDefs, keys)
		}
		t.Logf("%d Recvs; stats %+v", keys*steps, st)
	})
}

func TestTwoProcessSenderError(t *testing.T) {
	forEachProvider(t, func(t *testing.T, provider string) {
		p := startPeer(t, provider, false)
		ctx := recvCtx(t)
		p.send("senderr lost 7 device out of memory")
		_, _, err := p.local.ch.Recv(ctx, "lost", 7)
		if !errors.Is(err, ErrRemote) || !strings.Contains(err.Error(), "device out of memory") || !strings.Contains(err.Error(), "peer") {
			t.Fatalf("Recv = %v, want ErrRemote naming the peer and carrying the message", err)
		}
		// The channel still works.
		p.send("send after 7 uint16 9")
		got, _, err := p.local.ch.Recv(ctx, "after", 7)
		if err != nil {
			t.Fatal(err)
		}
		_ = got.Release()
	})
}

func TestTwoProcessChecksum(t *testing.T) {
	forEachProvider(t, func(t *testing.T, provider string) {
		p := startPeer(t, provider, true)
		ctx := recvCtx(t)
		for step := int64(0); step < 3; step++ {
			p.send("send clean %d float64 100", step)
			p.send("send corrupt %d float64 100", step)
			got, tr, err := p.local.ch.Recv(ctx, "clean", step)
			if err != nil || !tr.Checksummed {
				t.Fatalf("clean step %d: %v (checksummed %v)", step, err, tr.Checksummed)
			}
			_ = got.Release()
			_, _, err = p.local.ch.Recv(ctx, "corrupt", step)
			if !errors.Is(err, ErrChecksum) {
				t.Fatalf("corrupted write step %d: %v, want ErrChecksum", step, err)
			}
		}
	})
}

// TestTwoProcessEagerChecksum: in checksum mode a small tensor sent before
// its Recv goes eagerly with the CRC-32C of its bytes, and arrives
// checked; one corrupted on the way is never delivered: its Recv fails
// with ErrChecksum, as does the channel.
func TestTwoProcessEagerChecksum(t *testing.T) {
	forEachProvider(t, func(t *testing.T, provider string) {
		p := startPeerWith(t, provider, nil, []string{"GDRLINK_RDV_CHECKSUM=1"}, nil, WithChecksum(true))
		ctx := recvCtx(t)
		waitEager := func(n uint64) {
			t.Helper()
			deadline := time.Now().Add(10 * time.Second)
			for p.local.ch.Stats().EagerIn < n && time.Now().Before(deadline) {
				time.Sleep(time.Millisecond)
			}
		}
		for step := int64(0); step < 3; step++ {
			p.send("send clean %d float64 100", step)
			waitEager(uint64(step) + 1)
			got, tr, err := p.local.ch.Recv(ctx, "clean", step)
			if err != nil || !tr.Checksummed || tr.Path != PathEager {
				t.Fatalf("clean step %d: %v (checksummed %v, path %s), want eager and checksummed", step, err, tr.Checksummed, tr.Path)
			}
			if err := checkTensor(got, "float64", tensor.Shape{100}, "clean", step); err != nil {
				t.Fatal(err)
			}
			_ = got.Release()
		}
		// No Recv asks for it, so it goes eagerly, and fails the channel.
		p.send("send corrupt 0 float64 100")
		deadline := time.Now().Add(10 * time.Second)
		for p.local.ch.Err() == nil && time.Now().Before(deadline) {
			time.Sleep(time.Millisecond)
		}
		_, _, err := p.local.ch.Recv(ctx, "corrupt", 0)
		var ce *ChecksumError
		if !errors.Is(err, ErrChecksum) || !errors.As(err, &ce) || ce.Key != "corrupt" || ce.Got == ce.Want {
			t.Fatalf("a corrupted EAGER: %v, want a ChecksumError for \"corrupt\"", err)
		}
		if err := p.local.ch.Err(); !errors.Is(err, ErrChecksum) {
			t.Errorf("channel after a corrupted EAGER: %v, want ErrChecksum", err)
		}
	})
}

func TestTwoProcessSenderKilled(t *testing.T) {
	forEachProvider(t, func(t *testing.T, provider string) {
		base := runtime.NumGoroutine()
		p := startPeer(t, provider, false)
		p.send("stream s float32 4096 100000 2")
		for step := int64(0); step < 20; step++ {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			got, _, err := p.local.ch.Recv(ctx, "s", step)
			cancel()
			if err != nil {
				t.Fatalf("step %d before the kill: %v", step, err)
			}
			_ = got.Release()
		}
		pending := make(chan error, 8)
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		defer cancel()
		for i := 0; i < 8; i++ {
			p.local.ch.RecvFunc(ctx, "never-sent", int64(i), func(_ *tensor.Tensor, _ Transfer, err error) { pending <- err })
		}
		if err := p.cmd.Process.Kill(); err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		for step := int64(20); ; step++ {
			got, _, err := p.local.ch.Recv(ctx, "s", step)
			if err == nil {
				_ = got.Release()
				continue // written before the kill
			}
			if !errors.Is(err, verbsio.ErrPeerLost) || !strings.Contains(err.Error(), "peer") {
				t.Fatalf("Recv after the kill = %v, want ErrPeerLost naming the peer", err)
			}
			t.Logf("after %v: %v", time.Since(start).Round(time.Millisecond), err)
			break
		}
		for i := 0; i < 8; i++ {
			if err := <-pending; !errors.Is(err, verbsio.ErrPeerLost) {
				t.Fatalf("pending Recv %d = %v, want ErrPeerLost", i, err)
			}
		}
		<-p.done
		if err := p.local.close(); err != nil {
			t.Fatalf("close: %v", err)
		}
		p.local = &side{}
		deadline := time.Now().Add(5 * time.Second)
		for runtime.NumGoroutine() > base && time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond)
		}
		if n := runtime.NumGoroutine(); n > base {
			buf := make([]byte, 1<<16)
			t.Fatalf("%d goroutines after close, %d before:\n%s", n, base, buf[:runtime.Stack(buf, true)])
		}
	})
}

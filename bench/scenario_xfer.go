package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"time"

	"github.com/dustin/go-humanize"

	"github.com/gdrlink/gdrlink/verbsio"
	_ "github.com/gdrlink/gdrlink/verbsio/ibverbs"
	_ "github.com/gdrlink/gdrlink/verbsio/onnode"
	_ "github.com/gdrlink/gdrlink/verbsio/tcp"
)

// The xfer scenario measures raw RDMA WRITE between this process and a peer
// process of this host for each provider that has a device here: bandwidth
// from 4 KiB to 256 MiB, and one-way latency of 8 B and 4 KiB writes with
// immediate (half the median ping-pong round trip). Baselines measured in
// the same run: a single-thread memcpy between buffers like the two ends of
// the onnode transfer, one raw loopback TCP stream to the same peer process
// for tcp, perftest's ib_write_bw and ib_write_lat on the same device and
// GID for ibverbs (where perftest is installed), and ucx_perftest on
// loopback (tag_bw, tag_lat) where ucx-utils is installed. A provider with no device here is
// reported as a "skipped/PROVIDER" result whose note says why.
func init() {
	register(Scenario{
		Name: "xfer",
		Doc:  "RDMA WRITE between two processes per provider, 4 KiB..256 MiB GB/s and 8 B/4 KiB one-way latency, vs memcpy, raw TCP, ib_write_bw/ib_write_lat and ucx_perftest",
		Run:  runXfer,
		Plots: []Plot{
			{File: "xfer-bandwidth.svg", Title: "RDMA WRITE between two processes vs memcpy / raw TCP / ib_write_bw", Unit: "GB/s", CasePrefix: "bw/"},
			{File: "xfer-vs-ucx.svg", Title: "RDMA WRITE vs ucx_perftest tag_bw", Unit: "GB/s", CasePrefix: "ucx/"},
			{File: "xfer-latency.svg", Title: "one-way latency, write with immediate vs ucx_perftest tag_lat / ib_write_lat", Unit: "us", CasePrefix: "lat/"},
		},
		// The bench binary re-executes itself as the scenario's peer.
		Child: &Child{Env: xferPeerEnv, Run: runXferPeer},
	})
}

const (
	xferPeerEnv = "GDRLINK_BENCH_XFER_PEER"
	xferMaxEnv  = "GDRLINK_BENCH_XFER_MAX"

	xferMinSize = 4 << 10
	xferMaxSize = 256 << 20
	xferPingMem = 64 << 10
	// xferRecvs is how many receives each side keeps posted for immediates.
	xferRecvs = 64
	// xferSignalEvery: one write in so many asks for a completion.
	xferSignalEvery = 16
	xferWait        = 30 * time.Second
	// xferRunTime caps a timed run on slow (emulated) devices: where the
	// bytes of xferIters would take longer, a run makes fewer writes, and
	// so does its baseline.
	xferRunTime = time.Second
	// xferMinIters is the fewest writes a run capped by xferRunTime makes.
	xferMinIters = 32
	// requireRDMAEnv set to 1 says this host has an RDMA device: the
	// ibverbs provider may not be skipped.
	requireRDMAEnv = "GDRLINK_REQUIRE_RDMA"
)

// xferProviders are tried in this order; one with no device here is skipped
// with its reason in the log.
var xferProviders = []string{"onnode", "tcp", "ibverbs"}

// xferRegion names a registered region of the peer.
type xferRegion struct {
	Addr uint64
	RKey uint32
}

// xferHello is the peer's first line.
type xferHello struct {
	Err      string
	Endpoint verbsio.Endpoint
	Memfd    *xferRegion // onnode only: a memfd region (peers map it)
	THP      xferRegion
	Ping     xferRegion
}

// xferCmd is one command to the peer; xferReply its answer.
type xferCmd struct {
	Op       string // connect, pong, tcpsink, exit
	Endpoint *verbsio.Endpoint
	Ping     xferRegion
	Size     int
	Count    int
}

type xferReply struct {
	Err  string
	Addr string
}

// xferSide is one process's device, queues and regions.
type xferSide struct {
	dev      verbsio.Device
	pd       verbsio.ProtectionDomain
	scq, rcq verbsio.CompletionQueue
	qp       verbsio.QueuePair
	mems     []*xferMem
	mrs      []verbsio.MemoryRegion
	ping     verbsio.MemoryRegion
	signals  int // signaled sends not yet reaped
	posted   int // since the last signaled one
	// fence is a region of the peer that drain's zero-length write names
	// (a write must name a valid key on every provider, empty or not).
	fence  xferRegion
	comps  []verbsio.Completion
	repost [1]verbsio.RecvWR // waitImm's receive, posted again
}

func openXferSide(provider string) (*xferSide, error) {
	cfg, err := verbsio.ConfigFromEnv()
	if err != nil {
		return nil, err
	}
	s := &xferSide{comps: make([]verbsio.Completion, 64)}
	if s.dev, err = verbsio.Open(provider, cfg); err != nil {
		return nil, err
	}
	if s.pd, err = s.dev.AllocPD(); err == nil {
		if s.scq, err = s.dev.CreateCQ(1024); err == nil {
			if s.rcq, err = s.dev.CreateCQ(1024); err == nil {
				s.qp, err = s.pd.CreateQP(verbsio.QPConfig{SendCQ: s.scq, RecvCQ: s.rcq, MaxSendWR: 256, MaxRecvWR: 256})
			}
		}
	}
	if err != nil {
		s.Close()
		return nil, err
	}
	// On one host the ping buffers are memfd arenas, as a memfd pool's
	// tensors are: the peer maps them and the write is a plain store.
	pingKind := memTHP
	if provider == "onnode" {
		pingKind = memMemfd
	}
	if _, s.ping, err = s.register(pingKind, xferPingMem); err != nil {
		s.Close()
		return nil, err
	}
	return s, nil
}

const xferAccess = verbsio.AccessLocalWrite | verbsio.AccessRemoteWrite | verbsio.AccessRemoteRead

func (s *xferSide) register(kind xferMemKind, size int) (*xferMem, verbsio.MemoryRegion, error) {
	m, err := newXferMem(kind, size)
	if err != nil {
		return nil, nil, err
	}
	mr, err := s.pd.RegisterMemory(m.addr(), size, xferAccess)
	if err != nil {
		m.Close()
		return nil, nil, err
	}
	s.mems, s.mrs = append(s.mems, m), append(s.mrs, mr)
	return m, mr, nil
}

// Close releases everything in reverse order; idempotent.
func (s *xferSide) Close() error {
	var errs []error
	if s.qp != nil {
		errs = append(errs, s.qp.Close())
		s.qp = nil
	}
	for _, mr := range s.mrs {
		errs = append(errs, mr.Close())
	}
	for _, m := range s.mems {
		errs = append(errs, m.Close())
	}
	s.mrs, s.mems = nil, nil
	for _, c := range []*verbsio.CompletionQueue{&s.scq, &s.rcq} {
		if *c != nil {
			errs = append(errs, (*c).Close())
			*c = nil
		}
	}
	if s.pd != nil {
		errs = append(errs, s.pd.Close())
		s.pd = nil
	}
	if s.dev != nil {
		errs = append(errs, s.dev.Close())
		s.dev = nil
	}
	return errors.Join(errs...)
}

func (s *xferSide) postRecvs(n int) error {
	wrs := make([]verbsio.RecvWR, n)
	for i := range wrs {
		wrs[i].WRID = uint64(i)
	}
	return s.qp.PostRecv(wrs)
}

// post posts writes, asking for a completion every xferSignalEvery and
// reaping them so the send queue never fills.
func (s *xferSide) post(ctx context.Context, wrs []verbsio.SendWR) error {
	for i := range wrs {
		s.posted++
		if s.posted == xferSignalEvery {
			wrs[i].Signaled = true
			s.posted = 0
			s.signals++
		}
	}
	if err := s.qp.PostSend(wrs); err != nil {
		return err
	}
	for s.signals > 4 {
		if err := s.reap(ctx, true); err != nil {
			return err
		}
	}
	return nil
}

// reap takes send completions (waiting for one when block is set).
func (s *xferSide) reap(ctx context.Context, block bool) error {
	var n int
	var err error
	if block {
		wctx, cancel := context.WithTimeout(ctx, xferWait)
		n, err = s.scq.Wait(wctx, s.comps)
		cancel()
	} else {
		n, err = s.scq.Poll(s.comps)
	}
	if err != nil {
		return fmt.Errorf("send completions: %w", err)
	}
	for _, c := range s.comps[:n] {
		if c.Status != verbsio.StatusSuccess {
			return fmt.Errorf("work request %d (%s): %w", c.WRID, c.Op, c.Status.Err())
		}
		s.signals--
	}
	return nil
}

// drain waits until every write posted so far has completed.
func (s *xferSide) drain(ctx context.Context) error {
	if s.posted > 0 {
		// A zero-length signaled write completes after all before it.
		if err := s.qp.PostSend([]verbsio.SendWR{{Op: verbsio.OpWrite, Signaled: true, RemoteAddr: s.fence.Addr, RKey: s.fence.RKey}}); err != nil {
			return err
		}
		s.posted = 0
		s.signals++
	}
	for s.signals > 0 {
		if err := s.reap(ctx, true); err != nil {
			return err
		}
	}
	return nil
}

// writes moves size bytes from src to dst iters times and waits for all.
func (s *xferSide) writes(ctx context.Context, src verbsio.MemoryRegion, dst xferRegion, size, iters int) error {
	var batch [xferSignalEvery]verbsio.SendWR
	for done := 0; done < iters; {
		k := min(len(batch), iters-done)
		for i := range k {
			batch[i] = verbsio.SendWR{WRID: uint64(done + i), Op: verbsio.OpWrite, RemoteAddr: dst.Addr, RKey: dst.RKey,
				SG: []verbsio.SGE{{Addr: src.Addr(), Length: uint32(size), LKey: src.LKey()}}}
		}
		if err := s.post(ctx, batch[:k]); err != nil {
			return err
		}
		done += k
	}
	return s.drain(ctx)
}

// writeImm sends size bytes of the ping region with an immediate, into the
// start of dst. The bytes sent are the second half of the region, which
// the peer never writes, as a sender's tensor is not the one it receives
// into (a source the peer has just written would cost every copy a cache
// miss).
func (s *xferSide) writeImm(ctx context.Context, dst xferRegion, size int) error {
	wr := [1]verbsio.SendWR{{Op: verbsio.OpWriteImm, Imm: uint32(size), RemoteAddr: dst.Addr, RKey: dst.RKey,
		SG: []verbsio.SGE{{Addr: s.ping.Addr() + xferPingMem/2, Length: uint32(size), LKey: s.ping.LKey()}}}}
	if err := s.post(ctx, wr[:]); err != nil {
		return err
	}
	if s.signals > 0 {
		return s.reap(ctx, false)
	}
	return nil
}

// waitImm waits for one receive completion; repost1 posts its receive
// again. ctx carries the deadline: a ping-pong round's, made once per
// round (a context per wait would cost a timer's start and stop on every
// message, a quarter of a microsecond here). Each side keeps xferRecvs
// receives posted, so a ping-pong posts the one it took after its answer
// has gone, off the round trip, as a pipelined receiver would.
func (s *xferSide) waitImm(ctx context.Context) error {
	c := s.comps[:1]
	if _, err := s.rcq.Wait(ctx, c); err != nil {
		return fmt.Errorf("waiting for an immediate: %w", err)
	}
	if c[0].Status != verbsio.StatusSuccess {
		return fmt.Errorf("receive: %w", c[0].Status.Err())
	}
	s.repost[0] = verbsio.RecvWR{WRID: c[0].WRID}
	return nil
}

// repost1 posts the receive waitImm took.
func (s *xferSide) repost1() error { return s.qp.PostRecv(s.repost[:]) }

// runXferPeer is the peer process: it serves commands on stdin.
func runXferPeer(provider string) int {
	maxSize, err := strconv.Atoi(os.Getenv(xferMaxEnv))
	if err != nil || maxSize < xferMinSize {
		maxSize = xferMaxSize
	}
	enc := json.NewEncoder(os.Stdout)
	fail := func(err error) int {
		enc.Encode(xferHello{Err: err.Error()})
		return 1
	}
	s, err := openXferSide(provider)
	if err != nil {
		return fail(err)
	}
	defer s.Close()
	h := xferHello{Endpoint: s.qp.Endpoint(), Ping: xferRegion{uint64(s.ping.Addr()), s.ping.RKey()}}
	if provider == "onnode" {
		_, mr, err := s.register(memMemfd, maxSize)
		if err != nil {
			return fail(err)
		}
		h.Memfd = &xferRegion{uint64(mr.Addr()), mr.RKey()}
	}
	_, mr, err := s.register(memTHP, maxSize)
	if err != nil {
		return fail(err)
	}
	h.THP = xferRegion{uint64(mr.Addr()), mr.RKey()}
	if err := enc.Encode(h); err != nil {
		return 1
	}
	ctx := context.Background()
	var parentPing xferRegion
	dec := json.NewDecoder(bufio.NewReader(os.Stdin))
	for {
		var c xferCmd
		if err := dec.Decode(&c); err != nil {
			return 0 // the bench process is gone or done
		}
		var r xferReply
		switch c.Op {
		case "connect":
			parentPing = c.Ping
			s.fence = c.Ping
			cctx, cancel := context.WithTimeout(ctx, xferWait)
			err = s.qp.Connect(cctx, *c.Endpoint)
			cancel()
			if err == nil {
				err = s.postRecvs(xferRecvs)
			}
		case "pong":
			rctx, cancel := context.WithTimeout(ctx, xferWait)
			for i := 0; i < c.Count && err == nil; i++ {
				if err = s.waitImm(rctx); err == nil {
					if err = s.writeImm(rctx, parentPing, c.Size); err == nil {
						err = s.repost1()
					}
				}
			}
			cancel()
			if err == nil {
				err = s.drain(ctx)
			}
		case "tcpsink":
			var ln net.Listener
			if ln, err = net.Listen("tcp", "127.0.0.1:0"); err == nil {
				r.Addr = ln.Addr().String()
				go serveTCPSink(ln, 1<<20)
			}
		case "exit":
			enc.Encode(r)
			return 0
		default:
			err = fmt.Errorf("unknown command %q", c.Op)
		}
		if err != nil {
			r.Err = err.Error()
			err = nil
		}
		if enc.Encode(r) != nil {
			return 1
		}
	}
}

// xferPeer is the peer process seen from the bench process.
type xferPeer struct {
	cmd   *exec.Cmd
	enc   *json.Encoder
	dec   *json.Decoder
	hello xferHello
	done  chan error
}

func startXferPeer(ctx context.Context, provider string, maxSize int) (*xferPeer, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cmd := exec.CommandContext(ctx, self, "-test.run=^$")
	cmd.Env = append(os.Environ(), xferPeerEnv+"="+provider, xferMaxEnv+"="+strconv.Itoa(maxSize))
	cmd.Stderr = os.Stderr
	cmd.WaitDelay = 5 * time.Second
	in, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	p := &xferPeer{cmd: cmd, enc: json.NewEncoder(in), dec: json.NewDecoder(bufio.NewReader(out)), done: make(chan error, 1)}
	go func() { p.done <- cmd.Wait() }()
	if err := p.read(&p.hello); err != nil {
		p.Close()
		return nil, fmt.Errorf("peer process: %w", err)
	}
	if p.hello.Err != "" {
		p.Close()
		return nil, fmt.Errorf("peer process: %s", p.hello.Err)
	}
	return p, nil
}

// read decodes the peer's next line, or fails when the peer stays silent
// past xferWait... plus the time a command may take (reads have no
// deadline on a pipe: a peer that hangs is killed by Close).
func (p *xferPeer) read(v any) error {
	errc := make(chan error, 1)
	go func() { errc <- p.dec.Decode(v) }()
	select {
	case err := <-errc:
		return err
	case <-time.After(5 * time.Minute):
		p.cmd.Process.Kill()
		return fmt.Errorf("peer process did not answer within 5m")
	}
}

// call sends a command and reads its reply.
func (p *xferPeer) call(c xferCmd) (xferReply, error) {
	var r xferReply
	if err := p.enc.Encode(c); err != nil {
		return r, fmt.Errorf("peer process: %w", err)
	}
	if err := p.read(&r); err != nil {
		return r, fmt.Errorf("peer process (%s): %w", c.Op, err)
	}
	if r.Err != "" {
		return r, fmt.Errorf("peer process (%s): %s", c.Op, r.Err)
	}
	return r, nil
}

// Close asks the peer to exit and kills it if it does not; idempotent.
func (p *xferPeer) Close() error {
	if p.cmd == nil {
		return nil
	}
	p.enc.Encode(xferCmd{Op: "exit"})
	select {
	case <-p.done:
	case <-time.After(10 * time.Second):
		p.cmd.Process.Kill()
		<-p.done
	}
	p.cmd = nil
	return nil
}

// The xfer scenario's -set keys.
const (
	setXferProviders = "xfer.providers" // comma-separated subset of onnode,tcp,ibverbs
	setXferUCX       = "xfer.ucx"       // "off" skips the UCX baseline
)

func runXfer(ctx context.Context, env *Env) error {
	sizes := env.sizes(xferMinSize, xferMaxSize)
	if env.Quick && len(sizes) > 3 {
		sizes = []int64{sizes[0], sizes[len(sizes)/2], sizes[len(sizes)-1]}
	}
	ucxErr := ucxAvailable(ctx)
	if env.Args[setXferUCX] == "off" {
		ucxErr = fmt.Errorf("%w: -set %s=off", errNoUCX, setXferUCX)
	}
	if ucxErr != nil {
		env.Log.Info("UCX baseline skipped", "reason", ucxErr)
	}
	providers := xferProviders
	if v, ok := env.Args[setXferProviders]; ok {
		providers = strings.Split(v, ",")
	}
	ran := 0
	for _, name := range providers {
		p, err := verbsio.Lookup(name)
		if err == nil {
			_, err = p.Devices()
		}
		if err != nil {
			env.Log.Info("provider skipped", "provider", name, "reason", err)
			env.Emit(Result{Scenario: "xfer", Case: "skipped/" + name, Unit: "GB/s",
				Note: fmt.Sprintf("not measured: provider %s has no device here (%v)", name, err)})
			if name == "ibverbs" && os.Getenv(requireRDMAEnv) == "1" {
				return fmt.Errorf("%s=1 but the ibverbs provider has no device: %w", requireRDMAEnv, err)
			}
			continue
		}
		if err := xferProvider(ctx, env, name, sizes, ucxErr); err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
		ran++
	}
	if ran == 0 {
		return fmt.Errorf("%w: no provider could run", verbsio.ErrNoProvider)
	}
	return nil
}

// xferCase is one bandwidth series of a provider.
type xferCase struct {
	name   string
	target xferRegion
	note   string
	// one of the two baselines, or neither
	memcpy *memcpyBaseline
	raw    *rawTCP
	// perftest measures ib_write_bw moving iters writes of size bytes.
	perftest *perftestBW
	// UCX_TLS settings whose tag_bw this case is also held against
	ucx []string
}

// xferIters is how many writes of size one timed run makes: enough bytes
// that a run takes milliseconds.
func xferIters(env *Env, size int64) int {
	total := int64(256 << 20)
	if env.Quick {
		total = 8 << 20
	}
	return int(min(max(total/size, 1), 4096))
}

func xferProvider(ctx context.Context, env *Env, provider string, sizes []int64, ucxErr error) error {
	maxSize := int(sizes[len(sizes)-1])
	peer, err := startXferPeer(ctx, provider, maxSize)
	if err != nil {
		return err
	}
	defer peer.Close()
	s, err := openXferSide(provider)
	if err != nil {
		return err
	}
	defer s.Close()
	srcMem, src, err := s.register(memTHP, maxSize)
	if err != nil {
		return err
	}
	// Connect both ends at once.
	ep := s.qp.Endpoint()
	replied := make(chan error, 1)
	go func() {
		_, err := peer.call(xferCmd{Op: "connect", Endpoint: &ep, Ping: xferRegion{uint64(s.ping.Addr()), s.ping.RKey()}})
		replied <- err
	}()
	cctx, cancel := context.WithTimeout(ctx, xferWait)
	err = s.qp.Connect(cctx, peer.hello.Endpoint)
	cancel()
	if perr := <-replied; err == nil {
		err = perr
	}
	if err != nil {
		return fmt.Errorf("connecting to the peer process: %w", err)
	}
	if err := s.postRecvs(xferRecvs); err != nil {
		return err
	}
	s.fence = peer.hello.Ping

	var cases []*xferCase
	var ucxBW, ucxLat []string // UCX_TLS settings to run
	var latUCX string
	var latBase *perftestLat  // ib_write_lat, for ibverbs devices
	var sendBase *perftestLat // ib_send_lat, for ibverbs devices
	var latNote string        // why latBase is nil
	switch provider {
	case "onnode":
		shm := &xferCase{name: "bw/onnode-shm", target: *peer.hello.Memfd, ucx: []string{"sm", "cma,tcp"},
			note: "target memfd (peer maps it: one memmove), source anonymous THP; baseline memcpy from the same source into a memfd of this process"}
		vm := &xferCase{name: "bw/onnode-vm", target: peer.hello.THP, ucx: []string{"sm", "cma,tcp"},
			note: "target anonymous THP (process_vm_writev), source anonymous THP; baseline memcpy from the same source into anonymous THP of this process"}
		if shm.memcpy, err = newMemcpyBaseline(srcMem, memMemfd); err != nil {
			return err
		}
		defer shm.memcpy.Close()
		if vm.memcpy, err = newMemcpyBaseline(srcMem, memTHP); err != nil {
			return err
		}
		defer vm.memcpy.Close()
		cases = []*xferCase{shm, vm}
		ucxBW, ucxLat, latUCX = []string{"sm", "cma,tcp"}, []string{"sm"}, "sm"
	case "tcp":
		c := &xferCase{name: "bw/tcp", target: peer.hello.THP, ucx: []string{"tcp"},
			note: "loopback, target anonymous THP; baseline one raw TCP stream to the same peer process"}
		r, err := peer.call(xferCmd{Op: "tcpsink"})
		if err != nil {
			return err
		}
		if c.raw, err = dialRawTCP(ctx, r.Addr, srcMem.b); err != nil {
			return err
		}
		defer c.raw.Close()
		cases = []*xferCase{c}
		ucxBW, ucxLat, latUCX = []string{"tcp"}, []string{"tcp"}, "tcp"
	default:
		// ibverbs (and any later provider): ib_write_bw on the same device
		// and GID where this is an ibverbs device and perftest is installed.
		c := &xferCase{name: "bw/" + provider, target: peer.hello.THP, note: "target anonymous THP"}
		if c.perftest, err = perftestBaseline(s.dev, env.Quick); err != nil {
			c.perftest = nil
			if provider == "ibverbs" {
				env.Log.Info("ib_write_bw baseline skipped", "reason", err)
				c.note += "; no ib_write_bw baseline: " + err.Error()
			}
		} else {
			c.note += fmt.Sprintf("; baseline %s -F, as many writes of the same size, run alternately with the transfer", c.perftest)
		}
		if latBase, err = perftestLatBaseline(s.dev, "ib_write_lat"); err != nil {
			latBase = nil
			if provider == "ibverbs" {
				env.Log.Info("ib_write_lat baseline skipped", "reason", err)
				latNote = "; no ib_write_lat baseline: " + err.Error()
			}
		} else if sendBase, err = perftestLatBaseline(s.dev, "ib_send_lat"); err != nil {
			sendBase = nil
			env.Log.Info("ib_send_lat baseline skipped", "reason", err)
		}
		cases = []*xferCase{c}
	}

	// UCX first, so its figures are at hand for every emit.
	ucx := map[string]map[string]ucxRow{}
	if ucxErr == nil {
		for _, tls := range append(append([]string(nil), ucxBW...), ucxLat...) {
			if _, done := ucx[tls]; done {
				continue
			}
			start := time.Now()
			rows, err := runUCX(ctx, tls, ucxTests(env, tls, sizes, contains(ucxBW, tls), contains(ucxLat, tls)), 4*time.Minute)
			env.Log.Info("UCX baseline", "tls", tls, "took", time.Since(start).Round(time.Millisecond), "results", len(rows))
			if err != nil {
				env.Log.Info("UCX baseline incomplete", "tls", tls, "err", err)
			}
			ucx[tls] = rows
		}
	}

	for _, size := range sizes {
		for _, c := range cases {
			iters, err := xferCalibrate(ctx, s, src, c.target, size, xferIters(env, size))
			if err != nil {
				return fmt.Errorf("%s at %s: %w", c.name, humanize.IBytes(uint64(size)), err)
			}
			transfer := wallTime(func() error { return s.writes(ctx, src, c.target, int(size), iters) })
			var baseline func() (time.Duration, error)
			var baseName string
			switch {
			case c.memcpy != nil:
				baseline = wallTime(func() error { c.memcpy.copies(int(size), iters); return nil })
				baseName = c.memcpy.name()
			case c.raw != nil:
				baseline = wallTime(func() error { return c.raw.send(ctx, int(size), iters) })
				baseName = "raw TCP stream"
			case c.perftest != nil:
				// ib_write_bw times itself (its process start and
				// connection are not the device's): its rate becomes the
				// time it would take to move the transfer's bytes.
				baseline = func() (time.Duration, error) {
					gbs, err := c.perftest.bw(ctx, size, iters)
					if err != nil || !(gbs > 0) {
						return 0, errors.Join(err, fmt.Errorf("ib_write_bw measured %v GB/s", gbs))
					}
					return time.Duration(float64(size*int64(iters)) / gbs), nil
				}
				baseName = "ib_write_bw"
			}
			d, bd, err := timePair(env.Reps, transfer, baseline)
			if err != nil {
				return fmt.Errorf("%s at %s: %w", c.name, humanize.IBytes(uint64(size)), err)
			}
			gbs := rateGBs(size*int64(iters), d)
			var base float64
			if baseline != nil {
				base = rateGBs(size*int64(iters), bd)
			}
			r := newResult("xfer", c.name, size, gbs, "GB/s", base, baseName)
			r.Note = c.note
			env.Emit(r)
			for _, tls := range c.ucx {
				if u, ok := ucxMedian(ucx[tls], "bw", size, env.Reps, func(r ucxRow) float64 { return r.GBs() }); ok {
					r := newResult("xfer", "ucx/"+c.name[len("bw/"):]+"-vs-"+tls, size, gbs, "GB/s", u, "ucx_perftest tag_bw UCX_TLS="+tls)
					env.Emit(r)
				}
			}
		}
	}

	// One-way latency: half the median round trip of a ping-pong of writes
	// with immediate, in rounds of count; with ib_write_lat, each round
	// alternates with an ib_write_lat run of as many ping-pongs, and one of
	// ib_send_lat (whose receiver, like ours, waits for a receive
	// completion) right after it.
	count := 2000
	if env.Quick {
		count = 200
	}
	for _, size := range []int{8, 4096} {
		var rtts []float64 // of the timed rounds
		rounds := 0
		ours := func() (time.Duration, error) {
			round, err := peer.pingPong(ctx, s, size, count)
			if err != nil {
				return 0, err
			}
			if rounds++; rounds > 1 { // timePair's first round warms up
				rtts = append(rtts, round...)
			}
			return time.Duration(median(round) / 2 * 1e3), nil
		}
		var baseline func() (time.Duration, error)
		var sends []float64 // ib_send_lat's t_typical of the timed rounds
		if latBase != nil {
			baseline = func() (time.Duration, error) {
				r, err := latBase.run(ctx, size, count)
				if err == nil && sendBase != nil {
					rs, serr := sendBase.run(ctx, size, count)
					if serr != nil {
						env.Log.Info("ib_send_lat baseline failed", "size", size, "err", serr)
						sendBase = nil
					} else {
						sends = append(sends, rs.Typical)
					}
				}
				return time.Duration(r.Typical * 1e3), err
			}
		}
		_, bd, err := timePair(env.Reps, ours, baseline)
		if err != nil {
			return fmt.Errorf("one-way latency of %d B: %w", size, err)
		}
		oneWay := median(rtts) / 2
		note := fmt.Sprintf("half the median of %d ping-pong round trips of write with immediate (the receiver waits for its receive completion)", len(rtts))
		var base float64
		var baseName string
		switch {
		case latBase != nil:
			base, baseName = float64(bd)/1e3, "ib_write_lat"
			note += fmt.Sprintf("; baseline %s -F -n %d in turn with rounds of as many: the median of %d runs' t_typical, its median one-way latency (half the round trip; its receiver polls the buffer's last byte)", latBase, count, max(env.Reps, 1))
		default:
			if u, ok := ucxMedian(ucx[latUCX], "lat", int64(size), env.Reps, func(r ucxRow) float64 { return r.MedianLatU }); ok {
				base, baseName = u, "ucx_perftest tag_lat UCX_TLS="+latUCX+" (median)"
			}
			note += latNote
		}
		res := newResult("xfer", "lat/"+provider, int64(size), oneWay, "us", base, baseName)
		res.Note = note
		env.Emit(res)
		if sendBase != nil && len(sends) > 1 {
			// The first was timePair's warm-up.
			res := newResult("xfer", "lat/"+provider+"-vs-send", int64(size), oneWay, "us", median(sends[1:]), "ib_send_lat")
			res.Note = fmt.Sprintf("the same ping-pongs; baseline %s -F -n %d run right after each ib_write_lat round: the median of %d runs' t_typical (a send whose receiver polls its completion queue, as a write with immediate's does)", sendBase, count, len(sends)-1)
			env.Emit(res)
		}
	}
	return nil
}

// pingPong makes count ping-pongs of size-byte writes with immediate with
// the peer and returns their round trips in microseconds.
func (p *xferPeer) pingPong(ctx context.Context, s *xferSide, size, count int) ([]float64, error) {
	if err := p.enc.Encode(xferCmd{Op: "pong", Size: size, Count: count}); err != nil {
		return nil, err
	}
	rtts := make([]float64, 0, count)
	ctx, cancel := context.WithTimeout(ctx, xferWait)
	defer cancel()
	for i := range count {
		t := time.Now()
		if err := s.writeImm(ctx, p.hello.Ping, size); err != nil {
			return nil, fmt.Errorf("ping %d B: %w", size, err)
		}
		if i > 0 {
			// The last answer's receive, posted while this one travels.
			if err := s.repost1(); err != nil {
				return nil, fmt.Errorf("ping %d B: %w", size, err)
			}
		}
		if err := s.waitImm(ctx); err != nil {
			return nil, fmt.Errorf("ping %d B: %w", size, err)
		}
		rtts = append(rtts, sinceUS(t))
	}
	if count > 0 {
		if err := s.repost1(); err != nil {
			return nil, fmt.Errorf("ping %d B: %w", size, err)
		}
	}
	var r xferReply
	if err := p.read(&r); err != nil || r.Err != "" {
		return nil, fmt.Errorf("peer pong: %v %s", err, r.Err)
	}
	return rtts, s.drain(ctx)
}

// xferCalibrate returns how many writes of size a timed run makes: iters,
// or fewer where the device is so slow (an emulated one) that iters would
// take longer than xferRunTime, judged by an untimed run of a sixteenth of
// them; never fewer than xferMinIters.
func xferCalibrate(ctx context.Context, s *xferSide, src verbsio.MemoryRegion, dst xferRegion, size int64, iters int) (int, error) {
	probe := max(iters/16, 1)
	if iters <= xferMinIters || probe < xferMinIters/2 {
		return iters, nil
	}
	start := time.Now()
	if err := s.writes(ctx, src, dst, int(size), probe); err != nil {
		return 0, err
	}
	took := time.Since(start)
	if fit := int(int64(probe) * int64(xferRunTime) / max(int64(took), 1)); fit < iters {
		return max(fit, xferMinIters), nil
	}
	return iters, nil
}

// wallTime makes f a function that returns how long it took.
func wallTime(f func() error) func() (time.Duration, error) {
	return func() (time.Duration, error) {
		start := time.Now()
		err := f()
		return time.Since(start), err
	}
}

// timePair runs a and b (b may be nil) reps times each, alternating which
// goes first so that both see the same machine, after one untimed run of
// each; each returns the time its run took (its wall time, or what the
// run measured itself). It returns the median time of one run of each.
func timePair(reps int, a, b func() (time.Duration, error)) (time.Duration, time.Duration, error) {
	reps = max(reps, 1)
	fns := []func() (time.Duration, error){a, b}
	if b == nil {
		fns = fns[:1]
	}
	times := make([][]time.Duration, len(fns))
	for _, f := range fns {
		if _, err := f(); err != nil {
			return 0, 0, err
		}
	}
	for r := range reps {
		for k := range fns {
			i := (k + r) % len(fns)
			d, err := fns[i]()
			if err != nil {
				return 0, 0, err
			}
			times[i] = append(times[i], d)
		}
	}
	da := medianDuration(times[0])
	if b == nil {
		return da, 0, nil
	}
	return da, medianDuration(times[1]), nil
}

func contains(xs []string, x string) bool {
	for _, v := range xs {
		if v == x {
			return true
		}
	}
	return false
}

// ucxTests is the batch for one UCX_TLS setting: tag_bw at every size and
// tag_lat at 8 B and 4 KiB, each min(reps, 3) times.
func ucxTests(env *Env, tls string, sizes []int64, bw, lat bool) []ucxTest {
	var extra []string
	if tls == "tcp" {
		// UCX 1.13 over tcp collapses above 1 MiB when it busy-polls on two
		// cores; sleeping is its fair setting here.
		extra = []string{"-E", "sleep"}
	}
	var out []ucxTest
	// At most three runs of each: ucx_perftest is slow to converge on a
	// loaded host and the batch must end within its timeout.
	for r := range min(env.Reps, 3) {
		if bw {
			for _, size := range sizes {
				iters := int(min(max((16<<20)/size, 4), 1000))
				if env.Quick {
					iters = int(min(max((4<<20)/size, 2), 200))
				}
				out = append(out, ucxTest{Label: fmt.Sprintf("bw-%d-%d", size, r), Test: "tag_bw", Size: int(size), Iters: iters, Extra: extra})
			}
		}
		if lat {
			for _, size := range []int{8, 4096} {
				iters := 5000
				if env.Quick {
					iters = 1000
				}
				out = append(out, ucxTest{Label: fmt.Sprintf("lat-%d-%d", size, r), Test: "tag_lat", Size: size, Iters: iters})
			}
		}
	}
	return out
}

// ucxMedian is the median of f over the reps rows of one kind and size.
func ucxMedian(rows map[string]ucxRow, kind string, size int64, reps int, f func(ucxRow) float64) (float64, bool) {
	var xs []float64
	for r := range min(reps, 3) {
		if row, ok := rows[fmt.Sprintf("%s-%d-%d", kind, size, r)]; ok {
			if v := f(row); v > 0 {
				xs = append(xs, v)
			}
		}
	}
	if len(xs) == 0 {
		return 0, false
	}
	return median(xs), true
}

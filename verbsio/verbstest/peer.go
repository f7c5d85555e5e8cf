package verbstest

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gdrlink/gdrlink/internal/bootstrap"
	"github.com/gdrlink/gdrlink/internal/jobauth"
	"github.com/gdrlink/gdrlink/internal/offheap"
	"github.com/gdrlink/gdrlink/verbsio"
)

// PeerEnv is the environment variable that turns a re-executed test binary
// into a peer: its value is the provider's name.
const PeerEnv = "GDRLINK_VERBSTEST_PEER"

// request is one command from the test to its peer, one JSON object a line
// on the peer's standard input.
type request struct {
	Op       string
	ID       int // region or queue pair
	Region   int
	Size     int
	Guard    int
	Fill     byte
	Access   verbsio.Access
	Off      int
	Len      int
	Data     []byte
	Count    int
	WRID     uint64
	Endpoint *verbsio.Endpoint
	Root     string
	Timeout  time.Duration
}

// reply is the peer's answer, one JSON object a line on its standard output.
type reply struct {
	Err         string
	ID          int
	Addr        uint64
	RKey        uint32
	Data        []byte
	Endpoint    *verbsio.Endpoint
	Completions []wireCompletion
}

type wireCompletion struct {
	WRID    uint64
	Status  verbsio.Status
	Op      verbsio.Opcode
	ByteLen uint32
	Imm     uint32
	HasImm  bool
}

type peerRegion struct {
	mem   []byte // the whole mapping, guards included
	guard int
	mr    verbsio.MemoryRegion
}

type peerQP struct {
	qp       verbsio.QueuePair
	scq, rcq verbsio.CompletionQueue
}

type peer struct {
	cfg     verbsio.Config
	dev     verbsio.Device
	pd      verbsio.ProtectionDomain
	regions map[int]*peerRegion
	qps     map[int]*peerQP
	next    int
}

// PeerMain runs the peer side of the suite when the process was started as
// a peer (PeerEnv set), and never returns then; otherwise it returns at
// once. Call it first thing in TestMain:
//
//	func TestMain(m *testing.M) {
//		verbstest.PeerMain()
//		os.Exit(m.Run())
//	}
func PeerMain() {
	name := os.Getenv(PeerEnv)
	if name == "" {
		return
	}
	if err := runPeer(name, os.Stdin, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "verbstest peer:", err)
		os.Exit(1)
	}
	os.Exit(0)
}

func runPeer(name string, in io.Reader, out io.Writer) error {
	cfg, err := verbsio.ConfigFromEnv()
	if err != nil {
		return err
	}
	dev, err := verbsio.Open(name, cfg)
	if err != nil {
		return err
	}
	pd, err := dev.AllocPD()
	if err != nil {
		return err
	}
	p := &peer{cfg: cfg, dev: dev, pd: pd, regions: map[int]*peerRegion{}, qps: map[int]*peerQP{}}
	dec := json.NewDecoder(bufio.NewReader(in))
	enc := json.NewEncoder(out)
	if err := enc.Encode(reply{}); err != nil { // ready
		return err
	}
	for {
		var r request
		if err := dec.Decode(&r); err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		}
		if r.Op == "exit" {
			return nil
		}
		rep, err := p.do(r)
		if err != nil {
			rep.Err = err.Error()
		}
		if err := enc.Encode(rep); err != nil {
			return err
		}
	}
}

func (p *peer) do(r request) (reply, error) {
	var rep reply
	switch r.Op {
	case "reg":
		mem, err := unix.Mmap(-1, 0, r.Size+2*r.Guard, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
		if err != nil {
			return rep, err
		}
		for i := range mem {
			mem[i] = r.Fill
		}
		mr, err := p.pd.RegisterMemory(offheap.Addr(mem[r.Guard:]), r.Size, r.Access)
		if err != nil {
			unix.Munmap(mem)
			return rep, err
		}
		p.next++
		p.regions[p.next] = &peerRegion{mem: mem, guard: r.Guard, mr: mr}
		return reply{ID: p.next, Addr: uint64(mr.Addr()), RKey: mr.RKey()}, nil
	case "bytes":
		g := p.regions[r.ID]
		if g == nil {
			return rep, fmt.Errorf("no region %d", r.ID)
		}
		return reply{Data: g.mem}, nil
	case "digest":
		g := p.regions[r.ID]
		if g == nil {
			return rep, fmt.Errorf("no region %d", r.ID)
		}
		sum := sha256.Sum256(g.mem)
		return reply{Data: sum[:]}, nil
	case "set":
		g := p.regions[r.ID]
		if g == nil {
			return rep, fmt.Errorf("no region %d", r.ID)
		}
		copy(g.mem[g.guard+r.Off:], r.Data)
		return rep, nil
	case "dereg":
		g := p.regions[r.ID]
		if g == nil {
			return rep, fmt.Errorf("no region %d", r.ID)
		}
		// The mapping stays, so the test can check that nothing lands in
		// it after deregistration.
		return rep, g.mr.Close()
	case "qp":
		q, err := p.newQP(r.Count)
		if err != nil {
			return rep, err
		}
		p.next++
		p.qps[p.next] = q
		ep := q.qp.Endpoint()
		return reply{ID: p.next, Endpoint: &ep}, nil
	case "connect":
		q := p.qps[r.ID]
		if q == nil || r.Endpoint == nil {
			return rep, fmt.Errorf("no queue pair %d or no endpoint", r.ID)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		return rep, q.qp.Connect(ctx, *r.Endpoint)
	case "bootstrap":
		// Join a two-rank group as rank 1 and connect queue pair ID to
		// rank 0's through the pairwise exchange.
		q := p.qps[r.ID]
		if q == nil {
			return rep, fmt.Errorf("no queue pair %d", r.ID)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		g, err := bootstrap.Join(ctx, harnessBootstrap(p.cfg, bootstrap.Config{Rank: 1, Size: 2, Root: r.Root}))
		if err != nil {
			return rep, err
		}
		defer g.Close()
		b, err := g.Exchange(ctx, 0, bootstrap.EncodeEndpoint(nil, q.qp.Endpoint()))
		if err != nil {
			return rep, err
		}
		ep, err := bootstrap.DecodeEndpoint(b)
		if err != nil {
			return rep, err
		}
		if err := q.qp.Connect(ctx, ep); err != nil {
			return rep, err
		}
		return rep, g.Barrier(ctx)
	case "postrecv":
		q, g := p.qps[r.ID], p.regions[r.Region]
		if q == nil {
			return rep, fmt.Errorf("no queue pair %d", r.ID)
		}
		wrs := make([]verbsio.RecvWR, r.Count)
		for i := range wrs {
			wrs[i].WRID = r.WRID + uint64(i)
			if g != nil && r.Len > 0 {
				wrs[i].SG = []verbsio.SGE{{Addr: g.mr.Addr() + uintptr(r.Off+i*r.Len), Length: uint32(r.Len), LKey: g.mr.LKey()}}
			}
		}
		return rep, q.qp.PostRecv(wrs)
	case "poll":
		q := p.qps[r.ID]
		if q == nil {
			return rep, fmt.Errorf("no queue pair %d", r.ID)
		}
		ctx, cancel := context.WithTimeout(context.Background(), r.Timeout)
		defer cancel()
		buf := make([]verbsio.Completion, 16)
		for len(rep.Completions) < r.Count {
			n, err := q.rcq.Wait(ctx, buf)
			if err != nil {
				break
			}
			for _, c := range buf[:n] {
				rep.Completions = append(rep.Completions, wireCompletion{WRID: c.WRID, Status: c.Status, Op: c.Op, ByteLen: c.ByteLen, Imm: c.Imm, HasImm: c.HasImm})
			}
		}
		return rep, nil
	case "state":
		q := p.qps[r.ID]
		if q == nil {
			return rep, fmt.Errorf("no queue pair %d", r.ID)
		}
		return reply{Data: []byte(q.qp.State().String())}, nil
	case "closeqp":
		q := p.qps[r.ID]
		if q == nil {
			return rep, fmt.Errorf("no queue pair %d", r.ID)
		}
		delete(p.qps, r.ID)
		return rep, errors.Join(q.qp.Close(), q.scq.Close(), q.rcq.Close())
	}
	return rep, fmt.Errorf("unknown command %q", r.Op)
}

func (p *peer) newQP(depth int) (*peerQP, error) {
	if depth == 0 {
		depth = 256
	}
	scq, err := p.dev.CreateCQ(depth)
	if err != nil {
		return nil, err
	}
	rcq, err := p.dev.CreateCQ(depth)
	if err != nil {
		scq.Close()
		return nil, err
	}
	qp, err := p.pd.CreateQP(verbsio.QPConfig{SendCQ: scq, RecvCQ: rcq, MaxSendWR: depth, MaxRecvWR: depth})
	if err != nil {
		scq.Close()
		rcq.Close()
		return nil, err
	}
	return &peerQP{qp: qp, scq: scq, rcq: rcq}, nil
}

// harnessBootstrap is bc with the job key of the provider's configuration,
// so the harness's bootstrap authenticates as the provider does. Without a
// key it may listen beyond loopback (the network-namespace tests do): the
// harness, not a job, is what listens there.
func harnessBootstrap(cfg verbsio.Config, bc bootstrap.Config) bootstrap.Config {
	k, err := jobauth.FromBytes(cfg.JobKey)
	if err == nil {
		bc.Key = k
	}
	bc.Insecure = k.IsZero()
	return bc
}

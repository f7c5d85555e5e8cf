package gdrlink

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"strconv"
	"sync"
	"time"
	"unsafe"

	"github.com/gdrlink/gdrlink/collective"
	coll "github.com/gdrlink/gdrlink/internal/collective"
	"github.com/gdrlink/gdrlink/internal/hostcard"
	"github.com/gdrlink/gdrlink/internal/jobauth"
	"github.com/gdrlink/gdrlink/internal/switchml/bfp"
	"github.com/gdrlink/gdrlink/internal/switchml/worker"
	"github.com/gdrlink/gdrlink/rendezvous"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

// switchML is the switchml backend: AllReduce of float32, float16,
// bfloat16 and int32 tensors through a SwitchML aggregator
// (GDRLINK_AGGREGATOR); other element types, Broadcast and AllGather run
// on the ring.
type switchML struct {
	g    *Group
	ring coll.Backend
	addr string // the aggregator's control endpoint
	port uint16 // the RoCEv2 UDP port of both sides
	// local picks the worker's IPv4 address (localIPv4 unless a test
	// gives another).
	local func(aggregator string, rank int) ([4]byte, error)
	// mode is GDRLINK_SWITCHML_TRANSPORT; findVerbs the probe for a
	// verbs device (worker.FindVerbs unless a test gives another).
	mode      string
	findVerbs func(local [4]byte) (worker.Verbs, error)

	mu sync.Mutex
	w  *worker.Worker
}

func newSwitchML(g *Group, ring coll.Backend) *switchML {
	s := &switchML{g: g, ring: ring, addr: g.cfg.aggregator, port: g.cfg.aggregatorPort, local: localIPv4,
		mode: g.cfg.switchmlTransport, findVerbs: worker.FindVerbs}
	if g.cfg.switchmlLocal != nil {
		s.local = g.cfg.switchmlLocal
	}
	return s
}

// jobName names the job at the aggregator: the same on every rank, and
// different for any two jobs that run at once, whatever their size and
// whether or not they share a job key. Every rank knows the root's address
// (from the bootstrap's address list) and rank 0's host card (boot id and
// network namespace, from the card exchange of Join); rank 0 holds the
// root address's listening socket for the life of the job, so no other
// job running at the same time has the same root address in the same
// namespace of the same host. The job key's fingerprint and the size are
// mixed in too.
func jobName(size int, rootAddr string, root hostcard.Card, key jobauth.Key) string {
	h := sha256.New()
	for _, f := range []string{strconv.Itoa(size), rootAddr, root.Host, root.NetNS, key.Fingerprint()} {
		h.Write(binary.BigEndian.AppendUint32(nil, uint32(len(f))))
		h.Write([]byte(f))
	}
	return "gdrlink-" + strconv.Itoa(size) + "-" + hex.EncodeToString(h.Sum(nil)[:12])
}

func (s *switchML) Name() string { return "switchml" }

func (s *switchML) Broadcast(ctx context.Context, seq uint64, t *tensor.Tensor, root int) (collective.Report, error) {
	return s.ring.Broadcast(ctx, seq, t, root)
}

func (s *switchML) AllGather(ctx context.Context, seq uint64, in, out *tensor.Tensor) (collective.Report, error) {
	return s.ring.AllGather(ctx, seq, in, out)
}

// Abandon tells the other ranks that this rank's call failed before it
// began. A Broadcast or AllGather runs on the ring, which tells them. An
// AllReduce gives the aggregator's job up (worker.Abandon, setting it up
// first if this is the first call): the aggregator ends the job and the
// other ranks' AllReduce fails at once naming this rank, instead of
// waiting there for messages that will not come. (The group's
// collectives end with the failed call, collective.ErrBroken, so no new
// job is set up.)
func (s *switchML) Abandon(ctx context.Context, seq uint64, op string, m tensor.Meta, root int, cause error) error {
	if op == "allreduce" {
		err := &collective.RankError{Op: op, Rank: s.g.Rank(), Err: fmt.Errorf("rank %d: %w", s.g.Rank(), cause)}
		w, werr := s.worker(ctx)
		if werr != nil {
			s.g.log.Warn("switchml: the other ranks are not told of an abandoned AllReduce: no job", "rank", s.g.Rank(), "err", werr)
			return err
		}
		if werr := w.Abandon(fmt.Sprintf("rank %d: %v", s.g.Rank(), cause)); werr != nil {
			s.g.log.Warn("switchml: telling the aggregator of an abandoned AllReduce", "rank", s.g.Rank(), "err", werr)
		}
		return err
	}
	if a, ok := s.ring.(abandoner); ok {
		return a.Abandon(ctx, seq, op, m, root, cause)
	}
	return &collective.RankError{Op: op, Rank: s.g.Rank(), Err: fmt.Errorf("rank %d: %w", s.g.Rank(), cause)}
}

// worker returns the worker, setting the job up with the aggregator on
// first use (every rank gets there in its first AllReduce).
func (s *switchML) worker(ctx context.Context) (*worker.Worker, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.w != nil {
		return s.w, nil
	}
	rank, size := s.g.Rank(), s.g.Size()
	var local [4]byte
	var err error
	if s.mode == "verbs" {
		// Ranks of one host share their device's address.
		local, err = localIPv4(s.addr, -1)
	} else {
		local, err = s.local(s.addr, rank)
	}
	if err != nil {
		return nil, err
	}
	var v worker.Verbs
	var verr error
	if s.mode != "udp" {
		v, verr = s.findVerbs(local)
	}
	useVerbs, why, err := switchmlTransport(s.mode, s.port, v, verr)
	if err != nil {
		return nil, err
	}
	s.g.log.Info("switchml transport", "rank", rank, "transport", map[bool]string{true: "verbs", false: "udp"}[useVerbs], "why", why)
	cfg := worker.Config{Control: s.addr, Key: s.g.cfg.key, Workers: size, Rank: rank,
		Local: local, Port: s.port, DataPort: s.port, Seed: uint64(time.Now().UnixNano())}
	if useVerbs {
		cfg.Verbs = &v
		if v.Soft {
			// rxe loses a queue pair for good to one lost packet of a
			// multi-packet reply (package worker, Verbs.Soft).
			cfg.MsgSlots = 1
		}
	}
	if n := s.g.cfg.switchmlPackets; n > 0 {
		if useVerbs && v.Soft && n > 1 {
			s.g.log.Warn("switchml: multi-packet messages on Soft-RoCE: one lost packet of a reply stops its queue pair for good", "rank", rank, "packets", n)
		}
		cfg.MsgSlots = n
	}
	var root hostcard.Card
	if len(s.g.cards) > 0 {
		root = s.g.cards[0]
	}
	job := jobName(size, s.g.boot.RootAddr(), root, s.g.cfg.key)
	cfg.Job = job
	w, err := worker.New(ctx, cfg)
	if err != nil {
		return nil, err
	}
	s.w = w
	return w, nil
}

// switchmlTransport decides, from the mode (GDRLINK_SWITCHML_TRANSPORT:
// "", auto, verbs or udp), the RoCEv2 port and what the probe for a verbs
// device found (v, or why none: an error matching worker.ErrNoDevice, or
// another when it could not tell), whether the worker uses the verbs
// transport, and says why.
func switchmlTransport(mode string, port uint16, v worker.Verbs, probe error) (bool, string, error) {
	switch {
	case mode == "udp":
		return false, "GDRLINK_SWITCHML_TRANSPORT=udp", nil
	case port != 0 && port != 4791:
		why := fmt.Sprintf("RoCEv2 port %d: a verbs device sends to and receives on 4791 only", port)
		if mode == "verbs" {
			return false, why, fmt.Errorf("%w: GDRLINK_SWITCHML_TRANSPORT=verbs: %s", verbsio.ErrBadConfig, why)
		}
		return false, why, nil
	case probe == nil:
		return true, fmt.Sprintf("%s port %d has RoCE v2 GID %d for the route to the aggregator", v.Device, v.Port, v.GIDIndex), nil
	case mode == "verbs":
		return false, "", fmt.Errorf("switchml: GDRLINK_SWITCHML_TRANSPORT=verbs: %w", probe)
	case errors.Is(probe, worker.ErrNoDevice):
		return false, probe.Error(), nil
	default:
		return false, "could not tell whether a verbs device has the address: " + probe.Error(), nil
	}
}

// localIPv4 is the address the route to the aggregator leaves from; on
// loopback, where every rank of a host would get 127.0.0.1, rank r takes
// 127.0.0.(2+r), since the aggregator writes to every worker at one port
// (a negative rank takes the route's address as it is).
func localIPv4(aggregator string, rank int) ([4]byte, error) {
	var a [4]byte
	c, err := net.Dial("udp4", aggregator)
	if err != nil {
		return a, fmt.Errorf("switchml: route to aggregator %s: %w", aggregator, err)
	}
	defer c.Close()
	ip := c.LocalAddr().(*net.UDPAddr).IP.To4()
	if ip == nil {
		return a, fmt.Errorf("switchml: no IPv4 address toward aggregator %s", aggregator)
	}
	if ip.IsLoopback() && rank >= 0 {
		if rank > 252 {
			return a, fmt.Errorf("switchml: rank %d: loopback has no address left for it", rank)
		}
		ip = net.IPv4(127, 0, 0, byte(2+rank)).To4()
	}
	copy(a[:], ip)
	return a, nil
}

func (s *switchML) AllReduce(ctx context.Context, seq uint64, t *tensor.Tensor, op coll.Op) (collective.Report, error) {
	const name = "allreduce"
	start := time.Now()
	if t == nil || t.Device().IsGPU() || t.Meta().IsDead {
		return s.ring.AllReduce(ctx, seq, t, op) // the ring reports what is wrong
	}
	dt := t.Meta().DType
	switch dt {
	case tensor.Float32, tensor.Float16, tensor.BFloat16, tensor.Int32:
	default:
		return s.ring.AllReduce(ctx, seq, t, op)
	}
	if op != coll.Sum && op != coll.Average {
		return collective.Report{Op: name}, fmt.Errorf("%w: reduction %s", coll.ErrBadArgument, op)
	}
	b, err := t.Bytes()
	if err != nil {
		return collective.Report{Op: name}, fmt.Errorf("%w: %w", coll.ErrBadArgument, err)
	}
	rep := collective.Report{Op: name, Reduce: op.String(), Backend: s.Name(), Ranks: s.g.Size(), Bytes: int64(len(b))}
	if len(b) == 0 {
		return rep, nil
	}
	w, err := s.worker(ctx)
	if err != nil {
		return rep, err
	}
	st0 := w.Stats()
	n := float64(s.g.Size())
	switch dt {
	case tensor.Float32:
		x := unsafe.Slice((*float32)(unsafe.Pointer(&b[0])), len(b)/4)
		if err = w.AllReduceFloat32(ctx, x); err == nil && op == coll.Average {
			for i := range x {
				x[i] = float32(float64(x[i]) / n)
			}
		}
	case tensor.Int32:
		x := unsafe.Slice((*int32)(unsafe.Pointer(&b[0])), len(b)/4)
		if err = w.AllReduceInt32(ctx, x); err == nil && op == coll.Average {
			for i := range x {
				x[i] = int32(float64(x[i]) / n)
			}
		}
	case tensor.Float16:
		x := unsafe.Slice((*uint16)(unsafe.Pointer(&b[0])), len(b)/2)
		if err = w.AllReduceFloat16(ctx, x); err == nil && op == coll.Average {
			for i := range x {
				x[i] = bfp.Float64ToF16(bfp.F16ToFloat64(x[i]) / n)
			}
		}
	case tensor.BFloat16:
		x := unsafe.Slice((*uint16)(unsafe.Pointer(&b[0])), len(b)/2)
		if err = w.AllReduceBFloat16(ctx, x); err == nil && op == coll.Average {
			for i := range x {
				x[i] = bfp.Float64ToBF16(float64(bfp.BF16ToFloat32(x[i])) / n)
			}
		}
	}
	st := w.Stats()
	rep.Sent, rep.Received = int64(st.BytesSent-st0.BytesSent), int64(st.BytesReceived-st0.BytesReceived)
	rep.Resent, rep.StaleReplies = int64(st.Resent-st0.Resent), int64(st.StaleReplies-st0.StaleReplies)
	rep.Links = []collective.LinkUse{{Peer: -1, Provider: "switchml/" + w.Transport(), Device: s.addr, Path: rendezvous.PathNone,
		Transfers: int(st.Messages - st0.Messages), Bytes: rep.Received}}
	rep.Took = time.Since(start)
	var left *worker.LeftError
	if errors.As(err, &left) && left.Abandoned {
		// Another rank gave this call up (Abandon): name it; it is not
		// lost.
		return rep, &collective.RankError{Op: name, Rank: left.Rank, Err: fmt.Errorf("switchml AllReduce: %w", err)}
	}
	if errors.As(err, &left) {
		// Another rank is gone: name it, as the ring does.
		return rep, &collective.RankError{Op: name, Rank: left.Rank, Err: fmt.Errorf("switchml AllReduce: %w: %w", verbsio.ErrPeerLost, err)}
	}
	if err != nil {
		return rep, fmt.Errorf("switchml AllReduce: %w", err)
	}
	return rep, nil
}

// Close leaves the aggregator's job.
func (s *switchML) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.w == nil {
		return nil
	}
	return s.w.Close()
}

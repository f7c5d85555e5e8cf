package gdrlink

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/collective"
	"github.com/gdrlink/gdrlink/proxy"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

// gpuCopy copies src's bytes into dst, one of them on the group's GPU and
// the other pinned, on a stream of its own, and waits.
func gpuCopy(g *Group, dst, src *tensor.Tensor) error {
	s, err := g.gpu.dev.NewStream()
	if err != nil {
		return err
	}
	defer s.Close()
	n := int(src.Meta().ByteSize)
	if n == 0 {
		return nil
	}
	if dst.Device().IsGPU() {
		err = g.gpu.dev.CopyHtoDAsync(proxy.DevicePtr(dst.Addr()), src.Addr(), n, s)
	} else {
		err = g.gpu.dev.CopyDtoHAsync(dst.Addr(), proxy.DevicePtr(src.Addr()), n, s)
	}
	if err != nil {
		return err
	}
	return s.Synchronize()
}

// gpuCollJob runs the collective job's cases on tensors of the rank's GPU
// (case c on rank r stays in host memory where (r+c)%3 == 2, so that
// ranks mix GPU and host tensors in one call): each is filled through a
// pinned tensor, reduced, read back and checked element by element
// against the float64 sums, with the report's staged bytes. Then a
// Broadcast from each root and an AllGather from a GPU tensor into a GPU
// tensor.
func gpuCollJob(ctx context.Context, g *Group, rep *childReport) error {
	n, r := g.Size(), g.Rank()
	pinned := tensor.Device{Kind: tensor.PinnedHost}
	gpu := tensor.GPUDevice(0)
	// onGPU makes a GPU tensor holding h's bytes.
	onGPU := func(h *tensor.Tensor) (*tensor.Tensor, error) {
		m := h.Meta()
		t, err := g.NewTensorOn(gpu, m.DType, m.Shape...)
		if err != nil {
			return nil, err
		}
		return t, gpuCopy(g, t, h)
	}
	for c, cs := range collCases {
		h, err := g.NewTensorOn(pinned, cs.dt, cs.n)
		if err != nil {
			return err
		}
		for i := range cs.n {
			setElem(h, i, float64(collValue(c, r, i)))
		}
		t := h
		if (r+c)%3 != 2 {
			if t, err = onGPU(h); err != nil {
				return err
			}
		}
		cr, err := g.AllReduce(ctx, t, cs.op)
		if err != nil {
			return fmt.Errorf("case %d (%s[%d] on %s): %w", c, cs.dt, cs.n, t.Device(), err)
		}
		var staged int64
		if t != h {
			staged = 2 * h.Meta().ByteSize
			if err := gpuCopy(g, h, t); err != nil {
				return err
			}
			_ = t.Release()
		}
		if cr.Staged != staged || (staged > 0) != (cr.StageTook > 0) || cr.Took < cr.StageTook {
			return fmt.Errorf("case %d on %s: staged %d bytes in %v of %v, want %d bytes", c, t.Device(), cr.Staged, cr.StageTook, cr.Took, staged)
		}
		for i := range cs.n {
			if got, want := elem(h, i), collWant(c, cs, n, i); got != want {
				return fmt.Errorf("case %d (%s[%d] on %s): element %d is %v, want %v", c, cs.dt, cs.n, t.Device(), i, got, want)
			}
		}
		rep.Digests = append(rep.Digests, digest(h))
		_ = h.Release()
	}

	for root := range n {
		h, err := g.NewTensorOn(pinned, tensor.Int64, 100001)
		if err != nil {
			return err
		}
		w, _ := tensor.View[int64](h)
		for i := range w {
			w[i] = int64(r*1_000_000 + i)
		}
		t, err := onGPU(h)
		if err != nil {
			return err
		}
		cr, err := g.Broadcast(ctx, t, root)
		if err != nil {
			return err
		}
		if cr.Staged != h.Meta().ByteSize {
			return fmt.Errorf("broadcast from %d: staged %d bytes, want %d (one way)", root, cr.Staged, h.Meta().ByteSize)
		}
		clear(w)
		if err := gpuCopy(g, h, t); err != nil {
			return err
		}
		for i := range w {
			if w[i] != int64(root*1_000_000+i) {
				return fmt.Errorf("broadcast from %d: element %d is %d", root, i, w[i])
			}
		}
		_ = t.Release()
		_ = h.Release()
	}

	hin, err := g.NewTensorOn(pinned, tensor.Float64, 3, 1001)
	if err != nil {
		return err
	}
	iv, _ := tensor.View[float64](hin)
	for i := range iv {
		iv[i] = float64(r) + float64(i)/8
	}
	in, err := onGPU(hin)
	if err != nil {
		return err
	}
	out, err := g.NewTensorOn(gpu, tensor.Float64, int64(n), 3, 1001)
	if err != nil {
		return err
	}
	hout, err := g.NewTensorOn(pinned, tensor.Float64, int64(n), 3, 1001)
	if err != nil {
		return err
	}
	cr, err := g.AllGather(ctx, in, out)
	if err != nil {
		return err
	}
	if want := hin.Meta().ByteSize + hout.Meta().ByteSize; cr.Staged != want {
		return fmt.Errorf("allgather staged %d bytes, want %d (in, then out)", cr.Staged, want)
	}
	if err := gpuCopy(g, hout, out); err != nil {
		return err
	}
	if err := checkGathered(hout, n, len(iv)); err != nil {
		return err
	}
	for _, t := range []*tensor.Tensor{in, out, hin, hout} {
		_ = t.Release()
	}
	return nil
}

// TestCollectivesGPU: three ranks reduce, broadcast and gather tensors on
// their GPU (mixed with host tensors), on onnode and tcp: with a simulated
// GPU (named as such: no GPU here), and with GPU 0 where a CUDA driver is
// (all three processes share it).
func TestCollectivesGPU(t *testing.T) {
	for _, gpu := range []string{"simulated", "cuda"} {
		for _, prov := range []string{"onnode", "tcp"} {
			t.Run(gpu+"/"+prov, func(t *testing.T) {
				env := []string{"GDRLINK_TEST_SIMGPU=1"}
				if gpu == "cuda" {
					requireCUDA(t)
					env = []string{"GDRLINK_TEST_REALGPU=1"}
				}
				env = append(env, "GDRLINK_PROVIDER="+prov)
				j := startJob(t, "gpu-collectives", 3, "127.0.0.1", func(int) []string { return nil }, func(int) []string { return env })
				reps := j.wait(3 * time.Minute)
				for r, rep := range reps {
					if len(rep.Digests) != len(collCases) {
						t.Fatalf("rank %d: %d digests, want %d", r, len(rep.Digests), len(collCases))
					}
					for i, d := range rep.Digests {
						if d != reps[0].Digests[i] {
							t.Errorf("rank %d: result %d differs from rank 0's", r, i)
						}
					}
				}
			})
		}
	}
}

// TestCollectivesGPURefused: a GPU tensor in a group without a GPU is a
// bad argument that leaves the group usable, and so is a tensor of another
// GPU than the group's.
func TestCollectivesGPURefused(t *testing.T) {
	g, err := Join(context.Background(), WithRank(0, 1), withSimulatedGPU())
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	m, err := tensor.MetaFor(tensor.Float32, tensor.Shape{4})
	if err != nil {
		t.Fatal(err)
	}
	other, err := tensor.New(m, fakeBuffer{dev: tensor.GPUDevice(1)})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := g.AllReduce(ctx, other, Sum); !errors.Is(err, verbsio.ErrBadConfig) {
		t.Errorf("AllReduce of a tensor on GPU 1 in a group on GPU 0: %v, want ErrBadConfig", err)
	}
	plain, err := Join(context.Background(), WithRank(0, 1))
	if err != nil {
		t.Fatal(err)
	}
	defer plain.Close()
	if _, err := plain.AllReduce(ctx, other, Sum); !errors.Is(err, verbsio.ErrBadConfig) {
		t.Errorf("AllReduce of a GPU tensor in a group without a GPU: %v, want ErrBadConfig", err)
	}
	// Both groups still reduce: a bad argument does not break them.
	for _, gr := range []*Group{g, plain} {
		x, err := gr.NewTensor(tensor.Float32, 4)
		if err != nil {
			t.Fatal(err)
		}
		v, _ := tensor.View[float32](x)
		v[2] = 3
		if _, err := gr.AllReduce(ctx, x, Sum); err != nil || v[2] != 3 {
			t.Errorf("AllReduce after a refusal: %v, element %v", err, v[2])
		}
		if errors.Is(err, collective.ErrBroken) {
			t.Error("the group broke")
		}
	}
	gt, err := g.NewTensorOn(tensor.GPUDevice(0), tensor.Float32, 1000)
	if err != nil {
		t.Fatal(err)
	}
	defer gt.Release()
	// One rank: a small tensor is copied there and back whole; from
	// overlapMin up the ring copies nothing, the GPU tensor being the
	// result already.
	if rep, err := g.AllReduce(ctx, gt, Average); err != nil || rep.Staged != 8000 {
		t.Errorf("AllReduce of a 4000-byte GPU tensor on one rank: %v, staged %d bytes, want 8000", err, rep.Staged)
	}
	big, err := g.NewTensorOn(tensor.GPUDevice(0), tensor.Float32, overlapMin/4)
	if err != nil {
		t.Fatal(err)
	}
	defer big.Release()
	if rep, err := g.AllReduce(ctx, big, Average); err != nil || rep.Staged != 0 {
		t.Errorf("AllReduce of a %d-byte GPU tensor on one rank: %v, staged %d bytes, want 0", overlapMin, err, rep.Staged)
	}
}

// fakeBuffer is memory that claims to be on dev; nothing reads it.
type fakeBuffer struct{ dev tensor.Device }

func (b fakeBuffer) Bytes() []byte         { return nil }
func (b fakeBuffer) Addr() uintptr         { return 0x1000 }
func (b fakeBuffer) Len() int              { return 16 }
func (b fakeBuffer) Device() tensor.Device { return b.dev }
func (b fakeBuffer) Free() error           { return nil }

// gpuPinnedFullJob: rank 1 has no room left in its pinned pool
// (GDRLINK_POOL_LIMIT is small there, and it fills the pool first), so
// its collective on a GPU tensor (GDRLINK_TEST_COLLOP: "allreduce" of 4
// KiB, copied whole; "allreduce-staged" of 2 MiB, whose copies overlap
// the ring's steps; "allgather" into a GPU tensor) cannot be staged. The
// other ranks call it on host tensors. Every rank records when and how
// its call failed.
func gpuPinnedFullJob(ctx context.Context, g *Group, rep *childReport) error {
	const victim = 1
	op := os.Getenv("GDRLINK_TEST_COLLOP")
	elems := int64(1024)
	if op == "allreduce-staged" {
		elems = 2 * overlapMin / 4
	}
	dev := tensor.Host
	if g.Rank() == victim {
		dev = tensor.GPUDevice(0)
	}
	in, err := g.NewTensorOn(dev, tensor.Float32, elems)
	if err != nil {
		return err
	}
	defer in.Release()
	out, err := g.NewTensorOn(dev, tensor.Float32, int64(g.Size()), elems)
	if err != nil {
		return err
	}
	defer out.Release()
	if g.Rank() == victim {
		var held []*tensor.Tensor
		defer func() {
			for _, t := range held {
				_ = t.Release()
			}
		}()
		for {
			h, err := g.NewTensorOn(tensor.Device{Kind: tensor.PinnedHost}, tensor.Float32, 64<<10)
			if err != nil {
				break
			}
			held = append(held, h)
			if len(held) > 4096 {
				return errors.New("the pinned pool never filled")
			}
		}
		return failingCollective(ctx, g, op, in, out, rep)
	}
	return failingCollective(ctx, g, op, in, out, rep)
}

// failingCollective runs op (see gpuPinnedFullJob), which must fail
// before its 60 s deadline, and records the failure in rep.
func failingCollective(ctx context.Context, g *Group, op string, in, out *tensor.Tensor, rep *childReport) error {
	if op == "broadcast" {
		// From rank 0: rank 0 completes (rank 1 takes its piece), the
		// others fail.
		if g.Rank() == 0 {
			actx, cancel := context.WithTimeout(ctx, 60*time.Second)
			defer cancel()
			start := time.Now()
			_, err := g.Broadcast(actx, in, 0)
			rep.FailMS, rep.FailRank = float64(time.Since(start).Milliseconds()), -1
			return err
		}
		return failingCall(ctx, rep, "broadcast succeeded after rank 0", func(ctx context.Context) error {
			_, err := g.Broadcast(ctx, in, 0)
			return err
		})
	}
	if op != "allgather" {
		return failingAllReduce(ctx, g, in, rep, op+" succeeded on a rank with a full pinned pool")
	}
	return failingCall(ctx, rep, "allgather succeeded on a rank with a full pinned pool", func(ctx context.Context) error {
		_, err := g.AllGather(ctx, in, out)
		return err
	})
}

// TestCollectivesGPUPinnedPoolFull: a rank whose GPU tensor finds no room
// in its pinned pool fails its call at once, and the other ranks' calls
// fail within seconds (the ring's abort grace), not at their 60 s
// deadlines, naming that rank: the rank tells its ring successor, and the
// failure goes round the ring. Three processes, simulated GPUs (there is
// no GPU here), onnode.
//
// The "broadcast" case (from rank 0): rank 1 takes rank 0's pieces and
// drops them, so rank 0's call completes rather than waiting for its
// deadline; rank 2 fails naming rank 1.
//
// The "switchml" case runs the AllReduce through an aggregator (in this
// process, over UDP): rank 1 sets the aggregator's job up and abandons
// it, which ends it for the others at once, rather than at their
// deadlines.
func TestCollectivesGPUPinnedPoolFull(t *testing.T) {
	const victim = 1
	for _, op := range []string{"allreduce", "allreduce-staged", "allgather", "broadcast", "switchml"} {
		t.Run(op, func(t *testing.T) {
			extra := []string{"GDRLINK_PROVIDER=onnode", "GDRLINK_TEST_COLLOP=" + op}
			if op == "switchml" {
				_, env := startAggregator(t, "", 3)
				extra = append(env, "GDRLINK_TEST_COLLOP=allreduce")
			}
			j := startJob(t, "gpu-pinned-full", 3, "127.0.0.1", func(int) []string { return nil }, func(r int) []string {
				env := append([]string{"GDRLINK_TEST_SIMGPU=1"}, extra...)
				if r == victim {
					env = append(env, "GDRLINK_POOL_LIMIT=64MiB")
				}
				return env
			})
			reps := j.wait(2 * time.Minute)
			for r, rep := range reps {
				t.Logf("rank %d failed after %.0f ms: %s", r, rep.FailMS, rep.Failure)
				if op == "broadcast" && r == 0 {
					// The root: its call completed (in FailMS).
					if rep.Failure != "" || rep.FailMS > 10000 {
						t.Errorf("root: %q after %.0f ms, want its Broadcast complete within seconds", rep.Failure, rep.FailMS)
					}
					continue
				}
				if rep.FailRank != victim {
					t.Errorf("rank %d: failure names rank %d, want %d", r, rep.FailRank, victim)
				}
				if rep.FailMS > 10000 {
					t.Errorf("rank %d: failed after %.0f ms, want well within the 60 s deadline", r, rep.FailMS)
				}
			}
			if !strings.Contains(reps[victim].Failure, "pinned host copy") {
				t.Errorf("rank %d: %q does not say the pinned copy failed", victim, reps[victim].Failure)
			}
			if op != "switchml" {
				return
			}
			for r, rep := range reps {
				if r != victim && !strings.Contains(rep.Failure, "abandoned") {
					t.Errorf("rank %d: %q does not say rank %d abandoned", r, rep.Failure, victim)
				}
			}
		})
	}
}

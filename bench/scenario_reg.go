package main

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/alloc/visitor"
	"github.com/gdrlink/gdrlink/internal/ibvdiag"
	"github.com/gdrlink/gdrlink/verbsio"
	"github.com/gdrlink/gdrlink/verbsio/ibverbs"
)

// The reg scenario measures what the pool's registration visitor saves: the
// cost per tensor of registering each allocation with the RDMA device
// (ibv_reg_mr and ibv_dereg_mr around every tensor, what a transport without
// the pool must do) against allocating from a pool whose arenas the visitor
// registered once (amortised: no registration per tensor). It also counts
// the crossings into libibverbs of chained writes. It needs a real verbs device
// (Soft-RoCE counts); without one it reports a note saying why.
func init() {
	register(Scenario{
		Name: "reg",
		Doc:  "memory registration per tensor (ibv_reg_mr+dereg) vs a pool registered once per arena; crossings into libibverbs per chained write (ibverbs)",
		Run:  runReg,
		Plots: []Plot{
			{File: "reg-per-tensor.svg", Title: "registration cost per tensor", Unit: "us", CasePrefix: "pool-registered-once"},
		},
	})
}

const (
	regAccess = verbsio.AccessLocalWrite | verbsio.AccessRemoteWrite | verbsio.AccessRemoteRead
	// regChain is the length of the write chains whose crossings are counted.
	regChain = 16
)

func runReg(ctx context.Context, env *Env) error {
	cfg, err := verbsio.ConfigFromEnv()
	if err == nil {
		var dev verbsio.Device
		if dev, err = verbsio.Open(ibverbs.Name, cfg); err == nil {
			defer dev.Close()
			return regOnDevice(ctx, env, dev)
		}
	}
	if errors.Is(err, verbsio.ErrNoDevice) || errors.Is(err, verbsio.ErrNotSupported) {
		env.Emit(Result{Scenario: "reg", Case: "skipped", Unit: "us",
			Note: fmt.Sprintf("not measured: the ibverbs provider has no device here (%v); run it on an RDMA host or in Soft-RoCE (scripts/test-rdma.sh)", err)})
		return nil
	}
	return err
}

func regOnDevice(ctx context.Context, env *Env, dev verbsio.Device) error {
	pd, err := dev.AllocPD()
	if err != nil {
		return err
	}
	defer pd.Close()
	sizes := []int64{4 << 10, 64 << 10, 1 << 20, 16 << 20}
	limit := env.MaxSize
	if env.Quick && (limit == 0 || limit > 1<<20) {
		limit = 1 << 20
	}
	info := dev.Info()
	for _, size := range sizes {
		if limit > 0 && size > limit {
			break
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		perTensor, pooled, regs, tensors, err := regMeasure(env, pd, int(size))
		if err != nil {
			return fmt.Errorf("%s: %w", formatSize(size), err)
		}
		note := fmt.Sprintf("%s; pool: %d arena registrations for %d tensors (%.4f per tensor)", info.Name, regs, tensors, float64(regs)/float64(tensors))
		r := newResult("reg", "ibv_reg_mr-per-tensor", size, us(perTensor), "us", 0, "")
		r.Note = info.Name + ": register and deregister every allocation"
		env.Emit(r)
		r = newResult("reg", "pool-registered-once", size, us(pooled), "us", us(perTensor), "ibv_reg_mr-per-tensor")
		r.Note = note
		env.Emit(r)
	}
	return regCrossings(ctx, env, dev, pd)
}

// regMeasure times, per tensor of size bytes, allocation plus registration
// plus deregistration from a pool without visitors, and allocation plus the
// lookup of its registered region from a pool with the registration
// visitor. It returns both medians and the visitor's registration count
// against the tensors allocated from the registered pool.
func regMeasure(env *Env, pd verbsio.ProtectionDomain, size int) (perTensor, pooled time.Duration, regs, tensors int, err error) {
	iters := int(max(2, min(64, (64<<20)/int64(size))))
	if env.Quick {
		iters = max(2, iters/8)
	}
	plain, err := alloc.New(alloc.NewMmapSource(alloc.MmapOptions{NUMANode: -1}))
	if err != nil {
		return 0, 0, 0, 0, err
	}
	defer plain.Close()
	perTensor, err = timeEach(env.Reps, iters, func() error {
		b, err := plain.Alloc(size)
		if err != nil {
			return err
		}
		mr, err := pd.RegisterMemory(b.Addr(), b.Len(), regAccess)
		if err != nil {
			b.Free()
			return err
		}
		if err := mr.Close(); err != nil {
			return err
		}
		return b.Free()
	})
	if err != nil {
		return 0, 0, 0, 0, err
	}
	mrv := visitor.NewMemoryRegistration(pd, regAccess)
	pool, err := alloc.New(alloc.NewMmapSource(alloc.MmapOptions{NUMANode: -1}), alloc.WithVisitors(mrv))
	if err != nil {
		return 0, 0, 0, 0, err
	}
	defer pool.Close()
	pooled, err = timeEach(env.Reps, iters, func() error {
		b, err := pool.Alloc(size)
		if err != nil {
			return err
		}
		tensors++
		if _, _, err := visitor.SGEOf(pool, b.Addr(), b.Len()); err != nil {
			b.Free()
			return err
		}
		return b.Free()
	})
	// The pool's only visitor registers each arena once.
	return perTensor, pooled, int(pool.Stats().ArenasCreated), tensors, err
}

// regCrossings posts chains of regChain writes between two queue pairs of
// this process (pool memory registered once) and reports the crossings into libibverbs
// per write: posting, polling and completion-channel calls included.
func regCrossings(ctx context.Context, env *Env, dev verbsio.Device, pd verbsio.ProtectionDomain) error {
	mrv := visitor.NewMemoryRegistration(pd, regAccess)
	pool, err := alloc.New(alloc.NewMmapSource(alloc.MmapOptions{NUMANode: -1}), alloc.WithVisitors(mrv))
	if err != nil {
		return err
	}
	defer pool.Close()
	var cqs [2]verbsio.CompletionQueue
	var qps [2]verbsio.QueuePair
	defer func() {
		for i := range qps {
			if qps[i] != nil {
				qps[i].Close()
			}
			if cqs[i] != nil {
				cqs[i].Close()
			}
		}
	}()
	for i := range qps {
		if cqs[i], err = dev.CreateCQ(4 * regChain); err != nil {
			return err
		}
		if qps[i], err = pd.CreateQP(verbsio.QPConfig{SendCQ: cqs[i], RecvCQ: cqs[i], MaxSendWR: 2 * regChain, MaxRecvWR: 4}); err != nil {
			return err
		}
	}
	for i := range qps {
		if err := qps[i].Connect(ctx, qps[1-i].Endpoint()); err != nil {
			return err
		}
	}
	for _, size := range []int{64 << 10, 1 << 20} {
		if env.MaxSize > 0 && int64(size) > env.MaxSize {
			break
		}
		src, err := pool.Alloc(size * regChain)
		if err != nil {
			return err
		}
		dst, err := pool.Alloc(size * regChain)
		if err != nil {
			return err
		}
		rkey, err := visitor.RemoteKeyOf(pool, dst.Addr(), dst.Len())
		if err != nil {
			return err
		}
		wrs := make([]verbsio.SendWR, regChain)
		for i := range wrs {
			sge, _, err := visitor.SGEOf(pool, src.Addr()+uintptr(i*size), size)
			if err != nil {
				return err
			}
			wrs[i] = verbsio.SendWR{WRID: uint64(i), Op: verbsio.OpWrite, SG: []verbsio.SGE{sge},
				RemoteAddr: uint64(dst.Addr()) + uint64(i*size), RKey: rkey, Signaled: i == regChain-1}
		}
		before, _ := ibvdiag.StatsOf(dev)
		reps := max(env.Reps, 1)
		out := make([]verbsio.Completion, 4)
		for range reps {
			if err := qps[0].PostSend(wrs); err != nil {
				return err
			}
			wctx, cancel := context.WithTimeout(ctx, time.Minute)
			n, err := cqs[0].Wait(wctx, out)
			cancel()
			if err != nil {
				return err
			}
			if n != 1 || out[0].Status != verbsio.StatusSuccess {
				return fmt.Errorf("chain completion %+v", out[:n])
			}
		}
		after, _ := ibvdiag.StatsOf(dev)
		writes := float64(reps * regChain)
		r := newResult("reg", fmt.Sprintf("crossings-per-write-chain%d", regChain), int64(size),
			float64(after.Crossings-before.Crossings)/writes, "crossings/write", 0, "")
		r.Note = fmt.Sprintf("%d chains of %d writes: %d post, %d poll, %d notify crossings", reps, regChain,
			after.PostSend-before.PostSend, after.Poll-before.Poll, after.Notify-before.Notify)
		env.Emit(r)
		src.Free()
		dst.Free()
	}
	return nil
}

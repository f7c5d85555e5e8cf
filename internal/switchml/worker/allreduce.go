package worker

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"sync"

	"github.com/gdrlink/gdrlink/internal/switchml/bfp"
)

// blocks is a tensor seen as blocks of one slot's elements.
type blocks interface {
	// len is the tensor's element count.
	len() int
	// exp is the exponent byte of elements [i, j).
	exp(i, j int) uint8
	// put quantises elements [i, j) under exp into dst.
	put(dst []int32, i, j int, exp uint8) error
	// get dequantises sums into elements [i, j).
	get(sum []int32, i, j int, exp uint8) error
}

type f32 struct {
	c bfp.Codec
	x []float32
}

func (b f32) len() int                                   { return len(b.x) }
func (b f32) exp(i, j int) uint8                         { return bfp.Exponent32(b.x[i:j]) }
func (b f32) put(dst []int32, i, j int, exp uint8) error { return b.c.Quantize32(dst, b.x[i:j], exp) }
func (b f32) get(sum []int32, i, j int, exp uint8) error { return b.c.Dequantize32(b.x[i:j], sum, exp) }

type f16 struct {
	c bfp.Codec
	x []uint16
}

func (b f16) len() int                                   { return len(b.x) }
func (b f16) exp(i, j int) uint8                         { return bfp.ExponentF16(b.x[i:j]) }
func (b f16) put(dst []int32, i, j int, exp uint8) error { return b.c.QuantizeF16(dst, b.x[i:j], exp) }
func (b f16) get(sum []int32, i, j int, exp uint8) error {
	return b.c.DequantizeF16(b.x[i:j], sum, exp)
}

type bf16 struct {
	c bfp.Codec
	x []uint16
}

func (b bf16) len() int           { return len(b.x) }
func (b bf16) exp(i, j int) uint8 { return bfp.ExponentBF16(b.x[i:j]) }
func (b bf16) put(dst []int32, i, j int, exp uint8) error {
	return b.c.QuantizeBF16(dst, b.x[i:j], exp)
}
func (b bf16) get(sum []int32, i, j int, exp uint8) error {
	return b.c.DequantizeBF16(b.x[i:j], sum, exp)
}

// AllReduceFloat32 replaces x, on every worker, by the sum over the workers
// of their x, in block floating point (package bfp's error bound). Every
// worker must call it with the same length.
func (w *Worker) AllReduceFloat32(ctx context.Context, x []float32) error {
	c, err := bfp.NewCodec(w.cfg.Workers)
	if err != nil {
		return err
	}
	return w.allReduce(ctx, f32{c, x})
}

// AllReduceFloat16 is AllReduceFloat32 for IEEE binary16 values.
func (w *Worker) AllReduceFloat16(ctx context.Context, x []uint16) error {
	c, err := bfp.NewCodec(w.cfg.Workers)
	if err != nil {
		return err
	}
	return w.allReduce(ctx, f16{c, x})
}

// AllReduceBFloat16 is AllReduceFloat32 for bfloat16 values.
func (w *Worker) AllReduceBFloat16(ctx context.Context, x []uint16) error {
	c, err := bfp.NewCodec(w.cfg.Workers)
	if err != nil {
		return err
	}
	return w.allReduce(ctx, bf16{c, x})
}

// AllReduceInt32 replaces x, on every worker, by the exact sum over the
// workers of their x (wrapping in two's complement beyond int32).
func (w *Worker) AllReduceInt32(ctx context.Context, x []int32) error {
	return w.run(ctx, len(x), func(ctx context.Context, q *qp, chunks []int) error {
		e := w.cfg.SlotBytes / 4 * w.cfg.MsgSlots
		payload := make([]byte, w.msgB)
		for _, c := range chunks {
			i, j := c*e, min((c+1)*e, len(x))
			clear(payload)
			for k := i; k < j; k++ {
				binary.LittleEndian.PutUint32(payload[4*(k-i):], uint32(x[k]))
			}
			res, _, err := w.exchange(ctx, q, payload, 0)
			if err != nil {
				return err
			}
			for k := i; k < j; k++ {
				x[k] = int32(binary.LittleEndian.Uint32(res[4*(k-i):]))
			}
		}
		return nil
	})
}

// allReduce runs a float AllReduce: each queue pair first sends the
// exponents of its first chunk in an exponent-only message (no payload),
// then each chunk with the exponents of its next one.
func (w *Worker) allReduce(ctx context.Context, b blocks) error {
	se := w.slotEl
	e := se * w.cfg.MsgSlots
	n := b.len()
	exps := func(c int) uint32 {
		var imm uint32
		for k := range w.cfg.MsgSlots {
			i := c*e + k*se
			if i >= n {
				break
			}
			imm |= uint32(b.exp(i, min(i+se, n))) << (24 - 8*k)
		}
		return imm
	}
	return w.run(ctx, n, func(ctx context.Context, q *qp, chunks []int) error {
		payload := make([]byte, w.msgB)
		sig := make([]int32, se)
		_, shared, err := w.exchange(ctx, q, nil, exps(chunks[0]))
		if err != nil {
			return err
		}
		for ci, c := range chunks {
			next := uint32(0)
			if ci+1 < len(chunks) {
				next = exps(chunks[ci+1])
			}
			clear(payload)
			for k := range w.cfg.MsgSlots {
				i := c*e + k*se
				if i >= n {
					break
				}
				j := min(i+se, n)
				if err := b.put(sig[:j-i], i, j, uint8(shared>>(24-8*k))); err != nil {
					return fmt.Errorf("switchml: quantising: %w", err)
				}
				for t, v := range sig[:j-i] {
					binary.LittleEndian.PutUint32(payload[k*w.cfg.SlotBytes+4*t:], uint32(v))
				}
			}
			res, imm, err := w.exchange(ctx, q, payload, next)
			if err != nil {
				return err
			}
			for k := range w.cfg.MsgSlots {
				i := c*e + k*se
				if i >= n {
					break
				}
				j := min(i+se, n)
				for t := range sig[:j-i] {
					sig[t] = int32(binary.LittleEndian.Uint32(res[k*w.cfg.SlotBytes+4*t:]))
				}
				if err := b.get(sig[:j-i], i, j, uint8(shared>>(24-8*k))); err != nil {
					return err
				}
			}
			shared = imm
		}
		return nil
	})
}

// run cuts n elements into chunks, hands chunk c to queue pair c mod
// Window, and runs the queue pairs at once; the first error ends the rest.
func (w *Worker) run(ctx context.Context, n int, f func(context.Context, *qp, []int) error) error {
	w.opMu.Lock()
	defer w.opMu.Unlock()
	w.mu.Lock()
	broken, closed := w.broken, w.closed
	w.mu.Unlock()
	if closed {
		return ErrClosed
	}
	if broken != nil {
		return fmt.Errorf("switchml: an earlier AllReduce failed: %w", broken)
	}
	e := w.slotEl * w.cfg.MsgSlots
	chunks := (n + e - 1) / e
	if chunks == 0 {
		return nil
	}
	ctx, cancelCause := context.WithCancelCause(ctx)
	cancel := func() { cancelCause(context.Canceled) }
	defer cancel()
	// Close ends a pending call at once.
	go func() {
		select {
		case <-w.quit:
			cancelCause(ErrClosed)
		case <-ctx.Done():
		}
	}()
	var wg sync.WaitGroup
	errs := make([]error, len(w.qps))
	for qi, q := range w.qps {
		var mine []int
		for c := qi; c < chunks; c += len(w.qps) {
			mine = append(mine, c)
		}
		if len(mine) == 0 {
			break
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := f(ctx, q, mine); err != nil {
				errs[qi] = err
				cancel()
			}
		}()
	}
	wg.Wait()
	var first error
	for _, err := range errs {
		if err != nil && (first == nil || errors.Is(first, context.Canceled) && !errors.Is(err, context.Canceled)) {
			first = err
		}
	}
	if first != nil {
		// The queue pairs' sets and PSNs no longer agree with the other
		// workers': the worker is done.
		w.mu.Lock()
		w.broken = first
		w.mu.Unlock()
	}
	return first
}

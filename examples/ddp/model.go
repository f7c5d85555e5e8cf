package main

import (
	"fmt"
	"math"
	"math/rand/v2"

	gt "gorgonia.org/tensor"
)

// Sizes of the model and of the synthetic data set.
type sizes struct {
	In, Hidden int // input features, hidden units; the output is one value
	Samples    int // samples in the whole data set (the global batch)
}

// numParams is the length of the flat parameter vector:
// W1 (In×Hidden), b1 (Hidden), W2 (Hidden×1), b2 (1).
func (s sizes) numParams() int { return s.In*s.Hidden + s.Hidden + s.Hidden + 1 }

// dataset returns the whole synthetic data set, the same for every rank:
// X (Samples×In) uniform in [-1, 1) and y = sin(x·u) + 0.1·(x·v)² for
// fixed random directions u and v.
func dataset(s sizes, seed uint64) (x, y []float64) {
	r := rand.New(rand.NewPCG(seed, 1))
	u, v := make([]float64, s.In), make([]float64, s.In)
	for i := range u {
		u[i], v[i] = r.NormFloat64(), r.NormFloat64()
	}
	x, y = make([]float64, s.Samples*s.In), make([]float64, s.Samples)
	for n := range s.Samples {
		var xu, xv float64
		for i := range s.In {
			f := 2*r.Float64() - 1
			x[n*s.In+i] = f
			xu += f * u[i]
			xv += f * v[i]
		}
		y[n] = math.Sin(xu) + 0.1*xv*xv
	}
	return x, y
}

// initParams fills p with the initial parameters (scaled normal weights,
// zero biases), the same for a given seed on every rank.
func initParams(s sizes, p []float64, seed uint64) {
	r := rand.New(rand.NewPCG(seed, 2))
	w1, b1, w2, b2 := split(s, p)
	for i := range w1 {
		w1[i] = r.NormFloat64() / math.Sqrt(float64(s.In))
	}
	for i := range w2 {
		w2[i] = r.NormFloat64() / math.Sqrt(float64(s.Hidden))
	}
	clear(b1)
	clear(b2)
}

// split cuts a flat parameter (or gradient) vector into W1, b1, W2, b2,
// sharing its memory.
func split(s sizes, p []float64) (w1, b1, w2, b2 []float64) {
	a := s.In * s.Hidden
	return p[:a], p[a : a+s.Hidden], p[a+s.Hidden : a+2*s.Hidden], p[a+2*s.Hidden : a+2*s.Hidden+1]
}

// lossGrad computes, for the samples x (m×In) and targets y, the mean
// squared-error loss L = 1/(2m)·Σ(pred−y)² of the parameters p and writes
// dL/dp into grad (the same layout as p). The matrix products of the
// forward pass run on gorgonia.org/tensor Dense views of p and x; the
// backward pass is written out by hand over the same memory (gorgonia's
// autodiff lives in gorgonia.org/gorgonia, a graph library this example
// does not need for two layers).
func lossGrad(s sizes, p, x, y, grad []float64) (float64, error) {
	m := len(y)
	if m == 0 || len(x) != m*s.In || len(p) != s.numParams() || len(grad) != len(p) {
		return 0, fmt.Errorf("ddp: %d samples, %d inputs, %d params, %d grads for %+v", m, len(x), len(p), len(grad), s)
	}
	w1, b1, w2, b2 := split(s, p)
	g1, gb1, g2, gb2 := split(s, grad)
	X := gt.New(gt.WithShape(m, s.In), gt.WithBacking(x))
	W1 := gt.New(gt.WithShape(s.In, s.Hidden), gt.WithBacking(w1))
	W2 := gt.New(gt.WithShape(s.Hidden, 1), gt.WithBacking(w2))

	z, err := gt.MatMul(X, W1) // m×Hidden
	if err != nil {
		return 0, fmt.Errorf("ddp: X·W1: %w", err)
	}
	a := z.Data().([]float64)
	for n := range m {
		row := a[n*s.Hidden : (n+1)*s.Hidden]
		for j := range row {
			row[j] = math.Tanh(row[j] + b1[j])
		}
	}
	A := z.(*gt.Dense)
	out, err := gt.MatMul(A, W2) // m×1
	if err != nil {
		return 0, fmt.Errorf("ddp: A·W2: %w", err)
	}
	pred := out.Data().([]float64)

	clear(grad)
	var loss float64
	inv := 1 / float64(m)
	for n := range m {
		d := pred[n] + b2[0] - y[n]
		loss += d * d
		dp := d * inv // dL/dpred
		gb2[0] += dp
		row := a[n*s.Hidden : (n+1)*s.Hidden]
		xr := x[n*s.In : (n+1)*s.In]
		for j, aj := range row {
			g2[j] += aj * dp
			dz := dp * w2[j] * (1 - aj*aj)
			gb1[j] += dz
			for i, xi := range xr {
				g1[i*s.Hidden+j] += xi * dz
			}
		}
	}
	return loss * inv / 2, nil
}

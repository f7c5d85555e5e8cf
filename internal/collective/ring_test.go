package collective

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/collective"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

// runRanks runs f for every rank of a job of size ranks at once.
func runRanks(t *testing.T, size int, opts []RingOption, f func(r int, b *Ring) error) []error {
	t.Helper()
	j := newMemJob(size)
	errs := make([]error, size)
	var wg sync.WaitGroup
	for r := range size {
		wg.Go(func() { errs[r] = f(r, NewRing(memTransport{j, r}, opts...)) })
	}
	wg.Wait()
	return errs
}

// chunkOf is the chunk element i of n falls in, for size ranks (the
// partition Ring documents).
func chunkOf(i, n int64, size int) int {
	for c := range size {
		if i < n*int64(c+1)/int64(size) {
			return c
		}
	}
	return size - 1
}

var shapes = []struct {
	n    int64
	opts []RingOption
}{
	{0, nil}, {1, nil}, {5, nil}, {1000, nil}, {1000, []RingOption{WithSegment(64), WithLanes(3)}},
	{70001, []RingOption{WithSegment(4096), WithLanes(5)}},
}

// halvingSums is the halving AllReduce's sums of in (size ranks, a power
// of two), done step by step as halving.go documents: at distance d each
// rank adds its partner's (rank^d) partial sums into the half of its
// block that holds its own chunk; element i's sum is then its chunk's
// owner's.
func halvingSums(in [][]float32, size int) []float32 {
	n := int64(len(in[0]))
	vals := make([][]float32, size)
	for r := range vals {
		vals[r] = append([]float32(nil), in[r]...)
	}
	lo := make([]int, size)
	for d := size / 2; d >= 1; d /= 2 {
		next := make([][]float32, size)
		for r := range size {
			next[r] = append([]float32(nil), vals[r]...)
			keep := lo[r]
			if r&d != 0 {
				keep += d
			}
			for i := range n {
				if c := chunkOf(i, n, size); c >= keep && c < keep+d {
					next[r][i] = vals[r][i] + vals[r^d][i]
				}
			}
			lo[r] = keep
		}
		vals = next
	}
	out := make([]float32, n)
	for i := range n {
		out[i] = vals[chunkOf(i, n, size)][i]
	}
	return out
}

// TestAllReduceFloat32Order: random float32s, whose sums round, come out
// as the documented order, bit for bit, on every rank: the fold from rank
// c for chunk c round the ring, or the halving tree where the call goes
// by halving (4 ranks, one lane), whose report says which.
func TestAllReduceFloat32Order(t *testing.T) {
	for _, size := range []int{1, 2, 3, 4, 5, 6, 8} {
		for _, shape := range shapes {
			for _, op := range []Op{Sum, Average} {
				// By default small tensors on a power-of-two number of
				// ranks go by doubling; without it, by halving or the ring.
				for _, dmax := range []int64{defaultDoublingMax, 0} {
					sh := shape
					sh.opts = append(append([]RingOption(nil), sh.opts...), WithDoublingMax(dmax))
					t.Run(fmt.Sprintf("%d-ranks-%d-%s-doubling-%d", size, sh.n, op, dmax), func(t *testing.T) {
						in := make([][]float32, size)
						rng := rand.New(rand.NewPCG(uint64(size), uint64(sh.n)))
						for r := range in {
							in[r] = make([]float32, sh.n)
							for i := range in[r] {
								in[r][i] = float32(rng.NormFloat64() * math.Pow(10, float64(rng.IntN(6))))
							}
						}
						ring := NewRing(nil, sh.opts...)
						chunks := make([]span, size)
						for c := range size {
							chunks[c] = span{sh.n * int64(c) / int64(size), sh.n*int64(c+1)/int64(size) - sh.n*int64(c)/int64(size)}
						}
						algo := "ring"
						pow2 := size&(size-1) == 0 && lanesFor(chunks, 4, ring.segment, ring.lanes) == 1
						switch {
						case pow2 && size >= 2 && sh.n > 0 && 4*sh.n <= ring.doublingMax:
							algo = "doubling"
						case pow2 && size >= 4:
							algo = "halving"
						}
						want := make([]float32, sh.n)
						if algo == "halving" || algo == "doubling" && size >= 4 {
							want = halvingSums(in, size)
						} else {
							for i := range want {
								c := chunkOf(int64(i), sh.n, size)
								v := in[c][i]
								for s := 1; s < size; s++ {
									v += in[(c+s)%size][i]
								}
								want[i] = v
							}
						}
						if op == Average {
							for i := range want {
								want[i] /= float32(size)
							}
						}
						got := make([][]float32, size)
						errs := runRanks(t, size, sh.opts, func(r int, b *Ring) error {
							x := newTensor(tensor.Float32, sh.n)
							v, _ := tensor.View[float32](x)
							copy(v, in[r])
							rep, err := b.AllReduce(context.Background(), 7, x, op)
							if err == nil && size > 1 && sh.n >= int64(size) && (rep.Received == 0 || rep.Sent == 0 || rep.Backend != "ring" || rep.Algorithm != algo) {
								err = fmt.Errorf("report %+v, want algorithm %s", rep, algo)
							}
							got[r] = v
							return err
						})
						for r := range size {
							if errs[r] != nil {
								t.Fatalf("rank %d: %v", r, errs[r])
							}
							for i := range want {
								if math.Float32bits(got[r][i]) != math.Float32bits(want[i]) {
									t.Fatalf("rank %d element %d: %v, want %v", r, i, got[r][i], want[i])
								}
							}
						}
					})
				}
			}
		}
	}
}

// TestAllReduceTypes: exact sums of integers and of floats holding small
// integers, for every type the ring reduces.
func TestAllReduceTypes(t *testing.T) {
	const size, n = 4, 3001
	types := []tensor.DType{tensor.Int8, tensor.Int16, tensor.Int32, tensor.Int64, tensor.Uint8, tensor.Uint16, tensor.Uint32,
		tensor.Uint64, tensor.Float16, tensor.BFloat16, tensor.Float32, tensor.Float64, tensor.Complex64, tensor.Complex128}
	val := func(r, i int) int64 { return int64((r*7+i*13)%50) - 10 }
	for _, dt := range types {
		t.Run(dt.String(), func(t *testing.T) {
			errs := runRanks(t, size, []RingOption{WithSegment(256)}, func(r int, b *Ring) error {
				x := newTensor(dt, n)
				for i := range n {
					set(x, i, val(r, i))
				}
				if _, err := b.AllReduce(context.Background(), 0, x, Sum); err != nil {
					return err
				}
				for i := range n {
					var w int64
					for q := range size {
						w += val(q, i)
					}
					if got := get(x, i); got != w && !(dt == tensor.Uint8 && got == int64(uint8(w))) && !(dt >= tensor.Uint8 && dt <= tensor.Uint64 && got == wrapU(dt, w)) {
						return fmt.Errorf("element %d: %d, want %d", i, got, w)
					}
				}
				return nil
			})
			for r, err := range errs {
				if err != nil {
					t.Errorf("rank %d: %v", r, err)
				}
			}
		})
	}
	// Bool and strings do not add: a typed error, before any traffic.
	errs := runRanks(t, 2, nil, func(r int, b *Ring) error {
		_, err := b.AllReduce(context.Background(), 0, newTensor(tensor.Bool, 4), Sum)
		return err
	})
	for _, err := range errs {
		if !errors.Is(err, ErrBadArgument) {
			t.Errorf("bool allreduce: %v, want ErrBadArgument", err)
		}
	}
}

func wrapU(dt tensor.DType, w int64) int64 {
	switch dt {
	case tensor.Uint16:
		return int64(uint16(w))
	case tensor.Uint32:
		return int64(uint32(w))
	}
	return w
}

// set and get write and read element i as an integer value.
func set(x *tensor.Tensor, i int, v int64) {
	b, _ := x.Bytes()
	switch x.Meta().DType {
	case tensor.Int8, tensor.Uint8:
		as[int8](b)[i] = int8(v)
	case tensor.Int16, tensor.Uint16:
		as[int16](b)[i] = int16(v)
	case tensor.Int32, tensor.Uint32:
		as[int32](b)[i] = int32(v)
	case tensor.Int64, tensor.Uint64:
		as[int64](b)[i] = v
	case tensor.Float16:
		as[uint16](b)[i] = f32ToF16(float32(v))
	case tensor.BFloat16:
		as[uint16](b)[i] = f32ToBF16(float32(v))
	case tensor.Float32:
		as[float32](b)[i] = float32(v)
	case tensor.Float64:
		as[float64](b)[i] = float64(v)
	case tensor.Complex64:
		as[complex64](b)[i] = complex(float32(v), float32(-v))
	case tensor.Complex128:
		as[complex128](b)[i] = complex(float64(v), float64(-v))
	}
}

func get(x *tensor.Tensor, i int) int64 {
	b, _ := x.Bytes()
	switch x.Meta().DType {
	case tensor.Int8:
		return int64(as[int8](b)[i])
	case tensor.Uint8:
		return int64(as[uint8](b)[i])
	case tensor.Int16:
		return int64(as[int16](b)[i])
	case tensor.Uint16:
		return int64(as[uint16](b)[i])
	case tensor.Int32:
		return int64(as[int32](b)[i])
	case tensor.Uint32:
		return int64(as[uint32](b)[i])
	case tensor.Int64, tensor.Uint64:
		return as[int64](b)[i]
	case tensor.Float16:
		return int64(f16ToF32(as[uint16](b)[i]))
	case tensor.BFloat16:
		return int64(bf16ToF32(as[uint16](b)[i]))
	case tensor.Float32:
		return int64(as[float32](b)[i])
	case tensor.Float64:
		return int64(as[float64](b)[i])
	case tensor.Complex64:
		c := as[complex64](b)[i]
		if real(c) != -imag(c) {
			return math.MinInt64
		}
		return int64(real(c))
	case tensor.Complex128:
		c := as[complex128](b)[i]
		if real(c) != -imag(c) {
			return math.MinInt64
		}
		return int64(real(c))
	}
	return math.MinInt64
}

// TestBroadcastAndAllGather: every root, and slots of every rank.
func TestBroadcastAndAllGather(t *testing.T) {
	for size := 1; size <= 5; size++ {
		for _, sh := range shapes {
			for root := range size {
				errs := runRanks(t, size, sh.opts, func(r int, b *Ring) error {
					x := newTensor(tensor.Int32, sh.n)
					v, _ := tensor.View[int32](x)
					for i := range v {
						v[i] = int32(r*1000003 + i)
					}
					if _, err := b.Broadcast(context.Background(), 3, x, root); err != nil {
						return err
					}
					for i := range v {
						if v[i] != int32(root*1000003+i) {
							return fmt.Errorf("broadcast from %d: element %d is %d", root, i, v[i])
						}
					}
					return nil
				})
				for r, err := range errs {
					if err != nil {
						t.Fatalf("%d ranks, %d elements, rank %d: %v", size, sh.n, r, err)
					}
				}
			}
			errs := runRanks(t, size, sh.opts, func(r int, b *Ring) error {
				in, out := newTensor(tensor.Float64, sh.n), newTensor(tensor.Float64, sh.n*int64(size))
				v, _ := tensor.View[float64](in)
				for i := range v {
					v[i] = float64(r) + float64(i)/1e6
				}
				if _, err := b.AllGather(context.Background(), 1, in, out); err != nil {
					return err
				}
				o, _ := tensor.View[float64](out)
				for q := range size {
					for i := range sh.n {
						if w := float64(q) + float64(i)/1e6; o[int64(q)*sh.n+i] != w {
							return fmt.Errorf("slot %d element %d: %v, want %v", q, i, o[int64(q)*sh.n+i], w)
						}
					}
				}
				return nil
			})
			for r, err := range errs {
				if err != nil {
					t.Fatalf("allgather, %d ranks, %d elements, rank %d: %v", size, sh.n, r, err)
				}
			}
		}
	}
}

// TestDeadRankNamed: a rank that never comes and dies fails every other
// rank's AllReduce with a RankError naming it, whether it was a
// neighbour or heard of along the ring.
func TestDeadRankNamed(t *testing.T) {
	t.Run("ring", func(t *testing.T) { testDeadRankNamed(t, 5, 2, []RingOption{WithSegment(4096)}) })
	t.Run("halving", func(t *testing.T) { testDeadRankNamed(t, 8, 2, nil) })
}

func testDeadRankNamed(t *testing.T, size, dead int, opts []RingOption) {
	j := newMemJob(size)
	errs := make([]error, size)
	var wg sync.WaitGroup
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for r := range size {
		if r == dead {
			continue
		}
		wg.Go(func() {
			x := newTensor(tensor.Float32, 100000)
			_, errs[r] = NewRing(memTransport{j, r}, opts...).AllReduce(ctx, 0, x, Sum)
		})
	}
	time.Sleep(50 * time.Millisecond)
	j.kill(dead)
	wg.Wait()
	for r, err := range errs {
		t.Logf("rank %d: %v", r, err)
		if r == dead {
			continue
		}
		var re *collective.RankError
		if !errors.As(err, &re) || re.Rank != dead {
			t.Errorf("rank %d: %v, want a RankError naming rank %d", r, err, dead)
		}
	}
	// The rank that talks to the dead one first: its successor round the
	// ring, its first partner by halving.
	first := dead + 1
	if opts == nil {
		first = dead ^ (size / 2)
	}
	if !errors.Is(errs[first], verbsio.ErrPeerLost) {
		t.Errorf("rank %d (the dead one's first peer): %v, want ErrPeerLost", first, errs[first])
	}
}

// TestDeadlineNamesSelf: a rank whose context ends fails with a RankError
// naming itself, and the others, told along the ring, name it too.
func TestDeadlineNamesSelf(t *testing.T) {
	for _, size := range []int{3, 4} {
		t.Run(fmt.Sprintf("%d-ranks", size), func(t *testing.T) { testDeadlineNamesSelf(t, size) })
	}
}

// testDeadlineNamesSelf is TestDeadlineNamesSelf on size ranks: round the
// ring on 3, by halving on 4.
func testDeadlineNamesSelf(t *testing.T, size int) {
	const late = 1
	errs := runRanks(t, size, nil, func(r int, b *Ring) error {
		d := 20 * time.Second
		if r == late {
			d = -time.Second // ended before the call
		}
		ctx, cancel := context.WithTimeout(context.Background(), d)
		defer cancel()
		_, err := b.AllReduce(ctx, 0, newTensor(tensor.Int64, 10), Sum)
		return err
	})
	for r, err := range errs {
		var re *collective.RankError
		if !errors.As(err, &re) || re.Rank != late {
			t.Errorf("rank %d: %v, want a RankError naming rank %d", r, err, late)
		}
	}
	if !errors.Is(errs[late], context.DeadlineExceeded) {
		t.Errorf("rank %d: %v, want DeadlineExceeded", late, errs[late])
	}
}

// TestAbandon: a rank that abandons its call fails at once with a
// RankError naming it and wrapping its cause, and every other rank's call
// fails within seconds, naming it, not at its 30 s deadline: for every
// collective, with tensors cut into several segments (WithSegment).
func TestAbandon(t *testing.T) {
	const size, quitter = 4, 2
	cause := errors.New("no room to stage the tensor")
	for _, op := range []string{"allreduce", "broadcast", "allgather", "allreduce-halving"} {
		t.Run(op, func(t *testing.T) {
			opts := []RingOption{WithSegment(256)}
			if op == "allreduce-halving" {
				// One segment: the call goes by halving on 4 ranks.
				op, opts = "allreduce", nil
			}
			start := time.Now()
			errs := runRanks(t, size, opts, func(r int, b *Ring) error {
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				defer cancel()
				in := newTensor(tensor.Float32, 1000)
				out := newTensor(tensor.Float32, size*1000)
				if r == quitter {
					m := in.Meta()
					if op == "allgather" {
						m = out.Meta()
					}
					return b.Abandon(ctx, 0, op, m, quitter, cause)
				}
				var err error
				switch op {
				case "allreduce":
					_, err = b.AllReduce(ctx, 0, in, Sum)
				case "broadcast":
					_, err = b.Broadcast(ctx, 0, in, quitter)
				case "allgather":
					_, err = b.AllGather(ctx, 0, in, out)
				}
				return err
			})
			if d := time.Since(start); d > 10*time.Second {
				t.Errorf("the ranks took %v to fail", d)
			}
			for r, err := range errs {
				var re *collective.RankError
				if !errors.As(err, &re) || re.Rank != quitter {
					t.Errorf("rank %d: %v, want a RankError naming rank %d", r, err, quitter)
				}
			}
			if !errors.Is(errs[quitter], cause) {
				t.Errorf("rank %d: %v does not wrap its cause", quitter, errs[quitter])
			}
		})
	}
}

// TestBroadcastSuccessorAbandons: a Broadcast root whose successor
// abandoned the call completes it: the successor takes the root's pieces
// and drops them (before, the root waited for its deadline), and the rank
// after the successor fails naming it. Four lanes.
func TestBroadcastSuccessorAbandons(t *testing.T) {
	const size, root, quitter = 3, 0, 1
	cause := errors.New("abandoned")
	start := time.Now()
	errs := runRanks(t, size, []RingOption{WithSegment(64)}, func(r int, b *Ring) error {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		x := newTensor(tensor.Int32, 256)
		if r == quitter {
			return b.Abandon(ctx, 0, "broadcast", x.Meta(), root, cause)
		}
		_, err := b.Broadcast(ctx, 0, x, root)
		return err
	})
	if d := time.Since(start); d > 10*time.Second {
		t.Errorf("the ranks took %v", d)
	}
	if errs[root] != nil {
		t.Errorf("root: %v, want its Broadcast complete (its successor took its pieces)", errs[root])
	}
	var re *collective.RankError
	if !errors.As(errs[2], &re) || re.Rank != quitter {
		t.Errorf("rank 2: %v, want a RankError naming rank %d", errs[2], quitter)
	}
	if !errors.Is(errs[quitter], cause) {
		t.Errorf("rank %d: %v does not wrap its cause", quitter, errs[quitter])
	}
}

// TestBroadcastSuccessorSilent: a Broadcast root whose successor never
// asks for its pieces (it makes no call at all) fails at its own
// deadline, naming itself, rather than waiting for ever.
func TestBroadcastSuccessorSilent(t *testing.T) {
	const size, root = 2, 0
	errs := runRanks(t, size, nil, func(r int, b *Ring) error {
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		defer cancel()
		x := newTensor(tensor.Int32, 64)
		if r != root {
			<-ctx.Done()
			return nil
		}
		_, err := b.Broadcast(ctx, 0, x, root)
		return err
	})
	var re *collective.RankError
	if !errors.As(errs[root], &re) || re.Rank != root || !errors.Is(errs[root], context.DeadlineExceeded) {
		t.Errorf("root: %v, want a RankError naming itself at its deadline", errs[root])
	}
}

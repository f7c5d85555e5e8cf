package collective

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"context"

	"github.com/gdrlink/gdrlink/collective"
	"github.com/gdrlink/gdrlink/tensor"
)

// slowStaging is a device simulated by a byte slice: loads copy into the
// host tensor after a random delay of up to a millisecond (as an
// asynchronous copy lands some time after it is queued), stores copy at
// once. It counts bytes and fails the load of failOff, if set.
type slowStaging struct {
	dev, host []byte
	rng       *rand.Rand
	failOff   int64
	mu        sync.Mutex
	loads     sync.WaitGroup
	loaded    int64
	stored    int64
}

func (s *slowStaging) Load(off, n int64) func() error {
	s.mu.Lock()
	d := time.Duration(s.rng.IntN(1000)) * time.Microsecond
	s.loaded += n
	s.mu.Unlock()
	if off == s.failOff && n > 0 {
		return func() error { return errors.New("a load failed on purpose") }
	}
	done := make(chan struct{})
	s.loads.Add(1)
	go func() {
		defer s.loads.Done()
		time.Sleep(d)
		copy(s.host[off:off+n], s.dev[off:off+n])
		close(done)
	}()
	return func() error { <-done; return nil }
}

func (s *slowStaging) Store(off, n int64) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.stored += n
	copy(s.dev[off:off+n], s.host[off:off+n])
	return nil
}

// TestAllReduceStaged: each rank's values live in a simulated device
// buffer and its host tensor starts as garbage (0x7f bytes); the ring
// loads segments with random delays and stores them back. The device
// buffers end with the exact sums (small integers), as the unstaged ring
// gives them, on every rank; every byte was loaded and stored once.
func TestAllReduceStaged(t *testing.T) {
	for size := 1; size <= 5; size++ {
		for _, sh := range shapes {
			t.Run(fmt.Sprintf("%d-ranks-%d", size, sh.n), func(t *testing.T) {
				devs := make([][]int32, size)
				sts := make([]*slowStaging, size)
				for r := range size {
					devs[r] = make([]int32, sh.n)
					for i := range devs[r] {
						devs[r][i] = int32((r*31+i*7)%33 - 16)
					}
				}
				errs := runRanks(t, size, sh.opts, func(r int, b *Ring) error {
					x := newTensor(tensor.Int32, sh.n)
					host, _ := x.Bytes()
					for i := range host {
						host[i] = 0x7f
					}
					st := &slowStaging{dev: int32Bytes(devs[r]), host: host, rng: rand.New(rand.NewPCG(uint64(r), uint64(sh.n))), failOff: -1}
					sts[r] = st
					rep, err := b.AllReduceStaged(context.Background(), 0, x, Sum, st)
					st.loads.Wait()
					if err == nil && rep.Bytes != int64(len(host)) {
						err = fmt.Errorf("report of %d bytes", rep.Bytes)
					}
					return err
				})
				for r, err := range errs {
					if err != nil {
						t.Fatalf("rank %d: %v", r, err)
					}
				}
				for r := range size {
					for i := range devs[r] {
						d := sts[r].dev[4*i:]
						v := int32(uint32(d[0]) | uint32(d[1])<<8 | uint32(d[2])<<16 | uint32(d[3])<<24)
						var want int32
						for q := range size {
							want += int32((q*31+i*7)%33 - 16)
						}
						if v != want {
							t.Fatalf("rank %d element %d: %d on the device, want %d", r, i, v, want)
						}
					}
					n := 4 * sh.n
					if size == 1 {
						n = 0 // one rank: the device tensor is the result already
					}
					if sts[r].loaded != n || sts[r].stored != n {
						t.Errorf("rank %d: loaded %d and stored %d bytes, want %d each", r, sts[r].loaded, sts[r].stored, n)
					}
				}
			})
		}
	}
}

// TestAllReduceStagedLoadFails: rank 1's load of its first byte fails;
// every rank's call fails with a RankError naming rank 1.
func TestAllReduceStagedLoadFails(t *testing.T) {
	const size, n = 3, 3000
	errs := runRanks(t, size, []RingOption{WithSegment(1024), WithLanes(4)}, func(r int, b *Ring) error {
		x := newTensor(tensor.Int32, n)
		host, _ := x.Bytes()
		st := &slowStaging{dev: make([]byte, len(host)), host: host, rng: rand.New(rand.NewPCG(1, 2)), failOff: -1}
		if r == 1 {
			st.failOff = 0
		}
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		_, err := b.AllReduceStaged(ctx, 0, x, Sum, st)
		st.loads.Wait()
		return err
	})
	for r, err := range errs {
		var re *collective.RankError
		if !errors.As(err, &re) || re.Rank != 1 {
			t.Errorf("rank %d: %v, want a RankError naming rank 1", r, err)
		}
	}
}

func int32Bytes(v []int32) []byte {
	b := make([]byte, 4*len(v))
	for i, x := range v {
		b[4*i], b[4*i+1], b[4*i+2], b[4*i+3] = byte(x), byte(x>>8), byte(x>>16), byte(x>>24)
	}
	return b
}

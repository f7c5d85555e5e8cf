package alloc

import (
	"errors"
	"strings"
	"sync"
	"testing"
)

// TestBudgetShared: two pools under one budget of 4 MiB, arenas of 1 MiB:
// together they never reserve more; the one that finds it spent fails with
// ErrPoolExhausted naming the budget; arenas given back by one (Close) are
// room for the other; the budget's count is always the sum of theirs.
func TestBudgetShared(t *testing.T) {
	b, err := NewBudget("test", 4<<20)
	if err != nil {
		t.Fatal(err)
	}
	mk := func(name string) *Pool {
		p, err := New(NewMmapSource(MmapOptions{}), WithBudget(b), WithInitialArena(1<<20), WithMaxArena(1<<20), WithName(name))
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	pa, pb := mk("a"), mk("b")
	sum := func() int64 { return pa.Stats().Reserved + pb.Stats().Reserved }
	var held []Block
	for i := 0; ; i++ {
		p := pa
		if i%2 == 1 {
			p = pb
		}
		blk, err := p.Alloc(1 << 20)
		if err != nil {
			if !errors.Is(err, ErrPoolExhausted) || !strings.Contains(err.Error(), `budget "test"`) {
				t.Fatalf("allocation %d: %v; want ErrPoolExhausted naming the budget", i, err)
			}
			break
		}
		held = append(held, blk)
		if i > 8 {
			t.Fatalf("%d MiB allocated under a budget of 4 MiB", i+1)
		}
	}
	if len(held) != 4 || b.Reserved() != 4<<20 || sum() != b.Reserved() {
		t.Fatalf("%d blocks, budget reserved %d, pools %d; want 4 blocks and 4 MiB both", len(held), b.Reserved(), sum())
	}
	// Pool a gives its arenas back: pool b grows into them.
	for _, blk := range held {
		if a, _ := pa.ArenaOf(blk.Addr()); a != nil {
			blk.Free()
		}
	}
	if err := pa.Close(); err != nil {
		t.Fatal(err)
	}
	if b.Reserved() != pb.Stats().Reserved {
		t.Fatalf("after closing a: budget %d, b %d", b.Reserved(), pb.Stats().Reserved)
	}
	blk, err := pb.Alloc(1 << 20)
	if err != nil {
		t.Fatalf("b could not grow into what a gave back: %v", err)
	}
	blk.Free()
	for _, blk := range held {
		if a, _ := pb.ArenaOf(blk.Addr()); a != nil {
			blk.Free()
		}
	}
	if err := pb.Close(); err != nil {
		t.Fatal(err)
	}
	if b.Reserved() != 0 {
		t.Fatalf("both pools closed, budget still holds %d bytes", b.Reserved())
	}
}

// TestBudgetConcurrent: pools growing and shrinking at once keep the
// budget's count equal to theirs and within its limit (run with -race).
func TestBudgetConcurrent(t *testing.T) {
	b, _ := NewBudget("race", 16<<20)
	pools := make([]*Pool, 4)
	for i := range pools {
		var err error
		if pools[i], err = New(NewMmapSource(MmapOptions{}), WithBudget(b), WithInitialArena(1<<20), WithMaxArena(2<<20)); err != nil {
			t.Fatal(err)
		}
	}
	var wg sync.WaitGroup
	for i, p := range pools {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var held []Block
			for j := 0; j < 200; j++ {
				if blk, err := p.Alloc((i + 1) * (j%7 + 1) << 17); err == nil {
					held = append(held, blk)
				} else if !errors.Is(err, ErrPoolExhausted) {
					t.Error(err)
					return
				}
				if b.Reserved() > b.Limit() {
					t.Errorf("budget reserved %d over its limit %d", b.Reserved(), b.Limit())
				}
				if len(held) > 3 {
					held[0].Free()
					held = held[1:]
				}
			}
			for _, blk := range held {
				blk.Free()
			}
		}()
	}
	wg.Wait()
	var sum int64
	for _, p := range pools {
		sum += p.Stats().Reserved
	}
	if sum != b.Reserved() {
		t.Fatalf("pools reserve %d, the budget counts %d", sum, b.Reserved())
	}
	for _, p := range pools {
		if err := p.Close(); err != nil {
			t.Fatal(err)
		}
	}
	if b.Reserved() != 0 {
		t.Fatalf("all closed, budget holds %d", b.Reserved())
	}
	if _, err := NewBudget("zero", 0); !errors.Is(err, ErrBadOption) {
		t.Errorf("a budget of 0 bytes: %v", err)
	}
}

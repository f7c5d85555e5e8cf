package alloc_test

import (
	"errors"
	"fmt"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/tensor"
)

// A pool over anonymous mmap memory, with a visitor that sees each arena
// once, and a tensor found back to its arena from its address.
func Example() {
	visits := 0
	counter := alloc.NewVisitor("counter", func(a *alloc.Arena) error {
		visits++
		a.SetHandle("counter", fmt.Sprintf("registration of arena %d", a.ID))
		return nil
	}, nil)
	pool, err := alloc.New(alloc.NewMmapSource(alloc.MmapOptions{}),
		alloc.WithName("example"), alloc.WithVisitors(counter), alloc.WithInitialArena(4<<20))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pool.Close()

	meta, _ := tensor.MetaFor(tensor.Float32, tensor.Shape{256, 256})
	var tensors []*tensor.Tensor
	for range 3 {
		t, err := pool.NewTensor(meta)
		if err != nil {
			fmt.Println(err)
			return
		}
		tensors = append(tensors, t)
	}
	arena, _ := pool.ArenaOf(tensors[2].Addr())
	handle, _ := arena.Handle("counter")
	fmt.Println(handle)
	fmt.Println("visits:", visits)
	for _, t := range tensors {
		t.Release()
	}
	st := pool.Stats()
	fmt.Println("in use:", st.InUse, "arenas:", st.Arenas, "peak:", st.PeakInUse)
	// Output:
	// registration of arena 0
	// visits: 1
	// in use: 0 arenas: 1 peak: 786432
}

// Blocks are plain memory off the Go heap; freeing one twice is an error,
// not a crash.
func ExamplePool_Alloc() {
	pool, _ := alloc.New(alloc.NewMmapSource(alloc.MmapOptions{}))
	defer pool.Close()
	b, err := pool.Alloc(1000)
	if err != nil {
		fmt.Println(err)
		return
	}
	copy(b.Bytes(), "hello")
	fmt.Println(string(b.Bytes()[:5]), b.Len(), b.Addr()%256 == 0)
	fmt.Println(b.Free())
	fmt.Println(b.Free() != nil)
	// Output:
	// hello 1000 true
	// <nil>
	// true
}

// A memfd source makes arenas whose descriptor another process can map.
func ExampleNewMemfdSource() {
	pool, _ := alloc.New(alloc.NewMemfdSource("shared", alloc.MmapOptions{}))
	defer pool.Close()
	b, _ := pool.Alloc(4096)
	arena, _ := pool.ArenaOf(b.Addr())
	fmt.Println(arena.Region().FD >= 0)
	b.Free()
	// Output: true
}

// Two pools, one budget: tensors of different owners live in arenas of
// their own, and one limit bounds them together.
func ExampleBudget() {
	budget, err := alloc.NewBudget("results", 8<<20)
	if err != nil {
		panic(err)
	}
	a, _ := alloc.New(alloc.NewMmapSource(alloc.MmapOptions{}), alloc.WithBudget(budget), alloc.WithMaxArena(4<<20))
	b, _ := alloc.New(alloc.NewMmapSource(alloc.MmapOptions{}), alloc.WithBudget(budget), alloc.WithMaxArena(4<<20))
	x, _ := a.Alloc(4 << 20)
	y, _ := b.Alloc(4 << 20)
	_, err = b.Alloc(1 << 20)
	fmt.Println(budget.Reserved()>>20, "MiB reserved;", errors.Is(err, alloc.ErrPoolExhausted))
	x.Free()
	y.Free()
	a.Close()
	b.Close()
	fmt.Println(budget.Reserved(), "bytes reserved after Close")
	// Output:
	// 8 MiB reserved; true
	// 0 bytes reserved after Close
}

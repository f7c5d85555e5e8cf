package cowlist

import (
	"fmt"
	"slices"
	"sync"
	"testing"
)

func TestAddRemove(t *testing.T) {
	var l List[int]
	if got := l.Load(); len(got) != 0 {
		t.Fatalf("zero list holds %v", got)
	}
	l.Add(1)
	l.Add(2)
	l.Add(1)
	snap := l.Load()
	l.Remove(1)
	if got := l.Load(); !slices.Equal(got, []int{2}) {
		t.Fatalf("after Remove(1): %v, want [2]", got)
	}
	if !slices.Equal(snap, []int{1, 2}) {
		t.Fatalf("an earlier snapshot changed to %v", snap)
	}
	l.Remove(7)
	if got := l.Load(); !slices.Equal(got, []int{2}) {
		t.Fatalf("after removing an absent item: %v", got)
	}
}

func TestConcurrentAdds(t *testing.T) {
	var l List[int]
	var wg sync.WaitGroup
	for i := range 64 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			l.Add(i)
			_ = l.Load()
		}()
	}
	wg.Wait()
	got := slices.Sorted(slices.Values(l.Load()))
	if len(got) != 64 || got[0] != 0 || got[63] != 63 {
		t.Fatalf("64 concurrent Adds left %d items: %v", len(got), got)
	}
}

func ExampleList() {
	var qps List[string]
	qps.Add("qp1")
	qps.Add("qp2")
	qps.Remove("qp1")
	fmt.Println(qps.Load())
	// Output: [qp2]
}

package cpubind

import (
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strconv"
	"sync"
	"testing"
)

// TestShare: the allowed CPUs are cut into equal contiguous runs, one per
// rank, disjoint; with fewer CPUs than ranks no rank gets any.
func TestShare(t *testing.T) {
	allowed := []int{0, 1, 2, 3, 8, 9, 10}
	for _, c := range []struct {
		index, count int
		want         []int
	}{
		{0, 1, allowed},
		{0, 2, []int{0, 1, 2}},
		{1, 2, []int{3, 8, 9}},
		{2, 3, []int{8, 9}},
		{6, 7, []int{10}},
	} {
		got, err := Share(allowed, c.index, c.count)
		if err != nil || !slices.Equal(got, c.want) {
			t.Errorf("Share(%v, %d, %d) = %v, %v; want %v", allowed, c.index, c.count, got, err, c.want)
		}
	}
	if got, err := Share(allowed, 0, 8); !errors.Is(err, ErrTooFew) {
		t.Errorf("8 ranks on 7 CPUs: %v, %v; want ErrTooFew", got, err)
	}
	for _, bad := range [][2]int{{-1, 2}, {2, 2}, {0, 0}} {
		if _, err := Share(allowed, bad[0], bad[1]); err == nil {
			t.Errorf("Share(index %d, count %d) gave no error", bad[0], bad[1])
		}
	}
	// The caller's slice is not shared with the result.
	got, _ := Share(allowed, 0, 2)
	got[0] = 99
	if allowed[0] != 0 {
		t.Fatal("Share's result aliases its argument")
	}
}

// bindChildEnv makes the test binary a process that binds itself to the
// CPU it names, starts threads after, and prints every thread's mask.
const bindChildEnv = "CPUBIND_TEST_CHILD_CPU"

func TestMain(m *testing.M) {
	if v := os.Getenv(bindChildEnv); v != "" {
		os.Exit(bindChild(v))
	}
	os.Exit(m.Run())
}

func bindChild(v string) int {
	cpu, err := strconv.Atoi(v)
	if err != nil {
		return 2
	}
	before := startThreads(4)
	n, err := Bind([]int{cpu})
	if err != nil {
		os.Stderr.WriteString(err.Error())
		return 1
	}
	after := startThreads(4) // created after: they inherit the mask
	masks, err := ThreadMasks()
	if err != nil {
		os.Stderr.WriteString(err.Error())
		return 1
	}
	json.NewEncoder(os.Stdout).Encode(map[string]any{"bound": n, "masks": masks})
	close(before)
	close(after)
	return 0
}

// startThreads starts n goroutines locked to threads of their own, which
// stay until the returned channel closes.
func startThreads(n int) chan struct{} {
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for range n {
		wg.Add(1)
		go func() {
			runtime.LockOSThread()
			wg.Done()
			<-stop
		}()
	}
	wg.Wait()
	return stop
}

// TestBind: a process bound to one CPU has every thread on it, those it
// had and those it started after; the test process itself is not bound.
func TestBind(t *testing.T) {
	allowed, err := Allowed()
	if err != nil {
		t.Fatal(err)
	}
	if len(allowed) == 0 {
		t.Fatal("no allowed CPUs")
	}
	cpu := allowed[len(allowed)-1]
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	c := exec.Command(self, "-test.run=^$")
	c.Env = append(os.Environ(), bindChildEnv+"="+strconv.Itoa(cpu))
	c.Stderr = os.Stderr
	out, err := c.Output()
	if err != nil {
		t.Fatalf("child: %v", err)
	}
	var got struct {
		Bound int
		Masks map[string][]int
	}
	if err := json.Unmarshal(out, &got); err != nil {
		t.Fatalf("child said %q: %v", out, err)
	}
	if got.Bound < 5 || len(got.Masks) < 9 {
		t.Fatalf("bound %d threads, %d threads in all: want at least the 4 started before and the main thread, 9 in all", got.Bound, len(got.Masks))
	}
	for tid, m := range got.Masks {
		if !slices.Equal(m, []int{cpu}) {
			t.Errorf("thread %s runs on %v, want only CPU %d", tid, m, cpu)
		}
	}
	if mine, _ := Allowed(); !slices.Equal(mine, allowed) {
		t.Errorf("the test process's own mask changed: %v, was %v", mine, allowed)
	}
}

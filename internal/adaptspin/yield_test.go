package adaptspin

import (
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"

	"golang.org/x/sys/unix"
)

// yieldChildEnv makes the test binary the process of TestYieldCPU: it
// runs on one CPU (the mask it was started with) with two processors.
const yieldChildEnv = "ADAPTSPIN_TEST_YIELD_CHILD"

func TestMain(m *testing.M) {
	if os.Getenv(yieldChildEnv) != "" {
		os.Exit(yieldChild())
	}
	os.Exit(m.Run())
}

// yieldChild spins a goroutine that counts, and counts the calls of
// runtime.Gosched, then of YieldCPU, after which the counter moved. With
// both goroutines' threads on one CPU the counter moves only when this
// thread gives the CPU up (or the kernel preempts it).
func yieldChild() int {
	runtime.GOMAXPROCS(2)
	var count atomic.Int64
	var stop atomic.Bool
	started := make(chan struct{})
	go func() {
		close(started)
		for !stop.Load() {
			count.Add(1)
		}
	}()
	<-started
	for count.Load() == 0 {
		runtime.Gosched()
	}
	moved := func(yield func()) int {
		n := 0
		for range 40 {
			before := count.Load()
			yield()
			if count.Load() != before {
				n++
			}
		}
		return n
	}
	gosched := moved(runtime.Gosched)
	yielded := moved(YieldCPU)
	stop.Store(true)
	fmt.Println(gosched, yielded)
	return 0
}

// TestYieldCPU: on a host where two threads want one CPU, a thread that
// calls YieldCPU lets the other run at most calls; runtime.Gosched does
// not (it hands over the process's processor, not the CPU).
func TestYieldCPU(t *testing.T) {
	var set unix.CPUSet
	if err := unix.SchedGetaffinity(0, &set); err != nil {
		t.Fatal(err)
	}
	cpu := -1
	for c := 0; c < 1024 && cpu < 0; c++ {
		if set.IsSet(c) {
			cpu = c
		}
	}
	// The child inherits the mask of the thread that starts it: pin this
	// one (locked, it ends with the test's goroutine).
	runtime.LockOSThread()
	var one unix.CPUSet
	one.Set(cpu)
	if err := unix.SchedSetaffinity(0, &one); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), yieldChildEnv+"=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("child: %v\n%s", err, out)
	}
	f := strings.Fields(string(out))
	if len(f) != 2 {
		t.Fatalf("child printed %q", out)
	}
	gosched, _ := strconv.Atoi(f[0])
	yielded, _ := strconv.Atoi(f[1])
	t.Logf("on CPU %d alone, a spinning goroutine ran at %d of 40 YieldCPU calls and %d of 40 runtime.Gosched calls", cpu, yielded, gosched)
	if yielded < 10 || yielded <= gosched {
		t.Errorf("a thread wanting the same CPU ran at %d of 40 YieldCPU calls (%d of 40 runtime.Gosched calls); want at least 10, and more", yielded, gosched)
	}
}

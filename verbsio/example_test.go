package verbsio_test

import (
	"context"
	"fmt"
	"unsafe"

	"github.com/gdrlink/gdrlink/verbsio"
	_ "github.com/gdrlink/gdrlink/verbsio/tcp"
	"golang.org/x/sys/unix"
)

// Two queue pairs of one process, connected over the tcp provider: one
// RDMA-writes a message straight into the other's registered memory, with
// an immediate that completes a posted receive there.
func Example() {
	ctx := context.Background()
	dev, err := verbsio.Open("tcp", verbsio.Config{})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer dev.Close()
	pd, _ := dev.AllocPD()
	defer pd.Close()
	cq, _ := dev.CreateCQ(16)
	defer cq.Close()

	// Registered memory lives off the Go heap.
	mem, _ := unix.Mmap(-1, 0, 8192, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	defer unix.Munmap(mem)
	mr, err := pd.RegisterMemory(uintptr(unsafe.Pointer(&mem[0])), len(mem), verbsio.AccessLocalWrite|verbsio.AccessRemoteWrite)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer mr.Close()

	a, _ := pd.CreateQP(verbsio.QPConfig{SendCQ: cq, RecvCQ: cq})
	defer a.Close()
	b, _ := pd.CreateQP(verbsio.QPConfig{SendCQ: cq, RecvCQ: cq})
	defer b.Close()
	b.PostRecv([]verbsio.RecvWR{{WRID: 100}})
	done := make(chan error)
	go func() { done <- b.Connect(ctx, a.Endpoint()) }()
	if err := a.Connect(ctx, b.Endpoint()); err != nil {
		fmt.Println(err)
		return
	}
	<-done

	msg := "hello, zero copies"
	copy(mem, msg)
	err = a.PostSend([]verbsio.SendWR{{
		WRID: 1, Op: verbsio.OpWriteImm, Imm: 42, Signaled: true,
		SG:         []verbsio.SGE{{Addr: mr.Addr(), Length: uint32(len(msg)), LKey: mr.LKey()}},
		RemoteAddr: uint64(mr.Addr()) + 4096, RKey: mr.RKey(),
	}})
	if err != nil {
		fmt.Println(err)
		return
	}
	got := make([]verbsio.Completion, 2)
	for n := 0; n < 2; {
		k, _ := cq.Wait(ctx, got[n:])
		n += k
	}
	for _, c := range got {
		fmt.Println(c.Op, c.Status, c.Imm)
	}
	fmt.Println(string(mem[4096 : 4096+len(msg)]))
	// Unordered output:
	// write-imm success 0
	// recv-imm success 42
	// hello, zero copies
}

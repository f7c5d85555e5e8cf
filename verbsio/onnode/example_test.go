package onnode_test

import (
	"context"
	"fmt"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/gdrlink/gdrlink/verbsio"
	_ "github.com/gdrlink/gdrlink/verbsio/onnode"
)

// Two queue pairs of the onnode provider (here in one process; usually in
// two processes of one host, their endpoints swapped through the bootstrap)
// move a buffer with one RDMA WRITE WITH IMMEDIATE.
func Example() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	dev, err := verbsio.Open("onnode", verbsio.Config{})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer dev.Close()
	pd, _ := dev.AllocPD()
	defer pd.Close()
	cq, _ := dev.CreateCQ(16)
	defer cq.Close()

	// Memory handed to a provider lives off the Go heap.
	mem, _ := unix.Mmap(-1, 0, 8192, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	defer unix.Munmap(mem)
	base := uintptr(unsafe.Pointer(&mem[0]))
	src, _ := pd.RegisterMemory(base, 4096, verbsio.AccessLocalWrite)
	defer src.Close()
	dst, _ := pd.RegisterMemory(base+4096, 4096, verbsio.AccessLocalWrite|verbsio.AccessRemoteWrite)
	defer dst.Close()
	copy(mem, "tensor bytes")

	sender, _ := pd.CreateQP(verbsio.QPConfig{SendCQ: cq, RecvCQ: cq})
	defer sender.Close()
	receiver, _ := pd.CreateQP(verbsio.QPConfig{SendCQ: cq, RecvCQ: cq})
	defer receiver.Close()
	errc := make(chan error, 1)
	go func() { errc <- receiver.Connect(ctx, sender.Endpoint()) }()
	if err := sender.Connect(ctx, receiver.Endpoint()); err != nil {
		fmt.Println(err)
		return
	}
	if err := <-errc; err != nil {
		fmt.Println(err)
		return
	}

	// The receiver posts a receive for the immediate; the sender writes.
	receiver.PostRecv([]verbsio.RecvWR{{WRID: 1}})
	sender.PostSend([]verbsio.SendWR{{WRID: 2, Op: verbsio.OpWriteImm, Imm: 7, RemoteAddr: uint64(dst.Addr()), RKey: dst.RKey(),
		SG: []verbsio.SGE{{Addr: src.Addr(), Length: 12, LKey: src.LKey()}}}})
	var c [1]verbsio.Completion
	if _, err := cq.Wait(ctx, c[:]); err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("%s imm=%d bytes=%d: %q\n", c[0].Op, c[0].Imm, c[0].ByteLen, mem[4096:4096+c[0].ByteLen])
	// Output: recv-imm imm=7 bytes=12: "tensor bytes"
}

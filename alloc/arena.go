package alloc

import (
	"fmt"
	"sync"
	"unsafe"

	"github.com/gdrlink/gdrlink/tensor"
)

// Region is a range of memory that a Source made: off the Go heap, never
// moved, and alive until the source frees it.
type Region struct {
	// Base is the address of the first byte (a device pointer for GPU memory).
	Base uintptr
	// Size is the region's length in bytes.
	Size int
	// Device is where the memory lives.
	Device tensor.Device
	// FD is a file descriptor that maps the memory (a memfd), or -1.
	FD int
	// Notes are what the source tried and could not do, best effort
	// (for example "MADV_HUGEPAGE refused: EINVAL"), for people to read.
	Notes []string
	// Private is the source's own bookkeeping.
	Private any
}

// hostBytes returns the region as a byte slice, or nil for device memory.
func (r *Region) hostBytes() []byte {
	if r.Device.IsGPU() || r.Size == 0 {
		return nil
	}
	// The region is off the Go heap, so its address is stable; reading the
	// uintptr through a pointer keeps vet's unsafe.Pointer check quiet.
	base := *(*unsafe.Pointer)(unsafe.Pointer(&r.Base))
	return unsafe.Slice((*byte)(base), r.Size)
}

// Source makes and frees the regions that become a pool's arenas.
type Source interface {
	// Name says what the source is ("mmap", "memfd", "cuda-device:0").
	Name() string
	// Device is where the source's memory lives.
	Device() tensor.Device
	// Alloc makes a region of at least size bytes.
	Alloc(size int) (*Region, error)
	// Free releases a region Alloc made.
	Free(r *Region) error
	// Close releases what the source holds (a CUDA context, for the CUDA
	// sources); close the pools over the source first. Regions still
	// allocated are freed and reported in an error wrapping ErrLeaked.
	// The mmap and memfd sources hold nothing and their Close does
	// nothing. Idempotent.
	Close() error
}

// Arena is one region of a pool, registered by the pool's visitors. Visitors
// attach handles to it (a memory region's lkey and rkey, an IPC export), and
// anyone holding an address inside the arena finds them through Pool.ArenaOf.
type Arena struct {
	// ID is the arena's number in its pool, unique for the pool's life.
	ID     int
	region *Region

	mu      sync.RWMutex
	handles map[any]any
}

// Region is the memory of the arena.
func (a *Arena) Region() *Region { return a.region }

// Base is the address of the arena's first byte.
func (a *Arena) Base() uintptr { return a.region.Base }

// Size is the arena's length in bytes.
func (a *Arena) Size() int { return a.region.Size }

// Device is where the arena's memory lives.
func (a *Arena) Device() tensor.Device { return a.region.Device }

// contains reports whether [addr, addr+n) lies inside the arena.
func (a *Arena) contains(addr uintptr, n int) bool {
	return addr >= a.region.Base && n >= 0 && uint64(addr-a.region.Base)+uint64(n) <= uint64(a.region.Size)
}

// SetHandle attaches v to the arena under key. Visitors call it from Visit;
// key is usually a value of an unexported type of the visitor's package, or
// the visitor itself.
func (a *Arena) SetHandle(key, v any) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.handles == nil {
		a.handles = make(map[any]any)
	}
	a.handles[key] = v
}

// Handle returns what was attached under key, if anything.
func (a *Arena) Handle(key any) (any, bool) {
	a.mu.RLock()
	defer a.mu.RUnlock()
	v, ok := a.handles[key]
	return v, ok
}

// DeleteHandle removes the handle under key; visitors call it from Release.
func (a *Arena) DeleteHandle(key any) {
	a.mu.Lock()
	defer a.mu.Unlock()
	delete(a.handles, key)
}

// String prints the arena for people.
func (a *Arena) String() string {
	return fmt.Sprintf("arena %d [%#x+%d %s]", a.ID, a.region.Base, a.region.Size, a.region.Device)
}

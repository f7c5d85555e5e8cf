// Package offheap views memory that lives off the Go heap (mmap'd arenas,
// registered regions, shared mappings) as byte slices and back.
package offheap

import "unsafe"

// Bytes views the n bytes at addr. addr must be off the Go heap and mapped
// for as long as the slice is used; reading the uintptr through a pointer
// keeps vet's unsafe.Pointer check meaningful elsewhere.
func Bytes(addr uintptr, n int) []byte {
	if n == 0 {
		return nil
	}
	p := *(*unsafe.Pointer)(unsafe.Pointer(&addr))
	return unsafe.Slice((*byte)(p), n)
}

// Addr is the address of b's first byte (0 for an empty slice).
func Addr(b []byte) uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(b))) }

// Package tensor is the tensor model of gdrlink: element types, shapes,
// devices, meta-data, and tensors whose bytes live in allocator memory.
//
// It knows nothing of allocators or transports: a Tensor's bytes come from a
// Buffer, which the alloc package implements over registered arenas. Tensors
// whose elements are not plain bytes (strings) are not DMAable; they travel in
// the compact wire encoding of this package (AppendStrings, DecodeStringTensor).
package tensor

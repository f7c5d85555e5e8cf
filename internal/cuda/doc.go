// Package cuda is gdrlink's access to the CUDA driver, loaded at run time.
//
// Nothing here links against CUDA: Open loads libcuda.so.1 with dlopen
// (through github.com/ebitengine/purego, so no cgo and no CUDA toolkit are
// needed to build) and resolves the versioned driver symbols it uses
// (cuMemAlloc_v2, cuMemHostRegister_v2, cuMemcpyHtoDAsync_v2, ...). On a host
// without the driver Open fails with an error wrapping ErrNoDriver that
// carries the loader's message; nothing panics, and nothing is loaded before
// the first call to Open (never in init).
//
// Every resource is a handle with an idempotent Close: the Driver (its
// library reference), a retained primary Context, DeviceMemory, HostMemory
// (cuMemHostAlloc), HostRegistration (cuMemHostRegister), Stream, Event,
// DMABuf and IPCMapping. A driver call that fails returns an *Error that
// names the call and the CUresult code; errors.Is matches it against the
// sentinel of its code (ErrOutOfMemory, ErrNotSupported, ...) and, for the
// codes after which the context is unusable, ErrDeviceLost.
//
// The driver keeps a current context per OS thread. Every call that needs one
// locks the calling goroutine to its thread, makes the handle's context
// current and runs the call, so callers never deal with thread state.
package cuda

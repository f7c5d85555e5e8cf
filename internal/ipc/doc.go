// Package ipc is the on-node path between two ranks whose tensors live in
// device memory (or, on the CPU analog, in memfd arenas): the exporter gets a
// handle once per arena, the importer opens each remote arena once and keeps
// the mapping in a per-peer cache, and the receiver pulls the sender's tensor
// with one copy.
//
// Support between a pair of ranks is set up lazily, as Open MPI's smcuda
// does: nothing at join, and the first transfer from either side starts the
// state machine of Setup (INIT → SENT → ACKING → ACKED → OK, or BAD).
//
// Backends: the CPU analog (memfd arenas of alloc/visitor.NewIPCExport,
// whose descriptors travel over a unix socket with SCM_RIGHTS: MemfdOpener,
// Pull), CUDA's legacy IPC handles (NewCUDAExport, CUDA over a device from
// proxy.NewCUDADevice: DeviceOpener, PullDevice), and the simulated GPU's
// shareable memory (gpusim with Config.Shareable), through which every
// state and failure runs without a GPU. Importing a CUDA VMM descriptor
// (cuMemExportToShareableHandle) is not built yet: OpenHandle refuses one
// with ErrNotSupported.
package ipc

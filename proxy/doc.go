// Package proxy moves tensors between the NIC and GPUs that the NIC cannot
// reach directly: the transport writes into a pinned CPU proxy tensor from a
// pool, and the proxy copies it to the GPU with an asynchronous copy on a
// per-device stream (and, on the send side, stages GPU memory to a pinned
// proxy before the NIC reads it).
//
// Large tensors are pipelined. A Receiver splits nothing itself: the
// transport calls Receiver.ChunkArrived(offset, n) as each chunk's write
// completes, and the host-to-device copy of that chunk is queued at once, so
// the network and the copy overlap and the tensor is on the GPU shortly
// after its last byte lands (instead of one whole-tensor copy after the
// whole tensor arrived).
//
// Completion comes from device events without parking a goroutine per copy:
// each Proxy owns one poller goroutine that queries the oldest pending event
// of its stream (events of one stream complete in order, so only the head
// needs asking), runs the completions that are done, and sleeps with a
// short backoff (5 µs doubling to 200 µs) while the head is pending; with
// nothing pending it blocks on a channel and costs nothing.
//
// Device is the one interface over a GPU that this package needs. It is
// implemented by the real CUDA device (NewCUDADevice, over the driver loaded
// at run time) and by the simulated device in package gpusim (host memory
// and a copy goroutine with a configurable bandwidth), on which every test
// of this package runs without a GPU.
//
// Whether a GPU is written directly (GPUDirect RDMA) or through a proxy is
// decided by package gdr; a Proxy made WithDirect lets the NIC write the GPU
// itself and runs the GPUDirect flush (a DirectFlusher) that must precede
// the GPU's use of data a NIC wrote.
package proxy

package proxy_test

import (
	"context"
	"fmt"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/gpusim"
	"github.com/gdrlink/gdrlink/proxy"
)

// A tensor for a GPU the NIC cannot reach lands in a pinned proxy tensor in
// chunks; each chunk is copied to the GPU as soon as it arrives. The
// simulated GPU stands in for a real one (proxy.NewCUDADevice).
func ExampleProxy_Receive() {
	gpu := gpusim.New(gpusim.Config{})
	defer gpu.Close()
	pool, _ := alloc.New(alloc.NewMmapSource(alloc.MmapOptions{}), alloc.WithVisitors(gpu.HostRegisterVisitor()))
	defer pool.Close()
	px, _ := proxy.New(gpu, pool, proxy.WithChunk(4))
	defer px.Close()

	dst, _ := gpu.Alloc(8)
	rc, _ := px.Receive(dst, 8, nil)
	proxyTensor := rc.Block().Bytes()
	copy(proxyTensor[4:], "link") // the network delivers the second half first
	rc.ChunkArrived(4, 4)
	copy(proxyTensor, "gdr-")
	rc.ChunkArrived(0, 4)
	err := rc.Wait(context.Background())

	onGPU, _ := gpu.Peek(dst, 8)
	fmt.Println(string(onGPU), err, pool.Stats().InUse)
	// Output: gdr-link <nil> 0
}

// A Direct receive (the NIC writes the GPU's memory itself) on a GPU below
// compute capability 9.0 must flush the NIC's writes before the GPU reads
// them. A device whose driver flushes from the host (the CUDA device, with
// cuFlushGPUDirectRDMAWrites) needs no loopback flusher. The
// simulated GPU counts the flushes.
func ExampleWithDirect() {
	gpu := gpusim.New(gpusim.Config{ComputeCapability: 80, HostFlush: true})
	defer gpu.Close()
	pool, _ := alloc.New(alloc.NewMmapSource(alloc.MmapOptions{}), alloc.WithVisitors(gpu.HostRegisterVisitor()))
	defer pool.Close()
	px, err := proxy.New(gpu, pool, proxy.WithDirect(nil, false))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer px.Close()

	dst, _ := gpu.Alloc(64)
	rc, _ := px.Receive(dst, 64, nil)
	rc.ChunkArrived(0, 64) // the NIC's write completed
	err = rc.Wait(context.Background())
	fmt.Println(err, gpu.Stats().RDMAFlushes)
	// Output: <nil> 1
}

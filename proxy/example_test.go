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

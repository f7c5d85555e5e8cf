package proxy_test

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"
	"unsafe"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/alloc/visitor"
	"github.com/gdrlink/gdrlink/internal/cuda/cudatest"
	"github.com/gdrlink/gdrlink/proxy"
)

// TestCUDAProxyEndToEnd receives a tensor through a pinned proxy onto a real
// GPU in chunks, stages it back, and compares: once with proxy tensors from
// the pinned source, once from an mmap pool registered by the cudahost
// visitor.
func TestCUDAProxyEndToEnd(t *testing.T) {
	dev, err := proxy.NewCUDADevice(0)
	cudatest.SkipIfNoDriver(t, err)
	cudaEndToEnd(t, dev)
}

// TestCUDAProxyOnStandInDriver runs the same path over the stand-in driver
// (host memory behind the CUDA driver's ABI): it proves the plumbing from
// proxy through alloc's pinned source and the cudahost visitor down to the
// driver calls, not a GPU.
func TestCUDAProxyOnStandInDriver(t *testing.T) {
	t.Setenv("GDRLINK_LIBCUDA", cudatest.StandIn(t))
	dev, err := proxy.NewCUDADevice(0)
	if err != nil {
		t.Fatal(err)
	}
	cudaEndToEnd(t, dev)
}

func cudaEndToEnd(t *testing.T, dev proxy.Device) {
	defer func() {
		if err := dev.Close(); err != nil {
			t.Error(err)
		}
	}()
	pinned, err := alloc.NewPinnedHostSource(0)
	if err != nil {
		t.Fatal(err)
	}
	defer pinned.Close()
	for _, c := range []struct {
		name string
		src  alloc.Source
		vis  []alloc.Visitor
	}{
		{"pinned-source", pinned, nil},
		{"cudahost-visitor", alloc.NewMmapSource(alloc.MmapOptions{}), []alloc.Visitor{visitor.NewCUDAHostRegister(dev.Info().Ordinal)}},
	} {
		t.Run(c.name, func(t *testing.T) {
			pool, err := alloc.New(c.src, alloc.WithVisitors(c.vis...))
			if err != nil {
				t.Fatal(err)
			}
			defer func() {
				if err := pool.Close(); err != nil {
					t.Error(err)
				}
			}()
			px, err := proxy.New(dev, pool, proxy.WithChunk(4<<20))
			if err != nil {
				t.Fatal(err)
			}
			defer px.Close()
			const n = 64<<20 + 4096
			dst, err := dev.Alloc(n)
			if err != nil {
				t.Fatal(err)
			}
			defer dev.Free(dst)
			want := make([]byte, n)
			fill(want, 9)
			rc, err := px.Receive(dst, n, nil)
			if err != nil {
				t.Fatal(err)
			}
			buf := host(rc.Addr(), n)
			for off := 0; off < n; off += 4 << 20 {
				c := min(4<<20, n-off)
				copy(buf[off:off+c], want[off:off+c])
				if err := rc.ChunkArrived(off, c); err != nil {
					t.Fatal(err)
				}
			}
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			if err := rc.Wait(ctx); err != nil {
				t.Fatal(err)
			}
			st, err := px.Stage(dst, n, nil, nil)
			if err != nil {
				t.Fatal(err)
			}
			if err := st.Wait(ctx); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(host(st.Block().Addr(), n), want) {
				t.Fatal("bytes staged back from the GPU differ from those received")
			}
			if err := st.Release(); err != nil {
				t.Fatal(err)
			}
			if pool.Stats().InUse != 0 {
				t.Fatalf("pool has %d bytes in use", pool.Stats().InUse)
			}
			hostMem := make([]byte, 4096)
			if _, err := px.Receive(proxy.DevicePtr(uintptr(unsafe.Pointer(&hostMem[0]))), 4096, nil); !errors.Is(err, proxy.ErrWrongMemory) {
				t.Fatalf("host memory as a GPU destination: %v", err)
			}
		})
	}
}

package gdrlink

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/gpusim"
	"github.com/gdrlink/gdrlink/proxy"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

// simGPU is the simulated GPU of a child process started with
// GDRLINK_TEST_SIMGPU=1 (there is no GPU here): the same proxy.Device
// interface as a real one, with a host view of its memory for checking.
var simGPU gpusim.Device

// withSimulatedGPU joins with GPU 0 being a simulated GPU.
func withSimulatedGPU() Option {
	return func(c *config) error {
		c.gpu = 0
		c.openGPU = func(int) (proxy.Device, alloc.Visitor, error) {
			simGPU = gpusim.New(gpusim.Config{Shareable: true})
			return simGPU, simGPU.HostRegisterVisitor(), nil
		}
		return nil
	}
}

// gpuView is the host view of a tensor in simulated GPU memory.
func gpuView(t *tensor.Tensor) ([]byte, error) {
	return simGPU.Peek(proxy.DevicePtr(t.Addr()), int(t.Meta().ByteSize))
}

// gpuJob: rank 0 sends from the GPU, from pinned and from host memory;
// rank 1 receives onto the GPU and into host memory. Every byte is checked
// on the (simulated) GPU or in host memory.
func gpuJob(ctx context.Context, g *Group, rep *childReport) error {
	type item struct {
		key      string
		from, to tensor.Device
		n        int64
	}
	pinned := tensor.Device{Kind: tensor.PinnedHost}
	gpu := tensor.GPUDevice(0)
	items := []item{
		{"gpu-to-gpu", gpu, gpu, 3 << 20}, {"host-to-gpu", tensor.Host, gpu, 64 << 10},
		{"gpu-to-host", gpu, tensor.Host, 1 << 20}, {"pinned-to-host", pinned, tensor.Host, 4096},
	}
	bytesOf := func(t *tensor.Tensor) ([]byte, error) {
		if t.Device().IsGPU() {
			return gpuView(t)
		}
		return t.Bytes()
	}
	for i, it := range items {
		if g.Rank() == 0 {
			t, err := g.NewTensorOn(it.from, tensor.Uint8, it.n)
			if err != nil {
				return err
			}
			b, err := bytesOf(t)
			if err != nil {
				return err
			}
			fill(b, i)
			if err := g.Send(1, it.key, 0, t); err != nil {
				return err
			}
			continue
		}
		t, tr, err := g.RecvOn(ctx, it.to, 0, it.key, 0)
		if err != nil {
			return fmt.Errorf("%s: %w", it.key, err)
		}
		if t.Device() != it.to {
			return fmt.Errorf("%s: result on %s, want %s", it.key, t.Device(), it.to)
		}
		b, err := bytesOf(t)
		if err != nil {
			return err
		}
		want := make([]byte, len(b))
		fill(want, i)
		if !bytes.Equal(b, want) {
			return fmt.Errorf("%s: bytes differ", it.key)
		}
		rep.Paths = append(rep.Paths, it.key+":"+tr.Path.String())
		rep.Received++
		if err := t.Release(); err != nil {
			return err
		}
	}
	return nil
}

// TestTwoProcessesGPU runs the GPU job between two processes, each with a
// simulated GPU behind the proxy.Device interface (named as such: no GPU
// here). GPU results come through the pinned proxy; GPU sources are staged.
// The GPU-to-GPU tensor, the pair's first GPU transfer, starts the on-node
// path's setup: it goes through the proxy, or is already pulled when the
// setup won the race with the receiver's request.
func TestTwoProcessesGPU(t *testing.T) {
	for _, prov := range []string{"onnode", "tcp"} {
		t.Run(prov, func(t *testing.T) {
			j := startJob(t, "gpu", 2, "127.0.0.1", func(int) []string { return nil }, func(int) []string {
				return []string{"GDRLINK_TEST_SIMGPU=1", "GDRLINK_PROVIDER=" + prov}
			})
			reps := j.wait(2 * time.Minute)
			want := []string{"gpu-to-gpu:proxy", "host-to-gpu:proxy", "gpu-to-host:direct", "pinned-to-host:direct"}
			if len(reps[1].Paths) > 0 && reps[1].Paths[0] == "gpu-to-gpu:cuda-ipc" {
				want[0] = reps[1].Paths[0]
			}
			if fmt.Sprint(reps[1].Paths) != fmt.Sprint(want) {
				t.Errorf("paths %v, want %v", reps[1].Paths, want)
			}
		})
	}
}

// TestGPURefusals: without WithGPU there is no GPU or pinned memory, and
// strings never go to a GPU.
func TestGPURefusals(t *testing.T) {
	g, err := Join(context.Background(), WithRank(0, 1))
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	for _, dev := range []tensor.Device{tensor.GPUDevice(0), {Kind: tensor.PinnedHost}} {
		if _, err := g.NewTensorOn(dev, tensor.Float32, 4); !errors.Is(err, verbsio.ErrNotSupported) {
			t.Errorf("%s tensor without WithGPU: %v, want ErrNotSupported", dev, err)
		}
	}
	sg, err := Join(context.Background(), WithRank(0, 1), withSimulatedGPU())
	if err != nil {
		t.Fatal(err)
	}
	defer sg.Close()
	if _, err := sg.NewTensorOn(tensor.GPUDevice(0), tensor.String, 4); !errors.Is(err, verbsio.ErrNotSupported) {
		t.Errorf("a string tensor on the GPU: %v, want ErrNotSupported", err)
	}
	if _, err := sg.NewTensorOn(tensor.GPUDevice(1), tensor.Float32, 4); !errors.Is(err, verbsio.ErrNotSupported) {
		t.Errorf("a tensor on GPU 1 of a group on GPU 0: %v, want ErrNotSupported", err)
	}
	tn, err := sg.NewTensorOn(tensor.GPUDevice(0), tensor.Float32, 4)
	if err != nil {
		t.Fatal(err)
	}
	if tn.Device() != tensor.GPUDevice(0) {
		t.Errorf("GPU tensor on %s", tn.Device())
	}
	if err := tn.Release(); err != nil {
		t.Fatal(err)
	}
	// With a real GPU, WithGPU joins; without a CUDA driver it fails at
	// Join and says which GPU and why.
	rg, err := Join(context.Background(), WithRank(0, 1), WithGPU(0))
	switch {
	case err == nil:
		rg.Close()
	case os.Getenv("GDRLINK_REQUIRE_GPU") == "1":
		t.Errorf("GDRLINK_REQUIRE_GPU=1, but WithGPU(0) failed: %v", err)
	case !strings.Contains(err.Error(), "GPU 0"):
		t.Errorf("WithGPU(0) without a GPU: %v, want an error naming GPU 0", err)
	default:
		t.Logf("WithGPU(0) here: %v", err)
	}
}

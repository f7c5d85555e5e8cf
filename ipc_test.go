package gdrlink

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/gdrlink/gdrlink/internal/cuda/cudatest"
	"github.com/gdrlink/gdrlink/internal/ipc"
	"github.com/gdrlink/gdrlink/proxy"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

// deviceWrite puts data at the start of GPU tensor t: through the host
// view of the simulated GPU, or with a copy on the real one.
func deviceWrite(g *Group, t *tensor.Tensor, data []byte) error {
	if simGPU != nil {
		b, err := gpuView(t)
		if err != nil {
			return err
		}
		copy(b, data)
		return nil
	}
	dev := g.gpu.dev
	st, err := dev.NewStream()
	if err != nil {
		return err
	}
	defer st.Close()
	if err := dev.CopyHtoDAsync(proxy.DevicePtr(t.Addr()), uintptr(unsafe.Pointer(unsafe.SliceData(data))), len(data), st); err != nil {
		return err
	}
	err = st.Synchronize()
	runtime.KeepAlive(data)
	return err
}

// deviceRead reads GPU tensor t's bytes back.
func deviceRead(g *Group, t *tensor.Tensor) ([]byte, error) {
	if simGPU != nil {
		b, err := gpuView(t)
		return bytes.Clone(b), err
	}
	dev := g.gpu.dev
	out := make([]byte, t.Meta().ByteSize)
	st, err := dev.NewStream()
	if err != nil {
		return nil, err
	}
	defer st.Close()
	if err := dev.CopyDtoHAsync(uintptr(unsafe.Pointer(unsafe.SliceData(out))), proxy.DevicePtr(t.Addr()), len(out), st); err != nil {
		return nil, err
	}
	err = st.Synchronize()
	runtime.KeepAlive(out)
	return out, err
}

// ipcSizes are the tensors each rank sends once the pair is set up.
var ipcSizes = []int64{4096, 3<<20 + 7, 64 << 10, 1 << 20, 17, 8 << 20}

// ipcXfer moves one GPU tensor of n bytes from rank from to the other rank
// of a two-rank job under key "ipc" and step, and checks its bytes on the
// receiver's GPU; the receiver notes the path.
func ipcXfer(ctx context.Context, g *Group, rep *childReport, step int64, from int, n int64) error {
	gpu := tensor.GPUDevice(0)
	peer := 1 - g.Rank()
	want := make([]byte, n)
	fill(want, int(step)+100*from)
	if g.Rank() == from {
		t, err := g.NewTensorOn(gpu, tensor.Uint8, n)
		if err != nil {
			return err
		}
		if err := deviceWrite(g, t, want); err != nil {
			return err
		}
		return g.Send(peer, "ipc", step, t)
	}
	t, tr, err := g.RecvOn(ctx, gpu, peer, "ipc", step)
	if err != nil {
		return fmt.Errorf("step %d: %w", step, err)
	}
	got, err := deviceRead(g, t)
	if err != nil {
		return err
	}
	if !bytes.Equal(got, want) {
		return fmt.Errorf("step %d (%d bytes, %s): bytes differ on the GPU", step, n, tr.Path)
	}
	rep.Paths = append(rep.Paths, fmt.Sprintf("%d:%s", step, tr.Path))
	rep.Received++
	return t.Release()
}

// waitPairOK waits until this rank's side of its pair is OK.
func waitPairOK(g *Group) error {
	deadline := time.Now().Add(30 * time.Second)
	for {
		st := g.Stats().IPC
		if st.Pairs["OK"] == 1 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the on-node GPU pair is not OK after 30 s: %v", st.Pairs)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// ipcJob: each of two ranks sends a GPU tensor to the other at once, so
// both start the pair's setup together (the race smcuda resolves to OK on
// both sides); those go through host memory or are pulled, whichever the
// setup's timing gives. Once both sides are OK, each sends the other
// tensors of several sizes: all are pulled (cuda-ipc) from arenas opened
// once.
func ipcJob(ctx context.Context, g *Group, rep *childReport) error {
	if g.Rank() == 0 {
		if err := ipcXfer(ctx, g, rep, 0, 0, 3<<20+7); err != nil {
			return err
		}
		if err := ipcXfer(ctx, g, rep, 1, 1, 64<<10); err != nil {
			return err
		}
	} else {
		if err := ipcXfer(ctx, g, rep, 1, 1, 64<<10); err != nil {
			return err
		}
		if err := ipcXfer(ctx, g, rep, 0, 0, 3<<20+7); err != nil {
			return err
		}
	}
	if err := waitPairOK(g); err != nil {
		return err
	}
	if err := g.Barrier(ctx); err != nil {
		return err
	}
	rep.Paths = append(rep.Paths, "ok")
	for i, n := range ipcSizes {
		step := int64(2 + 2*i)
		if err := ipcXfer(ctx, g, rep, step, 0, n); err != nil {
			return err
		}
		if err := ipcXfer(ctx, g, rep, step+1, 1, n); err != nil {
			return err
		}
	}
	rep.IPC = g.Stats().IPC
	return nil
}

// ipcKillJob: rank 1 sends GPU tensors that rank 0 pulls (its mappings of
// rank 1's arenas stay open), then rank 1 dies (exits without closing).
// Rank 0's next Recv fails naming the lost peer, and its mappings of the
// dead process's arenas are closed. (The dead rank is the higher one: the
// lower rank makes the pair's connections, so it learns at once that the
// peer's ports are closed; the higher rank would wait for a reconnection
// until its Recv's deadline.)
func ipcKillJob(ctx context.Context, g *Group, rep *childReport) error {
	for step := int64(0); step < 2; step++ {
		if err := ipcXfer(ctx, g, rep, step, 1, 1<<20); err != nil {
			return err
		}
	}
	if err := waitPairOK(g); err != nil {
		return err
	}
	if err := g.Barrier(ctx); err != nil {
		return err
	}
	for step := int64(2); step < 5; step++ {
		if err := ipcXfer(ctx, g, rep, step, 1, 1<<20); err != nil {
			return err
		}
	}
	if err := g.Barrier(ctx); err != nil {
		return err
	}
	rep.IPC = g.Stats().IPC
	if g.Rank() == 1 {
		return errExitNow
	}
	start := time.Now()
	rctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	_, _, err := g.RecvOn(rctx, tensor.GPUDevice(0), 1, "ipc", 99)
	if !errors.Is(err, verbsio.ErrPeerLost) {
		return fmt.Errorf("Recv from the dead rank = %v, want ErrPeerLost", err)
	}
	rep.Failure = err.Error()
	rep.FailMS = float64(time.Since(start).Microseconds()) / 1000
	// The survivor closes its mappings of the dead peer's arenas.
	deadline := time.Now().Add(10 * time.Second)
	for g.Stats().IPC.Open != 0 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	rep.IPC = g.Stats().IPC
	return errExitNow
}

// checkIPCReports checks the ipc job's reports: every tensor after the
// setup pulled, each peer arena opened once and hit after, no pull
// failed, the pair OK on both sides.
func checkIPCReports(t *testing.T, reps []childReport) {
	t.Helper()
	for _, rep := range reps {
		i := strings.Index(strings.Join(rep.Paths, " "), "ok")
		if i < 0 {
			t.Fatalf("rank %d: no setup mark in %v", rep.Rank, rep.Paths)
		}
		after := strings.Fields(strings.Join(rep.Paths, " ")[i+2:])
		if len(after) != len(ipcSizes) {
			t.Errorf("rank %d received %d tensors after the setup, want %d: %v", rep.Rank, len(after), len(ipcSizes), rep.Paths)
		}
		for _, p := range after {
			if !strings.HasSuffix(p, ":cuda-ipc") {
				t.Errorf("rank %d: %s after the pair was OK, want cuda-ipc (all: %v)", rep.Rank, p, rep.Paths)
			}
		}
		st := rep.IPC
		if st.PullsFailed != 0 || st.Pulls < uint64(len(ipcSizes)) || st.Pairs["OK"] != 1 {
			t.Errorf("rank %d: %d pulls, %d failed, pairs %v; want at least %d, none failed, one OK", rep.Rank, st.Pulls, st.PullsFailed, st.Pairs, len(ipcSizes))
		}
		// The GPU pool's arenas hold every tensor: each opened once, the
		// rest of the pulls hit.
		if st.Opens < 1 || st.Opens > 4 || st.Hits+st.Opens < st.Pulls || st.Misses != st.Opens {
			t.Errorf("rank %d: cache %d opens, %d hits, %d misses for %d pulls", rep.Rank, st.Opens, st.Hits, st.Misses, st.Pulls)
		}
		t.Logf("rank %d: paths %v; cache opens %d hits %d; pulls %d", rep.Rank, rep.Paths, st.Opens, st.Hits, st.Pulls)
	}
}

// TestIPCTwoProcesses runs the ipc job between two processes with
// simulated GPUs that share memory by descriptor (named as such: no GPU
// here), over each provider (the pull does not use it; the setup and the
// pull's request and confirmation do).
func TestIPCTwoProcesses(t *testing.T) {
	for _, prov := range []string{"onnode", "tcp"} {
		t.Run(prov, func(t *testing.T) {
			j := startJob(t, "ipc", 2, "127.0.0.1", func(int) []string { return nil }, func(int) []string {
				return []string{"GDRLINK_TEST_SIMGPU=1", "GDRLINK_PROVIDER=" + prov}
			})
			checkIPCReports(t, j.wait(2*time.Minute))
		})
	}
}

// TestIPCRealGPU is TestIPCTwoProcesses on a real GPU: two processes on
// GPU 0, exporting their arenas as CUDA VMM descriptors (the default where
// the GPU can) and as legacy CUDA IPC handles, pulled with
// cuMemcpyDtoDAsync.
func TestIPCRealGPU(t *testing.T) {
	requireCUDA(t)
	for _, mode := range []string{"vmm", "legacy"} {
		t.Run(mode, func(t *testing.T) {
			j := startJob(t, "ipc", 2, "127.0.0.1", func(int) []string { return nil }, func(int) []string {
				return []string{"GDRLINK_TEST_REALGPU=1", "GDRLINK_CUDA_IPC=" + mode}
			})
			reps := j.wait(2 * time.Minute)
			checkIPCReports(t, reps)
			for _, r := range reps {
				if r.IPC.Export != mode {
					t.Errorf("rank %d exports %q, want %q", r.Rank, r.IPC.Export, mode)
				}
			}
		})
	}
}

// TestIPCPeerDeath: the exporter dies with the receiver's mappings of its
// arenas open; the receiver's Recv fails naming the lost peer and its
// mappings are closed (none left open).
func TestIPCPeerDeath(t *testing.T) {
	env := []string{"GDRLINK_TEST_SIMGPU=1"}
	if os.Getenv("GDRLINK_TEST_REALGPU") == "1" {
		env = []string{"GDRLINK_TEST_REALGPU=1"}
	}
	j := startJob(t, "ipc-kill", 2, "127.0.0.1", func(int) []string { return nil }, func(int) []string { return env })
	reps := j.wait(2 * time.Minute)
	exp, imp := reps[1].IPC, reps[0].IPC
	if imp.Opens < 1 || imp.Pulls < 3 {
		t.Fatalf("the receiver opened %d arenas and pulled %d tensors before the death, want at least 1 and 3", imp.Opens, imp.Pulls)
	}
	if imp.Open != 0 || imp.Closes != imp.Opens {
		t.Errorf("after the exporter died: %d mappings open, %d closed of %d opened; want all closed", imp.Open, imp.Closes, imp.Opens)
	}
	t.Logf("exporter: %+v; receiver: %+v; the Recv failed after %.1f ms: %s", exp, imp, reps[0].FailMS, reps[0].Failure)
}

// requireCUDA skips without a CUDA driver and GPU (failing instead where
// GDRLINK_REQUIRE_GPU=1 says there must be one).
func requireCUDA(t *testing.T) {
	t.Helper()
	d, err := proxy.NewCUDADevice(0)
	cudatest.SkipIfNoDriver(t, err)
	_ = d.Close()
}

// ipcNotReadyJob: rank 0 has a (simulated) GPU, rank 1 none. Each of rank
// 0's GPU Sends asks rank 1 to set the path up; rank 1 answers "not
// ready", and after ipc.MaxTries of those the pair is BAD on rank 0. Every
// tensor arrives through host memory.
func ipcNotReadyJob(ctx context.Context, g *Group, rep *childReport) error {
	const sends = 5
	for step := int64(0); step < sends; step++ {
		want := make([]byte, 4096)
		fill(want, int(step))
		if g.Rank() == 1 {
			t, tr, err := g.Recv(ctx, 0, "nr", step)
			if err != nil {
				return err
			}
			got, err := t.Bytes()
			if err != nil || !bytes.Equal(got, want) {
				return fmt.Errorf("step %d: bytes differ (%v)", step, err)
			}
			rep.Paths = append(rep.Paths, tr.Path.String())
			if err := t.Release(); err != nil {
				return err
			}
			continue
		}
		t, err := g.NewTensorOn(tensor.GPUDevice(0), tensor.Uint8, 4096)
		if err != nil {
			return err
		}
		if err := deviceWrite(g, t, want); err != nil {
			return err
		}
		if err := g.Send(1, "nr", step, t); err != nil {
			return err
		}
		// One try at a time: wait for this Send's request to be answered.
		deadline := time.Now().Add(20 * time.Second)
		for g.Stats().IPC.Pairs["SENT"] != 0 && time.Now().Before(deadline) {
			time.Sleep(time.Millisecond)
		}
	}
	rep.IPC = g.Stats().IPC
	return nil
}

// TestIPCNotReady: a peer whose GPU is not up answers "not ready" to each
// try; after ipc.MaxTries the pair is BAD and stays so, and the tensors go
// through host memory.
func TestIPCNotReady(t *testing.T) {
	j := startJob(t, "ipc-notready", 2, "127.0.0.1", func(int) []string { return nil }, func(r int) []string {
		if r == 0 {
			return []string{"GDRLINK_TEST_SIMGPU=1"}
		}
		return nil
	})
	reps := j.wait(2 * time.Minute)
	if got := reps[0].IPC.Pairs; got["BAD"] != 1 || len(got) != 1 {
		t.Errorf("rank 0's pair after %d not-ready answers: %v, want BAD", 5, got)
	}
	for _, p := range reps[1].Paths {
		if p == "cuda-ipc" {
			t.Errorf("a tensor was pulled by a rank without a GPU: %v", reps[1].Paths)
		}
	}
	if len(reps[1].Paths) != 5 {
		t.Errorf("rank 1 received %v, want 5 tensors", reps[1].Paths)
	}
}

// FuzzIPCReply: a peer's reply to an on-node path message, hostile or
// truncated, decodes to messages or to an error wrapping
// ipc.ErrBadMessage, and never panics.
func FuzzIPCReply(f *testing.F) {
	var two []byte
	for _, m := range []ipc.Msg{{Kind: ipc.KindAck, From: 1, Reach: true, Device: "0000:06:00.0", Handle: []byte("@gdrlink-ipc-0")}, {Kind: ipc.KindNotReady, From: 1}} {
		e := m.Append(nil)
		two = append(binary.BigEndian.AppendUint16(two, uint16(len(e))), e...)
	}
	f.Add(two)
	f.Add([]byte{0, 40, 1})
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		ms, err := decodeIPCMsgs(b)
		if err != nil {
			if !errors.Is(err, ipc.ErrBadMessage) {
				t.Fatalf("%v does not wrap ipc.ErrBadMessage", err)
			}
			return
		}
		var again []byte
		for _, m := range ms {
			e := m.Append(nil)
			again = append(binary.BigEndian.AppendUint16(again, uint16(len(e))), e...)
		}
		if !bytes.Equal(again, b) {
			t.Fatalf("re-encoding differs:\n%x\n%x", b, again)
		}
	})
}

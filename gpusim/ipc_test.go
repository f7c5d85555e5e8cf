package gpusim

import (
	"bytes"
	"context"
	"errors"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/gdrlink/gdrlink/proxy"
)

// TestSimulatedIPC exports an allocation of one shareable device, opens it
// in a second device (as a peer process would), copies device to device
// from the opened handle, and checks the bytes, the counters and the
// failures.
func TestSimulatedIPC(t *testing.T) {
	a := New(Config{Name: "a", Shareable: true}).(simulatedIPC)
	b := New(Config{Name: "b", Shareable: true})
	defer a.(Device).Close()
	defer b.Close()
	const n = 1 << 16
	src, err := a.(Device).Alloc(n)
	if err != nil {
		t.Fatal(err)
	}
	mem, _ := a.(Device).Peek(src, n)
	for i := range mem {
		mem[i] = byte(i * 5)
	}
	fd, size, err := a.ExportSimulatedHandle(src)
	if err != nil || size != n {
		t.Fatalf("export: %d bytes, %v", size, err)
	}
	bi := b.(simulatedIPC)
	peer, err := bi.OpenSimulatedHandle(fd, size)
	unix.Close(fd)
	if err != nil {
		t.Fatal(err)
	}
	dst, err := b.Alloc(n)
	if err != nil {
		t.Fatal(err)
	}
	st, err := b.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	if err := bi.CopyDtoDAsync(dst+16, peer+16, n-16, st); err != nil {
		t.Fatal(err)
	}
	ev, err := b.RecordEvent(st)
	if err != nil {
		t.Fatal(err)
	}
	if err := ev.Wait(context.Background()); err != nil {
		t.Fatal(err)
	}
	got, _ := b.Peek(dst, n)
	if !bytes.Equal(got[16:], mem[16:]) || got[0] != 0 {
		t.Fatal("DtoD copy through the opened handle differs")
	}
	if s := b.Stats(); s.BytesDtoD != n-16 || s.DeviceMemory != n || s.LiveAllocs != 2 {
		t.Errorf("stats %+v", s)
	}
	if err := bi.CopyDtoDAsync(dst, peer+1, n, st); !errors.Is(err, proxy.ErrOutOfRange) {
		t.Errorf("copy past the opened handle: %v", err)
	}
	if _, _, err := a.ExportSimulatedHandle(src + 1); !errors.Is(err, proxy.ErrWrongMemory) {
		t.Errorf("export of an inner pointer: %v", err)
	}
	if _, _, err := bi.ExportSimulatedHandle(peer); !errors.Is(err, proxy.ErrWrongMemory) {
		t.Errorf("re-export of an opened handle: %v", err)
	}
	plain := New(Config{})
	defer plain.Close()
	p, _ := plain.Alloc(64)
	if _, _, err := plain.(simulatedIPC).ExportSimulatedHandle(p); !errors.Is(err, proxy.ErrWrongMemory) {
		t.Errorf("export on a device that is not shareable: %v", err)
	}
	unsealed, _ := unix.MemfdCreate("x", unix.MFD_CLOEXEC)
	unix.Ftruncate(unsealed, 64)
	if _, err := bi.OpenSimulatedHandle(unsealed, 64); !errors.Is(err, proxy.ErrWrongMemory) {
		t.Errorf("open of an unsealed memfd: %v", err)
	}
	unix.Close(unsealed)
	if err := b.Free(peer); err != nil {
		t.Fatal(err)
	}
	if s := b.Stats(); s.DeviceMemory != n || s.LiveAllocs != 1 {
		t.Errorf("after closing the handle: %+v", s)
	}
	b.Lose()
	if _, err := bi.OpenSimulatedHandle(0, 64); !errors.Is(err, proxy.ErrDeviceLost) {
		t.Errorf("open on a lost device: %v", err)
	}
	st.Close()
}

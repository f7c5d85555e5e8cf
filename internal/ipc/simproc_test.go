package ipc

import (
	"context"
	"errors"
	"fmt"
	"os"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gdrlink/gdrlink/gpusim"
	"github.com/gdrlink/gdrlink/proxy"
)

// simIPC is what gpusim's devices offer in place of CUDA IPC.
type simIPC interface {
	ExportSimulatedHandle(p proxy.DevicePtr) (fd int, size int, err error)
	OpenSimulatedHandle(fd int, size int) (proxy.DevicePtr, error)
	CopyDtoDAsync(dst, src proxy.DevicePtr, n int, st proxy.Stream) error
}

// simDev opens exported arenas on a simulated GPU.
type simDev struct{ gpusim.Device }

func (d simDev) OpenHandle(h Msg, fd int) (proxy.DevicePtr, error) {
	return d.Device.(simIPC).OpenSimulatedHandle(fd, int(h.Size))
}

func (d simDev) CloseHandle(p proxy.DevicePtr) error { return d.Free(p) }

func (d simDev) CopyDtoDAsync(dst, src proxy.DevicePtr, n int, st proxy.Stream) error {
	return d.Device.(simIPC).CopyDtoDAsync(dst, src, n, st)
}

// runSimSender is runSender on a shareable simulated GPU: two device
// arenas (1 MiB for the small tensors, 4 MiB for the large one), each
// exported once as a simulated handle.
func runSimSender(mode string) error {
	c, err := sockConn(os.NewFile(3, "ipc"))
	if err != nil {
		return err
	}
	dev := gpusim.New(gpusim.Config{Name: "ipc-peer", Shareable: true})
	sim := dev.(simIPC)
	arenas := [2]struct {
		p    proxy.DevicePtr
		size int
		next int
	}{{size: 1 << 20}, {size: 4 << 20}}
	for i := range arenas {
		if arenas[i].p, err = dev.Alloc(arenas[i].size); err != nil {
			return err
		}
	}
	setup := NewSetup(1, 0, "host", hostLocal{})
	exported := map[uint64]bool{}
	for i, n := range peerSizes {
		for _, m := range setup.Start() {
			if err := c.Send(m, -1); err != nil {
				return err
			}
		}
		for setup.State() != OK && setup.State() != Bad {
			m, fd, err := c.Recv()
			closeFD(fd)
			if err != nil {
				return err
			}
			out, err := setup.Receive(m)
			if err != nil {
				return err
			}
			for _, o := range out {
				if err := c.Send(o, -1); err != nil {
					return err
				}
			}
		}
		if setup.State() != OK {
			return fmt.Errorf("setup ended %s", setup.State())
		}
		ai := 0
		if n > 512<<10 {
			ai = 1
		}
		a := &arenas[ai]
		if a.next+n > a.size {
			a.next = 0
		}
		off := a.next
		a.next += (n + 255) &^ 255
		src, err := dev.Peek(a.p+proxy.DevicePtr(off), n)
		if err != nil {
			return err
		}
		pattern(src, i)
		if !exported[uint64(ai)] {
			fd, size, err := sim.ExportSimulatedHandle(a.p)
			if err != nil {
				return err
			}
			err = c.Send(Msg{Kind: KindExport, From: 1, Arena: uint64(ai), Size: uint64(size), Device: "host"}, fd)
			unix.Close(fd)
			if err != nil {
				return err
			}
			exported[uint64(ai)] = true
		}
		pm := Msg{Kind: KindPull, From: 1, Arena: uint64(ai), Offset: uint64(off), Size: uint64(n)}
		if err := c.Send(pm, -1); err != nil {
			return err
		}
		m, fd, err := c.Recv()
		closeFD(fd)
		if err != nil {
			return err
		}
		if m.Kind != KindDone || m.Offset != pm.Offset || m.Arena != pm.Arena {
			return fmt.Errorf("want DONE of %+v, got %+v", pm, m)
		}
	}
	if mode == "die" {
		os.Exit(0)
	}
	for a := range exported {
		if err := c.Send(Msg{Kind: KindRelease, From: 1, Arena: a}, -1); err != nil {
			return err
		}
	}
	c.Close()
	return dev.Close()
}

// TestTwoProcGpusim runs the path between two processes on simulated
// GPUs: the receiver opens each exported device arena once and pulls each
// tensor with one device-to-device copy into its own device memory.
func TestTwoProcGpusim(t *testing.T) {
	twoProc(t, "sim-", func(t *testing.T) (*Cache, func(Mapping, Msg) ([]byte, error)) {
		dev := gpusim.New(gpusim.Config{Name: "ipc-recv"})
		st, err := dev.NewStream()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			st.Close()
			if s := dev.Stats(); s.LiveAllocs != 0 {
				t.Errorf("device allocations left: %+v", s)
			}
			dev.Close()
		})
		sd := simDev{dev}
		pull := func(mp Mapping, m Msg) ([]byte, error) {
			dst, err := dev.Alloc(int(m.Size))
			if err != nil {
				return nil, err
			}
			defer dev.Free(dst)
			ev, err := PullDevice(sd, st, dst, mp, m)
			if err != nil {
				return nil, err
			}
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			if err := ev.Wait(ctx); err != nil {
				return nil, err
			}
			got, err := dev.Peek(dst, int(m.Size))
			return append([]byte(nil), got...), err
		}
		return NewCache(DeviceOpener{sd}), pull
	})
}

// TestPullDeviceRejects: a pull outside the opened arena, or through a
// host mapping, fails with ErrNotMapped and queues nothing.
func TestPullDeviceRejects(t *testing.T) {
	dev := gpusim.New(gpusim.Config{})
	defer dev.Close()
	st, _ := dev.NewStream()
	defer st.Close()
	mp := &DeviceMapping{Ptr: 0x1000, Size: 4096, dev: simDev{dev}}
	for _, m := range []Msg{{Offset: 4000, Size: 97}, {Offset: 1 << 40, Size: 1}, {Size: 0}} {
		if _, err := PullDevice(simDev{dev}, st, 0, mp, m); !errors.Is(err, ErrNotMapped) {
			t.Errorf("%+v: %v", m, err)
		}
	}
	if _, err := PullDevice(simDev{dev}, st, 0, &HostMapping{}, Msg{Size: 1}); !errors.Is(err, ErrNotMapped) {
		t.Errorf("host mapping: %v", err)
	}
	if s := dev.Stats(); s.Copies != 0 {
		t.Errorf("copies queued: %+v", s)
	}
}

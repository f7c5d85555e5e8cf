package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/alloc/visitor"
	"github.com/gdrlink/gdrlink/gpusim"
	"github.com/gdrlink/gdrlink/internal/cuda"
	"github.com/gdrlink/gdrlink/internal/ipc"
	"github.com/gdrlink/gdrlink/proxy"
)

// The ipc scenario measures the on-node pull of internal/ipc: a second
// process of this binary opens the exporter's arena through the handle cache
// (once per arena), and pulls each tensor with one copy completed by an
// event. In the same process and the same run it measures, alternating with
// the pull, a copy inside its own memory (the in-process baseline) and
// staging through a host buffer (two copies). All figures are GB/s, higher
// is better; ratio is pull/baseline.
//
// Modes (-set ipc.mode=cpu,sim): "cpu" is the memfd CPU analog (the arena is
// a sealed memfd passed by SCM_RIGHTS, the pull a memmove); "sim" is the
// simulated GPU (gpusim's shareable device, its simulated IPC handle and
// device-to-device copy). Every row's note names its mode; neither is a
// GPU measurement. The real-GPU pull (cuIpcOpenMemHandle and
// cuMemcpyDtoDAsync through internal/cuda) is not measured by this
// scenario yet.
func init() {
	register(Scenario{
		Name: "ipc",
		Doc:  "on-node IPC pull by a second process (handle cache, one copy, event) vs an in-process copy and vs staging through host memory, 4 KiB..256 MiB (GB/s); memfd CPU analog and simulated GPU",
		Run:  runIPC,
		Plots: []Plot{{
			File:       "ipc-pull-bandwidth.svg",
			Title:      "IPC pull by a second process (baseline: in-process copy)",
			Unit:       "GB/s",
			CasePrefix: "pull-vs-inprocess/",
		}},
		// The bench binary re-executes itself as the pulling process.
		Child: &Child{Env: ipcPeerEnv, Run: func(mode string) int {
			if err := runIPCPeer(mode); err != nil {
				fmt.Fprintln(os.Stderr, "ipc peer:", err)
				return 1
			}
			return 0
		}},
	})
}

const (
	ipcPeerEnv = "GDRLINK_BENCH_IPC_PEER" // mode of the pulling process
	ipcRepsEnv = "GDRLINK_BENCH_IPC_REPS"
	setIPCMode = "ipc.mode" // "auto" (default), or a list of "cuda", "cpu", "sim"
)

// ipcNotes says, per mode, what a row measured.
var ipcNotes = map[string]string{
	"cuda": "REAL GPU: legacy CUDA IPC handle (cuIpcOpenMemHandle), cuMemcpyDtoDAsync and an event; staging through cuMemHostAlloc pinned memory",
	"cpu":  "CPU ANALOG: memfd arena passed by SCM_RIGHTS, pull is a memmove; not a GPU figure",
	"sim":  "SIMULATED GPU (gpusim): simulated IPC handle and device-to-device copy in host memory; not a GPU figure",
}

func runIPC(ctx context.Context, env *Env) error {
	spec := env.Args[setIPCMode]
	if spec == "" || spec == "auto" {
		// A real GPU when there is one, always the analogs beside it.
		spec = "cpu,sim"
		cd, err := proxy.NewCUDADevice(0)
		switch {
		case err == nil:
			cd.Close()
			spec = "cuda,cpu,sim"
		case !errors.Is(err, cuda.ErrNoDriver):
			return err
		default:
			env.Log.Info("no CUDA driver: measuring the CPU analog and the simulated GPU only", "err", err)
		}
	}
	var modes []string
	for _, m := range strings.Split(spec, ",") {
		m = strings.TrimSpace(m)
		if _, ok := ipcNotes[m]; !ok {
			return fmt.Errorf("-set %s=%s: want a comma-separated list of cuda, cpu, sim (or auto)", setIPCMode, spec)
		}
		modes = append(modes, m)
	}
	sizes := env.sizes(4<<10, 256<<20)
	reps := max(env.Reps, 3)
	for _, mode := range modes {
		rows, err := runIPCPair(ctx, mode, sizes, reps)
		if err != nil {
			return fmt.Errorf("mode %s: %w", mode, err)
		}
		for _, r := range rows {
			note := fmt.Sprintf("%s; pull by a second process, median of %d alternating runs", ipcNotes[mode], reps)
			if mode != "cpu" {
				note += "; each run queues up to 64 transfers (about 64 MiB), an event each, and waits for the last"
			}
			for _, c := range []struct {
				name string
				base time.Duration
				bn   string
			}{{"pull-vs-inprocess", r.inproc, "inprocess-copy"}, {"pull-vs-staged", r.staged, "staged-host"}} {
				res := newResult("ipc", c.name+"/"+mode, r.size, rateGBs(r.size, r.pull), "GB/s", rateGBs(r.size, c.base), c.bn)
				res.Note = note
				env.Emit(res)
			}
		}
	}
	return nil
}

// ipcRow is one size's median times in the pulling process.
type ipcRow struct {
	size                 int64
	pull, inproc, staged time.Duration
}

// runIPCPair starts the pulling process and, per size, exports an arena
// holding a tensor of that size and offers it for pulling; the peer answers
// DONE after its timed pulls and prints its row.
func runIPCPair(ctx context.Context, mode string, sizes []int64, reps int) ([]ipcRow, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	mine, theirs := os.NewFile(uintptr(fds[0]), "ipc"), os.NewFile(uintptr(fds[1]), "ipc-peer")
	defer theirs.Close()
	fc, err := net.FileConn(mine)
	mine.Close()
	if err != nil {
		return nil, err
	}
	conn := ipc.NewConn(fc.(*net.UnixConn))
	defer conn.Close()

	var out, errb bytes.Buffer
	c := exec.CommandContext(ctx, self, "-test.run=^$")
	c.Env = append(os.Environ(), ipcPeerEnv+"="+mode, ipcRepsEnv+"="+strconv.Itoa(reps))
	c.ExtraFiles = []*os.File{theirs}
	c.Stdout, c.Stderr = &out, &errb
	c.WaitDelay = 5 * time.Second
	if err := c.Start(); err != nil {
		return nil, err
	}
	theirs.Close()
	offerErr := ipcOffer(conn, mode, sizes)
	conn.Close()
	waitErr := c.Wait()
	if offerErr != nil || waitErr != nil {
		return nil, errors.Join(offerErr, waitErr, errors.New(strings.TrimSpace(errb.String())))
	}
	for _, l := range strings.Split(errb.String(), "\n") {
		if strings.HasPrefix(l, "ipc-diag ") {
			fmt.Fprintln(os.Stderr, l) // GDRLINK_BENCH_IPC_DIAG=1
		}
	}
	var rows []ipcRow
	opens, closes, open := -1, -1, -1
	sc := bufio.NewScanner(&out)
	for sc.Scan() {
		if _, err := fmt.Sscanf(sc.Text(), "cache %d %d %d", &opens, &closes, &open); err == nil {
			continue
		}
		var r ipcRow
		var p, i, s int64
		if _, err := fmt.Sscanf(sc.Text(), "row %d %d %d %d", &r.size, &p, &i, &s); err != nil {
			continue
		}
		r.pull, r.inproc, r.staged = time.Duration(p), time.Duration(i), time.Duration(s)
		rows = append(rows, r)
	}
	// Each arena opened once through the cache, and closed on release.
	if opens != len(sizes) || closes != opens || open != 0 {
		return nil, fmt.Errorf("peer's handle cache: %d opens, %d closes, %d open for %d arenas", opens, closes, open, len(sizes))
	}
	if len(rows) != len(sizes) {
		return nil, fmt.Errorf("peer printed %d rows for %d sizes: %s", len(rows), len(sizes), strings.TrimSpace(errb.String()))
	}
	return rows, nil
}

// ipcOffer is the exporting side: per size, one arena exported once and a
// tensor filled with a pattern offered with PULL; it keeps the source until
// the peer answers DONE, then releases the arena.
func ipcOffer(conn *ipc.Conn, mode string, sizes []int64) error {
	var dev gpusim.Device
	var cd proxy.Device
	var cctx *cuda.Context
	switch mode {
	case "sim":
		dev = gpusim.New(gpusim.Config{Name: "ipc-exporter", Shareable: true})
		defer dev.Close()
	case "cuda":
		var err error
		if cd, err = proxy.NewCUDADevice(0); err != nil {
			return err
		}
		defer cd.Close()
		drv, ctx, err := retainPrimary(0)
		if err != nil {
			return err
		}
		defer drv.Close()
		defer ctx.Close()
		cctx = ctx
	}
	for i, n := range sizes {
		arena := uint64(i + 1)
		var exp ipc.Msg
		fd := -1
		var release func()
		switch mode {
		case "cpu":
			pool, err := alloc.New(alloc.NewMemfdSource("ipc-bench", alloc.MmapOptions{}),
				alloc.WithVisitors(visitor.NewIPCExport()), alloc.WithInitialArena(int(n)+(1<<20)))
			if err != nil {
				return err
			}
			blk, err := pool.Alloc(int(n))
			if err != nil {
				pool.Close()
				return err
			}
			fillPattern(blk.Bytes()[:n], byte(i))
			a, _ := pool.ArenaOf(blk.Addr())
			m, afd, ok := ipc.ExportOf(0, a)
			if !ok {
				pool.Close()
				return errors.New("memfd arena has no export")
			}
			m.Arena = arena
			exp, fd = m, afd
			off := uint64(blk.Addr() - a.Base())
			if err := ipcSendPair(conn, exp, fd, off, uint64(n)); err != nil {
				pool.Close()
				return err
			}
			release = func() { blk.Free(); pool.Close() }
		case "sim":
			p, err := dev.Alloc(int(n))
			if err != nil {
				return err
			}
			src := make([]byte, n)
			fillPattern(src, byte(i))
			if err := upload(dev, p, src); err != nil {
				dev.Free(p)
				return err
			}
			sfd, size, err := dev.(simIPC).ExportSimulatedHandle(p)
			if err != nil {
				dev.Free(p)
				return err
			}
			exp = ipc.Msg{Kind: ipc.KindExport, Arena: arena, Size: uint64(size), Device: "gpusim"}
			err = ipcSendPair(conn, exp, sfd, 0, uint64(n))
			unix.Close(sfd)
			if err != nil {
				dev.Free(p)
				return err
			}
			release = func() { dev.Free(p) }
		case "cuda":
			p, err := cd.Alloc(int(n))
			if err != nil {
				return err
			}
			src := make([]byte, n)
			fillPattern(src, byte(i))
			if err := upload(cd, p, src); err != nil {
				cd.Free(p)
				return err
			}
			h, err := cctx.IPCHandle(uintptr(p))
			if err != nil {
				cd.Free(p)
				return err
			}
			exp = ipc.Msg{Kind: ipc.KindExport, Arena: arena, Size: uint64(n), Device: "cuda:0", Handle: h.Reserved[:]}
			if err := ipcSendPair(conn, exp, -1, 0, uint64(n)); err != nil {
				cd.Free(p)
				return err
			}
			release = func() { cd.Free(p) }
		}
		// DONE after the pulls; then RELEASE, answered by DONE once the
		// peer closed its mapping: only then is the memory freed.
		err := ipcAwaitDone(conn, arena)
		if err == nil {
			err = conn.Send(ipc.Msg{Kind: ipc.KindRelease, Arena: arena}, -1)
		}
		if err == nil {
			err = ipcAwaitDone(conn, arena)
		}
		release()
		if err != nil {
			return err
		}
	}
	return nil
}

func ipcAwaitDone(conn *ipc.Conn, arena uint64) error {
	m, fd, err := conn.Recv()
	closeFDIf(fd)
	if err != nil {
		return err
	}
	if m.Kind != ipc.KindDone || m.Arena != arena {
		return fmt.Errorf("peer answered %s for arena %d, want DONE for %d", m.Kind, m.Arena, arena)
	}
	return nil
}

func ipcSendPair(conn *ipc.Conn, exp ipc.Msg, fd int, off, n uint64) error {
	if err := conn.Send(exp, fd); err != nil {
		return err
	}
	return conn.Send(ipc.Msg{Kind: ipc.KindPull, Arena: exp.Arena, Offset: off, Size: n}, -1)
}

// fillPattern writes a pattern the peer checks after its first pull.
func fillPattern(b []byte, seed byte) {
	for i := range b {
		b[i] = byte(i*7) + seed
	}
}

func checkPattern(b []byte, seed byte) error {
	for i := range b {
		if b[i] != byte(i*7)+seed {
			return fmt.Errorf("byte %d is %#x, want %#x", i, b[i], byte(i*7)+seed)
		}
	}
	return nil
}

// simIPC is what gpusim's shareable devices offer in place of CUDA IPC.
type simIPC interface {
	ExportSimulatedHandle(p proxy.DevicePtr) (fd int, size int, err error)
	OpenSimulatedHandle(fd int, size int) (proxy.DevicePtr, error)
	CopyDtoDAsync(dst, src proxy.DevicePtr, n int, st proxy.Stream) error
}

// simOpener opens simulated handles on a simulated GPU for ipc.DeviceOpener.
type simOpener struct{ gpusim.Device }

func (d simOpener) OpenHandle(h ipc.Msg, fd int) (proxy.DevicePtr, error) {
	return d.Device.(simIPC).OpenSimulatedHandle(fd, int(h.Size))
}

func (d simOpener) CloseHandle(p proxy.DevicePtr) error { return d.Free(p) }

func (d simOpener) CopyDtoDAsync(dst, src proxy.DevicePtr, n int, st proxy.Stream) error {
	return d.Device.(simIPC).CopyDtoDAsync(dst, src, n, st)
}

func upload(dev proxy.Device, p proxy.DevicePtr, src []byte) error {
	st, err := dev.NewStream()
	if err != nil {
		return err
	}
	defer st.Close()
	if err := dev.CopyHtoDAsync(p, sliceAddr(src), len(src), st); err != nil {
		return err
	}
	return st.Synchronize()
}

func waitEvent(ev proxy.Event) error {
	defer ev.Close()
	return ev.Wait(context.Background())
}

// runIPCPeer is the pulling process: it opens each offered arena through
// the handle cache, checks the first pull's bytes, then times reps rounds
// of pull, in-process copy and staged copy, alternating, prints the medians
// as a row, and answers DONE.
func runIPCPeer(mode string) error {
	reps, err := strconv.Atoi(os.Getenv(ipcRepsEnv))
	if err != nil || reps < 1 {
		return fmt.Errorf("%s=%q", ipcRepsEnv, os.Getenv(ipcRepsEnv))
	}
	f := os.NewFile(3, "ipc")
	fc, err := net.FileConn(f)
	f.Close()
	if err != nil {
		return err
	}
	conn := ipc.NewConn(fc.(*net.UnixConn))
	defer conn.Close()
	var dev proxy.Device
	var cp ipc.Copier
	var opener ipc.Opener = ipc.MemfdOpener{}
	stageAlloc := func(n int) ([]byte, func(), error) { return make([]byte, n), func() {}, nil }
	switch mode {
	case "sim":
		sd := gpusim.New(gpusim.Config{Name: "ipc-puller", Shareable: true})
		defer sd.Close()
		dev, cp = sd, simOpener{sd}
		opener = ipc.DeviceOpener{Dev: simOpener{sd}}
	case "cuda":
		cd, err := proxy.NewCUDADevice(0)
		if err != nil {
			return err
		}
		defer cd.Close()
		drv, ctx, err := retainPrimary(0)
		if err != nil {
			return err
		}
		defer drv.Close()
		defer ctx.Close()
		c := ipc.CUDA{Dev: cd}
		dev, cp, opener = cd, c, ipc.DeviceOpener{Dev: c}
		stageAlloc = func(n int) ([]byte, func(), error) {
			hm, err := ctx.MemHostAlloc(n, 0)
			if err != nil {
				return nil, nil, err
			}
			return hm.Bytes(), func() { hm.Close() }, nil
		}
	}
	cache := ipc.NewCache(opener)
	defer cache.Close()
	out := bufio.NewWriter(os.Stdout)
	defer out.Flush()
	seed := byte(0)
	var exp ipc.Msg
	for {
		m, fd, err := conn.Recv()
		if errors.Is(err, io.EOF) {
			st := cache.Stats()
			fmt.Fprintf(out, "cache %d %d %d\n", st.Opens, st.Closes, st.Open)
			return nil
		}
		if err != nil {
			return err
		}
		switch m.Kind {
		case ipc.KindExport:
			if _, err := cache.Add(0, m, fd); err != nil {
				return err
			}
			exp = m
			continue
		case ipc.KindRelease:
			closeFDIf(fd)
			if err := cache.Release(0, m.Arena); err != nil {
				return err
			}
			seed++
			if err := conn.Send(ipc.Msg{Kind: ipc.KindDone, Arena: m.Arena}, -1); err != nil {
				return err
			}
			continue
		case ipc.KindPull:
		default:
			closeFDIf(fd)
			return fmt.Errorf("unexpected %s", m.Kind)
		}
		closeFDIf(fd)
		mp, ok := cache.Lookup(0, m.Arena)
		if !ok || exp.Arena != m.Arena {
			return fmt.Errorf("pull of arena %d, which is not open", m.Arena)
		}
		var row ipcRow
		switch mode {
		case "cpu":
			row, err = timeHostPull(mp, m, reps, seed)
		case "sim", "cuda":
			row, err = timeDevicePull(dev, cp, stageAlloc, mp, m, reps, seed)
		}
		if err != nil {
			return err
		}
		fmt.Fprintf(out, "row %d %d %d %d\n", row.size, row.pull, row.inproc, row.staged)
		if err := conn.Send(ipc.Msg{Kind: ipc.KindDone, Arena: m.Arena}, -1); err != nil {
			return err
		}
	}
}

func closeFDIf(fd int) {
	if fd >= 0 {
		unix.Close(fd)
	}
}

// alternate runs each of fns reps times, in turns, after one untimed round,
// and returns each one's median time.
func alternate(reps int, fns ...func() error) ([]time.Duration, error) {
	ds := make([][]time.Duration, len(fns))
	for r := -1; r < reps; r++ {
		for i, fn := range fns {
			start := time.Now()
			if err := fn(); err != nil {
				return nil, err
			}
			if r >= 0 {
				ds[i] = append(ds[i], time.Since(start))
			}
		}
	}
	med := make([]time.Duration, len(fns))
	for i := range ds {
		med[i] = medianDuration(ds[i])
	}
	return med, nil
}

func timeHostPull(mp ipc.Mapping, m ipc.Msg, reps int, seed byte) (ipcRow, error) {
	n := int(m.Size)
	dst, src, stage := make([]byte, n), make([]byte, n), make([]byte, n)
	ev, err := ipc.Pull(dst, mp, m)
	if err != nil {
		return ipcRow{}, err
	}
	<-ev.Done()
	if err := checkPattern(dst, seed); err != nil {
		return ipcRow{}, fmt.Errorf("pulled tensor of %d bytes: %w", n, err)
	}
	copy(src, dst)
	shared, err := ipc.Slice(mp, m.Offset, m.Size)
	if err != nil {
		return ipcRow{}, err
	}
	med, err := alternate(reps,
		func() error {
			ev, err := ipc.Pull(dst, mp, m)
			if err != nil {
				return err
			}
			return ev.Wait(context.Background())
		},
		func() error { copy(dst, src); return nil },
		// Staging: the exporter copies into a host buffer, the receiver
		// copies out of it.
		func() error { copy(stage, shared); copy(dst, stage); return nil },
	)
	if err != nil {
		return ipcRow{}, err
	}
	return ipcRow{size: int64(n), pull: med[0], inproc: med[1], staged: med[2]}, nil
}

// timeDevicePull times, on a device, the pull from the opened arena, a
// device-to-device copy between two allocations of this process, and
// staging through pinned host memory from stageAlloc (device to host, host
// to device), each completed by an event.
func timeDevicePull(dev proxy.Device, cp ipc.Copier, stageAlloc func(int) ([]byte, func(), error), mp ipc.Mapping, m ipc.Msg, reps int, seed byte) (ipcRow, error) {
	n := int(m.Size)
	st, err := dev.NewStream()
	if err != nil {
		return ipcRow{}, err
	}
	defer st.Close()
	dst, err := dev.Alloc(n)
	if err != nil {
		return ipcRow{}, err
	}
	defer dev.Free(dst)
	local, err := dev.Alloc(n)
	if err != nil {
		return ipcRow{}, err
	}
	defer dev.Free(local)
	ev, err := ipc.PullDevice(cp, st, dst, mp, m)
	if err != nil {
		return ipcRow{}, err
	}
	if err := waitEvent(ev); err != nil {
		return ipcRow{}, err
	}
	stage, freeStage, err := stageAlloc(n)
	if err != nil {
		return ipcRow{}, err
	}
	defer freeStage()
	host := make([]byte, n)
	if err := dev.CopyDtoHAsync(sliceAddr(host), dst, n, st); err != nil {
		return ipcRow{}, err
	}
	if err := st.Synchronize(); err != nil {
		return ipcRow{}, err
	}
	if err := checkPattern(host, seed); err != nil {
		return ipcRow{}, fmt.Errorf("pulled tensor of %d bytes: %w", n, err)
	}
	if err := cp.CopyDtoDAsync(local, dst, n, st); err != nil {
		return ipcRow{}, err
	}
	opened := mp.(*ipc.DeviceMapping).Ptr + proxy.DevicePtr(m.Offset)
	// Each timed sample queues iters transfers on the stream, each with the
	// event that would complete it, and waits for the last, so a copy of a
	// few microseconds is not drowned by the wait; the figure is the time
	// of one transfer.
	iters := deviceIters(n)
	// The pull and the in-process copy alternate; staging, which is bound
	// by the host link, is timed on its own afterwards: a device-to-device
	// copy right after a host-bound phase ran up to a third slower on an
	// H200 (clocks ramping up again), whichever copy it was.
	med, err := alternate(reps,
		func() error {
			return queueEach(iters, func() (proxy.Event, error) { return ipc.PullDevice(cp, st, dst, mp, m) })
		},
		func() error {
			return queueEach(iters, func() (proxy.Event, error) {
				if err := cp.CopyDtoDAsync(dst, local, n, st); err != nil {
					return nil, err
				}
				return dev.RecordEvent(st)
			})
		},
	)
	if err != nil {
		return ipcRow{}, err
	}
	staged, err := alternate(reps,
		// Staging through host memory: device to host, host to device.
		func() error {
			return queueEach(iters, func() (proxy.Event, error) {
				if err := dev.CopyDtoHAsync(sliceAddr(stage), opened, n, st); err != nil {
					return nil, err
				}
				if err := dev.CopyHtoDAsync(dst, sliceAddr(stage), n, st); err != nil {
					return nil, err
				}
				return dev.RecordEvent(st)
			})
		},
	)
	if err != nil {
		return ipcRow{}, err
	}
	med = append(med, staged[0])
	if os.Getenv("GDRLINK_BENCH_IPC_DIAG") == "1" {
		if err := ipcDiag(dev, cp, st, dst, opened, n, iters, reps); err != nil {
			return ipcRow{}, err
		}
	}
	for i := range med {
		med[i] /= time.Duration(iters)
	}
	return ipcRow{size: int64(n), pull: med[0], inproc: med[1], staged: med[2]}, nil
}

// ipcDiag (GDRLINK_BENCH_IPC_DIAG=1) tells where a pull's time goes apart
// from the in-process copy, on stderr: the same copy from the opened arena
// without the pull's bookkeeping, and in-process copies from a ring of
// sources larger than the GPU's L2 cache (cold), against the warm one.
func ipcDiag(dev proxy.Device, cp ipc.Copier, st proxy.Stream, dst, opened proxy.DevicePtr, n, iters, reps int) error {
	ring := make([]proxy.DevicePtr, max(1, min(8, (256<<20)/n)))
	for i := range ring {
		p, err := dev.Alloc(n)
		if err != nil {
			return err
		}
		defer dev.Free(p)
		ring[i] = p
	}
	k := 0
	med, err := alternate(reps,
		func() error {
			return queueEach(iters, func() (proxy.Event, error) {
				if err := cp.CopyDtoDAsync(dst, opened, n, st); err != nil {
					return nil, err
				}
				return dev.RecordEvent(st)
			})
		},
		func() error {
			return queueEach(iters, func() (proxy.Event, error) {
				k++
				if err := cp.CopyDtoDAsync(dst, ring[k%len(ring)], n, st); err != nil {
					return nil, err
				}
				return dev.RecordEvent(st)
			})
		},
		func() error {
			return queueEach(iters, func() (proxy.Event, error) {
				if err := cp.CopyDtoDAsync(dst, ring[0], n, st); err != nil {
					return nil, err
				}
				return dev.RecordEvent(st)
			})
		},
	)
	if err != nil {
		return err
	}
	gb := func(d time.Duration) float64 { return float64(n) * float64(iters) / d.Seconds() / 1e9 }
	fmt.Fprintf(os.Stderr, "ipc-diag %d bytes: opened-copy %.1f GB/s, cold-inproc (ring of %d) %.1f GB/s, warm-inproc %.1f GB/s\n", n, gb(med[0]), len(ring), gb(med[1]), gb(med[2]))
	return nil
}

// queueEach calls queue iters times, each queueing a transfer and
// returning its event, and waits for the last event (a stream runs in
// order); the others are closed once the last is done.
func queueEach(iters int, queue func() (proxy.Event, error)) error {
	evs := make([]proxy.Event, 0, iters)
	defer func() {
		for _, ev := range evs {
			_ = ev.Close()
		}
	}()
	for range iters {
		ev, err := queue()
		if err != nil {
			return err
		}
		evs = append(evs, ev)
	}
	return evs[len(evs)-1].Wait(context.Background())
}

// deviceIters is how many copies of n bytes one timed sample of a device
// mode queues: enough for about 64 MiB, from 1 to 64.
func deviceIters(n int) int { return min(max((64<<20)/max(n, 1), 1), 64) }

// sliceAddr is the address of b's first byte; b must stay reachable (and
// not be moved) while a device copy uses it, which the callers ensure by
// waiting on the copy before returning.
func sliceAddr(b []byte) uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(b))) }

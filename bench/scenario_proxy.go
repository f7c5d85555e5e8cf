package main

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/dustin/go-humanize"
	"golang.org/x/sys/unix"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/gpusim"
	"github.com/gdrlink/gdrlink/internal/cuda"
	"github.com/gdrlink/gdrlink/proxy"
)

// The proxy scenario measures the CPU proxy path to a GPU: its host-to-device
// bandwidth against the raw asynchronous copy, and a pipelined receive (each
// chunk copied as it lands) against an unpipelined one (one copy after the
// whole tensor landed), both held against the longer of the network time and
// the copy time measured in the same run. On a machine without a GPU it runs
// on gpusim's simulated device and says so in every result's note.
func init() {
	register(Scenario{
		Name: "proxy",
		Doc:  "CPU proxy to GPU: proxy vs raw host-to-device bandwidth (GB/s), pipelined vs unpipelined receive of 64/256 MiB (ms); simulated GPU when none",
		Run:  runProxy,
		Plots: []Plot{{
			File:       "proxy-htod-bandwidth.svg",
			Title:      "proxy host-to-device bandwidth (baseline: raw async copy)",
			Unit:       "GB/s",
			CasePrefix: "htod-",
		}},
	})
}

// Settings of the proxy scenario (-set key=value).
const (
	setProxySimCopy = "proxy.sim-copy-bw" // simulated copy bandwidth, bytes/s (default 4e9)
	setProxySimNet  = "proxy.sim-net-bw"  // simulated network bandwidth, bytes/s (default 2e9)
	setProxyChunk   = "proxy.chunk"       // pipelining chunk (default 4MiB)
	setProxyDevice  = "proxy.device"      // "auto", "cuda" or "sim"
)

// proxyRig is a device, a pinned pool for proxy tensors, a proxy, and for
// the real device its driver context for the raw-copy baseline.
type proxyRig struct {
	dev   proxy.Device
	pool  *alloc.Pool
	px    *proxy.Proxy
	ctx   *cuda.Context // real device only
	note  string
	close func()
}

func floatSetting(env *Env, key string, def float64) (float64, error) {
	v, ok := env.Args[key]
	if !ok {
		return def, nil
	}
	f, err := strconv.ParseFloat(v, 64)
	if err != nil || f <= 0 {
		return 0, fmt.Errorf("-set %s=%s: want a positive number of bytes per second", key, v)
	}
	return f, nil
}

func newProxyRig(env *Env, chunk int) (*proxyRig, error) {
	which := env.Args[setProxyDevice]
	if which == "" {
		which = "auto"
	}
	if which != "sim" {
		cd, err := proxy.NewCUDADevice(0)
		if err == nil {
			src, err := alloc.NewPinnedHostSource(0)
			if err != nil {
				cd.Close()
				return nil, err
			}
			pool, err := alloc.New(src, alloc.WithName("proxy-pinned"))
			if err != nil {
				src.Close()
				cd.Close()
				return nil, err
			}
			px, err := proxy.New(cd, pool, proxy.WithChunk(chunk))
			if err != nil {
				pool.Close()
				src.Close()
				cd.Close()
				return nil, err
			}
			// The raw-copy baseline calls the driver itself, through its own
			// reference on the GPU's primary context.
			drv, ctx, err := retainPrimary(0)
			if err != nil {
				px.Close()
				pool.Close()
				src.Close()
				cd.Close()
				return nil, err
			}
			return &proxyRig{dev: cd, pool: pool, px: px, ctx: ctx, note: cd.Info().Name,
				close: func() {
					px.Close()
					pool.Close()
					src.Close()
					ctx.Close()
					drv.Close()
					cd.Close()
				}}, nil
		}
		if which == "cuda" || !errors.Is(err, cuda.ErrNoDriver) {
			return nil, err
		}
		env.Log.Info("no CUDA driver: using the simulated GPU", "err", err)
	}
	copyBW, err := floatSetting(env, setProxySimCopy, 4e9)
	if err != nil {
		return nil, err
	}
	sim := gpusim.New(gpusim.Config{Bandwidth: copyBW})
	pool, err := alloc.New(alloc.NewMmapSource(alloc.MmapOptions{Populate: true}), alloc.WithName("proxy-pinned-sim"),
		alloc.WithVisitors(sim.HostRegisterVisitor()))
	if err != nil {
		sim.Close()
		return nil, err
	}
	px, err := proxy.New(sim, pool, proxy.WithChunk(chunk))
	if err != nil {
		pool.Close()
		sim.Close()
		return nil, err
	}
	return &proxyRig{dev: sim, pool: pool, px: px,
		note:  fmt.Sprintf("SIMULATED GPU (gpusim: host memory and a copy goroutine paced at %s/s; no CUDA driver here)", humanize.Bytes(uint64(copyBW))),
		close: func() { px.Close(); pool.Close(); sim.Close() }}, nil
}

// retainPrimary opens the CUDA driver and retains the primary context of GPU
// ordinal.
func retainPrimary(ordinal int) (*cuda.Driver, *cuda.Context, error) {
	drv, _, ctx, err := cuda.OpenPrimary(ordinal)
	return drv, ctx, err
}

// rawHtoD is the baseline copy: one asynchronous host-to-device copy of n
// bytes and an event waited on. On a real GPU it calls the driver directly
// (cuMemcpyHtoDAsync_v2 on a stream of its own, cuEventSynchronize).
func (r *proxyRig) rawHtoD(dst proxy.DevicePtr, src uintptr, n int, s proxy.Stream, cs *cuda.Stream, ev *cuda.Event) error {
	if r.ctx != nil {
		if err := r.ctx.MemcpyHtoDAsync(uintptr(dst), src, n, cs); err != nil {
			return err
		}
		if err := ev.Record(cs); err != nil {
			return err
		}
		return ev.Synchronize()
	}
	if err := r.dev.CopyHtoDAsync(dst, src, n, s); err != nil {
		return err
	}
	e, err := r.dev.RecordEvent(s)
	if err != nil {
		return err
	}
	defer e.Close()
	return e.Wait(context.Background())
}

// proxyReceive receives n bytes through the proxy; deliver writes (or
// pretends to write) the tensor into the proxy tensor, calling arrived for
// each part.
func (r *proxyRig) proxyReceive(ctx context.Context, dst proxy.DevicePtr, n int, deliver func(buf []byte, arrived func(off, n int) error) error) error {
	rc, err := r.px.Receive(dst, n, nil)
	if err != nil {
		return err
	}
	if err := deliver(rc.Block().Bytes()[:n], rc.ChunkArrived); err != nil {
		rc.Abort(err)
		_ = rc.Wait(ctx)
		return err
	}
	return rc.Wait(ctx)
}

// network is the simulated network: it writes src into the proxy tensor in
// chunks at a paced rate (real memory copies, sleeping until each chunk's
// deadline) and reports each chunk as it lands, as a transport reports a
// write-with-immediate completion.
type network struct {
	src   []byte
	bw    float64
	chunk int
}

func (nw network) deliver(buf []byte, arrived func(off, n int) error) error {
	start := time.Now()
	for off := 0; off < len(buf); off += nw.chunk {
		c := min(nw.chunk, len(buf)-off)
		copy(buf[off:off+c], nw.src[off:off+c])
		deadline := start.Add(time.Duration(float64(off+c) / nw.bw * float64(time.Second)))
		if w := time.Until(deadline); w > 0 {
			time.Sleep(w)
		}
		if arrived != nil {
			if err := arrived(off, c); err != nil {
				return err
			}
		}
	}
	return nil
}

func runProxy(ctx context.Context, env *Env) error {
	chunk := int64(4 << 20) // the proxy's default chunk
	if v, ok := env.Args[setProxyChunk]; ok {
		n, err := parseSize(v)
		if err != nil || n <= 0 {
			return fmt.Errorf("-set %s=%s: want a positive size", setProxyChunk, v)
		}
		chunk = n
	}
	netBW, err := floatSetting(env, setProxySimNet, 2e9)
	if err != nil {
		return err
	}
	r, err := newProxyRig(env, int(chunk))
	if err != nil {
		return err
	}
	defer r.close()

	sizes := env.sizes(1<<20, 256<<20)
	maxN := int(sizes[len(sizes)-1])
	recvSizes := []int64{64 << 20, 256 << 20}
	if env.Quick {
		recvSizes = []int64{2 << 20}
	} else if env.MaxSize > 0 {
		recvSizes = recvSizes[:0]
		for _, s := range []int64{64 << 20, 256 << 20} {
			if s <= env.MaxSize {
				recvSizes = append(recvSizes, s)
			}
		}
	}
	for _, s := range recvSizes {
		maxN = max(maxN, int(s))
	}
	dst, err := r.dev.Alloc(maxN)
	if err != nil {
		return err
	}
	defer r.dev.Free(dst)
	srcMem, err := unix.Mmap(-1, 0, maxN, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_POPULATE)
	if err != nil {
		return err
	}
	defer unix.Munmap(srcMem)
	for i := 0; i < maxN; i += 4096 {
		srcMem[i] = byte(i >> 12)
	}
	// The raw baseline copies from a pinned block of the same pool.
	staging, err := r.pool.Alloc(maxN)
	if err != nil {
		return err
	}
	defer staging.Free()
	copy(staging.Bytes(), srcMem)
	s, err := r.dev.NewStream()
	if err != nil {
		return err
	}
	defer s.Close()
	var cs *cuda.Stream
	var ev *cuda.Event
	if r.ctx != nil {
		if cs, err = r.ctx.NewStream(cuda.StreamNonBlocking); err != nil {
			return err
		}
		defer cs.Close()
		if ev, err = r.ctx.NewEvent(cuda.EventBlockingSync | cuda.EventDisableTiming); err != nil {
			return err
		}
		defer ev.Close()
	}

	// 1. Proxy host-to-device bandwidth against the raw copy.
	for _, size := range sizes {
		n := int(size)
		raw, err := timeIt(env.Reps, func() error {
			if err := ctx.Err(); err != nil {
				return err
			}
			return r.rawHtoD(dst, staging.Addr(), n, s, cs, ev)
		})
		if err != nil {
			return fmt.Errorf("raw copy of %d bytes: %w", n, err)
		}
		px, err := timeIt(env.Reps, func() error {
			return r.proxyReceive(ctx, dst, n, func(buf []byte, arrived func(off, n int) error) error {
				for off := 0; off < n; off += int(chunk) {
					if err := arrived(off, min(int(chunk), n-off)); err != nil {
						return err
					}
				}
				return nil
			})
		})
		if err != nil {
			return fmt.Errorf("proxy copy of %d bytes: %w", n, err)
		}
		v, b := rateGBs(size, px), rateGBs(size, raw)
		env.Emit(Result{Case: "htod-proxy", SizeBytes: size, Value: v, Unit: "GB/s", Baseline: b, Ratio: ratio("GB/s", v, b),
			BaselineName: "raw-cuMemcpyHtoDAsync", Note: joinNote(r.note, fmt.Sprintf("goal >= 0.90 of raw from 16 MiB; chunk %s", humanize.IBytes(uint64(chunk))))})
	}

	// 2. Pipelined and unpipelined receive against max(network, copy).
	for _, size := range recvSizes {
		n := int(size)
		nw := network{src: srcMem[:n], bw: netBW, chunk: int(chunk)}
		netOnly, err := timeIt(env.Reps, func() error {
			b, err := r.pool.Alloc(n)
			if err != nil {
				return err
			}
			defer b.Free()
			return nw.deliver(b.Bytes()[:n], nil)
		})
		if err != nil {
			return err
		}
		copyOnly, err := timeIt(env.Reps, func() error { return r.rawHtoD(dst, staging.Addr(), n, s, cs, ev) })
		if err != nil {
			return err
		}
		bound := max(netOnly, copyOnly)
		pipelined, err := timeIt(env.Reps, func() error { return r.proxyReceive(ctx, dst, n, nw.deliver) })
		if err != nil {
			return err
		}
		whole, err := timeIt(env.Reps, func() error {
			return r.proxyReceive(ctx, dst, n, func(buf []byte, arrived func(off, n int) error) error {
				if err := nw.deliver(buf, nil); err != nil {
					return err
				}
				return arrived(0, n) // one copy once the whole tensor landed
			})
		})
		if err != nil {
			return err
		}
		// The network is simulated on a real GPU too: the scenario needs no
		// NIC, and the transfer scenarios measure the real ones.
		note := joinNote(r.note, fmt.Sprintf("baseline max(network %.2f ms, copy %.2f ms); network simulated at %s/s; goal pipelined <= 1.15x baseline",
			ms(netOnly), ms(copyOnly), humanize.Bytes(uint64(nw.bw))))
		for _, c := range []struct {
			name string
			d    time.Duration
		}{{"recv-pipelined", pipelined}, {"recv-unpipelined", whole}} {
			env.Emit(Result{Case: c.name, SizeBytes: size, Value: ms(c.d), Unit: "ms", Baseline: ms(bound),
				Ratio: ratio("ms", ms(c.d), ms(bound)), BaselineName: "max(network,copy)", Note: note})
		}
	}
	return nil
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

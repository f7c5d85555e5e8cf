package ibverbs

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"github.com/gdrlink/gdrlink/internal/ibv"
	"github.com/gdrlink/gdrlink/verbsio"
	"golang.org/x/sys/unix"
)

// windowMode says when regions give grants through memory windows.
type windowMode int

const (
	// windowsAuto: where the device has type 2 windows and the probe
	// found that it enforces a window's bounds.
	windowsAuto windowMode = iota
	// windowsForce: wherever the device has type 2 windows, bounds
	// enforced or not. For tests of the window path on Soft-RoCE: a
	// grant there still ends in time, but does not bound the peer's
	// writes to its range.
	windowsForce
	// windowsOff: never.
	windowsOff
)

func (m windowMode) String() string {
	switch m {
	case windowsForce:
		return "force"
	case windowsOff:
		return "off"
	}
	return "auto"
}

// windowsEnv names the variable that sets the window mode of devices
// opened without withWindows: "auto" (or unset), "force" or "off". It is a
// testing knob (the rendezvous tests run in other processes and packages),
// not a tuning one: forcing windows on a device that does not bound them
// gives grants that end in time but do not keep a peer inside its range.
const windowsEnv = "GDRLINK_IBVERBS_WINDOWS"

// withWindows sets the window mode, over windowsEnv. Unexported: tests
// force windows to run the window path on Soft-RoCE.
func withWindows(m windowMode) Option {
	return func(o *options) { o.windows, o.windowsSet = m, true }
}

func parseWindowMode(s string) (windowMode, error) {
	switch s {
	case "", "auto":
		return windowsAuto, nil
	case "force":
		return windowsForce, nil
	case "off":
		return windowsOff, nil
	}
	return windowsAuto, fmt.Errorf("%w: %s=%q: want auto, force or off", verbsio.ErrBadConfig, windowsEnv, s)
}

// bounds is what the window probe found.
type bounds int

const (
	// boundsUnknown: the probe could not tell (or did not run).
	boundsUnknown bounds = iota
	// boundsEnforced: a write one byte past a window was refused with a
	// remote access error, and the byte stayed as it was.
	boundsEnforced
	// boundsNotEnforced: the write one byte past the window landed.
	boundsNotEnforced
	// windowsBroken: the device lists type 2 windows but allocating,
	// binding or writing through one failed.
	windowsBroken
)

// windowFacts are what the device says and what the probe found about
// memory windows; decideGrants turns them into a decision.
type windowFacts struct {
	Device string
	// Type2 says whether the device lists type 2 memory windows
	// (IBV_DEVICE_MEM_WINDOW_TYPE_2A or _2B, and max_mw > 0); MaxMW how
	// many it allocates.
	Type2 bool
	MaxMW int
	// Bounds is the probe's finding, Why its account of it.
	Bounds bounds
	Why    string
}

// decideGrants decides whether a device's regions give grants, and says
// why not (or, where windows are forced on a device that does not prove it
// bounds them, that). It is pure; its table test is the policy.
func decideGrants(f windowFacts, mode windowMode) (bool, string) {
	switch {
	case mode == windowsOff:
		return false, fmt.Sprintf("memory windows turned off (%s=off)", windowsEnv)
	case !f.Type2:
		return false, fmt.Sprintf("%s: %s has no type 2 memory windows (device_cap_flags lacks MEM_WINDOW_TYPE_2A/2B, or max_mw is %d)", verbsio.ErrNotSupported, f.Device, f.MaxMW)
	case f.Bounds == windowsBroken:
		return false, fmt.Sprintf("%s: %s lists type 2 memory windows, but they do not work: %s", verbsio.ErrNotSupported, f.Device, f.Why)
	case f.Bounds == boundsEnforced:
		return true, ""
	case mode == windowsForce && f.Bounds == boundsNotEnforced:
		return true, fmt.Sprintf("memory windows forced (%s=force) although %s does not enforce a window's bounds (%s): grants end in time but do not keep a peer inside its range", windowsEnv, f.Device, f.Why)
	case mode == windowsForce:
		return true, fmt.Sprintf("memory windows forced (%s=force) although the probe could not tell whether %s enforces a window's bounds (%s)", windowsEnv, f.Device, f.Why)
	case f.Bounds == boundsNotEnforced:
		return false, fmt.Sprintf("%s: %s does not enforce a memory window's bounds (%s): a window would bound a peer's writes in time but not in space", verbsio.ErrNotSupported, f.Device, f.Why)
	}
	return false, fmt.Sprintf("could not tell whether %s enforces a memory window's bounds: %s", f.Device, f.Why)
}

// probed caches the conclusive findings of the window probe, per device
// (name and node GUID), for the life of the process.
var probed sync.Map // probeKey -> windowFacts

type probeKey struct {
	name string
	guid uint64
}

// windowFacts gathers the device's memory-window facts, running the
// bounds probe (once per process and device, where conclusive) unless
// windows are off or the device has none.
func (d *device) windowFacts(mode windowMode) windowFacts {
	f := windowFacts{Device: d.ch.Device, Type2: d.attr.MemoryWindowsType2(), MaxMW: d.attr.MaxMW}
	if mode == windowsOff || !f.Type2 {
		return f
	}
	key := probeKey{d.ch.Device, d.attr.NodeGUID}
	if v, ok := probed.Load(key); ok {
		return v.(windowFacts)
	}
	f.Bounds, f.Why = d.probeWindows()
	if f.Bounds != boundsUnknown {
		probed.Store(key, f)
	}
	return f
}

// Geometry of the probe: a window over [probeWinOff, probeWinOff+probeWinLen)
// of a one-page region that allows binding windows but no remote access
// of its own.
const (
	probeWinOff = 1024
	probeWinLen = 1024
)

// probeTimeout bounds each completion the probe waits for.
var probeTimeout = 20 * time.Second

// probeWindows finds out whether the device enforces a memory window's
// bounds, on a loopback pair of queue pairs over the device's own route:
// it binds a type 2 window over part of a region, writes one byte inside
// it (which must land), then one byte just past it, still inside the
// region. A device that bounds windows refuses the second write with a
// remote access error; Soft-RoCE lets it land (softroce/README.md). It
// returns boundsUnknown, with the reason, when something else failed.
func (d *device) probeWindows() (bounds, string) {
	c := d.c
	pd, err := c.AllocPD()
	if err != nil {
		return boundsUnknown, "probe: " + err.Error()
	}
	defer pd.Close()
	cq, err := c.CreateCQ(8)
	if err != nil {
		return boundsUnknown, "probe: " + err.Error()
	}
	defer cq.Close()
	var qps [2]*ibv.QP
	for i := range qps {
		q, err := pd.CreateQP(cq, cq, ibv.QPCaps{MaxSendWR: 4, MaxRecvWR: 1, MaxSendSGE: 1, MaxRecvSGE: 1})
		if err != nil {
			return boundsUnknown, "probe: " + err.Error()
		}
		defer q.Close()
		qps[i] = q
	}
	for i, q := range qps {
		if err := d.loopback(q, qps[1-i].QPN()); err != nil {
			return boundsUnknown, "probe: loopback queue pairs: " + err.Error()
		}
	}
	page := os.Getpagesize()
	mem, err := unix.Mmap(-1, 0, 2*page, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		return boundsUnknown, fmt.Sprintf("probe: mmap: %v", err)
	}
	defer unix.Munmap(mem)
	tgt, src := mem[:page], mem[page:]
	for i := range tgt {
		tgt[i] = 'G'
	}
	src[0] = 'W'
	base := uintptr(unsafe.Pointer(&mem[0]))
	tmr, err := pd.RegMR(base, page, ibv.AccessLocalWrite|ibv.AccessMWBind)
	if err != nil {
		return boundsUnknown, "probe: " + err.Error()
	}
	defer tmr.Close()
	smr, err := pd.RegMR(base+uintptr(page), page, ibv.AccessLocalWrite)
	if err != nil {
		return boundsUnknown, "probe: " + err.Error()
	}
	defer smr.Close()
	mw, err := pd.AllocMW()
	if errors.Is(err, syscall.EOPNOTSUPP) || errors.Is(err, syscall.ENOSYS) {
		return windowsBroken, err.Error()
	}
	if err != nil {
		return boundsUnknown, "probe: " + err.Error()
	}
	defer mw.Close() // before the region: a region with a bound window stays registered
	rkey := mw.NextRKey()
	lo, hi := uint64(base)+probeWinOff, uint64(base)+probeWinOff+probeWinLen
	bind := ibv.SendWR{WRID: 1, Opcode: ibv.WRBindMW, Flags: ibv.SendSignaled, Bind: ibv.Bind{MW: mw, MR: tmr, RKey: rkey,
		Addr: lo, Length: probeWinLen, Access: ibv.AccessRemoteWrite}}
	if st, err := probePost(cq, qps[1], bind); err != nil {
		return boundsUnknown, "probe: bind: " + err.Error()
	} else if st != ibv.WCSuccess {
		return windowsBroken, fmt.Sprintf("binding a type 2 window completed with status %d", st)
	}
	mw.SetRKey(rkey)
	write := func(at uint64) (uint32, error) {
		sge := []ibv.SGE{{Addr: uint64(base) + uint64(page), Length: 1, LKey: smr.LKey()}}
		return probePost(cq, qps[0], ibv.SendWR{WRID: 2, Opcode: ibv.WRWrite, Flags: ibv.SendSignaled, NumSGE: 1, RemoteAddr: at, RKey: rkey}, sge...)
	}
	if st, err := write(lo); err != nil {
		return boundsUnknown, "probe: write inside the window: " + err.Error()
	} else if st != ibv.WCSuccess || tgt[probeWinOff] != 'W' {
		return windowsBroken, fmt.Sprintf("a one-byte write inside a bound window completed with status %d (byte now %q)", st, tgt[probeWinOff])
	}
	st, err := write(hi)
	past := tgt[probeWinOff+probeWinLen]
	switch {
	case err != nil:
		return boundsUnknown, "probe: write past the window: " + err.Error()
	case st == ibv.WCSuccess && past == 'W':
		return boundsNotEnforced, fmt.Sprintf("a one-byte write just past a window over [%d, %d) of a one-page region landed (found by the probe at open)", probeWinOff, probeWinOff+probeWinLen)
	case st == ibv.WCRemAccessErr && past == 'G':
		return boundsEnforced, ""
	}
	return boundsUnknown, fmt.Sprintf("probe: a one-byte write just past a window completed with status %d (byte now %q)", st, past)
}

// loopback connects q to the queue pair qpn of the same device, over the
// device's route (its own GID or LID).
func (d *device) loopback(q *ibv.QP, qpn uint32) error {
	ch := d.ch
	if err := q.ToInit(ch.Port.Num, d.cfg.PKeyIndex, ibv.AccessLocalWrite|ibv.AccessRemoteWrite|ibv.AccessRemoteRead); err != nil {
		return err
	}
	rtr := ibv.RTRAttr{DestQPN: qpn, MTU: ch.MTU, Global: ch.Global, DGID: ch.GID.GID, SGIDIndex: ch.GID.Index,
		HopLimit: d.p.o.hopLimit, DLID: ch.Port.Attr.LID, Port: ch.Port.Num, MaxDestRdAtomic: 1, MinRNRTimer: 12}
	if err := q.ToRTR(rtr); err != nil {
		return err
	}
	return q.ToRTS(ibv.RTSAttr{Timeout: 14, RetryCount: 3, RNRRetry: 3, MaxRdAtomic: 1})
}

// probePost posts one signaled work request on q and waits for its
// completion on cq; it returns the completion's status.
func probePost(cq *ibv.CQ, q *ibv.QP, wr ibv.SendWR, sges ...ibv.SGE) (uint32, error) {
	if _, err := q.PostSend([]ibv.SendWR{wr}, sges); err != nil {
		return 0, err
	}
	deadline := time.Now().Add(probeTimeout)
	wc := make([]ibv.WC, 1)
	pause := 5 * time.Microsecond
	for {
		n, err := cq.Poll(wc)
		if err != nil {
			return 0, err
		}
		if n == 1 {
			if wc[0].WRID != wr.WRID {
				return 0, fmt.Errorf("completion of work request %d, expected %d", wc[0].WRID, wr.WRID)
			}
			return wc[0].Status, nil
		}
		if time.Now().After(deadline) {
			return 0, fmt.Errorf("no completion in %v", probeTimeout)
		}
		time.Sleep(pause)
		pause = min(2*pause, time.Millisecond)
	}
}

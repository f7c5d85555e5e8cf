package gdrlink

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/internal/ipc"
	"github.com/gdrlink/gdrlink/proxy"
	"github.com/gdrlink/gdrlink/rendezvous"
	"github.com/gdrlink/gdrlink/tensor"
)

// The on-node GPU path (Open MPI's smcuda, in Go): two ranks of one node
// whose tensors live on GPUs that can reach each other move them with one
// device-to-device copy, pulled by the receiver from the sender's GPU
// memory mapped into its process, instead of through host memory.
//
// Nothing is set up at Join. The first GPU Send or GPU Recv between two
// ranks of one node starts the pair's state machine (ipc.Setup: INIT,
// SENT, ACKING, ACKED, OK, or BAD after ipc.MaxTries "not ready"
// answers), whose messages travel as bootstrap Calls (authenticated with
// the job key, like everything there). The transfers before it is OK go
// through host memory as before; so do all of a BAD pair's. An answering
// side without a GPU (not joined WithGPU) answers "not ready"; one whose
// GPU cannot reach the starter's answers no.
//
// Each arena of the GPU tensor pool is exported once, by a visitor: a
// legacy CUDA IPC handle on a real GPU (cuIpcGetMemHandle), a descriptor
// handed out by the group's descriptor service on the simulated one (the
// stand-in for a CUDA VMM export). A receiver opens each arena of a peer
// once (ipc.Cache) and keeps the mapping until the peer releases the arena
// (the pool gives it back, or the group closes: the peer is asked to close
// its mappings first, as CUDA requires) or leaves.

// Pull handle kinds, the first byte of a pull handle.
const (
	// handleLegacy: the arena's legacy CUDA IPC handle (64 bytes) follows.
	handleLegacy = 1
	// handleFD: the arena's descriptor comes from the exporter's
	// descriptor service (ipc.FDServer).
	handleFD = 2
)

// pullHandleLen is a pull handle's fixed part: kind, arena size.
const pullHandleLen = 1 + 8

// releaseAll in a RELEASE's Arena asks the peer to close every mapping of
// this side's arenas.
const releaseAll = ^uint64(0)

// releaseWait bounds how long a release waits for a peer to close its
// mappings.
const releaseWait = 2 * time.Second

// ipcDevice is what a GPU offers the on-node path.
type ipcDevice interface {
	// id names the GPU for a peer's reachability check.
	id() string
	// canReach reports whether this GPU and the peer's (as the peer named
	// it) can reach each other's memory.
	canReach(peer string) bool
	// kind is how arenas are exported: handleLegacy or handleFD.
	kind() byte
	// legacyHandle gets the legacy IPC handle of the allocation at base.
	legacyHandle(base proxy.DevicePtr) ([64]byte, error)
	// exportFD returns a new descriptor of the allocation at base.
	exportFD(base proxy.DevicePtr) (int, error)
	// open maps a peer's arena of size bytes: from its legacy handle h,
	// or from fd (which stays the caller's) when fd >= 0.
	open(h []byte, fd int, size int) (proxy.DevicePtr, error)
	// close unmaps what open mapped.
	close(p proxy.DevicePtr) error
	// copyDtoD queues a device-to-device copy on st.
	copyDtoD(dst, src proxy.DevicePtr, n int, st proxy.Stream) error
	// exportName says how arenas are exported (IPCStats.Export).
	exportName() string
}

// cudaGPU is what a real GPU from proxy.NewCUDADevice offers the path.
type cudaGPU interface {
	proxy.Device
	IPCHandle(p proxy.DevicePtr) ([64]byte, error)
	OpenIPCHandle(h [64]byte) (proxy.DevicePtr, error)
	CloseIPCHandle(p proxy.DevicePtr) error
	CopyDtoDAsync(dst, src proxy.DevicePtr, n int, s proxy.Stream) error
	CanAccessPeer(busID string) (bool, error)
	ShareableSupported() bool
	AllocShareable(n int) (proxy.DevicePtr, error)
	ExportShareable(p proxy.DevicePtr) (int, error)
	OpenShareable(fd int, size int) (proxy.DevicePtr, error)
}

// cudaIPCDevice is a real GPU. With vmm its arenas are CUDA VMM
// allocations exported as POSIX descriptors (what NCCL prefers: the
// descriptor goes over the descriptor service's socket, and the memory
// lives while any process maps it); otherwise cuMemAlloc arenas exported
// with legacy IPC handles. It opens what a peer exports either way.
type cudaIPCDevice struct {
	dev cudaGPU
	vmm bool
}

func (d cudaIPCDevice) id() string { return d.dev.Info().PCIBusID }
func (d cudaIPCDevice) canReach(peer string) bool {
	ok, err := d.dev.CanAccessPeer(peer)
	return err == nil && ok
}
func (d cudaIPCDevice) exportName() string {
	if d.vmm {
		return "vmm"
	}
	return "legacy"
}
func (d cudaIPCDevice) kind() byte {
	if d.vmm {
		return handleFD
	}
	return handleLegacy
}
func (d cudaIPCDevice) legacyHandle(base proxy.DevicePtr) ([64]byte, error) {
	return d.dev.IPCHandle(base)
}
func (d cudaIPCDevice) exportFD(base proxy.DevicePtr) (int, error) {
	if !d.vmm {
		return -1, fmt.Errorf("%w: descriptor export of a legacy-handle GPU", ipc.ErrNotSupported)
	}
	return d.dev.ExportShareable(base)
}
func (d cudaIPCDevice) open(h []byte, fd int, size int) (proxy.DevicePtr, error) {
	if fd >= 0 {
		return d.dev.OpenShareable(fd, size)
	}
	if len(h) != 64 {
		return 0, fmt.Errorf("%w: legacy CUDA IPC handle of %d bytes", ipc.ErrBadMessage, len(h))
	}
	return d.dev.OpenIPCHandle([64]byte(h))
}
func (d cudaIPCDevice) close(p proxy.DevicePtr) error {
	if err := d.dev.CloseIPCHandle(p); err == nil || !errors.Is(err, proxy.ErrWrongMemory) {
		return err
	}
	return d.dev.Free(p) // a shareable mapping
}

// alloc makes an arena of the GPU tensor pool: exportable by descriptor
// with vmm.
func (d cudaIPCDevice) alloc(n int) (proxy.DevicePtr, error) {
	if d.vmm {
		return d.dev.AllocShareable(n)
	}
	return d.dev.Alloc(n)
}
func (d cudaIPCDevice) copyDtoD(dst, src proxy.DevicePtr, n int, st proxy.Stream) error {
	return d.dev.CopyDtoDAsync(dst, src, n, st)
}

// simIPCDevice is the simulated GPU (gpusim with Config.Shareable): its
// allocations are memfds, shared by descriptor, as a CUDA VMM export
// would be. GPUs of one node reach each other.
type simIPCDevice struct {
	dev interface {
		proxy.Device
		ExportSimulatedHandle(p proxy.DevicePtr) (fd int, size int, err error)
		OpenSimulatedHandle(fd int, size int) (proxy.DevicePtr, error)
		CopyDtoDAsync(dst, src proxy.DevicePtr, n int, st proxy.Stream) error
	}
	node string
}

func (d simIPCDevice) id() string                { return "simulated@" + d.node }
func (d simIPCDevice) canReach(peer string) bool { return peer == d.id() }
func (d simIPCDevice) kind() byte                { return handleFD }
func (d simIPCDevice) exportName() string        { return "simulated" }
func (d simIPCDevice) legacyHandle(proxy.DevicePtr) ([64]byte, error) {
	return [64]byte{}, fmt.Errorf("%w: legacy handles of a simulated GPU", ipc.ErrNotSupported)
}
func (d simIPCDevice) exportFD(base proxy.DevicePtr) (int, error) {
	fd, _, err := d.dev.ExportSimulatedHandle(base)
	return fd, err
}
func (d simIPCDevice) open(_ []byte, fd int, size int) (proxy.DevicePtr, error) {
	return d.dev.OpenSimulatedHandle(fd, size)
}
func (d simIPCDevice) close(p proxy.DevicePtr) error { return d.dev.Free(p) }
func (d simIPCDevice) copyDtoD(dst, src proxy.DevicePtr, n int, st proxy.Stream) error {
	return d.dev.CopyDtoDAsync(dst, src, n, st)
}

// ipcDeviceOf is dev's on-node path, or nil when it has none (a simulated
// GPU that is not shareable, or mode "off"). mode is GDRLINK_CUDA_IPC's:
// "vmm" insists on VMM exports, "legacy" on legacy handles, "auto" (or "")
// takes VMM where the GPU has it.
func ipcDeviceOf(dev proxy.Device, node, mode string) (ipcDevice, error) {
	if mode == "off" {
		return nil, nil
	}
	switch d := dev.(type) {
	case cudaGPU:
		vmm := d.ShareableSupported()
		switch {
		case mode == "vmm" && !vmm:
			return nil, fmt.Errorf("%w: GDRLINK_CUDA_IPC=vmm, but %s cannot export memory as POSIX descriptors (CUDA virtual memory management)", ipc.ErrNotSupported, d.Info().Name)
		case mode == "legacy":
			vmm = false
		}
		return cudaIPCDevice{d, vmm}, nil
	case interface {
		proxy.Device
		ExportSimulatedHandle(p proxy.DevicePtr) (fd int, size int, err error)
		OpenSimulatedHandle(fd int, size int) (proxy.DevicePtr, error)
		CopyDtoDAsync(dst, src proxy.DevicePtr, n int, st proxy.Stream) error
		Shareable() bool
	}:
		if d.Shareable() {
			return simIPCDevice{d, node}, nil
		}
	}
	return nil, nil
}

// gpuIPC is a group's side of the on-node GPU path.
type gpuIPC struct {
	g     *Group
	dev   ipcDevice
	pdev  proxy.Device
	pool  *alloc.Pool // the GPU tensor pool, whose arenas are exported
	epoch uint32      // tells this process's arenas from a predecessor's
	cache *ipc.Cache
	fds   *ipc.FDServer // handleFD only

	// pulls run on one stream, made at the first (streamOnce).
	streamOnce sync.Once
	stream     proxy.Stream
	streamErr  error

	mu      sync.Mutex
	arenas  map[uint32]*alloc.Arena // exported arenas, by ID
	closing bool                    // releases no longer ask peers

	pullsOK, pullsFailed atomic.Uint64
}

// newGPUIPC makes the group's on-node path over dev, or returns nil when
// dev has none.
func newGPUIPC(g *Group, dev proxy.Device) (*gpuIPC, error) {
	d, err := ipcDeviceOf(dev, g.me.Host, g.cfg.cudaIPC)
	if d == nil || err != nil {
		return nil, err
	}
	var e [4]byte
	if _, err := rand.Read(e[:]); err != nil {
		return nil, err
	}
	x := &gpuIPC{g: g, dev: d, pdev: dev, epoch: binary.BigEndian.Uint32(e[:]), arenas: map[uint32]*alloc.Arena{}}
	x.cache = ipc.NewCache(ipc.DeviceOpener{Dev: opener{x}})
	if d.kind() == handleFD {
		fds, err := ipc.NewFDServer(g.cfg.jobKey, x.lookupFD, g.log)
		if err != nil {
			return nil, err
		}
		x.fds = fds
	}
	return x, nil
}

// opener opens peers' arenas for the cache.
type opener struct{ x *gpuIPC }

func (o opener) OpenHandle(h ipc.Msg, fd int) (proxy.DevicePtr, error) {
	return o.x.dev.open(h.Handle, fd, int(h.Size))
}
func (o opener) CloseHandle(p proxy.DevicePtr) error { return o.x.dev.close(p) }

// copier queues the pulls' copies and events.
type copier struct{ x *gpuIPC }

func (c copier) CopyDtoDAsync(dst, src proxy.DevicePtr, n int, st proxy.Stream) error {
	return c.x.dev.copyDtoD(dst, src, n, st)
}
func (c copier) RecordEvent(st proxy.Stream) (proxy.Event, error) { return c.x.pdev.RecordEvent(st) }

// legacyExportKey keys the legacy handle a GPU arena's visit got.
type legacyExportKey struct{}

// visitor exports each arena of the GPU tensor pool once: its legacy
// handle got at once (cheap, and the peer needs it with every pull), or,
// for descriptor exports, only its record for the descriptor service. A
// released arena is first closed by every peer that set the path up with
// this rank.
func (x *gpuIPC) visitor() alloc.Visitor {
	return alloc.NewVisitor("gdrlink-ipc-export", func(a *alloc.Arena) error {
		if x.dev.kind() == handleLegacy {
			h, err := x.dev.legacyHandle(proxy.DevicePtr(a.Base()))
			if err != nil {
				return fmt.Errorf("IPC handle of %s: %w", a, err)
			}
			a.SetHandle(legacyExportKey{}, h)
		}
		x.mu.Lock()
		x.arenas[uint32(a.ID)] = a
		x.mu.Unlock()
		return nil
	}, func(a *alloc.Arena) error {
		x.mu.Lock()
		delete(x.arenas, uint32(a.ID))
		closing := x.closing
		x.mu.Unlock()
		a.DeleteHandle(legacyExportKey{})
		if !closing {
			x.releaseToPeers(x.arenaID(a))
		}
		return nil
	})
}

// arenaID is an arena's name on the wire: this process's epoch and the
// arena's ID.
func (x *gpuIPC) arenaID(a *alloc.Arena) uint64 { return uint64(x.epoch)<<32 | uint64(uint32(a.ID)) }

// export says where a peer can pull n bytes at src from.
func (x *gpuIPC) export(src tensor.Buffer, n int) (rendezvous.PullRef, bool) {
	if x.pool == nil {
		return rendezvous.PullRef{}, false
	}
	a, ok := x.pool.ArenaOf(src.Addr())
	if !ok || src.Addr()+uintptr(n) > a.Base()+uintptr(a.Size()) {
		return rendezvous.PullRef{}, false
	}
	h := make([]byte, pullHandleLen, pullHandleLen+64)
	h[0] = x.dev.kind()
	binary.BigEndian.PutUint64(h[1:], uint64(a.Size()))
	if x.dev.kind() == handleLegacy {
		v, ok := a.Handle(legacyExportKey{})
		if !ok {
			return rendezvous.PullRef{}, false
		}
		lh := v.([64]byte)
		h = append(h, lh[:]...)
	}
	return rendezvous.PullRef{Arena: x.arenaID(a), Offset: uint64(src.Addr() - a.Base()), Size: int64(n), Handle: h}, true
}

// lookupFD is the descriptor service's Lookup: an exported arena of this
// process, for a peer whose pair is set up.
func (x *gpuIPC) lookupFD(peer uint32, m ipc.Msg) (int, error) {
	if m.Arena>>32 != uint64(x.epoch) {
		return -1, fmt.Errorf("%w: arena %#x is not one of this process's", ipc.ErrRefused, m.Arena)
	}
	p, err := x.g.peer(int(peer))
	if err != nil {
		return -1, fmt.Errorf("%w: %w", ipc.ErrRefused, err)
	}
	if st := p.ipcPair().state(); st != ipc.OK {
		return -1, fmt.Errorf("%w: the pair with rank %d is %s", ipc.ErrRefused, peer, st)
	}
	x.mu.Lock()
	a := x.arenas[uint32(m.Arena)]
	x.mu.Unlock()
	if a == nil {
		return -1, fmt.Errorf("%w: arena %#x is not exported", ipc.ErrRefused, m.Arena)
	}
	return x.dev.exportFD(proxy.DevicePtr(a.Base()))
}

// pullStream is the stream pulls run on.
func (x *gpuIPC) pullStream() (proxy.Stream, error) {
	x.streamOnce.Do(func() { x.stream, x.streamErr = x.pdev.NewStream() })
	return x.stream, x.streamErr
}

// pull copies ref's bytes from rank's GPU into dst: the arena is opened on
// the first pull from it (its descriptor fetched from the peer's
// descriptor service when it has no legacy handle) and kept in the cache.
// A failure sets the pair BAD: later transfers go through host memory.
func (x *gpuIPC) pull(p *peer, ref rendezvous.PullRef, dst tensor.Buffer) error {
	err := x.pullOnce(p, ref, dst)
	if err == nil {
		x.pullsOK.Add(1)
	} else {
		x.pullsFailed.Add(1)
		p.ipcPair().fail()
		x.g.log.Warn("gdrlink: pull from a peer's GPU failed; the pair uses host memory from now on", "rank", x.g.Rank(), "peer", p.rank, "err", err)
	}
	return err
}

func (x *gpuIPC) pullOnce(p *peer, ref rendezvous.PullRef, dst tensor.Buffer) error {
	h := ref.Handle
	if len(h) < pullHandleLen || (h[0] == handleLegacy) != (len(h) == pullHandleLen+64) || (h[0] != handleLegacy && h[0] != handleFD) {
		return fmt.Errorf("%w: pull handle of %d bytes, kind %d", ipc.ErrBadMessage, len(h), h[0])
	}
	size := binary.BigEndian.Uint64(h[1:])
	if ref.Offset > size || uint64(ref.Size) > size-ref.Offset || ref.Size > int64(dst.Len()) {
		return fmt.Errorf("%w: %d bytes at %d of a %d-byte arena into %d bytes", ipc.ErrNotMapped, ref.Size, ref.Offset, size, dst.Len())
	}
	mp, ok := x.cache.Lookup(uint32(p.rank), ref.Arena)
	if !ok {
		fd := -1
		if h[0] == handleFD {
			name := p.ipcPair().peerService()
			if name == "" {
				return fmt.Errorf("%w: rank %d named no descriptor service", ipc.ErrNotSupported, p.rank)
			}
			ctx, cancel := context.WithTimeout(x.g.ctx, 10*time.Second)
			var err error
			fd, err = ipc.FetchFD(ctx, name, x.g.cfg.jobKey, ipc.Msg{From: uint32(x.g.Rank()), Arena: ref.Arena})
			cancel()
			if err != nil {
				return err
			}
		}
		var err error
		mp, err = x.cache.Add(uint32(p.rank), ipc.Msg{Kind: ipc.KindExport, From: uint32(p.rank), Arena: ref.Arena, Size: size, Handle: h[pullHandleLen:]}, fd)
		if err != nil {
			return err
		}
	}
	st, err := x.pullStream()
	if err != nil {
		return err
	}
	ev, err := ipc.PullDevice(copier{x}, st, proxy.DevicePtr(dst.Addr()), mp, ipc.Msg{Offset: ref.Offset, Size: uint64(ref.Size)})
	if err != nil {
		return err
	}
	defer ev.Close()
	return ev.Wait(context.Background())
}

// releaseToPeers asks every peer whose pair is set up to close its
// mapping of arena (releaseAll: of every arena), and waits for them, up to
// releaseWait each: CUDA wants importers to close before the exporter
// frees.
func (x *gpuIPC) releaseToPeers(arena uint64) {
	g := x.g
	var peers []*peer
	for _, p := range g.peerList() {
		if pr := p.ipcPairIfAny(); pr != nil && pr.state() == ipc.OK {
			peers = append(peers, p)
		}
	}
	var wg sync.WaitGroup
	for _, p := range peers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), releaseWait)
			defer cancel()
			m := ipc.Msg{Kind: ipc.KindRelease, From: uint32(g.Rank()), Arena: arena}
			if _, err := g.boot.Call(ctx, p.rank, connMsg{kind: ipcMsg, payload: m.Append(nil)}.Append(nil)); err != nil {
				g.log.Debug("gdrlink: a peer did not confirm it closed its mappings", "rank", g.Rank(), "peer", p.rank, "arena", arena, "err", err)
			}
		}()
	}
	wg.Wait()
}

// shutdown is the first part of closing, while the bootstrap still runs:
// peers close their mappings of this side's arenas, this side closes its
// mappings of theirs, and the descriptor service stops.
func (x *gpuIPC) shutdown() error {
	x.mu.Lock()
	x.closing = true
	x.mu.Unlock()
	x.releaseToPeers(releaseAll)
	return x.closeLocal()
}

// closeLocal closes this side's mappings of peers' arenas and the
// descriptor service; both are idempotent.
func (x *gpuIPC) closeLocal() error {
	errs := []error{x.cache.Close()}
	if x.fds != nil {
		errs = append(errs, x.fds.Close())
	}
	return errors.Join(errs...)
}

// close releases what shutdown did (if it did not run: a Join that
// failed) and the pull stream.
func (x *gpuIPC) close() error {
	x.mu.Lock()
	x.closing = true
	x.mu.Unlock()
	errs := []error{x.closeLocal()}
	if x.stream != nil {
		errs = append(errs, x.stream.Close())
	}
	return errors.Join(errs...)
}

// IPCStats counts the on-node GPU path of a group (Stats.IPC).
type IPCStats struct {
	// Export is how this rank's GPU arenas are exported: "vmm" (CUDA
	// virtual memory management, a POSIX descriptor per arena), "legacy"
	// (a legacy CUDA IPC handle per arena) or "simulated" (the simulated
	// GPU's descriptors).
	Export string
	// Hits, Misses and Opens count the lookups of peers' arenas in the
	// handle cache and the arenas opened (each at most once until
	// released); Closes the mappings closed (the peer released the arena
	// or left); Open is how many are open now.
	Hits, Misses, Opens, Closes uint64
	Open                        int
	// Pulls counts the tensors pulled from peers' GPUs, PullsFailed the
	// pulls that failed (each set its pair BAD).
	Pulls, PullsFailed uint64
	// Pairs counts the pairs with this rank by state (INIT, SENT, ACKING,
	// ACKED, OK, BAD).
	Pairs map[string]int
}

// stats fills in the path's counters.
func (x *gpuIPC) stats() IPCStats {
	cs := x.cache.Stats()
	return IPCStats{Export: x.dev.exportName(), Hits: cs.Hits, Misses: cs.Misses, Opens: cs.Opens, Closes: cs.Closes, Open: cs.Open,
		Pulls: x.pullsOK.Load(), PullsFailed: x.pullsFailed.Load(), Pairs: map[string]int{}}
}

// ipcPair is the state of the on-node path between this rank and one
// peer (one per peer state; a rejoined peer gets a fresh one).
type ipcPair struct {
	p  *peer
	mu sync.Mutex
	s  *ipc.Setup
	// service is the peer's descriptor service, as its REQUEST or ACK
	// named it.
	service string
	// calling: a round of messages is on its way (one at a time).
	calling bool
	// decided: the OK or BAD was logged.
	decided bool
}

// ipcPair returns the peer's pair state, made on first use.
func (p *peer) ipcPair() *ipcPair {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ipc == nil {
		g := p.g
		dev := ""
		if g.gpu != nil && g.gpu.ipc != nil {
			dev = g.gpu.ipc.dev.id()
		}
		pr := &ipcPair{p: p}
		pr.s = ipc.NewSetup(uint32(g.Rank()), uint32(p.rank), dev, pairLocal{p})
		p.ipc = pr
	}
	return p.ipc
}

// ipcPairIfAny returns the peer's pair state, or nil if none was made.
func (p *peer) ipcPairIfAny() *ipcPair {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.ipc
}

// peerList returns the peer states there are now.
func (g *Group) peerList() []*peer {
	g.mu.Lock()
	defer g.mu.Unlock()
	ps := make([]*peer, 0, len(g.peers))
	for _, p := range g.peers {
		ps = append(ps, p)
	}
	return ps
}

// pairLocal answers the questions of the answering side of a pair.
type pairLocal struct{ p *peer }

func (l pairLocal) Ready() bool {
	g := l.p.g
	return g.gpu != nil && g.gpu.ipc != nil
}

func (l pairLocal) CanReach(peerDevice string) bool {
	g := l.p.g
	return g.gpu != nil && g.gpu.ipc != nil && l.p.local && g.gpu.ipc.dev.canReach(peerDevice)
}

func (pr *ipcPair) state() ipc.State {
	pr.mu.Lock()
	defer pr.mu.Unlock()
	return pr.s.State()
}

func (pr *ipcPair) peerService() string {
	pr.mu.Lock()
	defer pr.mu.Unlock()
	return pr.service
}

// fail sets the pair BAD.
func (pr *ipcPair) fail() {
	pr.mu.Lock()
	pr.s.Fail()
	pr.mu.Unlock()
}

// ready reports whether the pair is set up, and starts setting it up from
// INIT (in the background: this transfer goes through host memory).
func (pr *ipcPair) ready() bool {
	pr.mu.Lock()
	if st := pr.s.State(); st == ipc.OK || st == ipc.Bad || pr.calling {
		pr.mu.Unlock()
		return st == ipc.OK
	}
	out := pr.s.Start()
	if len(out) == 0 {
		pr.mu.Unlock()
		return false
	}
	pr.calling = true
	pr.mu.Unlock()
	g := pr.p.g
	g.mu.Lock()
	if g.closed {
		g.mu.Unlock()
		pr.mu.Lock()
		pr.calling = false
		pr.s.Unanswered()
		pr.mu.Unlock()
		return false
	}
	g.wg.Add(1)
	g.mu.Unlock()
	go func() {
		defer g.wg.Done()
		pr.send(out)
		pr.mu.Lock()
		pr.calling = false
		pr.mu.Unlock()
	}()
	return false
}

// stamp adds this side's descriptor service to the messages that carry it.
func (pr *ipcPair) stamp(ms []ipc.Msg) {
	g := pr.p.g
	if g.gpu == nil || g.gpu.ipc == nil || g.gpu.ipc.fds == nil {
		return
	}
	for i := range ms {
		if ms[i].Kind == ipc.KindRequest || ms[i].Kind == ipc.KindAck {
			ms[i].Handle = []byte(g.gpu.ipc.fds.Name())
		}
	}
}

// send sends the pair's messages to the peer, one Call each, and applies
// the answers that come back in the replies (which may be more messages to
// send). A request that gets no answer counts as "not ready".
func (pr *ipcPair) send(ms []ipc.Msg) {
	g := pr.p.g
	pr.stamp(ms)
	for _, m := range ms {
		ctx, cancel := context.WithTimeout(g.ctx, 10*time.Second)
		reply, err := g.boot.Call(ctx, pr.p.rank, connMsg{kind: ipcMsg, payload: m.Append(nil)}.Append(nil))
		cancel()
		var answers []ipc.Msg
		if err == nil {
			answers, err = decodeIPCMsgs(reply)
		}
		if err != nil {
			pr.mu.Lock()
			if m.Kind == ipc.KindRequest {
				pr.s.Unanswered()
			}
			st := pr.s.State()
			pr.mu.Unlock()
			g.log.Debug("gdrlink: on-node GPU setup message not answered", "rank", g.Rank(), "peer", pr.p.rank, "msg", m.Kind, "state", st, "err", err)
			continue
		}
		var next []ipc.Msg
		pr.mu.Lock()
		for _, a := range answers {
			if a.Kind == ipc.KindAck && len(a.Handle) > 0 {
				pr.service = string(a.Handle)
			}
			out, err := pr.s.Receive(a)
			if err != nil {
				g.log.Warn("gdrlink: on-node GPU setup", "rank", g.Rank(), "peer", pr.p.rank, "err", err)
				continue
			}
			next = append(next, out...)
		}
		st := pr.s.State()
		pr.mu.Unlock()
		if st == ipc.OK || st == ipc.Bad {
			pr.logDecided(st)
		}
		if len(next) > 0 {
			pr.send(next)
		}
	}
}

func (pr *ipcPair) logDecided(st ipc.State) {
	pr.mu.Lock()
	once := !pr.decided
	pr.decided = true
	pr.mu.Unlock()
	if !once {
		return
	}
	g := pr.p.g
	how := "device-to-device copies pulled by the receiver"
	if st == ipc.Bad {
		how = "host memory (the GPUs cannot reach each other, or the peer's GPU never came up)"
	}
	g.log.Info("gdrlink: on-node GPU path decided", "rank", g.Rank(), "peer", pr.p.rank, "state", st.String(), "tensors_go_through", how)
}

// dropIPCPeer closes this rank's mappings of rank's GPU arenas: the peer
// left (its process died or was replaced).
func (g *Group) dropIPCPeer(rank int) {
	if g.gpu == nil || g.gpu.ipc == nil {
		return
	}
	if err := g.gpu.ipc.cache.DropPeer(uint32(rank)); err != nil {
		g.log.Warn("gdrlink: closing the mappings of a peer's GPU arenas", "rank", g.Rank(), "peer", rank, "err", err)
	}
}

// onIPC answers a peer's on-node path message (a bootstrap Call from rank
// from). A RELEASE is answered even while this group closes: the peer
// waits for it to free its memory.
func (g *Group) onIPC(from int, payload []byte) ([]byte, error) {
	m, err := ipc.Decode(payload)
	if err != nil {
		return nil, err
	}
	if int(m.From) != from {
		return nil, fmt.Errorf("%w: rank %d sent a message as rank %d", ipc.ErrProtocol, from, m.From)
	}
	if m.Kind == ipc.KindRelease {
		if g.gpu == nil || g.gpu.ipc == nil {
			return nil, nil
		}
		c := g.gpu.ipc.cache
		if m.Arena == releaseAll {
			return nil, c.DropPeer(m.From)
		}
		return nil, c.Release(m.From, m.Arena)
	}
	p, err := g.peer(from)
	if err != nil {
		return nil, err
	}
	pr := p.ipcPair()
	pr.mu.Lock()
	if m.Kind == ipc.KindRequest && len(m.Handle) > 0 {
		pr.service = string(m.Handle)
	}
	out, err := pr.s.Receive(m)
	st := pr.s.State()
	pr.mu.Unlock()
	if err != nil {
		return nil, err
	}
	if st == ipc.OK || st == ipc.Bad {
		pr.logDecided(st)
	}
	pr.stamp(out)
	var b []byte
	for _, o := range out {
		e := o.Append(nil)
		b = binary.BigEndian.AppendUint16(b, uint16(len(e)))
		b = append(b, e...)
	}
	return b, nil
}

// decodeIPCMsgs decodes a reply of length-prefixed messages.
func decodeIPCMsgs(b []byte) ([]ipc.Msg, error) {
	var ms []ipc.Msg
	for len(b) > 0 {
		if len(b) < 2 || len(b) < 2+int(binary.BigEndian.Uint16(b)) {
			return nil, fmt.Errorf("%w: truncated reply of %d bytes", ipc.ErrBadMessage, len(b))
		}
		n := int(binary.BigEndian.Uint16(b))
		m, err := ipc.Decode(b[2 : 2+n])
		if err != nil {
			return nil, err
		}
		ms = append(ms, m)
		b = b[2+n:]
	}
	return ms, nil
}

// ipcPuller is a channel's Puller to one peer.
type ipcPuller struct {
	ipc *gpuIPC
	p   *peer
}

func (u *ipcPuller) Ready(dev tensor.Device) bool {
	g := u.p.g
	if g.gpu == nil || dev.Kind != tensor.GPU || dev.Index != g.gpu.ordinal {
		return false
	}
	return u.p.ipcPair().ready()
}

func (u *ipcPuller) Export(src tensor.Buffer, n int) (rendezvous.PullRef, bool) {
	if u.p.ipcPair().state() != ipc.OK {
		return rendezvous.PullRef{}, false
	}
	return u.ipc.export(src, n)
}

func (u *ipcPuller) Alloc(n int, dev tensor.Device) (tensor.Buffer, error) {
	return u.p.g.allocGPU(n, dev)
}

func (u *ipcPuller) Pull(ref rendezvous.PullRef, dst tensor.Buffer, done func(error)) {
	go func() { done(u.ipc.pull(u.p, ref, dst)) }()
}

package rendezvous

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/internal/wire"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

// The bounds on what a peer may make a channel hold: its requests for
// tensors not sent yet (WithMaxPendingRequests), its names (WithMaxNames)
// and the memory of our results (the pool's limit). The floods come from a
// raw peer (rawPeer): a queue pair driven by hand that writes control
// frames and keeps nothing of what it sends, so that the heap measured is
// the victim channel's.

// rawPeer is a hostile peer: a queue pair, completion queue and buffers of
// a channel that is never connected as one (no completion goroutine runs),
// driven by the test. It writes frames as the protocol lays them out,
// packed into SENDs as the victim's credits allow, returns the victim's
// credits, and counts what comes back.
type rawPeer struct {
	t *testing.T
	s *side
	c *Channel

	credits   int // the victim's posted receives we may use
	owed      int // our receives re-posted and not returned yet
	threshold int
	free      []int // send slots
	cur, n    int   // the SEND being filled (-1: none) and its length
	comps     []verbsio.Completion
	// hoard: return no credits (the victim's answers still land: our
	// receives are re-posted, as a NIC's would be).
	hoard bool

	codes map[wire.Code]int    // ERROR_STATUS received, by code
	texts map[wire.Code]string // the first text of each code
	imms  map[uint32]int       // writes with immediate received, by immediate
	other map[wire.Type]int    // other frames received
	watch map[uint32]string    // "code: text" of the ERROR_STATUS for the requests watched
}

// victimAndRawPeer makes a channel (the victim, named "victim", with opts)
// and a raw peer connected to it.
func victimAndRawPeer(t *testing.T, provider string, opts ...Option) (*side, *rawPeer) {
	t.Helper()
	v, err := openSide(provider, "victim", opts...)
	if err != nil {
		skipUnavailable(t, provider, err)
	}
	t.Cleanup(func() {
		if err := v.close(); err != nil {
			t.Errorf("closing the victim: %v", err)
		}
	})
	// Its requests carry arena rkeys; it takes no EAGER (it reads frames
	// of its own).
	s, err := openArenaKeySide(provider, "raw", WithEager(0))
	if err != nil {
		skipUnavailable(t, provider, err)
	}
	t.Cleanup(func() { // before the victim's: cleanups run last first
		if err := s.close(); err != nil {
			t.Errorf("closing the raw peer: %v", err)
		}
	})
	p := &rawPeer{t: t, s: s, c: s.ch, cur: -1, comps: make([]verbsio.Completion, 64),
		codes: map[wire.Code]int{}, texts: map[wire.Code]string{}, imms: map[uint32]int{}, other: map[wire.Type]int{}, watch: map[uint32]string{}}
	var hm wire.Message
	vh := v.ch.Hello()
	if _, err := wire.Decode(vh, &hm); err != nil {
		t.Fatal(err)
	}
	e := hm.Endpoints[0]
	ep := verbsio.Endpoint{Provider: string(e.Provider), Host: string(e.Host), Data: append([]byte(nil), e.Data...)}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	var verr error
	wg.Add(1)
	go func() { defer wg.Done(); verr = v.ch.Connect(ctx, p.c.Hello()) }()
	perr := p.c.qp.Connect(ctx, ep)
	wg.Wait()
	if verr != nil || perr != nil {
		t.Fatalf("connect: victim %v, raw peer %v", verr, perr)
	}
	if !p.c.posted {
		all := make([]verbsio.RecvWR, p.c.opts.ring)
		for i := range all {
			all[i] = p.c.recvWR(i)
		}
		if err := p.c.qp.PostRecv(all); err != nil {
			t.Fatal(err)
		}
		p.c.posted = true
	}
	p.credits = int(hm.Ring)
	p.threshold = max(2, p.c.opts.ring/4)
	for i := p.c.opts.sendSlots - 1; i >= 0; i-- {
		p.free = append(p.free, i)
	}
	return v, p
}

func (p *rawPeer) buf(slot int) []byte {
	return p.c.sendBuf.Bytes()[slot*p.c.slot : (slot+1)*p.c.slot]
}

// frame adds m to the SEND being filled, posting that one first when m
// does not fit, and waiting for a credit (one stays in reserve for CREDIT)
// and a send slot.
func (p *rawPeer) frame(m *wire.Message) {
	p.t.Helper()
	if !p.tryFrame(m, 30*time.Second) {
		p.t.Fatalf("raw peer: no credit for 30s (%d credits, %d free slots)", p.credits, len(p.free))
	}
}

// tryFrame is frame that gives up when no credit comes for patience.
func (p *rawPeer) tryFrame(m *wire.Message, patience time.Duration) bool {
	p.t.Helper()
	if p.cur >= 0 && p.n+m.Len() > p.c.slot {
		p.flush()
	}
	if p.cur < 0 {
		deadline := time.Now().Add(patience)
		for p.credits <= 1 || len(p.free) == 0 {
			if time.Now().After(deadline) {
				return false
			}
			p.poll(min(patience, 100*time.Millisecond))
		}
		p.cur, p.n = p.free[len(p.free)-1], 0
		p.free = p.free[:len(p.free)-1]
	}
	b := p.buf(p.cur)
	p.n += len(m.Append(b[p.n:p.n]))
	return true
}

// flush posts the SEND being filled, returning the credits owed in its
// first frame's header.
func (p *rawPeer) flush() {
	p.t.Helper()
	if p.cur < 0 {
		return
	}
	b := p.buf(p.cur)
	k := min(p.owed, 0xffff)
	if p.hoard {
		k = 0
	}
	b[2], b[3] = byte(k), byte(k>>8)
	p.owed -= k
	wr := verbsio.SendWR{WRID: wridCtrl | uint64(p.cur), Op: verbsio.OpSend, Signaled: true,
		SG: []verbsio.SGE{{Addr: p.c.sendBuf.Addr() + uintptr(p.cur*p.c.slot), Length: uint32(p.n), LKey: p.c.sendMR.LKey()}}}
	if err := p.c.qp.PostSend([]verbsio.SendWR{wr}); err != nil {
		p.t.Fatalf("raw peer: posting a SEND: %v", err)
	}
	p.credits--
	p.cur = -1
}

// poll takes the completions that arrive within d.
func (p *rawPeer) poll(d time.Duration) {
	p.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	n, err := p.c.cq.Wait(ctx, p.comps)
	cancel()
	if err != nil {
		if ctx.Err() == nil {
			p.t.Fatalf("raw peer: completion queue: %v", err)
		}
		n = 0 // nothing came: still return credits below
	}
	for i := range p.comps[:n] {
		wc := &p.comps[i]
		if wc.Status != verbsio.StatusSuccess {
			p.t.Fatalf("raw peer: %s completed with %s", wc.Op, wc.Status)
		}
		id := wc.WRID &^ wridKind
		switch wc.WRID & wridKind {
		case wridCtrl:
			p.free = append(p.free, int(id))
		case wridRecv:
			if wc.Op == verbsio.OpRecvImm || wc.HasImm {
				p.imms[wc.Imm]++
			} else {
				p.frames(p.c.recvBuf.Bytes()[int(id)*p.c.slot:][:wc.ByteLen])
			}
			if err := p.c.qp.PostRecv([]verbsio.RecvWR{p.c.recvWR(int(id))}); err != nil {
				p.t.Fatalf("raw peer: re-posting a receive: %v", err)
			}
			p.owed++
		}
	}
	// Return credits alone when many are owed and nothing carries them.
	if p.cur < 0 && !p.hoard && p.owed >= p.threshold && p.credits >= 1 && len(p.free) > 0 {
		p.cur, p.n = p.free[len(p.free)-1], 0
		p.free = p.free[:len(p.free)-1]
		m := wire.Message{Type: wire.TypeCredit}
		p.n = len(m.Append(p.buf(p.cur)[:0]))
		p.flush()
	}
}

func (p *rawPeer) frames(b []byte) {
	var m wire.Message
	for len(b) > 0 {
		n, err := wire.Decode(b, &m)
		if err != nil {
			p.t.Fatalf("raw peer: the victim sent a bad frame: %v", err)
		}
		b = b[n:]
		p.credits += int(m.Credits)
		switch m.Type {
		case wire.TypeCredit:
		case wire.TypeError:
			p.codes[m.Code]++
			if _, ok := p.texts[m.Code]; !ok {
				p.texts[m.Code] = string(m.Text)
			}
			if _, ok := p.watch[m.Req]; ok {
				p.watch[m.Req] = fmt.Sprintf("%s: %s", m.Code, m.Text)
			}
		default:
			p.other[m.Type]++
		}
	}
}

// waitUntil posts what is being filled and takes completions until cond
// holds (30s at most).
func (p *rawPeer) waitUntil(what string, cond func() bool) {
	p.t.Helper()
	p.flush()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			p.t.Fatalf("raw peer: %s did not happen in 30s (errors %v, writes %v, other %v)", what, p.codes, p.imms, p.other)
		}
		p.poll(50 * time.Millisecond)
	}
}

// rawRequest is a TENSOR_REQUEST of name index idx (defining it as name when
// name is not empty) with no result buffer.
func rawRequest(req, idx uint32, name []byte, step int64) wire.Message {
	m := wire.Message{Type: wire.TypeRequest, Req: req, Step: step, NameIndex: idx}
	if name != nil {
		m.Flags |= wire.ReqName
		m.Name = name
	}
	return m
}

// requestInto is rawRequest with a result buffer from the raw peer's pool
// sized for meta, so that the victim writes at once.
func (p *rawPeer) requestInto(req, idx uint32, name []byte, step int64, meta tensor.Meta, res tensor.Buffer) wire.Message {
	p.t.Helper()
	mr, ok := p.c.mem.Region(res.Addr(), res.Len())
	if !ok {
		p.t.Fatal("raw peer: result buffer not registered")
	}
	m := rawRequest(req, idx, name, step)
	m.Flags |= wire.ReqMeta
	m.Meta.SetMeta(meta)
	m.Addr, m.RKey, m.Capacity = uint64(res.Addr()), mr.RKey(), uint64(res.Len())
	return m
}

// legitResult is a result buffer of the raw peer's for a float32[1024].
func (p *rawPeer) legitResult() (tensor.Meta, tensor.Buffer) {
	p.t.Helper()
	meta, err := tensor.MetaFor(tensor.Float32, tensor.Shape{1024})
	if err != nil {
		p.t.Fatal(err)
	}
	res, err := p.c.mem.Alloc(int(meta.ByteSize), tensor.Host)
	if err != nil {
		p.t.Fatal(err)
	}
	p.t.Cleanup(func() { _ = res.Free() })
	return meta, res
}

// sendLegit sends the victim's patterned float32[1024] "legit" at step.
func sendLegit(t *testing.T, v *side, step int64) {
	t.Helper()
	src, err := makeTensor(v.pool, "float32", tensor.Shape{1024}, "legit", step)
	if err != nil {
		t.Fatal(err)
	}
	if err := v.ch.Send("legit", step, src); err != nil {
		t.Fatal(err)
	}
}

// goroutineSlack is how many more goroutines than before a flood the
// victim may run once it was answered: timers and pollers come and go; a
// goroutine per request or name would be thousands.
const goroutineSlack = 16

// goroutinesAfter is the goroutine count once it has settled within
// goroutineSlack of before, or after 5 s, whichever comes first.
func goroutinesAfter(before int) int {
	n := runtime.NumGoroutine()
	for deadline := time.Now().Add(5 * time.Second); n > before+goroutineSlack && time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		n = runtime.NumGoroutine()
	}
	return n
}

// checkGoroutines fails the test if the flood left more than
// goroutineSlack goroutines behind.
func checkGoroutines(t *testing.T, before, after int) {
	t.Helper()
	if after > before+goroutineSlack {
		t.Errorf("goroutines grew from %d to %d under the flood", before, after)
	}
}

// heapInUse is the heap in use after a collection.
func heapInUse() uint64 {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapInuse
}

// A peer that asks for 100k tensors never sent gets the first 4096 parked
// and each other one refused with ERROR_STATUS naming the bound; the
// victim's heap stays flat, an early request parked before the flood is
// still served byte for byte, and a slot freed by a Send takes a new
// request again.
func TestRequestFloodIsBounded(t *testing.T) {
	forEachProvider(t, func(t *testing.T, provider string) {
		const flood = 100_000
		limit := defaultMaxPending
		v, p := victimAndRawPeer(t, provider)
		meta, res := p.legitResult()
		legit := p.requestInto(1, 1, []byte("legit"), 0, meta, res)
		p.frame(&legit)
		p.waitUntil("the early request parked", func() bool { return v.ch.Stats().RequestsParked == 1 })

		before, gBefore := heapInUse(), runtime.NumGoroutine()
		ghost := []byte("ghost")
		for i := 0; i < flood; i++ {
			var name []byte
			if i == 0 {
				name = ghost // defines index 2; the others use it
			}
			m := rawRequest(uint32(2+i), 2, name, int64(i))
			p.frame(&m)
		}
		refused := flood - (limit - 1)
		p.waitUntil("the refusals", func() bool { return p.codes[wire.CodeLimit] >= refused })
		after, gAfter := heapInUse(), goroutinesAfter(gBefore)
		st := v.ch.Stats()
		growth := int64(after) - int64(before)
		t.Logf("%s: %d requests for tensors never sent: heap in use %.1f MiB before, %.1f MiB after (%+.1f MiB); goroutines %d before, %d after; %d parked, %d refused",
			provider, flood, mib(before), mib(after), float64(growth)/(1<<20), gBefore, gAfter, st.RequestsParked, st.PendingRefused)
		checkGoroutines(t, gBefore, gAfter)

		if st.RequestsParked != limit || st.PendingRefused != uint64(refused) || st.NamesRefused != 0 || st.Names != 2 {
			t.Errorf("victim: %d parked, %d and %d refused, %d names; want %d, %d, 0 and 2", st.RequestsParked, st.PendingRefused, st.NamesRefused, st.Names, limit, refused)
		}
		if got := p.codes[wire.CodeLimit]; got != refused || len(p.codes) != 1 {
			t.Errorf("raw peer got ERROR_STATUS %v, want %d of %s", p.codes, refused, wire.CodeLimit)
		}
		if txt := p.texts[wire.CodeLimit]; !strings.Contains(txt, fmt.Sprintf("WithMaxPendingRequests=%d", limit)) {
			t.Errorf("refusal %q does not name the bound", txt)
		}
		// Unbounded, each of the 100k would stay: several hundred bytes
		// each. 4096 parked take about 2 MiB.
		if growth > 32<<20 {
			t.Errorf("the victim's heap grew by %.1f MiB under the flood", float64(growth)/(1<<20))
		}
		if err := v.ch.Err(); err != nil {
			t.Fatalf("the flood broke the channel: %v", err)
		}

		// The early request is served, byte for byte.
		sendLegit(t, v, 0)
		p.waitUntil("the legit write", func() bool { return p.imms[1] == 1 })
		if err := checkFill(res.Bytes()[:meta.ByteSize], seedOf("legit", 0)); err != nil {
			t.Fatalf("legit tensor: %v", err)
		}
		// Its slot takes one new request; the next is refused again.
		for i := flood; i < flood+2; i++ {
			m := rawRequest(uint32(2+i), 2, nil, int64(i))
			p.frame(&m)
		}
		p.waitUntil("one more refusal", func() bool { return p.codes[wire.CodeLimit] == refused+1 })
		if st := v.ch.Stats(); st.RequestsParked != limit || st.PendingRefused != uint64(refused+1) {
			t.Errorf("after the Send: %d parked, %d refused; want %d and %d", st.RequestsParked, st.PendingRefused, limit, refused+1)
		}
		// And a Send first, request second, works as ever.
		sendLegit(t, v, 1)
		legit = p.requestInto(uint32(flood+10), 1, nil, 1, meta, res)
		p.frame(&legit)
		p.waitUntil("the second legit write", func() bool { return p.imms[uint32(flood+10)] == 1 })
		if err := checkFill(res.Bytes()[:meta.ByteSize], seedOf("legit", 1)); err != nil {
			t.Fatalf("legit tensor, step 1: %v", err)
		}
		if err := v.ch.Err(); err != nil {
			t.Fatalf("channel: %v", err)
		}
	})
}

// A peer that defines 100k names of 256 bytes gets the first ones (up to
// WithMaxNames) and each other refused with ERROR_STATUS naming the bound,
// as is a later use of a refused index, without failing the channel; the
// victim's heap stays flat, and the names defined before go on working.
func TestNameFloodIsBounded(t *testing.T) {
	forEachProvider(t, func(t *testing.T, provider string) {
		const flood, names, nameLen = 100_000, 8192, 256
		pending := defaultMaxPending
		v, p := victimAndRawPeer(t, provider, WithMaxNames(names))
		meta, res := p.legitResult()
		legit := p.requestInto(1, 1, []byte("legit"), 0, meta, res)
		p.frame(&legit)
		p.waitUntil("the early request parked", func() bool { return v.ch.Stats().RequestsParked == 1 })

		before, gBefore := heapInUse(), runtime.NumGoroutine()
		name := make([]byte, nameLen)
		for i := 0; i < flood; i++ {
			copy(name, fmt.Sprintf("%0*d", nameLen, i))
			m := rawRequest(uint32(2+i), uint32(2+i), name, 0)
			p.frame(&m)
		}
		// "legit" is one name and one parked request: of the names the
		// victim takes, the first parked requests fill the pending bound
		// and the others are refused for it.
		accepted := names - 1
		namesRefused := flood - accepted
		pendingRefused := accepted - (pending - 1)
		p.waitUntil("the refusals", func() bool { return p.codes[wire.CodeLimit] >= namesRefused+pendingRefused })
		after, gAfter := heapInUse(), goroutinesAfter(gBefore)
		st := v.ch.Stats()
		growth := int64(after) - int64(before)
		t.Logf("%s: %d names of %d bytes: heap in use %.1f MiB before, %.1f MiB after (%+.1f MiB); goroutines %d before, %d after; %d names kept, %d refused (%d requests refused for the pending bound)",
			provider, flood, nameLen, mib(before), mib(after), float64(growth)/(1<<20), gBefore, gAfter, st.Names, st.NamesRefused, st.PendingRefused)
		checkGoroutines(t, gBefore, gAfter)

		if st.Names != names || st.NamesRefused != uint64(namesRefused) || st.PendingRefused != uint64(pendingRefused) || st.RequestsParked != pending {
			t.Errorf("victim: %d names, %d refused for names, %d for pending, %d parked; want %d, %d, %d, %d",
				st.Names, st.NamesRefused, st.PendingRefused, st.RequestsParked, names, namesRefused, pendingRefused, pending)
		}
		if got := p.codes[wire.CodeLimit]; got != namesRefused+pendingRefused || len(p.codes) != 1 {
			t.Errorf("raw peer got ERROR_STATUS %v, want %d of %s", p.codes, namesRefused+pendingRefused, wire.CodeLimit)
		}
		// Unbounded, 100k names of 256 bytes stay: some 30 MiB.
		if growth > 16<<20 {
			t.Errorf("the victim's heap grew by %.1f MiB under the flood", float64(growth)/(1<<20))
		}

		// A refused name's index, used alone, is refused again; a new
		// name too; the channel goes on.
		last := uint32(2 + flood - 1)
		p.watch[last+1], p.watch[last+2] = "", ""
		again := rawRequest(last+1, last, nil, 1)
		p.frame(&again)
		fresh := rawRequest(last+2, last+1, []byte("one too many"), 0)
		p.frame(&fresh)
		p.waitUntil("two more refusals", func() bool { return p.watch[last+1] != "" && p.watch[last+2] != "" })
		for req, txt := range p.watch {
			if !strings.HasPrefix(txt, wire.CodeLimit.String()) || !strings.Contains(txt, fmt.Sprintf("WithMaxNames=%d", names)) {
				t.Errorf("request %d: %q, want a refusal naming WithMaxNames=%d", req, txt, names)
			}
		}
		if err := v.ch.Err(); err != nil {
			t.Fatalf("the flood broke the channel: %v", err)
		}
		if st := v.ch.Stats(); st.Names != names || st.NamesRefused != uint64(namesRefused+2) {
			t.Errorf("after: %d names, %d refused; want %d and %d", st.Names, st.NamesRefused, names, namesRefused+2)
		}

		// The early request is served, byte for byte.
		sendLegit(t, v, 0)
		p.waitUntil("the legit write", func() bool { return p.imms[1] == 1 })
		if err := checkFill(res.Bytes()[:meta.ByteSize], seedOf("legit", 0)); err != nil {
			t.Fatalf("legit tensor: %v", err)
		}
	})
}

// A peer that floods requests and returns no credits cannot make the
// victim queue answers without bound: past maxQueuedErrors queued
// ERROR_STATUS the victim holds its credits back, so the flood stops
// after a few tens of thousands of requests instead of the million and
// more that the victim's own sends would otherwise have let through. Once
// the peer returns credits, every answer arrives and the channel goes on.
func TestPeerThatTakesNoAnswersIsThrottled(t *testing.T) {
	forEachProvider(t, func(t *testing.T, provider string) {
		const most = 1_000_000
		v, p := victimAndRawPeer(t, provider)
		p.hoard = true
		before, gBefore := heapInUse(), runtime.NumGoroutine()
		sent := 0
		ghost := []byte("ghost")
		for ; sent < most; sent++ {
			var name []byte
			if sent == 0 {
				name = ghost
			}
			m := rawRequest(uint32(1+sent), 1, name, int64(sent))
			if !p.tryFrame(&m, time.Second) {
				break
			}
		}
		p.flush()
		time.Sleep(100 * time.Millisecond) // the last SENDs land
		after, gAfter := heapInUse(), goroutinesAfter(gBefore)
		v.ch.mu.Lock()
		queued, outq, credits := v.ch.snd.errorsQueued, len(v.ch.outq), v.ch.credits
		v.ch.mu.Unlock()
		// Each frame the peer sends holds at most this many requests.
		perFrame := wire.MaxFrame / 45
		bound := maxQueuedErrors + 2*defaultRing*perFrame
		t.Logf("%s: a peer that returns no credits sent %d requests before the victim stopped giving it credits; the victim queues %d ERROR_STATUS (%d items, %d credits left); heap in use %.1f MiB before, %.1f MiB after; goroutines %d before, %d after",
			provider, sent, queued, outq, credits, mib(before), mib(after), gBefore, gAfter)
		checkGoroutines(t, gBefore, gAfter)
		if sent >= most || queued > bound {
			t.Errorf("%d requests sent, %d answers queued; want the flood stopped with at most %d queued", sent, queued, bound)
		}
		if growth := int64(after) - int64(before); growth > 32<<20 {
			t.Errorf("the victim's heap grew by %.1f MiB", float64(growth)/(1<<20))
		}

		// The peer takes its answers: all arrive, and the channel works.
		p.hoard = false
		refused := sent - defaultMaxPending
		p.waitUntil("every answer", func() bool { return p.codes[wire.CodeLimit] == refused })
		if st := v.ch.Stats(); st.RequestsParked != defaultMaxPending || st.PendingRefused != uint64(refused) {
			t.Errorf("victim: %d parked, %d refused; want %d and %d", st.RequestsParked, st.PendingRefused, defaultMaxPending, refused)
		}
		meta, res := p.legitResult()
		sendLegit(t, v, 0)
		legit := p.requestInto(uint32(most+1), 2, []byte("legit"), 0, meta, res)
		p.frame(&legit)
		p.waitUntil("the legit write", func() bool { return p.imms[uint32(most+1)] == 1 })
		if err := checkFill(res.Bytes()[:meta.ByteSize], seedOf("legit", 0)); err != nil {
			t.Fatalf("legit tensor: %v", err)
		}
		if err := v.ch.Err(); err != nil {
			t.Fatalf("channel: %v", err)
		}
	})
}

func mib(n uint64) float64 { return float64(n) / (1 << 20) }

// outcome is how a Recv started by recvFunc ended.
type outcome struct {
	key  string
	step int64
	t    *tensor.Tensor
	err  error
}

func recvFunc(c *Channel, ctx context.Context, key string, step int64, out chan<- outcome) {
	c.RecvFunc(ctx, key, step, func(t *tensor.Tensor, _ Transfer, err error) { out <- outcome{key, step, t, err} })
}

func wait(t *testing.T, out <-chan outcome) outcome {
	t.Helper()
	select {
	case o := <-out:
		return o
	case <-time.After(20 * time.Second):
		t.Fatal("no Recv completed in 20s")
	}
	return outcome{}
}

// The peer's Recv refused for a bound fails with ErrLimit (and ErrRemote),
// naming the bound, its value and the refusing peer; the refusing side
// counts it; a Recv withdrawn frees its parked slot; and the channel goes
// on, byte for byte.
func TestLimitsFailThePeersRecv(t *testing.T) {
	forEachProvider(t, func(t *testing.T, provider string) {
		const pending, names = 8, 16
		a, b := pair(t, provider, WithMaxPendingRequests(pending), WithMaxNames(names))
		ctx := recvCtx(t)
		out := make(chan outcome, 64)

		// An early Recv, then more for tensors not sent than a may park.
		recvFunc(b.ch, ctx, "legit", 0, out)
		const ghosts = 20
		for step := int64(0); step < ghosts; step++ {
			recvFunc(b.ch, ctx, "ghost", step, out)
		}
		for i := 0; i < ghosts-(pending-1); i++ {
			o := wait(t, out)
			if o.key != "ghost" || !errors.Is(o.err, ErrLimit) || !errors.Is(o.err, ErrRemote) {
				t.Fatalf("%s step %d: %v, want ErrLimit and ErrRemote", o.key, o.step, o.err)
			}
			if msg := o.err.Error(); !strings.Contains(msg, fmt.Sprintf("WithMaxPendingRequests=%d", pending)) || !strings.Contains(msg, "a for \"ghost\"") {
				t.Errorf("error %q does not name the bound and the peer", msg)
			}
		}
		st := a.ch.Stats()
		if st.RequestsParked != pending || st.PendingRefused != ghosts-(pending-1) {
			t.Errorf("a: %d parked, %d refused; want %d and %d", st.RequestsParked, st.PendingRefused, pending, ghosts-(pending-1))
		}
		if e := b.ch.Stats().Errors; e != ghosts-(pending-1) {
			t.Errorf("b counted %d ERROR_STATUS, want %d", e, ghosts-(pending-1))
		}

		// Still full; a Send frees a slot, and so does a withdrawn Recv.
		recvFunc(b.ch, ctx, "ghost", 100, out)
		if o := wait(t, out); !errors.Is(o.err, ErrLimit) {
			t.Fatalf("ghost step 100: %v, want ErrLimit", o.err)
		}
		src, err := makeTensor(a.pool, "float32", tensor.Shape{256}, "ghost", 0)
		if err != nil {
			t.Fatal(err)
		}
		if err := a.ch.Send("ghost", 0, src); err != nil {
			t.Fatal(err)
		}
		o := wait(t, out)
		if o.err != nil || o.key != "ghost" || o.step != 0 {
			t.Fatalf("%s step %d: %v, want ghost step 0", o.key, o.step, o.err)
		}
		if err := checkTensor(o.t, "float32", tensor.Shape{256}, "ghost", 0); err != nil {
			t.Fatal(err)
		}
		_ = o.t.Release()
		waitParked(t, a.ch, pending-1)
		cctx, cancel := context.WithCancel(ctx)
		recvFunc(b.ch, cctx, "ghost", 200, out) // takes the slot
		waitParked(t, a.ch, pending)
		cancel() // CANCEL frees it
		if o := wait(t, out); !errors.Is(o.err, ErrCancelled) {
			t.Fatalf("cancelled Recv: %v", o.err)
		}
		waitParked(t, a.ch, pending-1)

		// Names: b has defined 2 ("legit", "ghost"); the next 14 are
		// taken (one parked, the others refused for the pending bound),
		// the rest refused for names. Using a refused name again is
		// refused again, not a protocol violation.
		const fresh = 20
		for i := 0; i < fresh; i++ {
			recvFunc(b.ch, ctx, fmt.Sprint("n", i), 0, out)
		}
		byBound := map[string]int{}
		for i := 0; i < fresh-1; i++ {
			o := wait(t, out)
			if !errors.Is(o.err, ErrLimit) {
				t.Fatalf("%s: %v, want ErrLimit", o.key, o.err)
			}
			switch msg := o.err.Error(); {
			case strings.Contains(msg, fmt.Sprintf("WithMaxNames=%d", names)):
				byBound["names"]++
			case strings.Contains(msg, fmt.Sprintf("WithMaxPendingRequests=%d", pending)):
				byBound["pending"]++
			default:
				t.Errorf("%s: %q names no bound", o.key, msg)
			}
		}
		if byBound["names"] != fresh-(names-2) || byBound["pending"] != names-2-1 {
			t.Errorf("refusals by bound %v, want %d for names and %d for pending", byBound, fresh-(names-2), names-2-1)
		}
		if _, _, err := b.ch.Recv(ctx, fmt.Sprint("n", fresh-1), 1); !errors.Is(err, ErrLimit) {
			t.Errorf("a refused name again: %v, want ErrLimit", err)
		}
		if st := a.ch.Stats(); st.Names != names || st.NamesRefused != fresh-(names-2)+1 {
			t.Errorf("a: %d names, %d refused for names; want %d and %d", st.Names, st.NamesRefused, names, fresh-(names-2)+1)
		}

		// The channel goes on: the early Recv and a later one, byte for
		// byte.
		for step := int64(0); step < 2; step++ {
			src, err := makeTensor(a.pool, "int32", tensor.Shape{4096}, "legit", step)
			if err != nil {
				t.Fatal(err)
			}
			if err := a.ch.Send("legit", step, src); err != nil {
				t.Fatal(err)
			}
		}
		o = wait(t, out)
		if o.err != nil || o.key != "legit" {
			t.Fatalf("%s step %d: %v, want legit", o.key, o.step, o.err)
		}
		if err := checkTensor(o.t, "int32", tensor.Shape{4096}, "legit", 0); err != nil {
			t.Fatal(err)
		}
		_ = o.t.Release()
		got, _, err := b.ch.Recv(ctx, "legit", 1)
		if err != nil {
			t.Fatal(err)
		}
		if err := checkTensor(got, "int32", tensor.Shape{4096}, "legit", 1); err != nil {
			t.Fatal(err)
		}
		_ = got.Release()
		if a.ch.Err() != nil || b.ch.Err() != nil {
			t.Fatalf("channels: %v / %v", a.ch.Err(), b.ch.Err())
		}
	})
}

func waitParked(t *testing.T, c *Channel, n int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for c.Stats().RequestsParked != n {
		if time.Now().After(deadline) {
			t.Fatalf("%d requests parked, want %d", c.Stats().RequestsParked, n)
		}
		time.Sleep(time.Millisecond)
	}
}

// limitedSide is openSide whose channel takes its memory from a pool of
// limit bytes.
func limitedSide(t *testing.T, provider, name string, limit int64) *side {
	t.Helper()
	s, err := openSide(provider, name)
	if err != nil {
		skipUnavailable(t, provider, err)
	}
	if err := s.ch.Close(); err != nil {
		t.Fatal(err)
	}
	s.ch = nil
	lp, err := alloc.New(alloc.NewMmapSource(alloc.MmapOptions{NUMANode: -1}), alloc.WithVisitors(registration(s.pd, 0)), alloc.WithName(name+" limited"), alloc.WithLimit(limit))
	if err != nil {
		_ = s.close()
		t.Fatal(err)
	}
	s.after = append(s.after, lp.Close)
	if s.ch, err = New(s.dev, s.pd, PoolMemory(regionOf, lp), WithName(name)); err != nil {
		_ = s.close()
		t.Fatal(err)
	}
	return s
}

// A result beyond the receiver's pool limit fails its Recv with
// alloc.ErrPoolExhausted naming the peer and the size; the receiver counts
// it and refuses it to the sender, whose Send fails with a RefusedError
// matching alloc.ErrPoolExhausted and gives the tensor's block back; the
// next tensor goes through.
func TestResultBeyondThePoolLimit(t *testing.T) {
	forEachProvider(t, func(t *testing.T, provider string) {
		const limit = 16 << 20
		a, err := openSide(provider, "a")
		if err != nil {
			skipUnavailable(t, provider, err)
		}
		b := limitedSide(t, provider, "b", limit)
		t.Cleanup(func() {
			if err := b.close(); err != nil {
				t.Errorf("closing b: %v", err)
			}
			if err := a.close(); err != nil {
				t.Errorf("closing a: %v", err)
			}
		})
		ctx := recvCtx(t)
		if err := connectSides(ctx, a, b); err != nil {
			t.Fatalf("connect: %v", err)
		}

		big := tensor.Shape{(2 * limit) / 4} // float32: twice the limit
		base := a.pool.Stats()
		src, err := makeTensor(a.pool, "float32", big, "huge", 0)
		if err != nil {
			t.Fatal(err)
		}
		sent := make(chan error, 1)
		if err := a.ch.SendFunc("huge", 0, src, func(err error) { _ = src.Release(); sent <- err }); err != nil {
			t.Fatal(err)
		}
		_, _, err = b.ch.Recv(ctx, "huge", 0)
		if !errors.Is(err, alloc.ErrPoolExhausted) {
			t.Fatalf("Recv of %d bytes into a pool of %d: %v, want ErrPoolExhausted", 2*limit, limit, err)
		}
		if msg := err.Error(); !strings.Contains(msg, "from a") || !strings.Contains(msg, fmt.Sprint(2*limit, " B")) {
			t.Errorf("error %q does not name the peer and the size", msg)
		}
		if st := b.ch.Stats(); st.ResultsRefused != 1 {
			t.Errorf("b: %d results refused, want 1", st.ResultsRefused)
		}
		// The sender learns it: the receiver's CANCEL with the reason
		// fails the Send, and the tensor goes back to its pool.
		var serr error
		select {
		case serr = <-sent:
		case <-time.After(5 * time.Second):
			t.Fatal("the refused Send is still pending after 5s")
		}
		var re *RefusedError
		if !errors.As(serr, &re) || !errors.Is(serr, alloc.ErrPoolExhausted) || !errors.Is(serr, ErrRemote) || re.Peer != "b" {
			t.Fatalf("refused Send: %v, want a RefusedError from b matching alloc.ErrPoolExhausted and ErrRemote", serr)
		}
		if msg := serr.Error(); !strings.Contains(msg, "peer b") || !strings.Contains(msg, "no memory") {
			t.Errorf("error %q does not name the peer and the reason", msg)
		}
		if st := a.ch.Stats(); st.Kept != 0 || st.SendsPending != 0 || st.SendsRefused != 1 {
			t.Errorf("a: %d kept, %d sends pending, %d refused; want 0, 0 and 1", st.Kept, st.SendsPending, st.SendsRefused)
		}
		if st := a.pool.Stats(); st.Blocks != base.Blocks || st.InUse != base.InUse {
			t.Errorf("a's pool: %d blocks, %d bytes in use after the refusal; %d and %d before", st.Blocks, st.InUse, base.Blocks, base.InUse)
		}

		src, err = makeTensor(a.pool, "float32", tensor.Shape{1 << 18}, "normal", 0)
		if err != nil {
			t.Fatal(err)
		}
		if err := a.ch.Send("normal", 0, src); err != nil {
			t.Fatal(err)
		}
		got, _, err := b.ch.Recv(ctx, "normal", 0)
		if err != nil {
			t.Fatal(err)
		}
		if err := checkTensor(got, "float32", tensor.Shape{1 << 18}, "normal", 0); err != nil {
			t.Fatal(err)
		}
		_ = got.Release()
		if a.ch.Err() != nil || b.ch.Err() != nil {
			t.Fatalf("channels: %v / %v", a.ch.Err(), b.ch.Err())
		}
	})
}

func TestLimitOptions(t *testing.T) {
	var o options
	for _, bad := range []Option{WithMaxPendingRequests(0), WithMaxPendingRequests(-1), WithMaxNames(0), WithMaxNames(1 << 32)} {
		if err := bad(&o); !errors.Is(err, ErrBadOption) {
			t.Errorf("accepted: %v", err)
		}
	}
	if o.pendingLimit() != defaultMaxPending || o.namesLimit() != defaultMaxNames {
		t.Errorf("defaults %d and %d, want %d and %d", o.pendingLimit(), o.namesLimit(), defaultMaxPending, defaultMaxNames)
	}
	if err := WithMaxPendingRequests(1)(&o); err != nil || o.pendingLimit() != 1 {
		t.Errorf("WithMaxPendingRequests(1): %v, %d", err, o.pendingLimit())
	}
	if err := WithMaxNames(1<<32 - 1)(&o); err != nil || o.namesLimit() != 1<<32-1 {
		t.Errorf("WithMaxNames(1<<32-1): %v, %d", err, o.namesLimit())
	}
	// A limit refusal from the peer matches both sentinels; other codes
	// only ErrRemote.
	if err := remoteErr(wire.CodeLimit); !errors.Is(err, ErrLimit) || !errors.Is(err, ErrRemote) {
		t.Errorf("CodeLimit: %v", err)
	}
	if err := remoteErr(wire.CodeSender); errors.Is(err, ErrLimit) || !errors.Is(err, ErrRemote) {
		t.Errorf("CodeSender: %v", err)
	}
}

// While more than maxQueuedErrors ERROR_STATUS wait to go out, the channel
// sends them with no credits in their headers as long as it has credits
// to spare; down to its last credit it returns what it owes, as ever, and
// once the queue is short again its frames carry credits again. The queue
// drains as the peer returns credits: nobody waits for ever.
func TestCreditsWithheldWhileAnswersPileUp(t *testing.T) {
	c, q := keepaliveChannel(t, 0)
	const ring = 8 // keepaliveChannel's, and its send slots
	perSend := wire.MaxFrame / (wire.HeaderLen + 4 + 2 + 2 + 1)
	n := maxQueuedErrors + 2*ring*perSend
	c.mu.Lock()
	c.owed = 5
	for i := 0; i < n; i++ {
		c.snd.sendErrorLocked(uint32(i), wire.CodeLimit, "x")
	}
	c.flushLocked()
	c.mu.Unlock()

	firsts := func(fs []sentFrame) []sentFrame { // the first frame of each SEND
		var out []sentFrame
		for i, f := range fs {
			if i == 0 || f.wrid != fs[i-1].wrid {
				out = append(out, f)
			}
		}
		return out
	}
	c.mu.Lock()
	sends := firsts(q.frames)
	c.mu.Unlock()
	if len(sends) != ring {
		t.Fatalf("%d SENDs posted with %d credits, want %d (all but the last credit, then a CREDIT)", len(sends), ring, ring)
	}
	for _, f := range sends[:ring-1] {
		if f.typ != wire.TypeError || f.credits != 0 {
			t.Errorf("a SEND of answers while they pile up: %s with %d credits, want ERROR_STATUS with none", f.typ, f.credits)
		}
	}
	if last := sends[ring-1]; last.typ != wire.TypeCredit || last.credits != 5 {
		t.Errorf("down to the last credit: %s with %d credits, want CREDIT with the 5 owed", last.typ, last.credits)
	}

	// The peer takes every SEND and returns its credits; the queue drains.
	seen, returned := 0, 5
	for round := 0; ; round++ {
		c.mu.Lock()
		left, fs := len(c.outq), append([]sentFrame(nil), q.frames[seen:]...)
		seen = len(q.frames)
		c.mu.Unlock()
		batch := firsts(fs)
		for _, f := range batch {
			returned += int(f.credits)
			complete(c, f.wrid, verbsio.StatusSuccess)
		}
		if left == 0 && len(batch) == 0 {
			break
		}
		if round > 10000 {
			t.Fatalf("%d items still queued after %d rounds", left, round)
		}
		arrive(c, wire.Message{Type: wire.TypeCredit, Credits: uint16(len(batch))})
	}
	c.mu.Lock()
	queued, owed := c.snd.errorsQueued, c.owed
	c.mu.Unlock()
	if queued != 0 {
		t.Errorf("%d ERROR_STATUS counted as queued in an empty queue", queued)
	}
	// Every arrival was owed; all but fewer than the threshold went back.
	if owed >= 2 || returned < 5 {
		t.Errorf("%d credits still owed, %d returned", owed, returned)
	}
}

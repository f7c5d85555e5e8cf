package onnode

import (
	"hash/crc32"
	"strconv"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/verbsio"
)

// TestFileRequestHoldsNoLock: the first write into a file-backed region of
// the peer asks the peer for the region's file and waits for the answer;
// meanwhile the protection domain stays free for what needs it (a Grant, an
// arriving write, a registration). Two ranks that each waited for the
// other's answer with the lock held stalled each other until the request's
// timeout, five seconds, whenever a Grant queued for the lock on both sides
// (the peer's answer takes the same lock): the first AllReduce of one job
// in ten on four ranks took 5.05 s. Here the peer is stopped, so the
// request waits; a registration here must not wait with it.
func TestFileRequestHoldsNoLock(t *testing.T) {
	n, p := pair(t, MechSHM)
	const size = 1 << 20
	src, err := n.register("anon", size, verbsio.AccessLocalWrite, 0)
	if err != nil {
		t.Fatal(err)
	}
	pattern(n.mems[src.RKey()].b, 5)
	f := p.one("mr", "reg memfd %d %d %d", size, rw, guard)
	addr, rkey := atoi(t, f[0]), atoi(t, f[1])
	resume := stopPeer(t, p)
	posted := make(chan error, 1)
	go func() {
		posted <- n.qp.PostSend([]verbsio.SendWR{{WRID: 9, Op: verbsio.OpWrite, Signaled: true, RemoteAddr: addr, RKey: uint32(rkey),
			SG: []verbsio.SGE{{Addr: src.Addr(), Length: size, LKey: src.LKey()}}}})
	}()
	// Let the write reach its request for the file (the stopped peer
	// cannot answer it: up to fdRequestTimeout).
	time.Sleep(200 * time.Millisecond)
	select {
	case err := <-posted:
		t.Fatalf("PostSend returned (%v) while the peer that must answer it is stopped", err)
	default:
	}
	regd := make(chan error, 1)
	start := time.Now()
	go func() {
		_, err := n.register("anon", 4096, rw, 0)
		regd <- err
	}()
	select {
	case err := <-regd:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(fdRequestTimeout / 2):
		t.Fatalf("registration still waiting %s after it began, behind a write waiting for the stopped peer's file", time.Since(start))
	}
	resume()
	if err := <-posted; err != nil {
		t.Fatal(err)
	}
	if c := waitOne(t, n.scq, 10*time.Second); c.Status != verbsio.StatusSuccess || c.WRID != 9 {
		t.Fatalf("write completion %+v", c)
	}
	if got := len(n.qp.(*qp).fileMaps); got != 1 {
		t.Errorf("%d peer files mapped here, want 1 (the peer answered once it ran)", got)
	}
	want := crc32.ChecksumIEEE(n.mems[src.RKey()].b)
	if c := p.one("crc", "crc %d %d %d", rkey, 0, size); c[0] != strconv.FormatUint(uint64(want), 10) {
		t.Errorf("target crc %s, want %d", c[0], want)
	}
}

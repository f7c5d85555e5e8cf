package ipc

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/alloc/visitor"
	"github.com/gdrlink/gdrlink/internal/leakcheck"
)

// peerEnv, when set, makes the test binary the sending peer: its value is
// the mode ("release": release every arena and leave; "die": exit with the
// receiver's mappings open).
const peerEnv = "GDRLINK_IPC_PEER"

// peerSizes are the tensors the peer sends, in order.
var peerSizes = []int{1, 4096, 100 << 10, 3 << 20, 4096, 64}

func TestMain(m *testing.M) {
	if mode := os.Getenv(peerEnv); mode != "" {
		run := runSender
		if m, ok := strings.CutPrefix(mode, "sim-"); ok {
			mode, run = m, runSimSender
		}
		if err := run(mode); err != nil {
			fmt.Fprintln(os.Stderr, "ipc peer:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(leakcheck.RunMain(m))
}

// pattern is the content of the i-th tensor.
func pattern(b []byte, i int) {
	for j := range b {
		b[j] = byte(j*7 + i*31 + 1)
	}
}

// sockConn is the peer's end of the socket pair, passed as descriptor 3.
func sockConn(f *os.File) (*Conn, error) {
	c, err := net.FileConn(f)
	f.Close()
	if err != nil {
		return nil, err
	}
	uc, ok := c.(*net.UnixConn)
	if !ok {
		return nil, fmt.Errorf("descriptor is a %T", c)
	}
	return NewConn(uc), nil
}

type hostLocal struct{}

func (hostLocal) Ready() bool              { return true }
func (hostLocal) CanReach(dev string) bool { return dev == "host" }

// runSender is the peer (rank 1): it sets up the path lazily on its first
// transfer, then offers each tensor of peerSizes for the receiver to pull,
// exporting each arena once, and keeps each source until the receiver says
// DONE.
func runSender(mode string) error {
	c, err := sockConn(os.NewFile(3, "ipc"))
	if err != nil {
		return err
	}
	pool, err := alloc.New(alloc.NewMemfdSource("ipc-peer", alloc.MmapOptions{}),
		alloc.WithVisitors(visitor.NewIPCExport()), alloc.WithInitialArena(1<<20))
	if err != nil {
		return err
	}
	setup := NewSetup(1, 0, "host", hostLocal{})
	exported := map[uint64]bool{}
	recv := func() (Msg, error) {
		m, fd, err := c.Recv()
		closeFD(fd)
		return m, err
	}
	for i, n := range peerSizes {
		for _, m := range setup.Start() {
			if err := c.Send(m, -1); err != nil {
				return err
			}
		}
		for setup.State() != OK && setup.State() != Bad {
			m, err := recv()
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
		b, err := pool.Alloc(n)
		if err != nil {
			return err
		}
		src := b.Bytes()[:n]
		pattern(src, i)
		a, _ := pool.ArenaOf(b.Addr())
		em, fd, ok := ExportOf(1, a)
		if !ok {
			return errors.New("arena not exported")
		}
		if !exported[em.Arena] {
			if err := c.Send(em, fd); err != nil {
				return err
			}
			exported[em.Arena] = true
		}
		pm := Msg{Kind: KindPull, From: 1, Arena: em.Arena, Offset: uint64(b.Addr() - a.Base()), Size: uint64(n)}
		if err := c.Send(pm, -1); err != nil {
			return err
		}
		m, err := recv()
		if err != nil {
			return err
		}
		if m.Kind != KindDone || m.Offset != pm.Offset || m.Arena != pm.Arena {
			return fmt.Errorf("want DONE of %+v, got %+v", pm, m)
		}
		b.Free() // the source is kept until the receiver's pull is done
	}
	if mode == "die" {
		// Leave abruptly, the receiver's mappings open.
		os.Exit(0)
	}
	for a := range exported {
		if err := c.Send(Msg{Kind: KindRelease, From: 1, Arena: a}, -1); err != nil {
			return err
		}
	}
	c.Close()
	return pool.Close()
}

// startSender runs the test binary as the sending peer and returns the
// receiver's end of their socket.
func startSender(t *testing.T, mode string) (*Conn, *exec.Cmd) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	mine, theirs := os.NewFile(uintptr(fds[0]), "ipc-recv"), os.NewFile(uintptr(fds[1]), "ipc-send")
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), peerEnv+"="+mode)
	cmd.ExtraFiles = []*os.File{theirs}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	theirs.Close()
	c, err := sockConn(mine)
	if err != nil {
		t.Fatal(err)
	}
	return c, cmd
}

// mappedPeerArenas counts this process's mappings of the peer's arenas.
func mappedPeerArenas(t *testing.T) int {
	t.Helper()
	b, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		t.Skipf("no /proc/self/maps: %v", err)
	}
	return strings.Count(string(b), "memfd:ipc-peer") + strings.Count(string(b), "memfd:gpusim:ipc-peer")
}

// receive is the receiver (rank 0): it answers the setup, opens each
// exported arena once through the cache, pulls every tensor into its own
// result buffer and checks it.
func receive(t *testing.T, c *Conn, cache *Cache, pull func(Mapping, Msg) ([]byte, error)) int {
	t.Helper()
	setup := NewSetup(0, 1, "host", hostLocal{})
	got, maxMapped := 0, 0
	for {
		m, fd, err := c.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		switch m.Kind {
		case KindRequest, KindConfirm:
			out, err := setup.Receive(m)
			if err != nil {
				t.Fatal(err)
			}
			for _, o := range out {
				if err := c.Send(o, -1); err != nil {
					t.Fatal(err)
				}
			}
		case KindExport:
			if setup.State() != OK {
				t.Fatalf("export before setup: %s", setup.State())
			}
			if _, err := cache.Add(1, m, fd); err != nil {
				t.Fatal(err)
			}
			maxMapped = max(maxMapped, mappedPeerArenas(t))
		case KindPull:
			mp, ok := cache.Lookup(1, m.Arena)
			if !ok {
				t.Fatalf("pull from arena %d, not open", m.Arena)
			}
			dst, err := pull(mp, m)
			if err != nil {
				t.Fatal(err)
			}
			want := make([]byte, m.Size)
			pattern(want, got)
			if !bytes.Equal(dst, want) {
				t.Fatalf("tensor %d (%d bytes) differs", got, m.Size)
			}
			got++
			if err := c.Send(Msg{Kind: KindDone, From: 0, Arena: m.Arena, Offset: m.Offset, Size: m.Size}, -1); err != nil {
				t.Fatal(err)
			}
		case KindRelease:
			if err := cache.Release(1, m.Arena); err != nil {
				t.Fatal(err)
			}
		default:
			t.Fatalf("unexpected %s", m.Kind)
		}
	}
	if got != len(peerSizes) {
		t.Fatalf("pulled %d tensors of %d", got, len(peerSizes))
	}
	if setup.State() != OK {
		t.Fatalf("setup %s", setup.State())
	}
	return maxMapped
}

// hostPull pulls through a memfd mapping into host memory.
func hostPull(mp Mapping, m Msg) ([]byte, error) {
	dst := make([]byte, m.Size)
	ev, err := Pull(dst, mp, m)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	return dst, ev.Wait(ctx)
}

func memfdsNow(t *testing.T) int {
	n, err := leakcheck.Memfds()
	if err != nil {
		t.Skipf("cannot count descriptors: %v", err)
	}
	return n
}

func TestTwoProcMemfd(t *testing.T) {
	twoProc(t, "", func(*testing.T) (*Cache, func(Mapping, Msg) ([]byte, error)) {
		return NewCache(MemfdOpener{}), hostPull
	})
}

func twoProc(t *testing.T, backend string, recv func(*testing.T) (*Cache, func(Mapping, Msg) ([]byte, error))) {
	for _, mode := range []string{"release", "die"} {
		t.Run(mode, func(t *testing.T) {
			fdsBefore, mapsBefore := memfdsNow(t), mappedPeerArenas(t)
			cache, pull := recv(t)
			c, cmd := startSender(t, backend+mode)
			maxMapped := receive(t, c, cache, pull)
			if err := cmd.Wait(); err != nil {
				t.Fatalf("peer: %v", err)
			}
			st := cache.Stats()
			switch {
			case mode == "release" && (st.Closes != st.Opens || st.Open != 0):
				t.Errorf("after the peer released its arenas: %+v", st)
			case mode == "die" && (st.Closes != 0 || st.Open != int(st.Opens) || mappedPeerArenas(t) <= mapsBefore):
				t.Errorf("after the peer died, before closing: %+v, %d mapped", st, mappedPeerArenas(t))
			}
			// The peer is gone: the survivor closes what is left of it.
			if err := cache.DropPeer(1); err != nil {
				t.Fatal(err)
			}
			c.Close()
			st = cache.Stats()
			// 6 tensors over a 1 MiB first arena and a grown one for the
			// 3 MiB tensor: each arena opened once, the rest are hits.
			if st.Opens < 2 || st.Opens != st.Closes || st.Open != 0 || st.Hits != uint64(len(peerSizes)) || st.Misses != 0 {
				t.Errorf("stats %+v", st)
			}
			if maxMapped < int(st.Opens) {
				t.Errorf("at most %d peer arenas mapped at once, %d opened", maxMapped, st.Opens)
			}
			if n := mappedPeerArenas(t); n != mapsBefore {
				t.Errorf("%d peer arena mappings left (%d before)", n, mapsBefore)
			}
			if n := memfdsNow(t); n != fdsBefore {
				t.Errorf("%d memfd descriptors open, %d before", n, fdsBefore)
			}
			t.Logf("%s: %+v", mode, st)
		})
	}
}

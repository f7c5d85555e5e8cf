package ipc

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gdrlink/gdrlink/internal/jobauth"
)

// The descriptor service hands a peer that proves the job key the
// descriptor of an arena Lookup allows, and refuses a wrong key, a rank
// that claims another's identity, and what Lookup refuses.
func TestFDServer(t *testing.T) {
	key, _, err := jobauth.Generate()
	if err != nil {
		t.Fatal(err)
	}
	other, _, err := jobauth.Generate()
	if err != nil {
		t.Fatal(err)
	}
	mfd, err := unix.MemfdCreate("fdserver-test", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(mfd)
	if err := unix.Ftruncate(mfd, 8192); err != nil {
		t.Fatal(err)
	}
	lookup := func(peer uint32, m Msg) (int, error) {
		if peer != 1 || m.Arena != 7 {
			return -1, fmt.Errorf("%w: rank %d, arena %d", ErrRefused, peer, m.Arena)
		}
		return dupFD(mfd)
	}
	for _, keyed := range []bool{true, false} {
		k := key
		if !keyed {
			k = jobauth.Key{}
		}
		s, err := NewFDServer(k, lookup, nil)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		fd, err := FetchFD(ctx, s.Name(), k, Msg{From: 1, Arena: 7})
		if err != nil {
			t.Fatalf("keyed=%v: %v", keyed, err)
		}
		var st unix.Stat_t
		if err := unix.Fstat(fd, &st); err != nil || st.Size != 8192 {
			t.Fatalf("keyed=%v: the descriptor is not the arena's: size %d, %v", keyed, st.Size, err)
		}
		unix.Close(fd)
		if _, err := FetchFD(ctx, s.Name(), k, Msg{From: 1, Arena: 8}); !errors.Is(err, ErrRefused) {
			t.Errorf("keyed=%v: an arena Lookup refuses: %v, want ErrRefused", keyed, err)
		}
		if _, err := FetchFD(ctx, s.Name(), k, Msg{From: 2, Arena: 7}); !errors.Is(err, ErrRefused) {
			t.Errorf("keyed=%v: a rank Lookup refuses: %v, want ErrRefused", keyed, err)
		}
		if keyed {
			if _, err := FetchFD(ctx, s.Name(), other, Msg{From: 1, Arena: 7}); err == nil {
				t.Error("a peer with another job key got the descriptor")
			}
			if _, err := FetchFD(ctx, s.Name(), jobauth.Key{}, Msg{From: 1, Arena: 7}); err == nil {
				t.Error("a peer without the job key got the descriptor")
			}
		}
		cancel()
		if err := s.Close(); err != nil {
			t.Fatal(err)
		}
		if _, err := FetchFD(context.Background(), s.Name(), k, Msg{From: 1, Arena: 7}); err == nil {
			t.Error("a closed service answered")
		}
	}
}

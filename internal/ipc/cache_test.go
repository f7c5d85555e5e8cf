package ipc

import (
	"errors"
	"sync"
	"testing"
)

type fakeMapping struct {
	b      []byte
	closed *int
}

func (m *fakeMapping) Close() error { *m.closed++; return nil }

type fakeOpener struct {
	mu     sync.Mutex
	opens  int
	closed int
	fail   bool
}

func (o *fakeOpener) Open(peer uint32, h Msg, fd int) (Mapping, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.fail {
		return nil, errors.New("open refused")
	}
	o.opens++
	return &fakeMapping{b: make([]byte, h.Size), closed: &o.closed}, nil
}

func exp(arena uint64) Msg { return Msg{Kind: KindExport, Arena: arena, Size: 64} }

func TestCacheCounts(t *testing.T) {
	o := &fakeOpener{}
	c := NewCache(o)
	if _, ok := c.Lookup(1, 0); ok {
		t.Fatal("empty cache hit")
	}
	for _, peer := range []uint32{1, 2} {
		for arena := uint64(0); arena < 3; arena++ {
			if _, err := c.Add(peer, exp(arena), -1); err != nil {
				t.Fatal(err)
			}
		}
	}
	if _, err := c.Add(1, exp(0), -1); err != nil { // already open: no second open
		t.Fatal(err)
	}
	for i := 0; i < 10; i++ {
		if _, ok := c.Lookup(1, uint64(i%3)); !ok {
			t.Fatal("miss on an open arena")
		}
	}
	if _, ok := c.Lookup(3, 0); ok {
		t.Fatal("hit on an unknown peer")
	}
	want := Stats{Hits: 10, Misses: 2, Opens: 6, Open: 6}
	if st := c.Stats(); st != want || o.opens != 6 {
		t.Fatalf("stats %+v (opener %d), want %+v", st, o.opens, want)
	}
	if err := c.Release(1, 2); err != nil {
		t.Fatal(err)
	}
	c.Release(1, 2) // again: nothing
	if _, ok := c.Lookup(1, 2); ok {
		t.Fatal("released arena still cached")
	}
	if err := c.DropPeer(2); err != nil {
		t.Fatal(err)
	}
	want = Stats{Hits: 10, Misses: 3, Opens: 6, Closes: 4, Open: 2}
	if st := c.Stats(); st != want || o.closed != 4 {
		t.Fatalf("stats %+v (closed %d), want %+v", st, o.closed, want)
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if st := c.Stats(); st.Closes != 6 || st.Open != 0 || o.closed != 6 {
		t.Fatalf("after Close: %+v, closed %d", st, o.closed)
	}
	if _, err := c.Add(1, exp(9), -1); !errors.Is(err, ErrClosed) {
		t.Fatalf("Add after Close: %v", err)
	}
	o2 := &fakeOpener{fail: true}
	if _, err := NewCache(o2).Add(1, exp(0), -1); err == nil {
		t.Fatal("failed open not reported")
	}
}

func TestCacheConcurrentAdd(t *testing.T) {
	o := &fakeOpener{}
	c := NewCache(o)
	var wg sync.WaitGroup
	for i := 0; i < 8; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := c.Add(1, exp(0), -1); err != nil {
				t.Error(err)
			}
			c.Lookup(1, 0)
		}()
	}
	wg.Wait()
	st := c.Stats()
	if st.Opens != 1 || st.Open != 1 || o.opens-o.closed != 1 {
		t.Fatalf("stats %+v, opened %d closed %d", st, o.opens, o.closed)
	}
	c.Close()
}

package ipc

import (
	"errors"
	"fmt"
	"sync"
)

// Mapping is a peer's arena opened in this process: a *HostMapping on the
// CPU analog, a *DeviceMapping on a device.
type Mapping interface {
	// Close unmaps it.
	Close() error
}

// Opener opens an exported arena of a peer: Handle is what the exporter
// announced, fd (or -1) a descriptor that came beside it. Open takes
// ownership of fd whether it succeeds or not.
type Opener interface {
	Open(peer uint32, h Msg, fd int) (Mapping, error)
}

// Stats counts the cache's work.
type Stats struct {
	// Hits: lookups that found the arena open.
	Hits uint64
	// Misses: lookups that did not.
	Misses uint64
	// Opens: arenas opened (opening costs about 90 µs on a GPU).
	Opens uint64
	// Closes: mappings closed (the exporter released the arena, the peer
	// left, or the cache closed).
	Closes uint64
	// Open is how many mappings are open now.
	Open int
}

type cacheKey struct {
	peer  uint32
	arena uint64
}

// Cache keeps, per peer, each remote arena opened once. It is safe for
// concurrent use.
type Cache struct {
	opener Opener
	mu     sync.Mutex
	m      map[cacheKey]Mapping
	st     Stats
	closed bool
}

// NewCache returns an empty cache that opens arenas with opener.
func NewCache(opener Opener) *Cache {
	return &Cache{opener: opener, m: make(map[cacheKey]Mapping)}
}

// Lookup returns the open mapping of a peer's arena, counting a hit or a
// miss.
func (c *Cache) Lookup(peer uint32, arena uint64) (Mapping, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	mp, ok := c.m[cacheKey{peer, arena}]
	if ok {
		c.st.Hits++
	} else {
		c.st.Misses++
	}
	return mp, ok
}

// Add opens the arena an EXPORT message of peer describes (fd beside it, or
// -1) and keeps the mapping. An arena already open keeps its mapping, and fd
// is closed.
func (c *Cache) Add(peer uint32, h Msg, fd int) (Mapping, error) {
	k := cacheKey{peer, h.Arena}
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		closeFD(fd)
		return nil, ErrClosed
	}
	if mp, ok := c.m[k]; ok {
		c.mu.Unlock()
		closeFD(fd)
		return mp, nil
	}
	c.mu.Unlock()
	mp, err := c.opener.Open(peer, h, fd)
	if err != nil {
		return nil, fmt.Errorf("ipc: open arena %d of rank %d: %w", h.Arena, peer, err)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if old, ok := c.m[k]; ok || c.closed {
		// Lost a race with another Add, or the cache closed meanwhile.
		cerr := mp.Close()
		if c.closed {
			return nil, errors.Join(ErrClosed, cerr)
		}
		return old, cerr
	}
	c.m[k] = mp
	c.st.Opens++
	c.st.Open++
	return mp, nil
}

// Release closes the mapping of one arena of peer (the exporter released
// it). Releasing an arena that is not open does nothing.
func (c *Cache) Release(peer uint32, arena uint64) error {
	c.mu.Lock()
	mp, ok := c.m[cacheKey{peer, arena}]
	if ok {
		delete(c.m, cacheKey{peer, arena})
		c.st.Closes++
		c.st.Open--
	}
	c.mu.Unlock()
	if !ok {
		return nil
	}
	return mp.Close()
}

// DropPeer closes every mapping of peer (it left).
func (c *Cache) DropPeer(peer uint32) error {
	return c.drop(func(k cacheKey) bool { return k.peer == peer })
}

// Close closes every mapping; later Adds fail with ErrClosed.
func (c *Cache) Close() error {
	c.mu.Lock()
	c.closed = true
	c.mu.Unlock()
	return c.drop(func(cacheKey) bool { return true })
}

func (c *Cache) drop(match func(cacheKey) bool) error {
	var ms []Mapping
	c.mu.Lock()
	for k, mp := range c.m {
		if match(k) {
			ms = append(ms, mp)
			delete(c.m, k)
			c.st.Closes++
			c.st.Open--
		}
	}
	c.mu.Unlock()
	var errs []error
	for _, mp := range ms {
		errs = append(errs, mp.Close())
	}
	return errors.Join(errs...)
}

// Stats returns the counters.
func (c *Cache) Stats() Stats {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.st
}

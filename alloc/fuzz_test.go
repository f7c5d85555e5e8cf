package alloc

import (
	"errors"
	"testing"
)

// FuzzPoolOps reads the input as a program of pool operations (allocate a
// size, free the i-th live block by Block or by address, free a stale block,
// free an address inside a block, trim) and checks after each one that the
// pool's invariants hold, that live blocks keep their bytes, and that bad
// frees fail with their sentinel.
func FuzzPoolOps(f *testing.F) {
	f.Add([]byte{0, 10, 0, 20, 1, 0, 0, 30, 2, 1, 5, 0})
	f.Add([]byte{0, 255, 0, 255, 0, 255, 3, 0, 1, 0, 1, 0, 1, 0, 4, 0})
	f.Add([]byte{0, 1, 6, 0, 0, 2, 5, 1, 1, 0})
	f.Fuzz(func(t *testing.T, prog []byte) {
		if len(prog) > 512 {
			prog = prog[:512]
		}
		p := newTestPool(t, newCountingSource(), WithInitialArena(64<<10), WithMaxArena(256<<10), WithLimit(2<<20), withAlignment(64))
		var live []modelBlock
		var stale []Block
		for pc := 0; pc+1 < len(prog); pc += 2 {
			op, arg := prog[pc]%7, int(prog[pc+1])
			switch op {
			case 0, 6: // allocate 1..~96 KiB
				n := 1 + arg*arg + arg*int(op)
				b, err := p.Alloc(n)
				if errors.Is(err, ErrPoolExhausted) {
					continue
				}
				if err != nil {
					t.Fatalf("Alloc(%d): %v", n, err)
				}
				mem := b.Bytes()
				for i := range mem {
					mem[i] = byte(arg)
				}
				live = append(live, modelBlock{b, byte(arg)})
			case 1, 2: // free by block or address
				if len(live) == 0 {
					continue
				}
				k := arg % len(live)
				m := live[k]
				for i, c := range m.b.Bytes() {
					if c != m.fill {
						t.Fatalf("block %#x byte %d overwritten", m.b.Addr(), i)
					}
				}
				var err error
				if op == 1 {
					err = m.b.Free()
				} else {
					err = p.freeAddr(m.b.Addr())
				}
				if err != nil {
					t.Fatalf("free: %v", err)
				}
				stale = append(stale, m.b)
				live = append(live[:k], live[k+1:]...)
			case 3: // free a stale block again
				if len(stale) == 0 {
					continue
				}
				if err := stale[arg%len(stale)].Free(); !errors.Is(err, ErrDoubleFree) {
					t.Fatalf("stale Free = %v", err)
				}
			case 4:
				if err := p.trim(); err != nil {
					t.Fatalf("Trim: %v", err)
				}
			case 5: // an address inside a live block, not its start
				if len(live) == 0 {
					continue
				}
				b := live[arg%len(live)].b
				if err := p.freeAddr(b.Addr() + 1 + uintptr(arg)%uintptr(b.Len())); !errors.Is(err, ErrNotOwned) && b.Len() > 1 {
					t.Fatalf("FreeAddr inside a block = %v", err)
				}
			}
			if err := p.Check(); err != nil {
				t.Fatalf("after op %d(%d): %v", op, arg, err)
			}
		}
		checkDisjoint(t, p, live, 64)
		for _, m := range live {
			if err := m.b.Free(); err != nil {
				t.Fatal(err)
			}
		}
	})
}

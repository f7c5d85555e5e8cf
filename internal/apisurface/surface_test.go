package apisurface

import (
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"testing"
)

// The goals of the public surface: every public package together, and the
// front door (the module's root package) alone. They were 450 and 40 until
// the collectives (AllReduce, Broadcast, AllGather, ReduceOp, Sum, Average
// on the front door; the collective package's report and errors) and
// rejoining (Rejoined, WaitRejoin) and the peer timeout (WithPeerTimeout) arrived; alloc.Budget and
// the checksum errors came with them; the SwitchML backend added
// WithAggregator (466 and 43); gdr.DecideGPUByBusID, the decision for a
// GPU known by its CUDA ordinal (467); the on-node GPU path: the
// rendezvous pull (Puller, PullRef, WithPull, PathPull, ErrPullFailed) and
// the front door's IPCStats (473 and 44); receiving into the caller's
// tensor, rendezvous.Into and the front door's RecvInto (475 and 45);
// binding the ranks of a host to CPUs of their own, WithCPUBinding (476
// and 46); queue pairs that take the checksum of a write as its bytes land,
// verbsio.WriteChecksummer (477); sending a channel's held confirmations
// at once, for a caller about to wait on the peer's, as a collective's
// rank does at a call's end: rendezvous.Channel.ConfirmNow (478); small
// tensors sent before their Recv asks, in the control message itself:
// rendezvous.WithEager and PathEager, the front door's WithEagerMax (481
// and 47).
// Raise them only for a capability, and say which here.
const (
	maxTotal     = 481
	maxFrontDoor = 47
)

// TestPublicSurface prints the exported identifiers per public package
// (go test -v ./internal/apisurface) and fails above the goals.
func TestPublicSurface(t *testing.T) {
	counts, err := CountModule(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	total, front := 0, -1
	for _, c := range counts {
		t.Logf("%-24s %4d  (%d top-level, %d methods)", c.Package, c.Total(), c.TopLevel, c.Methods)
		total += c.Total()
		if c.Package == "." {
			front = c.Total()
		}
	}
	t.Logf("%-24s %4d  (goal at most %d; front door %d, goal at most %d)", "total", total, maxTotal, front, maxFrontDoor)
	if front < 0 {
		t.Errorf("no front door: the module root has no public package")
	}
	if total > maxTotal {
		t.Errorf("%d exported identifiers in the public packages, goal at most %d", total, maxTotal)
	}
	if front > maxFrontDoor {
		t.Errorf("the front door exports %d identifiers, goal at most %d", front, maxFrontDoor)
	}
}

// TestCountFile checks the counting rules on a known file, so the surface
// figure means what it says.
func TestCountFile(t *testing.T) {
	src := `package p
type Exported struct{ A int }
type hidden struct{}
func (Exported) M() {}
func (*Exported) N() {}
func (Exported) m() {}
func (hidden) M() {}
func F() {}
func f() {}
var V, w = 1, 2
const (C = iota; D; e)
type G[T any] struct{}
func (G[T]) M() {}
`
	f, err := parser.ParseFile(token.NewFileSet(), "p.go", src, 0)
	if err != nil {
		t.Fatal(err)
	}
	var c Count
	countFile(f, &c)
	// Exported, F, V, C, D, G; methods M, N of Exported and M of G.
	if c.TopLevel != 6 || c.Methods != 3 {
		t.Errorf("counted %d top-level and %d methods, want 6 and 3", c.TopLevel, c.Methods)
	}
}

// TestSkipsOtherModules checks that a nested module and main packages are
// not counted as this module's surface.
func TestSkipsOtherModules(t *testing.T) {
	root := t.TempDir()
	write := func(p, s string) {
		if err := os.MkdirAll(filepath.Dir(filepath.Join(root, p)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(root, p), []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("a.go", "package m\nfunc A() {}\n")
	write("sub/b.go", "package sub\nfunc B() {}\nfunc C() {}\n")
	write("nested/go.mod", "module x\n")
	write("nested/n.go", "package n\nfunc N() {}\n")
	write("tool/main.go", "package main\nfunc Exported() {}\n")
	write("internal/i/i.go", "package i\nfunc I() {}\n")
	counts, err := CountModule(root)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]int{}
	for _, c := range counts {
		got[c.Package] = c.Total()
	}
	if len(got) != 2 || got["."] != 1 || got["sub"] != 2 {
		t.Errorf("counted %v, want . 1 and sub 2 only", got)
	}
}

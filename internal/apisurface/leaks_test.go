package apisurface

import (
	"go/parser"
	"go/token"
	"path/filepath"
	"strings"
	"testing"
)

// TestNoInternalTypesInAPI fails when the exported API of a public package
// names a type of an internal package: code outside the module could not
// call it.
func TestNoInternalTypesInAPI(t *testing.T) {
	leaks, err := FindLeaks(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range leaks {
		t.Errorf("%v", l)
	}
}

// TestFindLeaks checks the rules on a known file.
func TestFindLeaks(t *testing.T) {
	src := `package p
import (
	"example.com/m/internal/cuda"
	nv "example.com/m/internal/nvml"
	"example.com/m/tensor"
)
func Open(ctx *cuda.Context) error { return nil }
func open(ctx *cuda.Context) error { return nil }
func Dev() (tensor.Device, []nv.GPU) { return tensor.Device{}, nil }
type Pool struct{ ctx *cuda.Context; Ctx *cuda.Context; Dev tensor.Device }
func (p *Pool) Context() *cuda.Context { return p.ctx }
func (p *Pool) context() *cuda.Context { return p.ctx }
type hidden struct{}
func (hidden) Context() *cuda.Context { return nil }
type Handle = cuda.Context
type Embeds struct{ *cuda.Stream; nv.Lib }
type Source interface{ Context() *cuda.Context; gpu() nv.GPU }
type Hook func(g nv.GPU) error
var Default *cuda.Context
var Err = cuda.ErrNoDriver
const Kind cuda.Attribute = 1
`
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, "p.go", src, parser.SkipObjectResolution)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, l := range fileLeaks(fset, f, "p.go") {
		got = append(got, l.Where+" "+l.Type)
	}
	want := []string{
		"func Open cuda.Context",
		"func Dev nv.GPU",
		"field Pool.Ctx cuda.Context",
		"method Context cuda.Context",
		"type Handle cuda.Context",
		"embedded field of Embeds cuda.Stream",
		"embedded field of Embeds nv.Lib",
		"interface Source cuda.Context",
		"type Hook nv.GPU",
		"var Default cuda.Context",
		"const Kind cuda.Attribute",
	}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("leaks found:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

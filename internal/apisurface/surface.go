// Package apisurface counts the exported identifiers of the module's public
// packages: top-level functions, types, variables and constants, plus the
// exported methods of exported types. Its test holds the public surface to
// the project's goal and prints the breakdown per package.
package apisurface

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
)

// Count is one package's exported identifiers.
type Count struct {
	// Package is the folder, relative to the module root ("." is the root).
	Package string
	// TopLevel counts exported functions, types, variables and constants.
	TopLevel int
	// Methods counts exported methods of exported types.
	Methods int
}

// Total is TopLevel plus Methods.
func (c Count) Total() int { return c.TopLevel + c.Methods }

// skipped are folders whose packages are not part of the public API: the
// module's internal packages, commands, programs and test data.
var skipped = map[string]bool{"internal": true, "cmd": true, "bench": true, "examples": true, "testdata": true, "contrib": true}

// CountModule counts every public package under root, the module's folder,
// sorted by package. Folders of other modules (with their own go.mod) and
// main packages are left out.
func CountModule(root string) ([]Count, error) {
	counts := map[string]*Count{}
	err := walkPublic(root, func(_ *token.FileSet, f *ast.File, rel string) error {
		pkg := filepath.Dir(rel)
		c := counts[pkg]
		if c == nil {
			c = &Count{Package: pkg}
			counts[pkg] = c
		}
		countFile(f, c)
		return nil
	})
	if err != nil {
		return nil, err
	}
	out := make([]Count, 0, len(counts))
	for _, c := range counts {
		out = append(out, *c)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Package < out[j].Package })
	return out, nil
}

// walkPublic parses every non-test Go file of the public packages under
// root (skipping internal, commands, programs, test data, other modules and
// main packages) and calls fn with the file and its path relative to root.
func walkPublic(root string, fn func(fset *token.FileSet, f *ast.File, rel string) error) error {
	return filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if p != root && (skipped[d.Name()] || strings.HasPrefix(d.Name(), ".")) {
				return filepath.SkipDir
			}
			if p != root {
				if _, err := os.Stat(filepath.Join(p, "go.mod")); err == nil {
					return filepath.SkipDir
				}
			}
			return nil
		}
		if !strings.HasSuffix(p, ".go") || strings.HasSuffix(p, "_test.go") {
			return nil
		}
		fset := token.NewFileSet()
		f, err := parser.ParseFile(fset, p, nil, parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		if f.Name.Name == "main" {
			return nil
		}
		rel, err := filepath.Rel(root, p)
		if err != nil {
			return err
		}
		return fn(fset, f, filepath.ToSlash(rel))
	})
}

func countFile(f *ast.File, c *Count) {
	for _, d := range f.Decls {
		switch d := d.(type) {
		case *ast.FuncDecl:
			if !d.Name.IsExported() {
				continue
			}
			if d.Recv == nil {
				c.TopLevel++
			} else if typeNameExported(d.Recv.List[0].Type) {
				c.Methods++
			}
		case *ast.GenDecl:
			for _, s := range d.Specs {
				switch s := s.(type) {
				case *ast.TypeSpec:
					if s.Name.IsExported() {
						c.TopLevel++
					}
				case *ast.ValueSpec:
					for _, n := range s.Names {
						if n.IsExported() {
							c.TopLevel++
						}
					}
				}
			}
		}
	}
}

// typeNameExported reports whether the type named by t (a receiver, or an
// embedded field: T, *T, pkg.T, T[P]) has an exported name.
func typeNameExported(t ast.Expr) bool {
	for {
		switch x := t.(type) {
		case *ast.StarExpr:
			t = x.X
		case *ast.IndexExpr:
			t = x.X
		case *ast.IndexListExpr:
			t = x.X
		case *ast.SelectorExpr:
			return x.Sel.IsExported()
		case *ast.Ident:
			return x.IsExported()
		default:
			return false
		}
	}
}

package apisurface

import (
	"fmt"
	"go/ast"
	"go/token"
	"sort"
	"strconv"
	"strings"
)

// Leak is a type of an internal package named in the exported API of a
// public package, where code outside the module cannot name it.
type Leak struct {
	// Pos is the file and line, relative to the module root.
	Pos string
	// Where names the exported declaration ("func New", "method (*Pool).Alloc",
	// "field Device.Ctx").
	Where string
	// Type is the internal type as written ("cuda.Context").
	Type string
	// Import is its package's import path.
	Import string
}

// String prints the leak for people: where, what and which package.
func (l Leak) String() string {
	return fmt.Sprintf("%s: %s mentions %s (%s)", l.Pos, l.Where, l.Type, l.Import)
}

// FindLeaks parses the public packages under root, the module's folder, and
// returns every mention of an internal package's type in their exported API:
// the parameters and results of exported functions and of exported methods of
// exported types, the exported fields (embedded ones included) of exported
// struct types, the methods of exported interfaces, the definitions of
// exported types (an alias or a func type over an internal type), and the
// declared types of exported variables and constants. Only the syntax is
// read: a selector whose package is an import path with an "internal"
// element counts.
func FindLeaks(root string) ([]Leak, error) {
	var leaks []Leak
	err := walkPublic(root, func(fset *token.FileSet, f *ast.File, rel string) error {
		leaks = append(leaks, fileLeaks(fset, f, rel)...)
		return nil
	})
	sort.Slice(leaks, func(i, j int) bool { return leaks[i].Pos < leaks[j].Pos })
	return leaks, err
}

// internalImports maps the names under which a file imports internal
// packages to their import paths.
func internalImports(f *ast.File) map[string]string {
	out := map[string]string{}
	for _, s := range f.Imports {
		path, err := strconv.Unquote(s.Path.Value)
		if err != nil || !isInternal(path) {
			continue
		}
		name := path[strings.LastIndex(path, "/")+1:]
		if s.Name != nil {
			name = s.Name.Name
		}
		out[name] = path
	}
	return out
}

func isInternal(path string) bool {
	for _, e := range strings.Split(path, "/") {
		if e == "internal" {
			return true
		}
	}
	return false
}

func fileLeaks(fset *token.FileSet, f *ast.File, rel string) []Leak {
	imports := internalImports(f)
	if len(imports) == 0 {
		return nil
	}
	var out []Leak
	check := func(where string, n ast.Node) {
		if n == nil {
			return
		}
		ast.Inspect(n, func(n ast.Node) bool {
			sel, ok := n.(*ast.SelectorExpr)
			if !ok {
				return true
			}
			if id, ok := sel.X.(*ast.Ident); ok {
				if path, ok := imports[id.Name]; ok {
					line := fset.Position(sel.Pos()).Line
					out = append(out, Leak{Pos: fmt.Sprintf("%s:%d", rel, line), Where: where, Type: id.Name + "." + sel.Sel.Name, Import: path})
				}
			}
			return false
		})
	}
	for _, d := range f.Decls {
		switch d := d.(type) {
		case *ast.FuncDecl:
			if !d.Name.IsExported() {
				continue
			}
			where := "func " + d.Name.Name
			if d.Recv != nil {
				if !typeNameExported(d.Recv.List[0].Type) {
					continue
				}
				where = "method " + d.Name.Name
			}
			check(where, d.Type)
		case *ast.GenDecl:
			for _, s := range d.Specs {
				switch s := s.(type) {
				case *ast.TypeSpec:
					if s.Name.IsExported() {
						typeLeaks(s, check)
					}
				case *ast.ValueSpec:
					for _, n := range s.Names {
						if n.IsExported() {
							check(d.Tok.String()+" "+n.Name, s.Type)
							break
						}
					}
				}
			}
		}
	}
	return out
}

// typeLeaks checks an exported type's definition: exported fields of a
// struct, methods of an interface, anything else whole.
func typeLeaks(s *ast.TypeSpec, check func(string, ast.Node)) {
	name := s.Name.Name
	if s.TypeParams != nil {
		check("type "+name+" parameters", s.TypeParams)
	}
	switch t := s.Type.(type) {
	case *ast.StructType:
		for _, fld := range t.Fields.List {
			if len(fld.Names) == 0 { // embedded: exported when its type name is
				if typeNameExported(fld.Type) {
					check("embedded field of "+name, fld.Type)
				}
				continue
			}
			for _, n := range fld.Names {
				if n.IsExported() {
					check("field "+name+"."+n.Name, fld.Type)
					break
				}
			}
		}
	case *ast.InterfaceType:
		for _, m := range t.Methods.List {
			if len(m.Names) > 0 && !m.Names[0].IsExported() {
				continue
			}
			check("interface "+name, m.Type)
		}
	default:
		check("type "+name, s.Type)
	}
}

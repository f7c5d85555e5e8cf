package verbsio

import (
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// layersAbove are the packages, relative to the module root, that nothing
// under verbsio/ may import, directly or through another package of the
// module: the verbs layer knows nothing of how memory was allocated, of
// GPUDirect policy, of proxies or of the protocol ("." is the front door).
var layersAbove = []string{".", "alloc", "proxy", "gdr", "rendezvous"}

// TestLayering parses the imports of every Go file under verbsio/ (tests
// included) and of every package of the module they reach (tests of those
// left out, as the go command does), and fails on any path to a layer above.
func TestLayering(t *testing.T) {
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	mod := modulePath(t, filepath.Join(root, "go.mod"))
	above := func(imp string) bool {
		for _, l := range layersAbove {
			p := mod
			if l != "." {
				p += "/" + l
			}
			if imp == p || l != "." && strings.HasPrefix(imp, p+"/") {
				return true
			}
		}
		return false
	}
	// via records how each reached package of the module was reached, to
	// name the chain in a failure.
	via := map[string]string{}
	var queue []string
	reach := func(from, imp string) {
		if !strings.HasPrefix(imp+"/", mod+"/") {
			return
		}
		if above(imp) {
			t.Errorf("%s imports %s, a layer above verbsio%s", from, imp, chain(via, from))
			return
		}
		if _, seen := via[imp]; !seen {
			via[imp] = from
			queue = append(queue, imp)
		}
	}
	err = filepath.WalkDir(".", func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if d.Name() == "testdata" || strings.HasPrefix(d.Name(), ".") && p != "." {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(p, ".go") {
			return nil
		}
		pkg := mod + "/verbsio"
		if dir := filepath.ToSlash(filepath.Dir(p)); dir != "." {
			pkg += "/" + dir
		}
		for _, imp := range imports(t, p) {
			reach(pkg+" ("+filepath.Base(p)+")", imp)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for len(queue) > 0 {
		pkg := queue[0]
		queue = queue[1:]
		if strings.HasPrefix(pkg+"/", mod+"/verbsio/") {
			continue // its files, tests included, were read above
		}
		dir := filepath.Join(root, filepath.FromSlash(strings.TrimPrefix(pkg, mod+"/")))
		files, err := filepath.Glob(filepath.Join(dir, "*.go"))
		if err != nil || len(files) == 0 {
			t.Errorf("%s: no Go files in %s (%v)", pkg, dir, err)
			continue
		}
		for _, f := range files {
			if !strings.HasSuffix(f, "_test.go") {
				for _, imp := range imports(t, f) {
					reach(pkg, imp)
				}
			}
		}
	}
	if len(via) == 0 {
		t.Fatal("no imports found under verbsio/: the test reads the wrong folder")
	}
}

// chain names how pkg was reached from a file under verbsio/.
func chain(via map[string]string, pkg string) string {
	s := ""
	for i := 0; i < 32; i++ {
		from, ok := via[pkg]
		if !ok {
			break
		}
		s += ", imported by " + from
		pkg = from
	}
	return s
}

func imports(t *testing.T, file string) []string {
	t.Helper()
	f, err := parser.ParseFile(token.NewFileSet(), file, nil, parser.ImportsOnly)
	if err != nil {
		t.Fatal(err)
	}
	out := make([]string, 0, len(f.Imports))
	for _, s := range f.Imports {
		p, err := strconv.Unquote(s.Path.Value)
		if err != nil {
			t.Fatalf("%s: import %s: %v", file, s.Path.Value, err)
		}
		out = append(out, p)
	}
	return out
}

func modulePath(t *testing.T, gomod string) string {
	t.Helper()
	b, err := os.ReadFile(gomod)
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^module\s+(\S+)`).FindSubmatch(b)
	if m == nil {
		t.Fatalf("%s has no module line", gomod)
	}
	return string(m[1])
}

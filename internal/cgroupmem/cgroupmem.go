// Package cgroupmem reads the memory limit of the cgroup this process runs
// in (cgroup v2's memory.max, or v1's memory.limit_in_bytes), the lowest
// of its own and its ancestors' that the mount shows. A container's memory
// is that limit, not the machine's: defaults sized from physical memory
// take the lower of the two.
package cgroupmem

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"strconv"
	"strings"
)

// ErrMalformed is wrapped by the errors of the parsers for input that is
// not what the kernel writes.
var ErrMalformed = errors.New("cgroupmem: malformed")

// unlimited is the smallest value taken for "no limit": v1 writes a
// page-rounded 2^63-1, v2 writes "max".
const unlimited = 1 << 62

// Limit returns the memory limit, in bytes, of the cgroup this process runs
// in, read under root ("/" on a host; "/host" where a container sees the
// host's files there): ok is false when no limit applies or none can be
// read (no cgroup file system, no memory controller). Only an I/O error
// other than a missing file, or a file the kernel would not write, is an
// error.
func Limit(root string) (limit uint64, ok bool, err error) {
	mi, err := os.ReadFile(filepath.Join(root, "proc/self/mountinfo"))
	if err != nil {
		return 0, false, ignoreMissing(err)
	}
	cg, err := os.ReadFile(filepath.Join(root, "proc/self/cgroup"))
	if err != nil {
		return 0, false, ignoreMissing(err)
	}
	mounts, err := ParseMountinfo(mi)
	if err != nil {
		return 0, false, err
	}
	memberships, err := ParseCgroup(cg)
	if err != nil {
		return 0, false, err
	}
	for _, m := range mounts {
		var file, p string
		switch {
		case m.FSType == "cgroup2":
			file = "memory.max"
			p, ok = memberships.path("")
		case m.FSType == "cgroup" && m.hasOption("memory"):
			file = "memory.limit_in_bytes"
			p, ok = memberships.path("memory")
		default:
			continue
		}
		if !ok {
			continue
		}
		l, found, err := lowest(filepath.Join(root, m.Point), relative(p, m.Root), file)
		if err != nil || found {
			return l, found, err
		}
	}
	return 0, false, nil
}

// lowest reads file in dir/rel and in each of its ancestors up to dir,
// starting at the deepest that exists (a cgroup namespace or a container's
// mount may show only part of the path), and returns the lowest limit.
func lowest(dir, rel, file string) (uint64, bool, error) {
	var best uint64
	found := false
	for p := rel; ; p = path.Dir(p) {
		b, err := os.ReadFile(filepath.Join(dir, filepath.FromSlash(p), file))
		switch {
		case err == nil:
			v, lim, perr := ParseLimit(b)
			if perr != nil {
				return 0, false, fmt.Errorf("%s: %w", filepath.Join(dir, p, file), perr)
			}
			if lim && (!found || v < best) {
				best, found = v, true
			}
		case !errors.Is(err, os.ErrNotExist):
			return 0, false, err
		}
		if p == "/" || p == "." {
			return best, found, nil
		}
	}
}

// relative is cgroup path p as seen under a mount of the hierarchy whose
// root is mountRoot ("/" unless the mount shows a subtree).
func relative(p, mountRoot string) string {
	if mountRoot == "/" || mountRoot == "" {
		return path.Clean("/" + p)
	}
	if r, ok := strings.CutPrefix(p, mountRoot); ok && (r == "" || r[0] == '/') {
		return path.Clean("/" + r)
	}
	return "/"
}

func ignoreMissing(err error) error {
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	return err
}

// Mount is one line of /proc/self/mountinfo, the fields this package uses.
type Mount struct {
	// Root is the part of the file system the mount shows; Point where.
	Root, Point string
	// FSType is the file system's type ("cgroup2", "cgroup", ...);
	// SuperOptions its options (a v1 cgroup mount lists its controllers).
	FSType       string
	SuperOptions []string
}

func (m Mount) hasOption(o string) bool {
	for _, s := range m.SuperOptions {
		if s == o {
			return true
		}
	}
	return false
}

// ParseMountinfo parses /proc/self/mountinfo (proc(5)).
func ParseMountinfo(b []byte) ([]Mount, error) {
	var out []Mount
	sc := bufio.NewScanner(bytes.NewReader(b))
	sc.Buffer(nil, 1<<20)
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		if line == "" {
			continue
		}
		pre, post, ok := strings.Cut(line, " - ")
		f, g := strings.Fields(pre), strings.Fields(post)
		if !ok || len(f) < 6 || len(g) < 3 {
			return nil, fmt.Errorf("%w: mountinfo line %d: %q", ErrMalformed, n, line)
		}
		out = append(out, Mount{Root: unescape(f[3]), Point: unescape(f[4]), FSType: g[0], SuperOptions: strings.Split(g[2], ",")})
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("%w: mountinfo: %w", ErrMalformed, err)
	}
	return out, nil
}

// unescape undoes mountinfo's octal escapes (\040 for a space).
func unescape(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+4 <= len(s) {
			if v, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// Memberships are the lines of /proc/self/cgroup: the cgroup path of each
// hierarchy, by its controllers ("" for cgroup v2's unified hierarchy).
type Memberships map[string]string

// path is the cgroup of the hierarchy with controller c ("" for v2).
func (ms Memberships) path(c string) (string, bool) {
	if c == "" {
		p, ok := ms[""]
		return p, ok
	}
	for ctrls, p := range ms {
		for _, x := range strings.Split(ctrls, ",") {
			if x == c {
				return p, true
			}
		}
	}
	return "", false
}

// ParseCgroup parses /proc/self/cgroup (cgroups(7)):
// "hierarchy-ID:controllers:path" per line.
func ParseCgroup(b []byte) (Memberships, error) {
	ms := Memberships{}
	for n, line := range strings.Split(strings.TrimRight(string(b), "\n"), "\n") {
		if line == "" {
			continue
		}
		f := strings.SplitN(line, ":", 3)
		if len(f) != 3 || !strings.HasPrefix(f[2], "/") {
			return nil, fmt.Errorf("%w: cgroup line %d: %q", ErrMalformed, n+1, line)
		}
		if f[0] == "0" && f[1] != "" {
			return nil, fmt.Errorf("%w: cgroup line %d: hierarchy 0 with controllers %q", ErrMalformed, n+1, f[1])
		}
		ms[f[1]] = f[2]
	}
	return ms, nil
}

// ParseLimit parses a memory.max or memory.limit_in_bytes file: limited is
// false for "max" and for v1's "no limit" (at least 2^62).
func ParseLimit(b []byte) (v uint64, limited bool, err error) {
	s := strings.TrimSpace(string(b))
	if s == "max" {
		return 0, false, nil
	}
	v, err = strconv.ParseUint(s, 10, 64)
	if err != nil {
		return 0, false, fmt.Errorf("%w: memory limit %q", ErrMalformed, s)
	}
	return v, v < unlimited, nil
}

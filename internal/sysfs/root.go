package sysfs

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strings"
	"sync/atomic"
)

// MaxFileSize bounds every file a Root reads: sysfs and procfs files are
// small, and a snapshot from elsewhere must not make a reader swallow a
// huge file.
const MaxFileSize = 4 << 20

// Root is the directory that stands for "/" when gdr reads sysfs and procfs:
// "/" on the node itself, /host in a container that mounts the host there,
// or a copy of another node's tree (a gdrcheck snapshot). Symbolic links are
// followed only inside the root. A Root is safe for concurrent use.
type Root struct {
	dir    string
	host   bool
	r      *os.Root
	closed atomic.Bool
	rec    Recorder
}

// Recorder is told about everything a Root reads successfully, under the
// real path inside the root (symbolic links resolved, each link reported
// with its target). gdrcheck's snapshot command uses it to capture exactly
// what the checks read.
type Recorder interface {
	// File is a regular file that was read.
	File(name string, data []byte)
	// Link is a symbolic link that was followed or read.
	Link(name, target string)
	// Dir is a directory that was listed.
	Dir(name string)
}

// SetRecorder makes the root report its reads to rec (nil stops it). Call
// it before the root is shared.
func (r *Root) SetRecorder(rec Recorder) { r.rec = rec }

// resolve returns the real path of name inside the root, reporting each
// symbolic link on the way to the recorder.
func (r *Root) resolve(name string) string {
	parts := strings.Split(strings.TrimPrefix(filepath.Clean("/"+name), "/"), "/")
	cur := ""
	for hops := 0; len(parts) > 0 && hops < 64; {
		c := parts[0]
		parts = parts[1:]
		if c == "" || c == "." {
			continue
		}
		next := path.Join(cur, c)
		if c == ".." {
			cur = path.Dir(cur)
			if cur == "." {
				cur = ""
			}
			continue
		}
		fi, err := r.r.Lstat(next)
		if err != nil || fi.Mode()&fs.ModeSymlink == 0 {
			cur = next
			continue
		}
		t, err := r.r.Readlink(next)
		if err != nil {
			cur = next
			continue
		}
		hops++
		r.rec.Link("/"+next, t)
		if strings.HasPrefix(t, "/") {
			cur = ""
		}
		parts = append(strings.Split(t, "/"), parts...)
	}
	return "/" + cur
}

// OpenRoot opens dir as a root. "" means "/".
func OpenRoot(dir string) (*Root, error) {
	if dir == "" {
		dir = "/"
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		return nil, fmt.Errorf("gdr: root %s: %w", dir, err)
	}
	r, err := os.OpenRoot(abs)
	if err != nil {
		return nil, fmt.Errorf("gdr: root %s: %w", dir, err)
	}
	host := abs == "/"
	if !host {
		if real, err := filepath.EvalSymlinks(abs); err == nil && real == "/" {
			host = true
		}
	}
	return &Root{dir: abs, host: host, r: r}, nil
}

// Dir is the root's directory.
func (r *Root) Dir() string { return r.dir }

// IsHost reports whether the root is this node's own "/", so that live
// queries (getrlimit, NVML, libibverbs) describe the same node as its files.
func (r *Root) IsHost() bool { return r.host }

// Close releases the root. Idempotent.
func (r *Root) Close() error {
	if r.closed.Swap(true) {
		return nil
	}
	return r.r.Close()
}

// rel turns "/sys/x" into "sys/x" and rejects paths that climb out.
func (r *Root) rel(name string) (string, error) {
	if r.closed.Load() {
		return "", ErrClosed
	}
	p := filepath.Clean("/" + name)
	if p == "/" {
		return ".", nil
	}
	return strings.TrimPrefix(p, "/"), nil
}

func (r *Root) wrap(op, name string, err error) error {
	if err == nil {
		return nil
	}
	var pe *fs.PathError
	if errors.As(err, &pe) && strings.Contains(pe.Err.Error(), "escapes") {
		return fmt.Errorf("%w: %s %s: %w", ErrOutsideRoot, op, filepath.Join(r.dir, name), err)
	}
	return fmt.Errorf("gdr: %s %s: %w", op, filepath.Join(r.dir, name), err)
}

// ReadFile reads a file under the root (at most 4 MiB).
func (r *Root) ReadFile(name string) ([]byte, error) {
	p, err := r.rel(name)
	if err != nil {
		return nil, err
	}
	f, err := r.r.Open(p)
	if err != nil {
		return nil, r.wrap("read", name, err)
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, MaxFileSize+1))
	if err != nil {
		return nil, r.wrap("read", name, err)
	}
	if len(b) > MaxFileSize {
		return nil, fmt.Errorf("%w: %s is larger than %d bytes", ErrMalformed, filepath.Join(r.dir, name), MaxFileSize)
	}
	if r.rec != nil {
		r.rec.File(r.resolve(name), b)
	}
	return b, nil
}

// ReadString reads a file under the root, with surrounding white space
// trimmed.
func (r *Root) ReadString(name string) (string, error) {
	b, err := r.ReadFile(name)
	if err != nil {
		return "", err
	}
	return strings.TrimSpace(string(b)), nil
}

// Readlink returns the target of a symbolic link under the root.
func (r *Root) Readlink(name string) (string, error) {
	p, err := r.rel(name)
	if err != nil {
		return "", err
	}
	t, err := r.r.Readlink(p)
	if err == nil && r.rec != nil {
		r.rec.Link(path.Join(r.resolve(path.Dir("/"+p)), path.Base(p)), t)
	}
	return t, r.wrap("readlink", name, err)
}

// ReadDir lists the names in a directory under the root, sorted.
func (r *Root) ReadDir(name string) ([]string, error) {
	p, err := r.rel(name)
	if err != nil {
		return nil, err
	}
	f, err := r.r.Open(p)
	if err != nil {
		return nil, r.wrap("readdir", name, err)
	}
	defer f.Close()
	names, err := f.Readdirnames(-1)
	if err != nil {
		return nil, r.wrap("readdir", name, err)
	}
	sort.Strings(names)
	if r.rec != nil {
		r.rec.Dir(r.resolve(name))
	}
	return names, nil
}

// Exists reports whether name exists under the root (following links).
func (r *Root) Exists(name string) bool {
	p, err := r.rel(name)
	if err != nil {
		return false
	}
	fi, err := r.r.Stat(p)
	if err == nil && r.rec != nil && fi.Mode().IsRegular() {
		_, _ = r.ReadFile(name)
	}
	return err == nil
}

package main

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path"
	"sort"
	"strings"
	"time"

	"github.com/gdrlink/gdrlink/gdr"
	"github.com/gdrlink/gdrlink/internal/sysfs"
)

// Limits on a snapshot archive read with --root.
const (
	maxArchiveEntries = 200000
	maxArchiveBytes   = 256 << 20
	maxArchiveFile    = 8 << 20
)

// capture records what the checks read, cleaned of anything personal.
type capture struct {
	salt  []byte
	files map[string][]byte
	links map[string]string
	dirs  map[string]bool
}

func newCapture() *capture {
	salt := make([]byte, 16)
	_, _ = rand.Read(salt)
	return &capture{salt: salt, files: map[string][]byte{}, links: map[string]string{}, dirs: map[string]bool{}}
}

// Link implements gdr.Recorder and sysfs.Recorder. Links to shared
// libraries are left out with the libraries.
func (c *capture) Link(name, target string) {
	if !strings.Contains(path.Base(name), ".so") {
		c.links[name] = target
	}
}

// Dir implements gdr.Recorder and sysfs.Recorder.
func (c *capture) Dir(name string) { c.dirs[name] = true }

// File implements gdr.Recorder and sysfs.Recorder. Shared libraries are left
// out (the snapshot keeps what was learned from them in facts.json); GIDs are
// hashed (they hold IP and MAC addresses); the kernel command line, kernel
// config and process status keep only the lines the checks use.
func (c *capture) File(name string, data []byte) {
	base := path.Base(name)
	switch {
	case strings.Contains(base, ".so"):
		return
	case base == "address" || base == "node_guid" || base == "sys_image_guid" || base == "hostname" || strings.Contains(base, "serial"):
		return
	case strings.Contains(name, "/gids/") && strings.Trim(strings.TrimSpace(string(data)), "0:") == "":
		// Empty GID table entries (most of a software device's 1024) say
		// nothing: the replay reads the same table without them.
		return
	case strings.Contains(name, "/gids/"):
		data = []byte(c.hashGID(strings.TrimSpace(string(data))) + "\n")
	case name == "/proc/cmdline":
		var keep []string
		for _, t := range strings.Fields(string(data)) {
			if strings.Contains(t, "iommu") {
				keep = append(keep, t)
			}
		}
		data = []byte(strings.Join(keep, " ") + "\n")
	case strings.HasPrefix(name, "/boot/config-"):
		data = keepLines(data, configLine)
	case name == "/proc/config.gz":
		zr, err := gzip.NewReader(bytes.NewReader(data))
		if err != nil {
			return
		}
		plain, err := io.ReadAll(io.LimitReader(zr, maxArchiveFile))
		if err != nil {
			return
		}
		var buf bytes.Buffer
		zw := gzip.NewWriter(&buf)
		_, _ = zw.Write(keepLines(plain, configLine))
		_ = zw.Close()
		data = buf.Bytes()
	case strings.HasPrefix(name, "/proc/") && base == "status":
		data = keepLines(data, func(l string) bool {
			return strings.HasPrefix(l, "Cpus_allowed_list:") || strings.HasPrefix(l, "Mems_allowed_list:")
		})
	}
	c.files[name] = data
}

// configLine keeps the kernel config lines the checks may use.
func configLine(l string) bool {
	for _, k := range []string{"CONFIG_DMA", "CONFIG_PCI", "CONFIG_INFINIBAND", "CONFIG_IOMMU", "CONFIG_NUMA"} {
		if strings.HasPrefix(strings.TrimPrefix(l, "# "), k) {
			return true
		}
	}
	return false
}

func keepLines(data []byte, keep func(string) bool) []byte {
	var out []string
	for _, l := range strings.Split(string(data), "\n") {
		if keep(l) {
			out = append(out, l)
		}
	}
	return []byte(strings.Join(out, "\n") + "\n")
}

// hashGID keeps a GID's prefix (link-local fe80::/64, or ::ffff:0:0/96 for
// IPv4-mapped) and replaces the rest, which carries a MAC or IP address,
// with a salted hash: the same GID maps to the same value within one
// snapshot, and nothing of the address survives.
func (c *capture) hashGID(g string) string {
	groups := strings.Split(g, ":")
	if len(groups) != 8 || strings.Trim(g, "0:") == "" {
		return g
	}
	keep := 0
	switch {
	case groups[0] == "fe80":
		keep = 4
	case strings.Join(groups[:6], ":") == "0000:0000:0000:0000:0000:ffff":
		keep = 6
	}
	h := sha256.Sum256(append(append([]byte{}, c.salt...), g...))
	hx := hex.EncodeToString(h[:])
	for i := keep; i < 8; i++ {
		groups[i] = hx[i*4 : i*4+4]
	}
	return strings.Join(groups, ":")
}

func runSnapshot(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("gdrcheck snapshot", flag.ContinueOnError)
	fs.SetOutput(stderr)
	rootArg := fs.String("root", "", "capture from this directory or snapshot instead of /")
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "usage: gdrcheck snapshot [--root DIR] FILE.tar.gz\n\nCaptures the files the checks read, and NVML's answers, into one archive with\nno hostname, serial, MAC or IP address in it; gdrcheck --root FILE replays it.\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return exitReady
		}
		return exitNotReady
	}
	if fs.NArg() != 1 {
		fs.Usage()
		return exitNotReady
	}
	if err := snapshot(ctx, *rootArg, fs.Arg(0)); err != nil {
		fmt.Fprintf(stderr, "gdrcheck: snapshot: %v\n", err)
		return exitNotReady
	}
	fmt.Fprintf(stdout, "snapshot written to %s; replay it with: gdrcheck --root %s\n", fs.Arg(0), fs.Arg(0))
	return exitReady
}

func snapshot(ctx context.Context, rootArg, out string) error {
	root, cleanup, err := openRootArg(rootArg)
	if err != nil {
		return err
	}
	defer cleanup()
	c := newCapture()
	root.SetRecorder(c)
	// gdr records what it reads, and the facts it learned other than from
	// files; gdrcheck records what it reads itself.
	if _, err := gdr.Collect(ctx, gdr.CollectOptions{Root: root.Dir(), Recorder: c}); err != nil {
		return err
	}
	_, _ = root.ReadFile("/proc/self/limits")
	_ = readProcess(root)
	return c.writeArchive(out)
}

// writeArchive writes the capture as a tar.gz: directories, then links and
// files, sorted, with fixed times so equal captures give equal archives.
func (c *capture) writeArchive(out string) (err error) {
	f, err := os.OpenFile(out, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o644)
	if err != nil {
		return err
	}
	defer func() {
		if cerr := f.Close(); err == nil {
			err = cerr
		}
	}()
	zw := gzip.NewWriter(f)
	tw := tar.NewWriter(zw)
	dirs := map[string]bool{}
	addParents := func(p string) {
		for d := path.Dir(p); d != "/" && d != "."; d = path.Dir(d) {
			dirs[d] = true
		}
	}
	for d := range c.dirs {
		if d != "/" {
			dirs[d] = true
		}
		addParents(d)
	}
	for n := range c.files {
		addParents(n)
	}
	for n := range c.links {
		addParents(n)
	}
	for n := range c.links {
		delete(dirs, n)
	}
	mt := time.Unix(0, 0)
	for _, d := range sortedKeys(dirs) {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: strings.TrimPrefix(d, "/") + "/", Mode: 0o755, ModTime: mt}); err != nil {
			return err
		}
	}
	for _, n := range sortedKeys(c.links) {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeSymlink, Name: strings.TrimPrefix(n, "/"), Linkname: c.links[n], Mode: 0o777, ModTime: mt}); err != nil {
			return err
		}
	}
	for _, n := range sortedKeys(c.files) {
		if _, isLink := c.links[n]; isLink {
			continue
		}
		b := c.files[n]
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: strings.TrimPrefix(n, "/"), Size: int64(len(b)), Mode: 0o644, ModTime: mt}); err != nil {
			return err
		}
		if _, err := tw.Write(b); err != nil {
			return err
		}
	}
	if err := tw.Close(); err != nil {
		return err
	}
	return zw.Close()
}

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// openRootArg opens --root: "" is /, a directory is used as is, a file is a
// snapshot archive extracted to a temporary directory that cleanup removes.
func openRootArg(arg string) (*sysfs.Root, func(), error) {
	if arg == "" {
		r, err := sysfs.OpenRoot("/")
		if err != nil {
			return nil, nil, err
		}
		return r, func() { r.Close() }, nil
	}
	st, err := os.Stat(arg)
	if err != nil {
		return nil, nil, fmt.Errorf("--root: %w", err)
	}
	if st.IsDir() {
		r, err := sysfs.OpenRoot(arg)
		if err != nil {
			return nil, nil, err
		}
		return r, func() { r.Close() }, nil
	}
	dir, err := os.MkdirTemp("", "gdrcheck-root-")
	if err != nil {
		return nil, nil, err
	}
	if err := extract(arg, dir); err != nil {
		os.RemoveAll(dir)
		return nil, nil, err
	}
	r, err := sysfs.OpenRoot(dir)
	if err != nil {
		os.RemoveAll(dir)
		return nil, nil, err
	}
	return r, func() { r.Close(); os.RemoveAll(dir) }, nil
}

// extract unpacks a snapshot archive into dir: only directories, regular
// files and relative symbolic links that stay inside, within the size
// limits; everything is written through an os.Root so no entry can land
// outside dir.
func extract(archive, dir string) error {
	bad := func(format string, a ...any) error {
		return fmt.Errorf("%w: snapshot %s: %s", sysfs.ErrMalformed, archive, fmt.Sprintf(format, a...))
	}
	f, err := os.Open(archive)
	if err != nil {
		return err
	}
	defer f.Close()
	zr, err := gzip.NewReader(f)
	if err != nil {
		return bad("not a gzip archive: %v", err)
	}
	root, err := os.OpenRoot(dir)
	if err != nil {
		return err
	}
	defer root.Close()
	tr := tar.NewReader(io.LimitReader(zr, maxArchiveBytes+1))
	var total int64
	for n := 0; ; n++ {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return bad("%v", err)
		}
		if n >= maxArchiveEntries {
			return bad("more than %d entries", maxArchiveEntries)
		}
		name := path.Clean(h.Name)
		if path.IsAbs(name) || name == ".." || strings.HasPrefix(name, "../") || name == "." {
			return bad("entry %q leaves the root", h.Name)
		}
		if err := root.MkdirAll(path.Dir(name), 0o755); err != nil {
			return bad("entry %q: %v", h.Name, err)
		}
		switch h.Typeflag {
		case tar.TypeDir:
			if err := root.MkdirAll(name, 0o755); err != nil {
				return bad("entry %q: %v", h.Name, err)
			}
		case tar.TypeSymlink:
			t := h.Linkname
			if path.IsAbs(t) {
				return bad("link %q has an absolute target %q", h.Name, t)
			}
			if j := path.Join(path.Dir(name), t); j == ".." || strings.HasPrefix(j, "../") {
				return bad("link %q points outside the root (%q)", h.Name, t)
			}
			if err := root.Symlink(t, name); err != nil {
				return bad("entry %q: %v", h.Name, err)
			}
		case tar.TypeReg:
			if h.Size < 0 || h.Size > maxArchiveFile {
				return bad("file %q has %d bytes (limit %d)", h.Name, h.Size, maxArchiveFile)
			}
			total += h.Size
			if total > maxArchiveBytes {
				return bad("more than %d bytes", maxArchiveBytes)
			}
			w, err := root.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
			if err != nil {
				return bad("entry %q: %v", h.Name, err)
			}
			_, err = io.CopyN(w, tr, h.Size)
			if cerr := w.Close(); err == nil {
				err = cerr
			}
			if err != nil {
				return bad("entry %q: %v", h.Name, err)
			}
		default:
			return bad("entry %q has type %q (want directory, file or symbolic link)", h.Name, string(rune(h.Typeflag)))
		}
	}
}

package main

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/gdrlink/gdrlink/internal/sysfs"
)

// dropLines removes the lines that legitimately differ between a tree and
// its snapshot: where it came from, and the GIDs, which are hashed.
func dropLines(s string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.HasPrefix(l, "gdrcheck: GPUDirect RDMA readiness of") || strings.HasPrefix(strings.TrimSpace(l), "GID ") {
			continue
		}
		out = append(out, l)
	}
	return strings.Join(out, "\n")
}

// TestSnapshotReplaysFixtures snapshots each fixture tree and checks that
// the archive reproduces the report of the tree.
func TestSnapshotReplaysFixtures(t *testing.T) {
	t.Setenv("GDRLINK_NET_GDR_LEVEL", "")
	for name, code := range layouts {
		t.Run(name, func(t *testing.T) {
			archive := filepath.Join(t.TempDir(), name+".tar.gz")
			if out, errs, c := runArgs(t, "snapshot", "--root", "testdata/nodes/"+name, archive); c != 0 {
				t.Fatalf("snapshot: exit %d: %s %s", c, out, errs)
			}
			want, _, _ := runArgs(t, "--root", "testdata/nodes/"+name, "--color", "never")
			got, errs, c := runArgs(t, "--root", archive, "--color", "never")
			if c != code {
				t.Fatalf("replay: exit %d, want %d; %s", c, code, errs)
			}
			if dropLines(got) != dropLines(want) {
				t.Errorf("replay differs from the tree:\n%s", diff(dropLines(want), dropLines(got)))
			}
		})
	}
}

var macRE = regexp.MustCompile(`^([0-9a-f]{2}:){5}[0-9a-f]{2}$`)

// TestSnapshotThisNode snapshots this machine, replays it and checks that
// the verdict is reproduced and that nothing personal went into the archive.
func TestSnapshotThisNode(t *testing.T) {
	archive := filepath.Join(t.TempDir(), "node.tar.gz")
	if out, errs, c := runArgs(t, "snapshot", archive); c != 0 {
		t.Fatalf("snapshot: exit %d: %s %s", c, out, errs)
	}
	live, _, liveCode := runArgs(t, "--json")
	replay, errs, code := runArgs(t, "--root", archive, "--json")
	if code != liveCode {
		t.Fatalf("replay exit %d, live %d; %s", code, liveCode, errs)
	}
	validate(t, compileSchema(t), replay)
	grab := func(js, key string) string {
		i := strings.Index(js, `"`+key+`"`)
		if i < 0 {
			return ""
		}
		j := strings.Index(js[i:], "\n")
		return js[i : i+j]
	}
	for _, k := range []string{"verdict", "summary", "exit_code"} {
		if grab(live, k) != grab(replay, k) {
			t.Errorf("%s: live %s, replay %s", k, grab(live, k), grab(replay, k))
		}
	}
	// Nothing personal: no hostname, no MAC address of this machine.
	var secrets []string
	if h, err := os.Hostname(); err == nil && len(h) > 3 {
		secrets = append(secrets, h)
	}
	if nets, err := os.ReadDir("/sys/class/net"); err == nil {
		for _, n := range nets {
			if b, err := os.ReadFile("/sys/class/net/" + n.Name() + "/address"); err == nil {
				if m := strings.TrimSpace(string(b)); macRE.MatchString(m) && m != "00:00:00:00:00:00" {
					secrets = append(secrets, m)
				}
			}
		}
	}
	files := readArchive(t, archive)
	for name, content := range files {
		for _, s := range secrets {
			if strings.Contains(content, s) || strings.Contains(name, s) {
				t.Errorf("%s holds %q", name, s)
			}
		}
	}
	if _, ok := files["gdrlink/facts.json"]; !ok {
		t.Error("no gdrlink/facts.json in the snapshot")
	}
	t.Logf("snapshot of this node: %d files and links", len(files))
}

func readArchive(t *testing.T, p string) map[string]string {
	t.Helper()
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	zr, err := gzip.NewReader(f)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	tr := tar.NewReader(zr)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return out
		}
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(tr)
		out[h.Name] = string(b) + h.Linkname
	}
}

func TestGIDHashing(t *testing.T) {
	c := newCapture()
	ll := "fe80:0000:0000:0000:0e42:a1ff:fe6b:7c10"
	h := c.hashGID(ll)
	if !strings.HasPrefix(h, "fe80:0000:0000:0000:") || strings.Contains(h, "0e42:a1ff:fe6b:7c10") || len(h) != len(ll) {
		t.Fatalf("link-local GID hashed to %q", h)
	}
	if c.hashGID(ll) != h {
		t.Fatal("hash not stable within a capture")
	}
	v4 := "0000:0000:0000:0000:0000:ffff:0a00:0005"
	if h := c.hashGID(v4); !strings.HasPrefix(h, "0000:0000:0000:0000:0000:ffff:") || strings.HasSuffix(h, "0a00:0005") {
		t.Fatalf("IPv4-mapped GID hashed to %q", h)
	}
	if z := "0000:0000:0000:0000:0000:0000:0000:0000"; c.hashGID(z) != z {
		t.Fatal("zero GID changed")
	}
	if newCapture().hashGID(ll) == h {
		t.Fatal("two captures share a salt")
	}
	c.File("/sys/class/infiniband/rxe0/ports/1/gids/7", []byte("0000:0000:0000:0000:0000:0000:0000:0000\n"))
	if len(c.files) != 0 {
		t.Fatalf("empty GID captured: %v", c.files)
	}
	c.File("/proc/cmdline", []byte("BOOT_IMAGE=/vmlinuz root=UUID=1234 intel_iommu=on iommu=pt quiet\n"))
	if got := string(c.files["/proc/cmdline"]); got != "intel_iommu=on iommu=pt\n" {
		t.Fatalf("cmdline kept as %q", got)
	}
	c.File("/usr/lib/x86_64-linux-gnu/libibverbs.so.1", []byte("\x7fELF"))
	if _, ok := c.files["/usr/lib/x86_64-linux-gnu/libibverbs.so.1"]; ok {
		t.Fatal("shared library captured")
	}
}

// writeTar builds an archive from entries for the hostile-archive tests.
func writeTar(t *testing.T, hdrs []tar.Header) string {
	t.Helper()
	var buf bytes.Buffer
	zw := gzip.NewWriter(&buf)
	tw := tar.NewWriter(zw)
	for _, h := range hdrs {
		h := h
		body := ""
		if h.Typeflag == tar.TypeReg {
			body = strings.Repeat("x", int(h.Size))
		}
		if err := tw.WriteHeader(&h); err != nil {
			t.Fatal(err)
		}
		if body != "" {
			if _, err := tw.Write([]byte(body)); err != nil {
				t.Fatal(err)
			}
		}
	}
	tw.Close()
	zw.Close()
	p := filepath.Join(t.TempDir(), "a.tar.gz")
	if err := os.WriteFile(p, buf.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestHostileArchives(t *testing.T) {
	outside := filepath.Join(t.TempDir(), "outside")
	cases := map[string][]tar.Header{
		"absolute":      {{Typeflag: tar.TypeReg, Name: "/etc/x", Size: 1}},
		"dotdot":        {{Typeflag: tar.TypeReg, Name: "../x", Size: 1}},
		"abs link":      {{Typeflag: tar.TypeSymlink, Name: "sys", Linkname: "/sys"}},
		"escaping link": {{Typeflag: tar.TypeSymlink, Name: "a/b", Linkname: "../../x"}},
		"through link":  {{Typeflag: tar.TypeSymlink, Name: "a", Linkname: "b"}, {Typeflag: tar.TypeDir, Name: "b/"}, {Typeflag: tar.TypeSymlink, Name: "b/c", Linkname: "../../" + outside}},
		"device":        {{Typeflag: tar.TypeChar, Name: "dev/null"}},
		"huge file":     {{Typeflag: tar.TypeReg, Name: "big", Size: maxArchiveFile + 1}},
		"duplicate":     {{Typeflag: tar.TypeReg, Name: "f", Size: 1}, {Typeflag: tar.TypeReg, Name: "f", Size: 1}},
	}
	for name, hdrs := range cases {
		t.Run(name, func(t *testing.T) {
			p := writeTar(t, hdrs)
			_, _, err := openRootArg(p)
			if !errors.Is(err, sysfs.ErrMalformed) {
				t.Fatalf("openRootArg: %v, want ErrMalformed", err)
			}
			if _, err := os.Stat(outside); err == nil {
				t.Fatal("archive wrote outside its root")
			}
		})
	}
	notGzip := filepath.Join(t.TempDir(), "x.tar.gz")
	os.WriteFile(notGzip, []byte("plain"), 0o644)
	if _, _, err := openRootArg(notGzip); !errors.Is(err, sysfs.ErrMalformed) {
		t.Fatalf("not gzip: %v", err)
	}
	if _, _, code := runArgs(t, "--root", notGzip); code != exitNotReady {
		t.Fatalf("gdrcheck --root with a bad archive: exit %d", code)
	}
	if _, _, code := runArgs(t, "snapshot"); code != exitNotReady {
		t.Fatalf("snapshot without a file: exit %d", code)
	}
	_ = context.Background
}

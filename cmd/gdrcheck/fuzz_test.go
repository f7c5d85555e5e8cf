package main

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/gdrlink/gdrlink/internal/sysfs"
)

func tarGz(entries ...tar.Header) []byte {
	var buf bytes.Buffer
	zw := gzip.NewWriter(&buf)
	tw := tar.NewWriter(zw)
	for _, h := range entries {
		h := h
		_ = tw.WriteHeader(&h)
		if h.Typeflag == tar.TypeReg {
			_, _ = tw.Write(bytes.Repeat([]byte("1"), int(h.Size)))
		}
	}
	tw.Close()
	zw.Close()
	return buf.Bytes()
}

// FuzzExtract feeds arbitrary archives to the snapshot reader: it must
// unpack them or fail with ErrMalformed, and never write outside its
// directory.
func FuzzExtract(f *testing.F) {
	f.Add(tarGz(tar.Header{Typeflag: tar.TypeDir, Name: "sys/"}, tar.Header{Typeflag: tar.TypeReg, Name: "sys/x", Size: 1}, tar.Header{Typeflag: tar.TypeSymlink, Name: "sys/l", Linkname: "x"}))
	f.Add(tarGz(tar.Header{Typeflag: tar.TypeSymlink, Name: "a", Linkname: "../b"}))
	f.Add([]byte("not gzip"))
	f.Fuzz(func(t *testing.T, b []byte) {
		base := t.TempDir()
		dir := filepath.Join(base, "root")
		if err := os.Mkdir(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		archive := filepath.Join(base, "a.tar.gz")
		if err := os.WriteFile(archive, b, 0o644); err != nil {
			t.Fatal(err)
		}
		err := extract(archive, dir)
		if err != nil && !errors.Is(err, sysfs.ErrMalformed) {
			t.Fatalf("error %v does not wrap ErrMalformed", err)
		}
		ents, _ := os.ReadDir(base)
		for _, e := range ents {
			if e.Name() != "root" && e.Name() != "a.tar.gz" {
				t.Fatalf("extract wrote %s outside its root", e.Name())
			}
		}
		_ = filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
			if err == nil && d.Type()&os.ModeSymlink != 0 {
				l, _ := os.Readlink(p)
				if filepath.IsAbs(l) {
					t.Fatalf("absolute link %s -> %s", p, l)
				}
				rel, _ := filepath.Rel(dir, filepath.Join(filepath.Dir(p), l))
				if rel == ".." || strings.HasPrefix(rel, "../") {
					t.Fatalf("link %s -> %s leaves the root", p, l)
				}
			}
			return nil
		})
	})
}

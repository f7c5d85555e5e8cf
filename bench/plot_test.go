package main

import (
	"encoding/xml"
	"errors"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// readSVG checks that path is a well-formed XML document whose root is an
// SVG element, and returns its text contents.
func readSVG(t *testing.T, path string) []string {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	dec := xml.NewDecoder(f)
	var texts []string
	root := ""
	for {
		tok, err := dec.Token()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("%s is not well-formed XML: %v", path, err)
		}
		switch tok := tok.(type) {
		case xml.StartElement:
			if root == "" {
				root = tok.Name.Local
				if tok.Name.Space != "http://www.w3.org/2000/svg" {
					t.Errorf("root namespace %q", tok.Name.Space)
				}
			}
		case xml.CharData:
			if s := strings.TrimSpace(string(tok)); s != "" {
				texts = append(texts, s)
			}
		}
	}
	if root != "svg" {
		t.Fatalf("%s: root element %q, want svg", path, root)
	}
	return texts
}

func TestWriteSVG(t *testing.T) {
	path := filepath.Join(t.TempDir(), "x.svg")
	ss := []series{
		{name: "tcp", xs: []float64{4096, 8192, 16384}, ys: []float64{1, 2, 3}},
		{name: "verbs", xs: []float64{4096, 8192, 16384}, ys: []float64{2, 4, 6}},
		{name: "memcpy (baseline)", dashed: true, xs: []float64{4096, 8192, 16384}, ys: []float64{9, 9, 9}},
	}
	if err := writeSVG(path, "transfer bandwidth", "GB/s", ss); err != nil {
		t.Fatal(err)
	}
	texts := readSVG(t, path)
	for _, want := range []string{"transfer bandwidth", "GB/s", "tcp", "verbs", "memcpy (baseline)", "4KiB", "16KiB"} {
		if !slicesContain(texts, want) {
			t.Errorf("SVG texts %q lack %q", texts, want)
		}
	}
	raw, _ := os.ReadFile(path)
	if !strings.Contains(string(raw), "stroke-dasharray") {
		t.Error("baseline is not dashed")
	}
}

func TestWriteSVGBadInput(t *testing.T) {
	dir := t.TempDir()
	for name, ss := range map[string][]series{
		"empty":     nil,
		"zero size": {{name: "a", xs: []float64{0}, ys: []float64{1}}},
		"nan":       {{name: "a", xs: []float64{1}, ys: []float64{nanValue()}}},
	} {
		if err := writeSVG(filepath.Join(dir, "x.svg"), "t", "GB/s", ss); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
	// One point is drawable (the axis is widened around it).
	if err := writeSVG(filepath.Join(dir, "one.svg"), "t", "GB/s", []series{{name: "a", xs: []float64{1 << 20}, ys: []float64{5}}}); err != nil {
		t.Errorf("one point: %v", err)
	}
}

func nanValue() float64 {
	var zero float64
	return zero / zero
}

func TestPlotSeries(t *testing.T) {
	rs := []Result{
		newResult("s", "tcp/8KiB", 8192, 2, "GB/s", 9, "memcpy"),
		newResult("s", "tcp/4KiB", 4096, 1, "GB/s", 8, "memcpy"),
		newResult("s", "verbs-4096", 4096, 3, "GB/s", 8.5, "memcpy"),
		newResult("s", "tcp/4KiB", 4096, 1, "us", 0, ""),       // other unit
		newResult("other", "tcp/4KiB", 4096, 1, "GB/s", 0, ""), // other scenario
		newResult("s", "lat", 0, 1, "GB/s", 0, ""),             // no size
	}
	got := plotSeries(Plot{Unit: "GB/s"}, "s", rs)
	if len(got) != 3 {
		t.Fatalf("series %+v, want tcp, verbs, memcpy baseline", got)
	}
	if got[0].name != "tcp" || len(got[0].xs) != 2 || got[0].xs[0] != 4096 || got[0].ys[1] != 2 {
		t.Errorf("tcp series %+v", got[0])
	}
	if got[1].name != "verbs" || got[1].dashed {
		t.Errorf("verbs series %+v", got[1])
	}
	b := got[2]
	if b.name != "memcpy (baseline)" || !b.dashed || len(b.xs) != 2 || b.ys[0] != 8 || b.ys[1] != 9 {
		t.Errorf("baseline series %+v (first baseline per size wins)", b)
	}
	if got := plotSeries(Plot{Unit: "GB/s", CasePrefix: "verbs"}, "s", rs); len(got) != 2 || got[0].name != "verbs" {
		t.Errorf("prefix verbs: %+v", got)
	}
	// A baseline that is itself a case with the same points is drawn once.
	self := []Result{
		newResult("m", "memcpy-4k", 4096, 5, "GB/s", 0, ""),
		newResult("m", "memcpy-thp", 4096, 6, "GB/s", 5, "memcpy-4k"),
	}
	if got := plotSeries(Plot{Unit: "GB/s"}, "m", self); len(got) != 2 {
		t.Errorf("self baseline drawn twice: %+v", got)
	}
}

func TestSeriesName(t *testing.T) {
	for _, tc := range []struct {
		c    string
		size int64
		want string
	}{
		{"tcp/1MiB", 1 << 20, "tcp"},
		{"tcp-1048576", 1 << 20, "tcp"},
		{"tcp@1 MiB", 1 << 20, "tcp"},
		{"tcp/2MiB", 1 << 20, "tcp/2MiB"},
		{"memcpy-4k", 4096, "memcpy-4k"}, // 4k is 4000 bytes: not this size
		{"memcpy-thp", 4096, "memcpy-thp"},
		{"plain", 1, "plain"},
		{"/1MiB", 1 << 20, "/1MiB"},
	} {
		if got := seriesName(tc.c, tc.size); got != tc.want {
			t.Errorf("seriesName(%q, %d) = %q, want %q", tc.c, tc.size, got, tc.want)
		}
	}
}

func TestDrawPlotsBadFileName(t *testing.T) {
	addScenario(t, Scenario{Name: "t-plotname", Plots: []Plot{{File: "../escape.svg", Unit: "GB/s"}, {File: "none.svg", Unit: "us"}}})
	rs := []Result{newResult("t-plotname", "a", 4096, 1, "GB/s", 0, "")}
	dir := t.TempDir()
	err := drawPlots(dir, []string{"t-plotname"}, rs, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err == nil || !strings.Contains(err.Error(), "escape.svg") {
		t.Fatalf("err = %v, want a bad file name", err)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 0 {
		t.Fatalf("wrote %v", ents)
	}
}

func TestLog2Ticks(t *testing.T) {
	ticks := log2Ticks(64<<10, 256<<20)
	if len(ticks) != 13 {
		t.Fatalf("%d ticks, want 13", len(ticks))
	}
	labels := 0
	for _, tk := range ticks {
		if tk.Label != "" {
			labels++
		}
	}
	if labels < 4 || labels > 9 || ticks[0].Label != "64KiB" {
		t.Fatalf("%d labels, first %q", labels, ticks[0].Label)
	}
	for e, want := range map[int]string{0: "1B", 9: "512B", 10: "1KiB", 20: "1MiB", 31: "2GiB"} {
		if got := pow2Label(e); got != want {
			t.Errorf("pow2Label(%d) = %q, want %q", e, got, want)
		}
	}
}

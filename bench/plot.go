package main

import (
	"errors"
	"fmt"
	"image/color"
	"log/slog"
	"maps"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
)

// series is one line of a plot: value against size.
type series struct {
	name   string
	xs, ys []float64 // sizes in bytes (ascending) and values
	dashed bool      // a baseline
}

// drawPlots draws the Plots of the named scenarios from results, as SVG
// files in dir (created if needed). A plot with nothing to draw is skipped
// with a warning; any other failure is returned after the rest are drawn.
func drawPlots(dir string, names []string, results []Result, log *slog.Logger) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("svg: %w", err)
	}
	var errs []error
	for _, name := range names {
		s, err := lookupScenario(name)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		for _, p := range s.Plots {
			ss := plotSeries(p, s.Name, results)
			if len(ss) == 0 {
				log.Warn("nothing to plot", "scenario", s.Name, "file", p.File, "unit", p.Unit, "case_prefix", p.CasePrefix)
				continue
			}
			if p.File == "" || p.File != filepath.Base(p.File) || !strings.HasSuffix(p.File, ".svg") {
				errs = append(errs, fmt.Errorf("svg: scenario %s: plot file %q is not a base name ending in .svg", s.Name, p.File))
				continue
			}
			path := filepath.Join(dir, p.File)
			if err := writeSVG(path, p.Title, p.Unit, ss); err != nil {
				errs = append(errs, fmt.Errorf("svg: scenario %s: %w", s.Name, err))
				continue
			}
			log.Info("wrote plot", "scenario", s.Name, "file", path, "series", len(ss))
		}
	}
	return errors.Join(errs...)
}

// plotSeries selects the results of scenario that p plots (its unit, cases
// with its prefix, positive sizes) and groups them into one series per case
// name, a size at the end of the name stripped (see seriesName), followed by
// one dashed series per baseline name. Where a series has two values at one
// size, the later wins.
func plotSeries(p Plot, scenario string, results []Result) []series {
	type key struct {
		name   string
		dashed bool
	}
	points := map[key]map[int64]float64{}
	var order []key
	add := func(k key, x int64, y float64) {
		m, ok := points[k]
		if !ok {
			m = map[int64]float64{}
			points[k] = m
			order = append(order, k)
		}
		m[x] = y
	}
	baselineSeen := map[key]map[int64]bool{}
	for _, r := range results {
		if r.Scenario != scenario || r.Unit != p.Unit || !strings.HasPrefix(r.Case, p.CasePrefix) || r.SizeBytes <= 0 {
			continue
		}
		name := seriesName(r.Case, r.SizeBytes)
		add(key{name, false}, r.SizeBytes, r.Value)
		if r.Baseline > 0 {
			bn := r.BaselineName
			if bn == "" {
				bn = name
			}
			k := key{bn + " (baseline)", true}
			// One line per baseline name: the first series that reports a
			// baseline at a size gives its value there.
			if baselineSeen[k] == nil {
				baselineSeen[k] = map[int64]bool{}
			}
			if !baselineSeen[k][r.SizeBytes] {
				baselineSeen[k][r.SizeBytes] = true
				add(k, r.SizeBytes, r.Baseline)
			}
		}
	}
	// Solid lines first, then dashed, each in order of appearance.
	slices.SortStableFunc(order, func(a, b key) int {
		switch {
		case a.dashed == b.dashed:
			return 0
		case a.dashed:
			return 1
		}
		return -1
	})
	out := make([]series, 0, len(order))
	for _, k := range order {
		// A baseline that is itself a plotted case ("memcpy-4k" as the
		// baseline of "memcpy-thp") with the same points is drawn once.
		if base, ok := strings.CutSuffix(k.name, " (baseline)"); k.dashed && ok && maps.Equal(points[k], points[key{base, false}]) {
			continue
		}
		s := series{name: k.name, dashed: k.dashed}
		sizes := make([]int64, 0, len(points[k]))
		for x := range points[k] {
			sizes = append(sizes, x)
		}
		slices.Sort(sizes)
		for _, x := range sizes {
			s.xs = append(s.xs, float64(x))
			s.ys = append(s.ys, points[k][x])
		}
		out = append(out, s)
	}
	return out
}

// seriesName is the case name without a trailing size that equals size:
// "tcp/1MiB", "tcp-1048576" and "tcp@1 MiB" at 1 MiB all give "tcp", so a
// scenario may name its cases with or without their size.
func seriesName(caseName string, size int64) string {
	for i := len(caseName) - 1; i > 0; i-- {
		if !strings.ContainsRune("/@-_: ", rune(caseName[i])) {
			continue
		}
		if n, err := parseSize(caseName[i+1:]); err == nil && n == size {
			return caseName[:i]
		}
	}
	return caseName
}

// writeSVG draws the series as value against size on a log2 x axis into
// the SVG file path.
func writeSVG(path, title, unit string, ss []series) (err error) {
	defer func() {
		// gonum/plot panics on some degenerate input; keep that an error.
		if r := recover(); r != nil {
			err = fmt.Errorf("drawing %s: %v", path, r)
		}
	}()
	p := plot.New()
	p.Title.Text = title
	p.X.Label.Text = "size"
	p.Y.Label.Text = unit
	p.X.Scale = plot.LogScale{}
	p.Legend.Top = false
	p.Legend.XOffs = -vg.Points(6)
	minX, maxX, maxY := math.Inf(1), 0.0, 0.0
	solid := 0
	for _, s := range ss {
		xys := make(plotter.XYs, len(s.xs))
		for i := range s.xs {
			if !(s.xs[i] > 0) || math.IsInf(s.xs[i], 0) || math.IsNaN(s.ys[i]) || math.IsInf(s.ys[i], 0) {
				return fmt.Errorf("series %q: point (%v, %v) cannot be drawn", s.name, s.xs[i], s.ys[i])
			}
			xys[i] = plotter.XY{X: s.xs[i], Y: s.ys[i]}
			minX, maxX, maxY = math.Min(minX, s.xs[i]), math.Max(maxX, s.xs[i]), math.Max(maxY, s.ys[i])
		}
		line, points, err := plotter.NewLinePoints(xys)
		if err != nil {
			return fmt.Errorf("series %q: %w", s.name, err)
		}
		var c color.Color
		if s.dashed {
			c = color.Gray{Y: 0x60}
			line.LineStyle.Dashes = []vg.Length{vg.Points(6), vg.Points(3)}
			points.GlyphStyle.Radius = 0
			p.Add(line)
			p.Legend.Add(s.name, line)
		} else {
			c = plotutil.Color(solid)
			points.GlyphStyle.Shape = plotutil.Shape(solid)
			points.GlyphStyle.Color = c
			solid++
			p.Add(line, points)
			p.Legend.Add(s.name, line, points)
		}
		line.LineStyle.Color = c
		line.LineStyle.Width = vg.Points(1.5)
	}
	if math.IsInf(minX, 1) {
		return errors.New("no points")
	}
	if minX == maxX {
		minX, maxX = minX/2, maxX*2
	}
	p.X.Min, p.X.Max = minX, maxX
	p.X.Tick.Marker = plot.ConstantTicks(log2Ticks(minX, maxX))
	p.Y.Min = 0
	p.Y.Max = math.Max(maxY*1.05, 1e-9)
	return p.Save(8*vg.Inch, 5*vg.Inch, path)
}

// log2Ticks marks every power of two in [lo, hi], with labels ("64 KiB")
// on at most about eight of them.
func log2Ticks(lo, hi float64) []plot.Tick {
	first := int(math.Ceil(math.Log2(lo)))
	last := int(math.Floor(math.Log2(hi)))
	if first > last || first < 0 || last > 62 {
		return nil
	}
	step := (last-first)/8 + 1
	var ticks []plot.Tick
	for e := first; e <= last; e++ {
		t := plot.Tick{Value: math.Ldexp(1, e)}
		if (e-first)%step == 0 {
			t.Label = pow2Label(e)
		}
		ticks = append(ticks, t)
	}
	return ticks
}

// pow2Label names 2^e bytes compactly: "512B", "64KiB", "1MiB", "2GiB".
func pow2Label(e int) string {
	units := []string{"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"}
	return fmt.Sprintf("%d%s", 1<<(e%10), units[e/10])
}

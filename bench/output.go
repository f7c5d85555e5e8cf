package main

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"strconv"
	"strings"
	"text/tabwriter"

	"github.com/dustin/go-humanize"
)

// resultWriter prints results as they come; Flush ends a scenario's part.
type resultWriter interface {
	Write(r Result) error
	Flush() error
}

// jsonWriter prints one JSON object per result and line, with Result's JSON
// field names and order.
type jsonWriter struct {
	enc *json.Encoder
}

func newJSONWriter(w io.Writer) *jsonWriter {
	enc := json.NewEncoder(w)
	enc.SetEscapeHTML(false)
	return &jsonWriter{enc: enc}
}

// Write prints r at once, so a long run shows its lines as they are measured.
func (j *jsonWriter) Write(r Result) error { return j.enc.Encode(r) }

// Flush does nothing: every line is written by Write.
func (j *jsonWriter) Flush() error { return nil }

// tableWriter prints each scenario's results as an aligned table for people,
// followed by the distinct notes of its cases.
type tableWriter struct {
	w       io.Writer
	rows    []Result
	written bool
}

func newTableWriter(w io.Writer) *tableWriter { return &tableWriter{w: w} }

// Write keeps r for the table Flush prints.
func (t *tableWriter) Write(r Result) error {
	t.rows = append(t.rows, r)
	return nil
}

// Flush prints the kept results as one table and forgets them.
func (t *tableWriter) Flush() error {
	if len(t.rows) == 0 {
		return nil
	}
	if t.written {
		fmt.Fprintln(t.w)
	}
	t.written = true
	tw := newTabWriter(t.w)
	fmt.Fprintln(tw, "SCENARIO\tCASE\tSIZE\tVALUE\tUNIT\tBASELINE\tBASELINE VALUE\tRATIO")
	type note struct{ c, n string }
	var notes []note
	seen := map[note]bool{}
	ratios := false
	for _, r := range t.rows {
		base, baseVal, rat := "-", "-", "-"
		if r.BaselineName != "" || r.Baseline != 0 {
			base, baseVal = r.BaselineName, formatFigure(r.Baseline)
			if base == "" {
				base = "?"
			}
		}
		if r.Ratio != 0 {
			rat = strconv.FormatFloat(r.Ratio, 'f', 2, 64) + "x"
			ratios = true
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", r.Scenario, r.Case, formatSize(r.SizeBytes), formatFigure(r.Value), r.Unit, base, baseVal, rat)
		if n := (note{r.Case, r.Note}); r.Note != "" && !seen[n] {
			seen[n] = true
			notes = append(notes, n)
		}
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if ratios {
		if _, err := fmt.Fprintln(t.w, ratioLegend); err != nil {
			return err
		}
	}
	for _, n := range notes {
		if _, err := fmt.Fprintf(t.w, "  note (%s): %s\n", n.c, n.n); err != nil {
			return err
		}
	}
	t.rows = t.rows[:0]
	return nil
}

// ratioLegend follows every table with ratios: which way is better.
const ratioLegend = "  RATIO: higher is better for gdrlink (value/baseline for rates, baseline/value for times)"

func newTabWriter(w io.Writer) *tabwriter.Writer {
	return tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
}

// formatSize prints a byte count in IEC units ("64 KiB").
func formatSize(n int64) string {
	if n < 0 {
		return strconv.FormatInt(n, 10)
	}
	return humanize.IBytes(uint64(n))
}

// formatFigure prints a measured figure with about four significant digits
// and thousands separators: "12.35", "1,234", "0.0123".
func formatFigure(v float64) string {
	switch a := math.Abs(v); {
	case a >= 1000:
		return humanize.CommafWithDigits(math.Round(v), 0)
	case a >= 1:
		s := strconv.FormatFloat(v, 'f', 2, 64)
		return strings.TrimSuffix(strings.TrimRight(s, "0"), ".")
	case a == 0:
		return "0"
	}
	return strconv.FormatFloat(v, 'g', 3, 64)
}

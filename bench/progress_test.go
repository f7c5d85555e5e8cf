package main

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"regexp"
	"strings"
	"testing"
)

// driveProgress runs p through a scenario of two rows, with a log line and
// a table line written through its wrapped writers in between.
func driveProgress(p *progress, stderr, stdout io.Writer) {
	errW, outW := p.wrap(stderr), p.wrap(stdout)
	p.start("xfer", 2, 3)
	io.WriteString(errW, "log line\n")
	p.row(Result{Case: "bw/tcp", SizeBytes: 1 << 20})
	p.row(Result{Case: "skipped/ibverbs"})
	io.WriteString(outW, "table line\n")
	p.done()
}

func TestProgressOffWritesNothing(t *testing.T) {
	var stderr, stdout bytes.Buffer
	p := newProgress(&stderr, false)
	if w := p.wrap(&stdout); w != io.Writer(&stdout) {
		t.Errorf("wrap returned %T, want the writer itself", w)
	}
	driveProgress(p, &stderr, &stdout)
	if got := stderr.String(); got != "log line\n" {
		t.Errorf("stderr %q, want only the log line", got)
	}
	if got := stdout.String(); got != "table line\n" {
		t.Errorf("stdout %q, want only the table line", got)
	}
}

func TestProgressTerminal(t *testing.T) {
	var stderr, stdout bytes.Buffer
	driveProgress(newProgress(&stderr, true), &stderr, &stdout)
	want := "\rbench: xfer (scenario 2/3), starting\x1b[K" +
		"\r\x1b[K" + "log line\n" + "\rbench: xfer (scenario 2/3), starting\x1b[K" +
		"\rbench: xfer (scenario 2/3), row 1: bw/tcp 1.0 MiB\x1b[K" +
		"\rbench: xfer (scenario 2/3), row 2: skipped/ibverbs\x1b[K" +
		"\r\x1b[K" + "\rbench: xfer (scenario 2/3), row 2: skipped/ibverbs\x1b[K" +
		"\r\x1b[K"
	if got := stderr.String(); got != want {
		t.Errorf("stderr\n%q\nwant\n%q", got, want)
	}
	if got := stdout.String(); got != "table line\n" {
		t.Errorf("stdout %q: the status line must not reach it", got)
	}
	if !strings.HasSuffix(stderr.String(), "\r\x1b[K") {
		t.Errorf("stderr does not end by erasing the line: %q", stderr.String())
	}
}

func TestProgressPartialWriteKeepsLineOff(t *testing.T) {
	var stderr bytes.Buffer
	p := newProgress(&stderr, true)
	w := p.wrap(&stderr)
	p.start("memcpy", 1, 1)
	io.WriteString(w, "half ")
	io.WriteString(w, "a line\n")
	p.done()
	p.done() // a second done writes nothing
	want := "\rbench: memcpy (scenario 1/1), starting\x1b[K" +
		"\r\x1b[K" + "half a line\n" + "\rbench: memcpy (scenario 1/1), starting\x1b[K" +
		"\r\x1b[K"
	if got := stderr.String(); got != want {
		t.Errorf("stderr\n%q\nwant\n%q", got, want)
	}
}

func TestProgressCutToWidth(t *testing.T) {
	var stderr bytes.Buffer
	p := newProgress(&stderr, true)
	p.width = 20
	p.start("a-long-scenario-name", 1, 1)
	line := strings.TrimSuffix(strings.TrimPrefix(stderr.String(), "\r"), "\x1b[K")
	if line != "bench: a-long-scen~" {
		t.Errorf("line %q, want it cut to 19 columns", line)
	}
}

func TestProgressNotTerminal(t *testing.T) {
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	defer w.Close()
	f, err := os.Create(t.TempDir() + "/out")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for name, w := range map[string]io.Writer{"pipe": w, "file": f, "buffer": &bytes.Buffer{}} {
		if isTerminal(w) || terminalWidth(w) != 0 {
			t.Errorf("%s: taken for a terminal", name)
		}
		if progressAuto.draws(w) || !progressAlways.draws(w) || progressNever.draws(w) {
			t.Errorf("%s: auto %v, always %v, never %v; want false, true, false", name,
				progressAuto.draws(w), progressAlways.draws(w), progressNever.draws(w))
		}
	}
}

func TestParseProgressMode(t *testing.T) {
	for _, m := range []progressMode{progressAuto, progressAlways, progressNever} {
		got, err := parseProgressMode(m.String())
		if err != nil || got != m {
			t.Errorf("parseProgressMode(%q) = %v, %v", m.String(), got, err)
		}
	}
	for _, s := range []string{"", "on", "ALWAYS", "auto "} {
		if _, err := parseProgressMode(s); err == nil || !strings.Contains(err.Error(), "auto, always or never") {
			t.Errorf("parseProgressMode(%q): error %v, want one naming the values", s, err)
		}
	}
}

func TestParseArgsProgress(t *testing.T) {
	for _, c := range []struct {
		args []string
		want progressMode
	}{
		{nil, progressAuto},
		{[]string{"-progress", "auto"}, progressAuto},
		{[]string{"-progress=always"}, progressAlways},
		{[]string{"-progress", "never"}, progressNever},
	} {
		o, err := parseArgs(c.args, io.Discard)
		if err != nil || o.progress != c.want {
			t.Errorf("%q: progress %v, %v; want %v", c.args, o.progress, err, c.want)
		}
	}
	var usage bytes.Buffer
	_, err := parseArgs([]string{"-progress", "sometimes"}, &usage)
	if !errors.Is(err, errUsage) || !strings.Contains(err.Error(), `invalid value "sometimes" for flag -progress: want auto, always or never`) {
		t.Errorf("-progress sometimes: error %v", err)
	}
	code, out, errOut := runBench(t, "-progress", "sometimes")
	if code != exitUsage || out != "" || !strings.Contains(errOut, "-progress") {
		t.Errorf("-progress sometimes: exit %d, stdout %q, stderr %q; want %d with a message", code, out, errOut, exitUsage)
	}
}

func TestRunProgress(t *testing.T) {
	addScenario(t, Scenario{Name: "t-progress", Run: func(ctx context.Context, env *Env) error {
		env.Emit(Result{Case: "c", SizeBytes: 512, Value: 1, Unit: "GB/s"})
		env.Emit(Result{Case: "c", SizeBytes: 1024, Value: 2, Unit: "GB/s"})
		return nil
	}})
	stamp := regexp.MustCompile(`time=\S+ `)
	runs := map[string][2]string{}
	for _, mode := range []string{"", "never", "always"} {
		args := []string{"-scenario", "t-progress"}
		if mode != "" {
			args = append(args, "-progress", mode)
		}
		code, out, errOut := runBench(t, args...)
		if code != exitOK {
			t.Fatalf("%q: exit %d, stderr:\n%s", args, code, errOut)
		}
		runs[mode] = [2]string{out, stamp.ReplaceAllString(errOut, "")}
	}
	// Not a terminal (a buffer): auto and never print the same, and no
	// control characters.
	if runs[""] != runs["never"] {
		t.Errorf("auto printed\n%q\nnever\n%q", runs[""], runs["never"])
	}
	for _, mode := range []string{"", "never", "always"} {
		if out := runs[mode][0]; strings.ContainsAny(out, "\r\x1b") {
			t.Errorf("-progress %q: stdout has control characters: %q", mode, out)
		}
	}
	if errOut := runs["never"][1]; strings.ContainsAny(errOut, "\r\x1b") || strings.Contains(errOut, "scenario 1/1") {
		t.Errorf("-progress never: stderr has a status line: %q", errOut)
	}
	if runs["always"][0] != runs["never"][0] {
		t.Errorf("stdout differs: always\n%q\nnever\n%q", runs["always"][0], runs["never"][0])
	}
	errOut := runs["always"][1]
	for _, want := range []string{
		"\rbench: t-progress (scenario 1/1), starting\x1b[K",
		"\rbench: t-progress (scenario 1/1), row 1: c 512 B\x1b[K",
		"\rbench: t-progress (scenario 1/1), row 2: c 1.0 KiB\x1b[K",
	} {
		if !strings.Contains(errOut, want) {
			t.Errorf("-progress always: stderr lacks %q:\n%q", want, errOut)
		}
	}
	if !strings.HasSuffix(errOut, "\r\x1b[K") {
		t.Errorf("-progress always: stderr does not end by erasing the line: %q", errOut)
	}
	// Without the status line's bytes, stderr is what -progress never prints.
	plain := regexp.MustCompile("\r(bench: [^\x1b]*)?\x1b\\[K").ReplaceAllString(errOut, "")
	if plain != runs["never"][1] {
		t.Errorf("-progress always, status line removed:\n%q\nwant\n%q", plain, runs["never"][1])
	}
}

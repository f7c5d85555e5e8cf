package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"sync"

	"golang.org/x/sys/unix"
)

// progressMode is the value of -progress: when to draw the status line.
type progressMode int

const (
	progressAuto   progressMode = iota // when stderr is a terminal
	progressAlways                     // also on a pipe or a file
	progressNever                      // never
)

// parseProgressMode parses -progress's value: auto, always or never. The
// error does not repeat s, which the flag package prints.
func parseProgressMode(s string) (progressMode, error) {
	switch s {
	case "auto":
		return progressAuto, nil
	case "always":
		return progressAlways, nil
	case "never":
		return progressNever, nil
	}
	return progressAuto, errors.New("want auto, always or never")
}

// String returns the mode as -progress spells it.
func (m progressMode) String() string {
	switch m {
	case progressAlways:
		return "always"
	case progressNever:
		return "never"
	}
	return "auto"
}

// draws reports whether the status line is drawn on w in mode m.
func (m progressMode) draws(w io.Writer) bool {
	switch m {
	case progressAlways:
		return true
	case progressNever:
		return false
	}
	return isTerminal(w)
}

// isTerminal reports whether w is a file open on a terminal.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
	return err == nil
}

// terminalWidth is the number of columns of the terminal w is open on, 0
// when w is not a terminal or its size is unknown.
func terminalWidth(w io.Writer) int {
	f, ok := w.(*os.File)
	if !ok {
		return 0
	}
	ws, err := unix.IoctlGetWinsize(int(f.Fd()), unix.TIOCGWINSZ)
	if err != nil {
		return 0
	}
	return int(ws.Col)
}

// Control sequences of the status line: a carriage return, and "erase to
// the end of the line" (ANSI EL), understood by every terminal emulator.
const (
	progressCR    = "\r"
	progressErase = "\x1b[K"
)

// progress draws one status line on a terminal, such as
//
//	bench: xfer (scenario 2/5), row 7: bw/tcp 1.0 MiB
//
// rewritten in place (a carriage return, then the line) as scenarios start
// and rows are measured, and erased by done. When it is off it writes
// nothing at all. Other output to the same terminal goes through writers
// from wrap, which erase the line before they write and draw it again after
// a whole line, so the two never mix. The methods are safe for concurrent
// use; errors writing the line are ignored (it is only a help to people).
type progress struct {
	w  io.Writer
	on bool
	// width is the terminal's column count: a longer line is cut to
	// width-1 columns, as a wrapped line cannot be rewritten in place. 0:
	// unknown, lines are not cut.
	width int

	mu    sync.Mutex
	line  string // the current status line, "" before the first scenario
	shown bool   // line is on the screen
	name  string // the scenario running
	index int    // its position in the run, from 1
	count int    // the number of scenarios in the run
	rows  int    // rows it has measured so far
}

// newProgress returns a status line drawn on w when terminal is true (w is
// a terminal, or -progress always) and writing nothing otherwise.
func newProgress(w io.Writer, terminal bool) *progress {
	return &progress{w: w, on: terminal}
}

// start notes that scenario name, the index-th (from 1) of count, is starting.
func (p *progress) start(name string, index, count int) {
	if !p.on {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.name, p.index, p.count, p.rows = name, index, count, 0
	p.set(fmt.Sprintf("bench: %s (scenario %d/%d), starting", name, index, count))
}

// row notes that the running scenario measured r.
func (p *progress) row(r Result) {
	if !p.on {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.rows++
	what := r.Case
	if r.SizeBytes > 0 {
		what += " " + formatSize(r.SizeBytes)
	}
	p.set(fmt.Sprintf("bench: %s (scenario %d/%d), row %d: %s", p.name, p.index, p.count, p.rows, what))
}

// done erases the line; the next start draws it again.
func (p *progress) done() {
	if !p.on {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.erase()
	p.line = ""
}

// wrap returns a writer to w, which shares the terminal with the status
// line: it erases the line before each write and draws it again after a
// write that ends a line. When the status line is off it returns w itself,
// so the output is the same as without one.
func (p *progress) wrap(w io.Writer) io.Writer {
	if !p.on {
		return w
	}
	return &progressWriter{p: p, w: w}
}

// set draws line in place of the current one; p.mu is held.
func (p *progress) set(line string) {
	p.line = p.cut(line)
	p.draw()
}

// draw writes the status line over whatever the cursor's line holds; p.mu
// is held.
func (p *progress) draw() {
	if p.line == "" {
		return
	}
	io.WriteString(p.w, progressCR+p.line+progressErase)
	p.shown = true
}

// erase takes the status line off the screen, leaving the cursor at the
// start of the empty line; p.mu is held.
func (p *progress) erase() {
	if !p.shown {
		return
	}
	io.WriteString(p.w, progressCR+progressErase)
	p.shown = false
}

// cut shortens s to fit the terminal's width, if known.
func (p *progress) cut(s string) string {
	if p.width < 2 {
		return s
	}
	r := []rune(s)
	if len(r) < p.width {
		return s
	}
	return string(r[:p.width-2]) + "~"
}

// progressWriter is a writer sharing the terminal with a status line.
type progressWriter struct {
	p *progress
	w io.Writer
}

// Write erases the status line, writes b, and draws the line again when b
// ends a line.
func (pw *progressWriter) Write(b []byte) (int, error) {
	pw.p.mu.Lock()
	defer pw.p.mu.Unlock()
	pw.p.erase()
	n, err := pw.w.Write(b)
	if n > 0 && b[n-1] == '\n' {
		pw.p.draw()
	}
	return n, err
}

package main

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"time"
)

// printRow reads a receiver's and a sender's report (either may be missing
// or empty: a killed process prints none; its columns then read "-") and writes the matrix row name:
// the outcome, how long after faultAt each side saw its error, the tensors
// verified and the corrupt ones accepted, and what each side left behind.
func printRow(w io.Writer, name string, faultAt int64, paths []string) error {
	if len(paths) != 2 {
		return fmt.Errorf("-row wants two report files (receiver, sender), got %d", len(paths))
	}
	var reps [2]*report
	for i, p := range paths {
		reps[i] = readReport(p)
	}
	rc, sd := reps[0], reps[1]
	outcome := "ok"
	switch {
	case rc == nil:
		outcome = "no report" // the receiver died: the sender's row says more
	case rc.Corrupt > 0:
		outcome = "CORRUPT ACCEPTED"
	case rc.Err != "" || (sd != nil && sd.Err != ""):
		outcome = "failed"
	case rc.Rejoins > 0:
		outcome = "ok, rejoined"
	case sd == nil:
		outcome = "ok, sender gone" // killed on purpose, the receiver had all
	}
	detect := func(r *report) string {
		if r == nil {
			return "-"
		}
		if r.Err == "" && r.Lost == "" {
			return "none"
		}
		if faultAt == 0 || r.ErrAt < faultAt {
			return "n/a"
		}
		return time.Duration(r.ErrAt - faultAt).Round(time.Millisecond).String()
	}
	leak := func(r *report) string {
		if r == nil {
			return "-"
		}
		return fmt.Sprintf("%+d/%+d", r.GoroutinesAfter-r.GoroutinesBefore, r.FDsAfter-r.FDsBefore)
	}
	verified, corrupt, steps := 0, 0, 0
	if rc != nil {
		verified, corrupt, steps = rc.Verified, rc.Corrupt, rc.Steps
	}
	fmt.Fprintf(w, "%-26s %-16s %9s %9s %6d/%-6d %7d %9s %9s\n", name, outcome, detect(rc), detect(sd), verified, steps, corrupt, leak(rc), leak(sd))
	for _, r := range reps {
		if r != nil && r.Lost != "" {
			fmt.Fprintf(w, "%28s%s: lost, then resumed %v later with a new process: %s\n", "", r.Role, time.Duration(r.RejoinedAt-r.ErrAt).Round(time.Millisecond), oneLine(r.Lost, 120))
		}
		if r != nil && r.Err != "" {
			fmt.Fprintf(w, "%28s%s: %s\n", "", r.Role, oneLine(r.Err, 160))
		}
	}
	return nil
}

// rowHeader is the matrix's header, for the script.
const rowHeader = "cell                       outcome          recv-det   send-det  verified/steps corrupt  recv g/fd  send g/fd"

func readReport(path string) *report {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil
	}
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	var r report
	if err := json.Unmarshal([]byte(lines[len(lines)-1]), &r); err != nil {
		return nil
	}
	return &r
}

func oneLine(s string, n int) string {
	s = strings.ReplaceAll(s, "\n", " ")
	if len(s) > n {
		s = s[:n] + "..."
	}
	return s
}

// floodConns opens up to n idle TCP connections spread over addrs, holds
// them for hold, and reports how many opened.
func floodConns(addrs []string, n int, hold time.Duration) (int, error) {
	var conns []net.Conn
	var firstErr error
	d := net.Dialer{Timeout: time.Second}
	for i := 0; i < n; i++ {
		c, err := d.Dial("tcp", addrs[i%len(addrs)])
		if err != nil {
			if firstErr == nil {
				firstErr = err
			}
			continue
		}
		conns = append(conns, c)
	}
	time.Sleep(hold)
	for _, c := range conns {
		_ = c.Close()
	}
	return len(conns), firstErr
}

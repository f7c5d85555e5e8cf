package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// The UCX baseline: Debian's ucx_perftest (ucx-utils) as a server and a
// client process on loopback, in batch mode (one connection runs every
// test line), restricted to a set of transports with UCX_TLS.

// errNoUCX: ucx_perftest is not installed or does not run here.
var errNoUCX = errors.New("ucx_perftest not available")

// ucxTest is one line of a ucx_perftest batch file.
type ucxTest struct {
	Label string // unique, no spaces or commas
	Test  string // tag_bw, tag_lat, ...
	Size  int
	Iters int
	Extra []string // more options, e.g. "-E", "sleep"
}

func (t ucxTest) line() string {
	warm := max(t.Iters/10, 1)
	f := []string{t.Label, "-t", t.Test, "-s", strconv.Itoa(t.Size), "-n", strconv.Itoa(t.Iters), "-w", strconv.Itoa(warm)}
	return strings.Join(append(f, t.Extra...), " ")
}

// ucxRow is one result row of ucx_perftest -f -v.
type ucxRow struct {
	Iters      int
	MedianLatU float64 // 50th percentile latency, us (one way for latency tests)
	AvgLatU    float64 // us
	AvgBWMiBs  float64 // MiB/s (ucx_perftest's MB are 2^20 bytes)
}

// GBs is the row's bandwidth in GB/s (1e9 bytes per second).
func (r ucxRow) GBs() float64 { return r.AvgBWMiBs * (1 << 20) / 1e9 }

// parseUCXOutput reads the CSV rows of ucx_perftest -f -v from a batch run:
// a header "<batch>,iterations,50.0_percentile_lat,avg_lat,overall_lat,
// avg_bw,overall_bw,avg_mr,overall_mr" and "label,iters,..." rows. Lines
// that are not rows (banners, warnings) are ignored; a row whose numbers do
// not parse is an error.
func parseUCXOutput(out []byte) (map[string]ucxRow, error) {
	rows := map[string]ucxRow{}
	header := false
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Split(strings.TrimSpace(line), ",")
		if len(f) == 9 && f[1] == "iterations" {
			if !strings.HasSuffix(f[2], "_percentile_lat") || f[3] != "avg_lat" || f[5] != "avg_bw" {
				return nil, fmt.Errorf("ucx_perftest header %q has columns this parser does not know", line)
			}
			header = true
			continue
		}
		if !header || len(f) != 9 || f[0] == "" || strings.ContainsAny(f[0], " |[") {
			continue
		}
		var nums [8]float64
		for i := range nums {
			v, err := strconv.ParseFloat(strings.TrimSpace(f[i+1]), 64)
			if err != nil || v < 0 || v != v || v > 1e300 {
				return nil, fmt.Errorf("ucx_perftest row %q: column %d is not a number", line, i+2)
			}
			nums[i] = v
		}
		rows[f[0]] = ucxRow{Iters: int(nums[0]), MedianLatU: nums[1], AvgLatU: nums[2], AvgBWMiBs: nums[4]}
	}
	if !header {
		return nil, fmt.Errorf("no ucx_perftest result header in %d bytes of output", len(out))
	}
	return rows, nil
}

// ucxAvailable says whether ucx_perftest can run here (it asks for its
// help text, which exits 0 only when the libraries load).
func ucxAvailable(ctx context.Context) error {
	path, err := exec.LookPath("ucx_perftest")
	if err != nil {
		return fmt.Errorf("%w: %w (Debian package ucx-utils)", errNoUCX, err)
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, path, "-h").CombinedOutput()
	if err != nil && !bytes.Contains(out, []byte("Usage")) {
		return fmt.Errorf("%w: %s -h: %w", errNoUCX, path, err)
	}
	return nil
}

// runUCX runs tests in one ucx_perftest server and client pair on loopback
// with UCX_TLS=tls, within timeout, and returns their rows by label. When
// the run fails or times out it returns the rows of the tests that finished
// with the error.
func runUCX(ctx context.Context, tls string, tests []ucxTest, timeout time.Duration) (map[string]ucxRow, error) {
	dir, err := os.MkdirTemp("", "gdrlink-ucx-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	var batch strings.Builder
	for _, t := range tests {
		batch.WriteString(t.line() + "\n")
	}
	file := filepath.Join(dir, "batch")
	if err := os.WriteFile(file, []byte(batch.String()), 0o600); err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	port, err := ucxFreePort()
	if err != nil {
		return nil, err
	}
	env := append(os.Environ(), "UCX_TLS="+tls, "UCX_WARN_UNUSED_ENV_VARS=n")
	command := func(args ...string) (*exec.Cmd, *bytes.Buffer) {
		c := exec.CommandContext(ctx, "ucx_perftest", args...)
		c.Env = env
		c.WaitDelay = 2 * time.Second
		var out bytes.Buffer
		c.Stdout, c.Stderr = &out, &out
		return c, &out
	}
	srv, srvOut := command("-p", port, "-b", file)
	if err := srv.Start(); err != nil {
		return nil, fmt.Errorf("%w: starting the server: %w", errNoUCX, err)
	}
	srvDone := make(chan error, 1)
	go func() { srvDone <- srv.Wait() }()
	stopped := false
	// stopServer waits for the server (killing it after a grace period);
	// its output may be read only after.
	stopServer := func() {
		if stopped {
			return
		}
		stopped = true
		select {
		case <-srvDone:
		case <-time.After(3 * time.Second):
			srv.Process.Kill()
			<-srvDone
		}
	}
	defer stopServer()
	// The server needs a moment to listen; the client fails fast until it does.
	var out *bytes.Buffer
	for attempt := 0; ; attempt++ {
		var cli *exec.Cmd
		cli, out = command("127.0.0.1", "-p", port, "-b", file, "-f", "-v")
		err = cli.Run()
		if err == nil || ctx.Err() != nil || attempt >= 50 || !bytes.Contains(out.Bytes(), []byte("onnect")) {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	// Rows of tests that finished are good even when a later one did not.
	rows, perr := parseUCXOutput(out.Bytes())
	if ctx.Err() != nil {
		stopServer()
		return rows, fmt.Errorf("ucx_perftest UCX_TLS=%s: %w after %v, %d of %d tests done (server said: %s)", tls, ctx.Err(), timeout, len(rows), len(tests), ucxTail(srvOut.Bytes()))
	}
	if err != nil {
		return rows, fmt.Errorf("ucx_perftest UCX_TLS=%s client: %w, %d of %d tests done: %s", tls, err, len(rows), len(tests), ucxTail(out.Bytes()))
	}
	if perr != nil {
		return nil, fmt.Errorf("UCX_TLS=%s: %w", tls, perr)
	}
	return rows, nil
}

func ucxFreePort() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer ln.Close()
	return strconv.Itoa(ln.Addr().(*net.TCPAddr).Port), nil
}

// ucxTail is the last few hundred bytes of out, for error messages.
func ucxTail(out []byte) string {
	if len(out) > 400 {
		out = out[len(out)-400:]
	}
	return strings.TrimSpace(string(out))
}

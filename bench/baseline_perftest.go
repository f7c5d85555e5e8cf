package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"maps"
	"math"
	"net"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/gdrlink/gdrlink/internal/ibvdiag"
	"github.com/gdrlink/gdrlink/verbsio"
)

// errNoPerftest: a perftest program (ib_write_bw, ib_write_lat) is not
// installed; the wrapped error names it.
var errNoPerftest = errors.New("perftest (Debian package perftest) not found")

// perftestIters is how many writes ib_write_bw makes for a size: enough
// bytes for a steady figure, few enough for emulated devices (Soft-RoCE
// moves tens of MB/s).
func perftestIters(size int64, quick bool) int {
	total := int64(256 << 20)
	if quick {
		total = 32 << 20
	}
	return int(max(5, min(5000, total/max(size, 1))))
}

// perftestBW is the ib_write_bw baseline of one ibverbs device: it
// measures on the device and GID that the device uses.
type perftestBW struct {
	dev   string
	gid   int
	quick bool
}

// perftestBaseline returns the ib_write_bw baseline of an ibverbs device's
// write bandwidth. It fails with errNoPerftest when perftest is not
// installed, and with verbsio.ErrNotSupported for devices of other
// providers.
func perftestBaseline(dev verbsio.Device, quick bool) (*perftestBW, error) {
	d, ok := ibvdiag.Of(dev)
	if !ok {
		return nil, fmt.Errorf("%w: ib_write_bw measures ibverbs devices, not %s", verbsio.ErrNotSupported, dev.Info().Provider)
	}
	if _, err := exec.LookPath("ib_write_bw"); err != nil {
		return nil, fmt.Errorf("%w: %w", errNoPerftest, err)
	}
	return &perftestBW{dev: d.Info().Name, gid: d.GIDIndex(), quick: quick}, nil
}

// bw measures iters writes of size bytes (perftestIters's count for
// iters < 1), in GB/s.
func (p *perftestBW) bw(ctx context.Context, size int64, iters int) (float64, error) {
	if iters < 1 {
		iters = perftestIters(size, p.quick)
	}
	return perftestWriteBW(ctx, p.dev, p.gid, size, iters)
}

// String is the command line it runs, without size and count.
func (p *perftestBW) String() string {
	if p.gid < 0 {
		return "ib_write_bw -d " + p.dev
	}
	return fmt.Sprintf("ib_write_bw -d %s -x %d", p.dev, p.gid)
}

// perftestWriteBW measures RDMA WRITE bandwidth with perftest's ib_write_bw
// between a server and a client on one device of this host (the reference
// the ibverbs provider is compared with), in GB/s (1e9 bytes per second).
// It runs `ib_write_bw -d DEV -x GID -F -s SIZE -n ITERS -p PORT` as server
// and client and parses the client's "BW average[MB/sec]" (perftest's MB are
// MiB, so the figure is converted).
func perftestWriteBW(ctx context.Context, dev string, gidIndex int, size int64, iters int) (float64, error) {
	// On Soft-RoCE under emulation, ib_write_bw now and then reports a
	// bandwidth of 0 for a run that completed (seen at 1 MiB in about one
	// full test-rdma run in two); such a run is measured again, up to
	// three times in all, and the error quotes the last report.
	var err error
	for try := 0; try < 3; try++ {
		var gbs float64
		gbs, err = perftestWriteBWOnce(ctx, dev, gidIndex, size, iters)
		if !errors.Is(err, errPerftestZero) {
			return gbs, err
		}
	}
	return 0, err
}

// errPerftestZero: ib_write_bw completed but reported no bandwidth.
var errPerftestZero = errors.New("ib_write_bw reported a bandwidth of 0")

func perftestWriteBWOnce(ctx context.Context, dev string, gidIndex int, size int64, iters int) (float64, error) {
	out, err := perftestPair(ctx, "ib_write_bw", dev, gidIndex, "-s", strconv.FormatInt(size, 10), "-n", strconv.Itoa(iters))
	if err != nil {
		return 0, err
	}
	mibs, err := parsePerftestBW(out)
	if err != nil {
		return 0, err
	}
	if !(mibs > 0) {
		return 0, fmt.Errorf("%w (%v MB/s) for %d writes of %d bytes:\n%s", errPerftestZero, mibs, iters, size, out)
	}
	return mibs * (1 << 20) / 1e9, nil
}

// perftestPair runs the perftest program prog as a server and a client on
// one device of this host, `prog -d DEV -F ARGS... -p PORT [-x GID]` (the
// client with 127.0.0.1 added), and returns the client's output. The
// server's port is one that was free a moment ago; the client is started
// again while the server is not listening yet.
func perftestPair(ctx context.Context, prog, dev string, gidIndex int, extra ...string) ([]byte, error) {
	bin, err := exec.LookPath(prog)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", errNoPerftest, err)
	}
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	args := append([]string{"-d", dev, "-F"}, extra...)
	args = append(args, "-p", strconv.Itoa(port))
	if gidIndex >= 0 {
		args = append(args, "-x", strconv.Itoa(gidIndex))
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	var serverOut bytes.Buffer
	server := exec.CommandContext(ctx, bin, args...)
	server.Stdout, server.Stderr = &serverOut, &serverOut
	if err := server.Start(); err != nil {
		return nil, fmt.Errorf("starting the %s server: %w", prog, err)
	}
	defer func() {
		server.Process.Kill()
		server.Wait()
	}()
	// The client fails at once while the server is not listening yet.
	var out []byte
	for try := 0; ; try++ {
		client := exec.CommandContext(ctx, bin, append(args, "127.0.0.1")...)
		out, err = client.CombinedOutput()
		if err == nil || try >= 50 || ctx.Err() != nil || !strings.Contains(string(out), "onnect") {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err != nil {
		return nil, fmt.Errorf("%s client: %w\n%s\nserver:\n%s", prog, err, out, serverOut.String())
	}
	return out, nil
}

// parsePerftestBW finds the "BW average[MB/sec]" column of ib_*_bw's
// report and returns the figure of its first data line.
func parsePerftestBW(out []byte) (float64, error) {
	sc := bufio.NewScanner(bytes.NewReader(out))
	col := -1
	for sc.Scan() {
		line := sc.Text()
		if col < 0 {
			if !strings.Contains(line, "#bytes") || !strings.Contains(line, "BW average") {
				continue
			}
			// Headers are words, some with units in brackets: count the
			// columns by their positions in the header.
			heads := strings.Fields(strings.NewReplacer("BW peak", "BW_peak", "BW average", "BW_average").Replace(line))
			for i, h := range heads {
				if strings.HasPrefix(h, "BW_average") {
					col = i
				}
			}
			continue
		}
		f := strings.Fields(line)
		if len(f) <= col {
			continue
		}
		v, err := strconv.ParseFloat(f[col], 64)
		if err != nil || v < 0 {
			return 0, fmt.Errorf("ib_write_bw: bandwidth %q in %q", f[col], line)
		}
		return v, nil
	}
	return 0, fmt.Errorf("ib_write_bw printed no bandwidth report:\n%s", out)
}

// perftestLat is a perftest latency baseline of one ibverbs device
// (ib_write_lat or ib_send_lat): it measures on the device and GID that
// the device uses.
type perftestLat struct {
	prog string
	dev  string
	gid  int
}

// perftestLatBaseline returns the baseline of an ibverbs device's one-way
// latency that prog measures: ib_write_lat (RDMA writes; its receiver
// polls the buffer's last byte) or ib_send_lat (sends; its receiver polls
// its completion queue for the receive, as a write with immediate's
// does). It fails with errNoPerftest when perftest is not installed, and
// with verbsio.ErrNotSupported for devices of other providers.
func perftestLatBaseline(dev verbsio.Device, prog string) (*perftestLat, error) {
	d, ok := ibvdiag.Of(dev)
	if !ok {
		return nil, fmt.Errorf("%w: %s measures ibverbs devices, not %s", verbsio.ErrNotSupported, prog, dev.Info().Provider)
	}
	if _, err := exec.LookPath(prog); err != nil {
		return nil, fmt.Errorf("%w: %w", errNoPerftest, err)
	}
	return &perftestLat{prog: prog, dev: d.Info().Name, gid: d.GIDIndex()}, nil
}

// run makes iters ping-pongs of size-byte messages with the program
// (`PROG -d DEV -x GID -F -s SIZE -n ITERS -p PORT`, server and client)
// and returns the client's report, whose figures are one-way latencies.
func (p *perftestLat) run(ctx context.Context, size, iters int) (perftestLatReport, error) {
	// A report of inf (errPerftestNoClock, seen in about one Soft-RoCE
	// guest run in three) is measured again, up to three times in all.
	var out []byte
	var r perftestLatReport
	var err error
	for try := 0; try < 3; try++ {
		out, err = perftestPair(ctx, p.prog, p.dev, p.gid, "-s", strconv.Itoa(size), "-n", strconv.Itoa(iters))
		if err != nil {
			return perftestLatReport{}, err
		}
		if r, err = parsePerftestLat(out); !errors.Is(err, errPerftestNoClock) {
			break
		}
	}
	if err != nil {
		return r, fmt.Errorf("%s: %w", p.prog, err)
	}
	if !(r.Typical > 0) {
		return r, fmt.Errorf("%s reported a typical latency of %v us for %d messages of %d bytes:\n%s", p.prog, r.Typical, iters, size, out)
	}
	return r, nil
}

// String is the command line it runs, without size and count.
func (p *perftestLat) String() string {
	if p.gid < 0 {
		return p.prog + " -d " + p.dev
	}
	return fmt.Sprintf("%s -d %s -x %d", p.prog, p.dev, p.gid)
}

// perftestLatReport is the data line of an ib_*_lat report (run with -n,
// without -C), in microseconds. perftest times round trips and divides
// them by two for its write and send tests (by one for read and atomic),
// so ib_write_lat's figures are one-way. t_typical is the median.
// Every perftest prints bytes, iterations, t_min, t_max and t_typical;
// the others came later (perftest 4.x) and are nil where missing.
type perftestLatReport struct {
	Bytes, Iters      int64
	Min, Max, Typical float64
	Avg, Stdev        *float64
	P99, P999         *float64
}

// errPerftestNoClock: a perftest latency report of inf or nan. perftest
// converts cycles to microseconds by the CPU clock rate it measures at
// the start; where it cannot measure one (get_cpu_mhz returns 0), -F makes
// that no failure, and every figure is divided by 0.
var errPerftestNoClock = errors.New("perftest could not measure the CPU clock rate (its report reads inf)")

// parsePerftestLat finds the header of ib_*_lat's report (the line naming
// #bytes and t_typical[usec]) and reads the first data line under it by
// the header's columns.
func parsePerftestLat(out []byte) (perftestLatReport, error) {
	var r perftestLatReport
	required := map[string]bool{"#bytes": true, "#iterations": true, "t_min[usec]": true, "t_max[usec]": true, "t_typical[usec]": true}
	sc := bufio.NewScanner(bytes.NewReader(out))
	var heads []string
	for sc.Scan() {
		line := sc.Text()
		if heads == nil {
			if !strings.Contains(line, "#bytes") || !strings.Contains(line, "t_typical[usec]") {
				continue
			}
			// The percentile headers are two words each.
			heads = strings.Fields(strings.NewReplacer("% percentile", "%_percentile").Replace(line))
			continue
		}
		f := strings.Fields(line)
		if len(f) < len(heads) {
			continue
		}
		for i, h := range heads {
			switch h {
			case "#bytes", "#iterations":
				n, err := strconv.ParseInt(f[i], 10, 64)
				if err != nil || n < 0 {
					return perftestLatReport{}, fmt.Errorf("latency report: %s %q in %q", h, f[i], line)
				}
				if h == "#bytes" {
					r.Bytes = n
				} else {
					r.Iters = n
				}
				delete(required, h)
				continue
			}
			var dst *float64
			switch h {
			case "t_min[usec]":
				dst = &r.Min
			case "t_max[usec]":
				dst = &r.Max
			case "t_typical[usec]":
				dst = &r.Typical
			case "t_avg[usec]":
				r.Avg = new(float64)
				dst = r.Avg
			case "t_stdev[usec]":
				r.Stdev = new(float64)
				dst = r.Stdev
			case "99%_percentile[usec]":
				r.P99 = new(float64)
				dst = r.P99
			case "99.9%_percentile[usec]":
				r.P999 = new(float64)
				dst = r.P999
			default:
				continue // a column of a later perftest
			}
			v, err := strconv.ParseFloat(f[i], 64)
			if err == nil && (math.IsInf(v, 0) || math.IsNaN(v)) {
				return perftestLatReport{}, fmt.Errorf("%w: %s %q in %q", errPerftestNoClock, h, f[i], line)
			}
			if err != nil || !(v >= 0) {
				return perftestLatReport{}, fmt.Errorf("latency report: %s %q in %q", h, f[i], line)
			}
			*dst = v
			delete(required, h)
		}
		if len(required) > 0 {
			return perftestLatReport{}, fmt.Errorf("the latency report has no %s column:\n%s", strings.Join(slices.Sorted(maps.Keys(required)), ", "), out)
		}
		return r, nil
	}
	return perftestLatReport{}, fmt.Errorf("perftest printed no latency report:\n%s", out)
}

// freePort returns a TCP port that was free a moment ago.
func freePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

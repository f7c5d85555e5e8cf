// Command switchml-agg is a SwitchML aggregator in software: it adds the
// block-floating-point gradients that workers write to it as RDMA WRITE WITH
// IMMEDIATE over unreliable-connected queue pairs (RoCEv2 on UDP port
// 4791), and writes the sums back, as a programmable switch would.
//
//	switchml-agg -data 10.0.0.5:4791 -control 10.0.0.5:4792
//
// Workers set their jobs up on the control endpoint, proving the job key
// (GDRLINK_JOB_KEY or GDRLINK_JOB_KEY_FILE, as for the rest of the
// library); without a key the control endpoint must be on loopback unless
// GDRLINK_INSECURE=1. The data address must be one IPv4 address (the ICRC
// covers it), and no RoCE device may hold port 4791 on it: on a host with
// Soft-RoCE or a RoCE NIC, give the aggregator an address of its own (a
// network namespace). On SIGINT or SIGTERM it prints its counters as JSON
// and exits.
//
// The ICRC of a worker's packet covers its IPv4 header's identification,
// which a UDP socket does not show. With -raw auto (the default) or on, the
// aggregator reads packets from a raw IPv4 socket (CAP_NET_RAW) and checks
// the ICRC over the ID each packet carries, as Soft-RoCE and NICs write
// IDs of their own; without that capability, auto reads the UDP socket and
// assumes ID 0 (what gdrlink's software workers send), and the first line
// it prints says which.
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/gdrlink/gdrlink/internal/jobauth"
	"github.com/gdrlink/gdrlink/internal/switchml/aggsrv"
)

func main() {
	os.Exit(run(os.Args[1:], os.Getenv, os.Stdout, os.Stderr, nil))
}

// run is the command; stop, when not nil, ends it in place of a signal.
func run(args []string, getenv func(string) string, stdout, stderr io.Writer, stop <-chan struct{}) int {
	fs := flag.NewFlagSet("switchml-agg", flag.ContinueOnError)
	fs.SetOutput(stderr)
	data := fs.String("data", "", "IPv4 address and UDP port of the RoCEv2 data path (port 4791 for real NICs)")
	control := fs.String("control", "127.0.0.1:4792", "TCP address of the control endpoint")
	skipICRC := fs.Bool("skip-icrc", false, "accept packets without checking their ICRC")
	rawFlag := fs.String("raw", "auto", "read packets from a raw IPv4 socket, to check the ICRC over their IP ID: on, off, or auto (when permitted)")
	timeout := fs.Duration("setup-timeout", 60*time.Second, "how long a job's workers have to announce themselves")
	drop := fs.Float64("drop", 0, "drop this share (0..1) of the packets received and sent, at random, to test loss")
	peerPort := fs.Uint("peer-port", 0, "UDP port the workers receive on (default 4791)")
	verbose := fs.Bool("v", false, "log job setup and refused connections")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if *drop < 0 || *drop >= 1 || *peerPort > 0xffff {
		fmt.Fprintln(stderr, "switchml-agg: -drop must be in [0, 1) and -peer-port a UDP port")
		return 2
	}
	raw, err := aggsrv.ParseRawMode(*rawFlag)
	if err != nil {
		fmt.Fprintln(stderr, "switchml-agg:", err)
		return 2
	}
	if *data == "" {
		fmt.Fprintln(stderr, "switchml-agg: -data is required (an IPv4 address and port, e.g. 10.0.0.5:4791)")
		return 2
	}
	key, _, err := jobauth.FromEnv(getenv)
	if err != nil {
		fmt.Fprintln(stderr, "switchml-agg:", err)
		return 1
	}
	if err := jobauth.CheckListen(key, *control, jobauth.Insecure(getenv)); err != nil {
		fmt.Fprintln(stderr, "switchml-agg:", err)
		return 1
	}
	ua, err := net.ResolveUDPAddr("udp4", *data)
	if err != nil {
		fmt.Fprintln(stderr, "switchml-agg:", err)
		return 2
	}
	dc, err := net.ListenUDP("udp4", ua)
	if err != nil {
		fmt.Fprintln(stderr, "switchml-agg:", err)
		return 1
	}
	cl, err := net.Listen("tcp", *control)
	if err != nil {
		dc.Close()
		fmt.Fprintln(stderr, "switchml-agg:", err)
		return 1
	}
	cfg := aggsrv.Config{Key: key, Control: cl, Data: dc, SkipICRC: *skipICRC, RawIPv4: raw, SetupTimeout: *timeout, Seed: uint64(time.Now().UnixNano()), Drop: *drop, PeerPort: uint16(*peerPort)}
	if *verbose {
		cfg.Logger = slog.New(slog.NewTextHandler(stderr, nil))
	}
	if key.IsZero() {
		// Without a key, the rank of an announce is taken as it comes:
		// only for loopback or GDRLINK_INSECURE=1 (checked above).
		cfg.Logger = orStderr(cfg.Logger, stderr)
		cfg.Logger.Warn("no job key: control connections are not authenticated")
	}
	s, err := aggsrv.New(cfg)
	if err != nil {
		cl.Close()
		dc.Close()
		fmt.Fprintln(stderr, "switchml-agg:", err)
		return 1
	}
	reads := "UDP socket, ICRC assuming IP ID 0"
	if s.RawIPv4() {
		reads = "raw IPv4 socket, ICRC over each packet's IP ID"
	}
	fmt.Fprintf(stdout, "switchml-agg: data %s (%s), control %s\n", dc.LocalAddr(), reads, cl.Addr())
	served := make(chan error, 1)
	go func() { served <- s.Serve() }()
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
	defer signal.Stop(sig)
	code := 0
	select {
	case <-sig:
	case <-stop:
	case err := <-served:
		fmt.Fprintln(stderr, "switchml-agg:", err)
		code = 1
	}
	st := s.Stats()
	s.Close()
	b, _ := json.Marshal(st)
	fmt.Fprintf(stdout, "%s\n", b)
	return code
}

func orStderr(l *slog.Logger, w io.Writer) *slog.Logger {
	if l != nil {
		return l
	}
	return slog.New(slog.NewTextHandler(w, nil))
}

// Package roceveth makes, for tests in the Soft-RoCE guest of make
// test-rdma, a network namespace joined to the root one by a veth pair whose
// root-side end carries a Soft-RoCE (rdma_rxe) device: a RoCEv2 peer for
// that device which is not itself an rxe device (rxe holds UDP 4791 in the
// namespace it lives in). The SwitchML tests put their aggregator there.
package roceveth

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/internal/ibv"
)

// Env must be 1 where a test may make namespaces and Soft-RoCE devices.
const Env = "GDRLINK_TEST_ROCE_VETH"

// Link is a namespace joined to the root one by veth, with an rxe device
// on the root-side end.
type Link struct {
	t testing.TB // nil for New's
	// NS is the namespace, Dev the rxe device.
	NS, Dev string
	ip, nft string
}

// Setup skips t unless GDRLINK_TEST_ROCE_VETH=1, fails it unless it runs as
// root with libibverbs, ip, rdma and nft, then makes the link as New does.
// All of it goes when the test ends.
func Setup(t testing.TB, name string, rootAddrs []string, nsAddr string) *Link {
	t.Helper()
	if os.Getenv(Env) != "1" {
		t.Skip("skipping: set " + Env + "=1 where this test may make namespaces and Soft-RoCE devices (the guest of make test-rdma does)")
	}
	l, cleanup, err := New(name, rootAddrs, nsAddr)
	if err != nil {
		t.Fatalf("%s=1 but %v", Env, err)
	}
	t.Cleanup(cleanup)
	l.t = t
	return l
}

// New makes a namespace and a veth pair named after name and this process,
// gives the root-side end the addresses rootAddrs and the namespace's end
// nsAddr (prefixes such as "10.234.0.10/24"), adds an rxe device on the
// root-side end and waits until it has a RoCE v2 GID for each root
// address. It needs root, libibverbs, ip, rdma and nft. cleanup removes
// all of it (also after an error, where it removes what was made); the
// Link's test-only methods (Run, NFT, Impair) need Setup's Link.
func New(name string, rootAddrs []string, nsAddr string) (l *Link, cleanup func(), err error) {
	var undo []func()
	cleanup = func() {
		for i := len(undo) - 1; i >= 0; i-- {
			undo[i]()
		}
	}
	defer func() {
		if err != nil {
			cleanup()
		}
	}()
	if os.Geteuid() != 0 {
		return nil, cleanup, errors.New("not root")
	}
	if err := ibv.Load(); err != nil {
		return nil, cleanup, fmt.Errorf("libibverbs: %w", err)
	}
	var tools []string
	for _, tool := range []string{"ip", "rdma", "nft"} {
		p, err := exec.LookPath(tool)
		if err != nil {
			return nil, cleanup, fmt.Errorf("%s is missing (Debian: iproute2, nftables): %w", tool, err)
		}
		tools = append(tools, p)
	}
	id := os.Getpid() % 100000
	l = &Link{NS: fmt.Sprintf("gdr%s-%d", name, id), Dev: fmt.Sprintf("rx%s%d", name, id), ip: tools[0], nft: tools[2]}
	rdma := tools[1]
	vr, vn := fmt.Sprintf("%sr%d", name, id), fmt.Sprintf("%sn%d", name, id)
	run := func(args ...string) error {
		if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
			return fmt.Errorf("%v: %w: %s", args, err, out)
		}
		return nil
	}
	exec.Command("modprobe", "veth").Run()
	if err := run(l.ip, "netns", "add", l.NS); err != nil {
		return nil, cleanup, err
	}
	ip, ns, dev := l.ip, l.NS, l.Dev // l is nil after an error
	undo = append(undo, func() { exec.Command(ip, "netns", "del", ns).Run() })
	if err := run(l.ip, "link", "add", vr, "type", "veth", "peer", "name", vn); err != nil {
		return nil, cleanup, err
	}
	undo = append(undo, func() { exec.Command(ip, "link", "del", vr).Run() })
	if err := run(l.ip, "link", "set", vn, "netns", l.NS); err != nil {
		return nil, cleanup, err
	}
	var want []string
	for _, a := range rootAddrs {
		p, err := netip.ParsePrefix(a)
		if err != nil || !p.Addr().Is4() {
			return nil, cleanup, fmt.Errorf("root address %q: want an IPv4 prefix", a)
		}
		if err := run(l.ip, "addr", "add", a, "dev", vr); err != nil {
			return nil, cleanup, err
		}
		want = append(want, GID(p.Addr()))
	}
	for _, args := range [][]string{
		{l.ip, "-n", l.NS, "addr", "add", nsAddr, "dev", vn},
		{l.ip, "-n", l.NS, "link", "set", "lo", "up"},
		{l.ip, "-n", l.NS, "link", "set", vn, "up"},
		{l.ip, "link", "set", vr, "up"},
		{rdma, "link", "add", l.Dev, "type", "rxe", "netdev", vr},
	} {
		if err := run(args...); err != nil {
			return nil, cleanup, err
		}
	}
	undo = append(undo, func() { exec.Command(rdma, "link", "delete", dev).Run() })
	for _, w := range want {
		found := false
		for deadline := time.Now().Add(15 * time.Second); !found && time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
			files, _ := filepath.Glob("/sys/class/infiniband/" + l.Dev + "/ports/1/gids/*")
			for _, f := range files {
				if b, err := os.ReadFile(f); err == nil && strings.TrimSpace(string(b)) == w {
					found = true
				}
			}
		}
		if !found {
			return nil, cleanup, fmt.Errorf("%s has no GID %s after 15 s", l.Dev, w)
		}
	}
	return l, cleanup, nil
}

// GID is the RoCE v2 GID of an IPv4 address as sysfs writes it.
func GID(a netip.Addr) string {
	b := a.As4()
	return fmt.Sprintf("0000:0000:0000:0000:0000:ffff:%02x%02x:%02x%02x", b[0], b[1], b[2], b[3])
}

// Run runs a command and fails the test if it fails.
func (l *Link) Run(args ...string) {
	l.t.Helper()
	if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
		l.t.Fatalf("%v: %v: %s", args, err, out)
	}
}

// InNS is the command line that runs args in the namespace.
func (l *Link) InNS(args ...string) []string {
	return append([]string{l.ip, "netns", "exec", l.NS}, args...)
}

// Command is an exec.Cmd that runs args in the namespace.
func (l *Link) Command(args ...string) *exec.Cmd {
	a := l.InNS(args...)
	return exec.Command(a[0], a[1:]...)
}

// NFT runs nft with args in the namespace and fails the test if it fails.
func (l *Link) NFT(args ...string) {
	l.t.Helper()
	l.Run(l.InNS(append([]string{l.nft}, args...)...)...)
}

// NFTOutput runs nft with args in the namespace and returns what it
// printed, errors included.
func (l *Link) NFTOutput(args ...string) string {
	out, _ := l.Command(append([]string{l.nft}, args...)...).CombinedOutput()
	return string(out)
}

// Impair makes the namespace's end of the link lose or corrupt RoCEv2
// packets (UDP port 4791) with nftables, in a table of its own: "loss"
// drops 5% of them each way; "corrupt" rewrites bytes 44-47 of the UDP
// payload of 5% of those coming in, which are payload bytes of a write with
// immediate (after BTH, RETH and ImmDt), so the packet still parses and
// only its ICRC is wrong. The function it returns removes the table and
// returns its listing with the rules' counters.
func (l *Link) Impair(mode string) (undo func() string) {
	l.t.Helper()
	const table = "gdrlink_roceveth"
	rules := [][]string{
		{"add", "table", "inet", table},
		{"add", "chain", "inet", table, "out", "{ type filter hook output priority 0; }"},
		{"add", "chain", "inet", table, "in", "{ type filter hook input priority 0; }"},
	}
	some := []string{"udp", "dport", "4791", "numgen", "random", "mod", "100", "<", "5", "counter"}
	switch mode {
	case "loss":
		for _, chain := range []string{"out", "in"} {
			rules = append(rules, append(append([]string{"add", "rule", "inet", table, chain}, some...), "drop"))
		}
	case "corrupt":
		rules = append(rules, append(append([]string{"add", "rule", "inet", table, "in"}, some...), "@th,352,32", "set", "0xdeadbeef"))
	default:
		l.t.Fatalf("roceveth: impairment %q: want loss or corrupt", mode)
	}
	for _, r := range rules {
		l.NFT(r...)
	}
	return func() string {
		out := l.NFTOutput("list", "table", "inet", table)
		l.NFTOutput("delete", "table", "inet", table)
		return out
	}
}

package tcp_test

import (
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/gdrlink/gdrlink/verbsio"
	"github.com/gdrlink/gdrlink/verbsio/verbstest"
)

// TestConformanceAcrossNetns runs the conformance suite between this process
// in its own network namespace and a peer in a fresh one, joined by a veth
// pair: two hosts as far as the network stack can tell.
func TestConformanceAcrossNetns(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("creating network namespaces needs root")
	}
	ip, err := exec.LookPath("ip")
	if err != nil {
		t.Skip("the ip command is not installed (Debian package iproute2)")
	}
	id := os.Getpid() % 60000
	ns := fmt.Sprintf("gdrl-tcp-%d", id)
	host, peer := fmt.Sprintf("gdrh%d", id), fmt.Sprintf("gdrp%d", id)
	// A /30 of 10.251.0.0/16 picked by the process id, so concurrent runs
	// do not collide.
	prefix, last := fmt.Sprintf("10.251.%d.", id/64%256), id%64*4
	hostIP, peerIP := fmt.Sprintf("%s%d", prefix, last+1), fmt.Sprintf("%s%d", prefix, last+2)
	run := func(args ...string) {
		t.Helper()
		if out, err := exec.Command(ip, args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %s: %v: %s", strings.Join(args, " "), err, out)
		}
	}
	t.Cleanup(func() {
		exec.Command(ip, "link", "del", host).Run()
		exec.Command(ip, "netns", "del", ns).Run()
	})
	if out, err := exec.Command(ip, "netns", "add", ns).CombinedOutput(); err != nil {
		t.Skipf("cannot create a network namespace here: %v: %s", err, out)
	}
	run("link", "add", host, "type", "veth", "peer", "name", peer)
	run("link", "set", peer, "netns", ns)
	run("addr", "add", hostIP+"/30", "dev", host)
	run("link", "set", host, "up")
	run("-n", ns, "addr", "add", peerIP+"/30", "dev", peer)
	run("-n", ns, "link", "set", peer, "up")
	run("-n", ns, "link", "set", "lo", "up")
	// Beyond loopback a device needs a job key (or Config.Insecure).
	key, env := jobKey(t)
	verbstest.Run(t, verbstest.Harness{
		Provider: "tcp",
		Config:   verbsio.Config{ListenAddr: hostIP + ":0", JobKey: key},
		PeerEnv:  []string{"GDRLINK_LISTEN_ADDR=" + peerIP + ":0", env},
		Wrap: func(argv []string) []string {
			return append([]string{ip, "netns", "exec", ns}, argv...)
		},
	})
}

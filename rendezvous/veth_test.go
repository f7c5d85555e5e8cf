package rendezvous

import (
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"

	"github.com/gdrlink/gdrlink/tensor"
)

// Two hosts with two NICs each, as far as the network stack can tell: this
// process and a peer in its own network namespace, joined by two veth pairs.
// The tcp provider opens one device per veth; large tensors are striped over
// both, which the second veth's byte counters show.
func TestTwoProcessRailsOverVeth(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("creating network namespaces and veth pairs needs root")
	}
	ip, err := exec.LookPath("ip")
	if err != nil {
		t.Skip("the ip command is not installed (Debian package iproute2)")
	}
	id := os.Getpid() % 60000
	ns := fmt.Sprintf("gdrl-rdv-%d", id)
	run := func(args ...string) {
		t.Helper()
		if out, err := exec.Command(ip, args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %s: %v: %s", strings.Join(args, " "), err, out)
		}
	}
	var hosts []string
	t.Cleanup(func() {
		for _, h := range hosts {
			_ = exec.Command(ip, "link", "del", h).Run()
		}
		_ = exec.Command(ip, "netns", "del", ns).Run()
	})
	if out, err := exec.Command(ip, "netns", "add", ns).CombinedOutput(); err != nil {
		t.Skipf("cannot create a network namespace here: %v: %s", err, out)
	}
	run("-n", ns, "link", "set", "lo", "up")
	var localAddrs, peerAddrs []string
	for rail := 0; rail < 2; rail++ {
		host, peer := fmt.Sprintf("gdrr%d%d", rail, id), fmt.Sprintf("gdrs%d%d", rail, id)
		// A /30 of 10.252.0.0/16 per rail, picked by the process id.
		slot := (id%8192)*2 + rail
		prefix, last := fmt.Sprintf("10.252.%d.", slot/64%256), slot%64*4
		hostIP, peerIP := fmt.Sprintf("%s%d", prefix, last+1), fmt.Sprintf("%s%d", prefix, last+2)
		run("link", "add", host, "type", "veth", "peer", "name", peer)
		hosts = append(hosts, host)
		run("link", "set", peer, "netns", ns)
		run("addr", "add", hostIP+"/30", "dev", host)
		run("link", "set", host, "up")
		run("-n", ns, "addr", "add", peerIP+"/30", "dev", peer)
		run("-n", ns, "link", "set", peer, "up")
		localAddrs = append(localAddrs, hostIP+":0")
		peerAddrs = append(peerAddrs, peerIP+":0")
	}
	const stripeMin = 1 << 20
	// The rails listen beyond loopback, so the pair needs a job key: both
	// sides read it from the environment (the peer inherits it).
	t.Setenv("GDRLINK_JOB_KEY", "veth rails test key "+strconv.Itoa(id))
	p := startPeerWith(t, "tcp", localAddrs,
		[]string{"GDRLINK_RDV_LISTEN=" + strings.Join(peerAddrs, ","), "GDRLINK_RDV_STRIPE_MIN=" + strconv.Itoa(stripeMin)},
		[]string{ip, "netns", "exec", ns}, withStripeMin(stripeMin))
	if p.local.ch.active != 1 {
		t.Fatalf("%d extra rails active, want 1", p.local.ch.active)
	}
	rx := func() int64 {
		b, err := os.ReadFile("/sys/class/net/" + hosts[1] + "/statistics/rx_bytes")
		if err != nil {
			t.Fatal(err)
		}
		n, _ := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
		return n
	}
	before := rx()
	ctx := recvCtx(t)
	const n = 8 << 20
	for step := 0; step < 4; step++ {
		p.send("send big %d uint8 %d", step, n)
		got, _, err := p.local.ch.Recv(ctx, "big", int64(step))
		if err != nil {
			t.Fatal(err)
		}
		if err := checkTensor(got, "uint8", tensor.Shape{n}, "big", int64(step)); err != nil {
			t.Fatalf("step %d: %v", step, err)
		}
		_ = got.Release()
	}
	// Each 8 MiB tensor puts half its bytes on the second rail.
	if moved := rx() - before; moved < 4*n/2 {
		t.Fatalf("%d bytes arrived on the second veth, want at least %d (half of each tensor)", moved, 4*n/2)
	} else {
		t.Logf("%d bytes arrived on the second rail's veth %s", moved, hosts[1])
	}
}

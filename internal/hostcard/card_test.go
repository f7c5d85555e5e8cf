package hostcard

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/gdrlink/gdrlink/verbsio"
)

const boot = "0b6a4c1e-8a3f-4d2b-9c7e-5f1a2b3c4d5e"

func card(host, net, pid string, ps ...string) Card {
	return Card{Host: host, NetNS: net, PIDNS: pid, Providers: ps}
}

func TestCandidates(t *testing.T) {
	all := []string{"ibverbs", "onnode", "tcp"}
	node := card(boot, "net:[1]", "pid:[2]", all...)
	cases := []struct {
		name     string
		me, peer Card
		forced   string
		want     []string
		why      string // a substring of the reason, "" for none
	}{
		{"SameNode", node, node, "", []string{"onnode", "ibverbs", "tcp"}, ""},
		{"OtherHost", node, card("other", "net:[1]", "pid:[2]", all...), "", []string{"ibverbs", "tcp"}, "another host"},
		{"OtherNetNS", node, card(boot, "net:[9]", "pid:[2]", all...), "", []string{"ibverbs", "tcp"}, "network namespace"},
		{"OtherPIDNS", node, card(boot, "net:[1]", "pid:[9]", all...), "", []string{"ibverbs", "tcp"}, "PID namespace"},
		{"NoBootID", card("", "net:[1]", "pid:[2]", all...), node, "", []string{"ibverbs", "tcp"}, "cannot tell"},
		{"PeerWithoutIbverbs", node, card(boot, "net:[1]", "pid:[2]", "onnode", "tcp"), "", []string{"onnode", "tcp"}, ""},
		{"TCPOnly", card("", "", "", "tcp"), card("", "", "", "tcp"), "", []string{"tcp"}, ""},
		{"Nothing", card("", "", "", "ibverbs"), card("", "", "", "tcp"), "", nil, "no provider in common"},
		{"Forced", node, node, "tcp", []string{"tcp"}, ""},
		{"ForcedMissingHere", card(boot, "net:[1]", "pid:[2]", "tcp"), node, "ibverbs", nil, "not usable here"},
		{"ForcedMissingThere", node, card(boot, "net:[1]", "pid:[2]", "tcp"), "ibverbs", nil, "at the peer"},
		{"ForcedOnnodeAcross", node, card(boot, "net:[9]", "pid:[2]", all...), "onnode", nil, "network namespace"},
		{"ForcedList", node, node, "ibverbs,tcp", []string{"ibverbs", "tcp"}, ""},
		{"ForcedListOrder", node, node, "tcp,onnode", []string{"tcp", "onnode"}, ""},
		{"ForcedListPartly", card(boot, "net:[1]", "pid:[2]", "onnode", "tcp"), node, "ibverbs,tcp", []string{"tcp"}, "ibverbs is not usable here"},
		{"ForcedListNone", card(boot, "net:[1]", "pid:[2]", "tcp"), node, "ibverbs,onnode", nil, "ibverbs is not usable here; provider onnode is not usable here"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, why := Candidates(tc.me, tc.peer, tc.forced)
			if !slices.Equal(got, tc.want) {
				t.Errorf("candidates %v, want %v (reason %q)", got, tc.want, why)
			}
			back, _ := Candidates(tc.peer, tc.me, tc.forced)
			if len(tc.want) > 0 && !slices.Equal(back, got) {
				t.Errorf("not symmetric: %v one way, %v the other", got, back)
			}
			if tc.why != "" && !strings.Contains(why, tc.why) {
				t.Errorf("reason %q, want it to mention %q", why, tc.why)
			}
		})
	}
}

func TestLocalReadsRoot(t *testing.T) {
	root := t.TempDir()
	if err := os.MkdirAll(filepath.Join(root, "proc/sys/kernel/random"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "proc/sys/kernel/random/boot_id"), []byte(boot+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(root, "proc/self/ns"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("net:[4026531840]", filepath.Join(root, "proc/self/ns/net")); err != nil {
		t.Fatal(err)
	}
	c := Local(root, []string{"tcp"})
	if c.Host != boot || c.NetNS != "net:[4026531840]" || c.PIDNS != "" || !slices.Equal(c.Providers, []string{"tcp"}) {
		t.Fatalf("card %+v", c)
	}
	// This process: both namespaces readable on Linux.
	self := Local("/", nil)
	if self.NetNS == "" || self.PIDNS == "" {
		t.Errorf("this process's card lacks namespaces: %+v", self)
	}
	if c.Process != "" {
		t.Errorf("a root without proc/self gave process %q", c.Process)
	}
	if want := strconv.Itoa(os.Getpid()); self.Process != want {
		t.Errorf("this process's card says process %q, want %s", self.Process, want)
	}
}

func TestSameProcess(t *testing.T) {
	a := card(boot, "net:[1]", "pid:[2]", "onnode")
	a.Process = "42"
	for _, tc := range []struct {
		edit func(*Card)
		want bool
	}{
		{func(*Card) {}, true},
		{func(c *Card) { c.Process = "43" }, false},
		{func(c *Card) { c.PIDNS = "pid:[3]" }, false},
		{func(c *Card) { c.Host = "other" }, false},
		{func(c *Card) { c.Process = "" }, false},
	} {
		b := a
		tc.edit(&b)
		if got := SameProcess(a, b); got != tc.want {
			t.Errorf("SameProcess(%+v, %+v) = %v, want %v", a, b, got, tc.want)
		}
	}
	if SameProcess(Card{}, Card{}) {
		t.Error("two unknown cards are one process")
	}
}

func TestRoundTrip(t *testing.T) {
	withProcess := card(boot, "net:[1]", "pid:[2]", "onnode")
	withProcess.Process = "4242"
	for _, c := range []Card{{}, card(boot, "net:[1]", "pid:[2]", "onnode", "tcp"), withProcess} {
		got, err := Decode(c.Append(nil))
		if err != nil {
			t.Fatal(err)
		}
		if got.Host != c.Host || got.NetNS != c.NetNS || got.PIDNS != c.PIDNS || !slices.Equal(got.Providers, c.Providers) || got.Process != c.Process {
			t.Errorf("round trip %+v -> %+v", c, got)
		}
	}
	enc := card(boot, "n", "p", "tcp").Append(nil)
	for i := range len(enc) {
		if _, err := Decode(enc[:i]); !errors.Is(err, verbsio.ErrBadFrame) {
			t.Errorf("truncated to %d bytes: %v, want ErrBadFrame", i, err)
		}
	}
	if _, err := Decode(append(enc, 0)); !errors.Is(err, verbsio.ErrBadFrame) {
		t.Errorf("trailing byte: %v, want ErrBadFrame", err)
	}
}

func FuzzDecode(f *testing.F) {
	f.Add(card(boot, "net:[1]", "pid:[2]", "onnode", "tcp").Append(nil))
	f.Add(Card{}.Append(nil))
	f.Add(Card{Host: boot, PIDNS: "pid:[2]", Providers: []string{"tcp"}, Process: "4242"}.Append(nil))
	f.Add([]byte{1, 0, 0, 0, 0, 0, 0, 200})
	f.Fuzz(func(t *testing.T, b []byte) {
		c, err := Decode(b)
		if err != nil {
			if !errors.Is(err, verbsio.ErrBadFrame) {
				t.Fatalf("error %v does not wrap ErrBadFrame", err)
			}
			return
		}
		again, err := Decode(c.Append(nil))
		if err != nil || again.Host != c.Host || !slices.Equal(again.Providers, c.Providers) || again.Process != c.Process {
			t.Fatalf("re-encoded card does not decode the same: %+v, %v", again, err)
		}
	})
}

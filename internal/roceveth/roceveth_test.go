package roceveth

import (
	"net/netip"
	"testing"
)

func TestGID(t *testing.T) {
	for _, c := range []struct{ addr, want string }{
		{"10.234.0.10", "0000:0000:0000:0000:0000:ffff:0aea:000a"},
		{"192.168.255.1", "0000:0000:0000:0000:0000:ffff:c0a8:ff01"},
	} {
		if got := GID(netip.MustParseAddr(c.addr)); got != c.want {
			t.Errorf("GID(%s) = %s, want %s", c.addr, got, c.want)
		}
	}
}

// Without GDRLINK_TEST_ROCE_VETH=1, Setup skips and makes nothing.
func TestSetupSkipsUnlessAllowed(t *testing.T) {
	var skipped bool
	t.Run("setup", func(t *testing.T) {
		t.Setenv(Env, "")
		defer func() { skipped = t.Skipped() }()
		Setup(t, "x", []string{"10.250.0.10/24"}, "10.250.0.2/24")
		t.Error("Setup went on without " + Env + "=1")
	})
	if !skipped {
		t.Error("Setup did not skip")
	}
}

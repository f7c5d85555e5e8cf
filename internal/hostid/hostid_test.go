package hostid_test

import (
	"errors"
	"testing"

	"github.com/gdrlink/gdrlink/internal/hostid"
	"github.com/gdrlink/gdrlink/verbsio"
	_ "github.com/gdrlink/gdrlink/verbsio/tcp"
)

func TestHostID(t *testing.T) {
	id, err := hostid.At("testdata/proc-a")
	if err != nil || id != "3f1c2a8e-52b1-4c39-9c7e-0f6d2b1a9e44" {
		t.Errorf("At(fixture) = %q, %v", id, err)
	}
	if _, err := hostid.At("testdata/proc-bad"); !errors.Is(err, verbsio.ErrBadConfig) {
		t.Errorf("malformed boot id: %v, want ErrBadConfig", err)
	}
	if _, err := hostid.At("testdata/none"); !errors.Is(err, verbsio.ErrNotSupported) {
		t.Errorf("missing boot id: %v, want ErrNotSupported", err)
	}
	if !hostid.Same(id, verbsio.Endpoint{Host: id}) || hostid.Same(id, verbsio.Endpoint{Host: "other"}) || hostid.Same("", verbsio.Endpoint{}) {
		t.Error("Same")
	}
	if live, err := hostid.Get(); err == nil {
		if _, err := hostid.Parse(live); err != nil {
			t.Errorf("this machine's boot id %q: %v", live, err)
		}
	} else if !errors.Is(err, verbsio.ErrNotSupported) {
		t.Errorf("Get: %v", err)
	}
}

// ChooseFor with this machine's own host id: the peer shares the host.
// Only tcp is linked into this test binary, so it is chosen, and the
// reasons the better providers were passed over are kept.
func TestChooseForLinkedProviders(t *testing.T) {
	host, err := hostid.Get()
	if err != nil {
		t.Skipf("no boot id here: %v", err)
	}
	c, err := hostid.ChooseFor(host)
	if err != nil {
		t.Fatal(err)
	}
	if c.Provider != "tcp" {
		t.Errorf("chose %q, want tcp (the only provider linked)", c.Provider)
	}
	for _, name := range []string{"ibverbs", "onnode"} {
		if !errors.Is(c.Skipped[name], verbsio.ErrNoProvider) {
			t.Errorf("Skipped[%s] = %v, want ErrNoProvider (not linked)", name, c.Skipped[name])
		}
	}
}

package ibvdiag_test

import (
	"testing"

	"github.com/gdrlink/gdrlink/internal/ibvdiag"
	"github.com/gdrlink/gdrlink/verbsio"
	_ "github.com/gdrlink/gdrlink/verbsio/tcp"
)

// A device of another provider is not an ibverbs device: Of and StatsOf
// say so rather than report zeros. (The ibverbs device's side is checked
// at compile time in its package.)
func TestOtherProvider(t *testing.T) {
	dev, err := verbsio.Open("tcp", verbsio.Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Close()
	if _, ok := ibvdiag.Of(dev); ok {
		t.Error("Of(tcp device) = true")
	}
	if s, ok := ibvdiag.StatsOf(dev); ok || s != (ibvdiag.Stats{}) {
		t.Errorf("StatsOf(tcp device) = %+v, %v", s, ok)
	}
}

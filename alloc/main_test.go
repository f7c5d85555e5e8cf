package alloc

import (
	"os"
	"testing"

	"github.com/gdrlink/gdrlink/internal/leakcheck"
)

// TestMain fails the run when tests leave memfd descriptors open: every
// region a memfd source makes must be freed, closing its descriptor.
func TestMain(m *testing.M) {
	os.Exit(leakcheck.RunMain(m))
}

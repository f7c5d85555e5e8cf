package main

import (
	"context"
	"os"
	"strings"
	"testing"

	// Named here too so that scripts/test-rdma.sh, which picks the packages
	// whose tests use the ibverbs provider, runs these tests on Soft-RoCE.
	_ "github.com/gdrlink/gdrlink/verbsio/ibverbs"
)

// TestSelftest runs the selftest on this machine with small writes: every
// provider either moves and verifies the pattern or says why it is skipped,
// and the TCP provider, which needs nothing but loopback, must work.
func TestSelftest(t *testing.T) {
	s := runSelftest(context.Background(), 64<<10)
	if s.Failed != 0 {
		t.Errorf("%d failed: %+v", s.Failed, s.Runs)
	}
	ok := map[string]bool{}
	for _, r := range s.Runs {
		switch r.Status {
		case "ok":
			ok[r.Provider] = true
			if r.GBps <= 0 {
				t.Errorf("%s/%s ok with %v GB/s", r.Provider, r.Path, r.GBps)
			}
		case "skipped":
			if r.Detail == "" {
				t.Errorf("%s/%s skipped without a reason", r.Provider, r.Path)
			}
		default:
			t.Errorf("%s/%s: %s: %s", r.Provider, r.Path, r.Status, r.Detail)
		}
		t.Logf("%-8s %-6s %-7s %6.2f GB/s %s", r.Provider, r.Path, r.Status, r.GBps, r.Detail)
	}
	if os.Getenv("GDRLINK_REQUIRE_RDMA") == "1" && !ok["ibverbs"] {
		t.Error("GDRLINK_REQUIRE_RDMA=1 but the ibverbs provider did not move data")
	}
	if !ok["tcp"] {
		t.Error("the tcp provider did not move data over loopback")
	}
	if bad := runSelftest(context.Background(), 0); bad.Failed != 1 {
		t.Errorf("size 0: %+v", bad)
	}
}

func TestSelftestJSON(t *testing.T) {
	js, errs, _ := runArgs(t, "--selftest", "--selftest-size", "65536", "--json")
	validate(t, compileSchema(t), js)
	if !strings.Contains(js, `"selftest"`) {
		t.Fatalf("no selftest in the report; stderr %s", errs)
	}
	human, _, _ := runArgs(t, "--selftest", "--selftest-size", "65536")
	if !strings.Contains(human, "Selftest (loopback, 64 KiB per write)") {
		t.Fatalf("no selftest section:\n%s", human)
	}
}

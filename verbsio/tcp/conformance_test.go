package tcp_test

import (
	"fmt"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/internal/jobauth"
	"github.com/gdrlink/gdrlink/verbsio"
	_ "github.com/gdrlink/gdrlink/verbsio/tcp"
	"github.com/gdrlink/gdrlink/verbsio/verbstest"
)

func TestMain(m *testing.M) {
	verbstest.PeerMain()
	grantWriterMain()
	code := m.Run()
	if code == 0 {
		if leaked := leakedGoroutines(); leaked != "" {
			fmt.Fprintf(os.Stderr, "goroutines of the provider still running after the tests (a Close that does not wait, or a handle not closed):\n%s\n", leaked)
			code = 1
		}
	}
	os.Exit(code)
}

// leakedGoroutines returns the stacks of goroutines running provider code,
// after giving them a moment to finish.
func leakedGoroutines() string {
	var found []string
	for deadline := time.Now().Add(3 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		buf := make([]byte, 1<<20)
		buf = buf[:runtime.Stack(buf, true)]
		found = found[:0]
		for _, g := range strings.Split(string(buf), "\n\n") {
			if strings.Contains(g, "gdrlink/verbsio/tcp.(") && !strings.Contains(g, "_test.") {
				found = append(found, g)
			}
		}
		if len(found) == 0 {
			return ""
		}
	}
	return strings.Join(found, "\n\n")
}

// jobKey makes a fresh job key: the key material for this process's
// Config and the environment entry that gives the key to a verbstest peer
// (whose Config comes from verbsio.ConfigFromEnv).
func jobKey(t testing.TB) (key []byte, peerEnv string) {
	t.Helper()
	k, secret, err := jobauth.Generate()
	if err != nil {
		t.Fatal(err)
	}
	return k.Bytes(), jobauth.KeyEnv + "=" + secret
}

// TestConformance runs the suite with a job key on both sides, so every
// lane of every test proves it first.
func TestConformance(t *testing.T) {
	key, env := jobKey(t)
	verbstest.Run(t, verbstest.Harness{Provider: "tcp", Config: verbsio.Config{JobKey: key}, PeerEnv: []string{env}})
}

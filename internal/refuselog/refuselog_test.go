package refuselog

import (
	"bytes"
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"
)

func TestRateLimited(t *testing.T) {
	var buf bytes.Buffer
	l := New(slog.New(slog.NewTextHandler(&buf, nil)), "tcp", "127.0.0.1:1")
	clock := time.Unix(1000, 0)
	l.now = func() time.Time { return clock }
	why := errors.New("no key")
	l.Refused("10.0.0.1:5", why)
	for i := 0; i < 99; i++ {
		clock = clock.Add(time.Millisecond)
		l.Refused("10.0.0.2:5", why)
	}
	clock = clock.Add(Every)
	l.Refused("10.0.0.3:5", why)
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	if len(lines) != 2 {
		t.Fatalf("%d lines for 101 refusals over %v, want 2:\n%s", len(lines), 99*time.Millisecond+Every, buf.String())
	}
	for i, want := range []string{
		`level=WARN msg="tcp: connection refused" listener=127.0.0.1:1 peer=10.0.0.1:5 reason="no key" suppressed=0 refused_total=1`,
		`level=WARN msg="tcp: connection refused" listener=127.0.0.1:1 peer=10.0.0.3:5 reason="no key" suppressed=99 refused_total=101`,
	} {
		if _, rest, _ := strings.Cut(lines[i], " "); rest != want {
			t.Errorf("line %d: %s\nwant (after the time): %s", i, lines[i], want)
		}
	}
	if l.Total() != 101 {
		t.Errorf("total %d, want 101", l.Total())
	}
}

func TestNilLoggerIsDefault(t *testing.T) {
	var buf bytes.Buffer
	old := slog.Default()
	defer slog.SetDefault(old)
	slog.SetDefault(slog.New(slog.NewTextHandler(&buf, nil)))
	New(nil, "onnode", "@x").Refused("pid 1 uid 0", errors.New("wrong uid"))
	if !strings.Contains(buf.String(), `msg="onnode: connection refused"`) {
		t.Fatalf("default logger got %q", buf.String())
	}
}

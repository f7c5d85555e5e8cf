package main

import (
	"bytes"
	"encoding/json"
	"strings"
	"sync"
	"testing"
	"time"
)

// syncBuffer is a bytes.Buffer safe for a writer and a reader.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestRun starts the command on loopback, stops it, and reads its counters.
func TestRun(t *testing.T) {
	var out, errb syncBuffer
	stop := make(chan struct{})
	done := make(chan int)
	env := func(k string) string { return map[string]string{"GDRLINK_JOB_KEY": strings.Repeat("k", 32)}[k] }
	go func() {
		done <- run([]string{"-data", "127.0.0.1:0", "-control", "127.0.0.1:0"}, env, &out, &errb, stop)
	}()
	deadline := time.Now().Add(10 * time.Second)
	for !strings.Contains(out.String(), "control") && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	close(stop)
	if code := <-done; code != 0 {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	if !strings.Contains(lines[0], "socket") {
		t.Errorf("the first line does not say which socket packets are read from: %q", lines[0])
	}
	t.Log(lines[0])
	var st map[string]any
	if err := json.Unmarshal([]byte(lines[len(lines)-1]), &st); err != nil || st["Jobs"] == nil {
		t.Fatalf("counters %q: %v", lines[len(lines)-1], err)
	}
}

// TestRefusals: bad command lines and a keyless non-loopback control
// address are refused.
func TestRefusals(t *testing.T) {
	none := func(string) string { return "" }
	for _, c := range []struct {
		args []string
		code int
	}{
		{nil, 2},
		{[]string{"-data", "127.0.0.1:0", "-control", "0.0.0.0:0"}, 1},
		{[]string{"-data", "0.0.0.0:0", "-control", "127.0.0.1:0"}, 1},
		{[]string{"-bogus"}, 2},
		{[]string{"-data", "127.0.0.1:0", "-control", "127.0.0.1:0", "-raw", "maybe"}, 2},
	} {
		var out, errb syncBuffer
		if code := run(c.args, none, &out, &errb, nil); code != c.code {
			t.Errorf("%v: exit %d, want %d (%s)", c.args, code, c.code, errb.String())
		}
	}
}

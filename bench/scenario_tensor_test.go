package main

import (
	"bufio"
	"context"
	"encoding/binary"
	"encoding/json"
	"strings"
	"testing"
)

// The scenario runs for real, quick: two processes (this test binary is the
// peer), every available provider, both baselines.
func TestTensorScenarioQuick(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a peer process per provider")
	}
	code, out, errOut := runBench(t, "-quick", "-reps", "1", "-json", "-scenario", "tensor")
	if code != exitOK {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	seen := map[string]bool{}
	var rows []Result
	sc := bufio.NewScanner(strings.NewReader(out))
	for sc.Scan() {
		var r Result
		if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
			t.Fatalf("%q: %v", sc.Text(), err)
		}
		rows = append(rows, r)
		if r.Value <= 0 || r.Baseline <= 0 || r.Ratio <= 0 || r.BaselineName == "" {
			t.Errorf("result without a measured value and baseline: %+v", r)
		}
		parts := strings.Split(r.Case, "/")
		if len(parts) < 3 {
			t.Fatalf("case %q", r.Case)
		}
		seen[strings.Join(parts[2:], "/")] = true
	}
	for _, want := range []string{"small/vs-grpc", "small/vs-copybuf", "small/latency-vs-raw-write", "small/latency-median-vs-raw-write", "large/vs-grpc", "large/vs-copybuf", "large/vs-raw-write"} {
		if !seen[want] {
			t.Errorf("no %s result in:\n%s", want, out)
		}
	}
	checkGrantRows(t, rows)
}

func TestGRPCBaselineServes(t *testing.T) {
	src := make([]byte, 1<<20)
	for i := range src {
		src[i] = byte(i)
	}
	s, err := startGRPCServer(src)
	if err != nil {
		t.Fatal(err)
	}
	defer s.close()
	c, err := dialGRPC(s.addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.close()
	dst := make([]byte, 4096)
	if err := c.get(context.Background(), len(dst), dst); err != nil {
		t.Fatal(err)
	}
	if want := byte(4095 % 256); dst[4095] != want {
		t.Fatalf("byte 4095 is %d", dst[4095])
	}
	if err := c.get(context.Background(), 2<<20, make([]byte, 2<<20)); err == nil {
		t.Fatal("a request beyond the source succeeded")
	}
	var req []byte
	if err := (rawCodec{}).Unmarshal(binary.LittleEndian.AppendUint64(nil, 1), &req); err != nil || len(req) != 8 {
		t.Fatalf("codec: %v", err)
	}
	if _, err := (rawCodec{}).Marshal("not bytes"); err == nil {
		t.Fatal("codec marshalled a string")
	}
}

package gdrlink

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/internal/bootstrap"
	"github.com/gdrlink/gdrlink/verbsio"
)

// TestTwoProcessesKeyed runs the pair job between two processes that share
// a job key, over tcp, onnode and ibverbs (whose queue pairs are exchanged
// over the authenticated bootstrap): every connection proves the key, and
// the 15 tensors arrive checked byte for byte. ibverbs skips without a
// device, or fails where GDRLINK_REQUIRE_RDMA=1.
func TestTwoProcessesKeyed(t *testing.T) {
	key, err := NewJobKey()
	if err != nil {
		t.Fatal(err)
	}
	for _, provider := range []string{"tcp", "onnode", "ibverbs"} {
		t.Run(provider, func(t *testing.T) {
			p, err := verbsio.Lookup(provider)
			if err == nil {
				_, err = p.Devices()
			}
			if err != nil {
				if os.Getenv("GDRLINK_REQUIRE_RDMA") == "1" {
					t.Fatalf("GDRLINK_REQUIRE_RDMA=1 but %s is not usable: %v", provider, err)
				}
				t.Skipf("skipping: provider %s not usable here: %v", provider, err)
			}
			j := startJob(t, "pair", 2, "127.0.0.1", func(int) []string { return nil }, func(int) []string {
				return []string{"GDRLINK_PROVIDER=" + provider, "GDRLINK_JOB_KEY=" + key}
			})
			reps := j.wait(2 * time.Minute)
			if reps[1].Received != 15 {
				t.Fatalf("rank 1 received %d tensors, want 15", reps[1].Received)
			}
			for r, rep := range reps {
				if rep.Connections[provider] != 1 {
					t.Errorf("rank %d connections %v, want one over %s", r, rep.Connections, provider)
				}
			}
			t.Logf("%s with a job key: join %.1f ms and %.1f ms", provider, reps[0].JoinMS, reps[1].JoinMS)
		})
	}
}

// TestWrongKey starts rank 1 with another job's key: the root refuses it at
// the bootstrap, and rank 1's Join fails at once (not at its deadline),
// saying the key was not proven.
func TestWrongKey(t *testing.T) {
	k0, err := NewJobKey()
	if err != nil {
		t.Fatal(err)
	}
	k1, _ := NewJobKey()
	start := time.Now()
	j := startJob(t, "pair", 2, "127.0.0.1", func(int) []string { return nil }, func(r int) []string {
		if r == 0 {
			return []string{"GDRLINK_JOB_KEY=" + k0}
		}
		return []string{"GDRLINK_JOB_KEY=" + k1}
	})
	done := make(chan error, 1)
	go func() { done <- j.cmds[1].Wait() }()
	select {
	case err := <-done:
		took := time.Since(start)
		if err == nil {
			t.Fatalf("rank 1 with a wrong key succeeded: %s", j.outs[1])
		}
		msg := j.errs[1].String()
		if !strings.Contains(msg, "job key") {
			t.Errorf("rank 1's error does not name the job key: %s", msg)
		}
		if took > 20*time.Second {
			t.Errorf("rank 1 was refused after %v, want at once", took)
		}
		t.Logf("refused after %v: %s", took.Round(time.Millisecond), strings.TrimSpace(msg))
	case <-time.After(60 * time.Second):
		t.Fatal("rank 1 with a wrong key did not end within 60 s")
	}
	// The root is still waiting for a rank 1 that holds the key: the
	// refused process took no rank's place and did not end the job.
	if err := j.cmds[0].Process.Signal(syscall.Signal(0)); err != nil {
		t.Errorf("rank 0 ended although only a stranger came: %v %s", err, j.errs[0])
	}
}

// TestInsecureListen: a job without a key may listen on loopback only;
// WithInsecure lifts that, and a key makes it safe.
func TestInsecureListen(t *testing.T) {
	var ip string
	addrs, _ := net.InterfaceAddrs()
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok && !n.IP.IsLoopback() && n.IP.To4() != nil {
			ip = n.IP.String()
			break
		}
	}
	if ip == "" {
		t.Skip("skipping: this host has no non-loopback IPv4 address to listen on")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	root := net.JoinHostPort(ip, "0")
	t.Setenv("GDRLINK_JOB_KEY", "")
	t.Setenv("GDRLINK_JOB_KEY_FILE", "")
	t.Setenv("GDRLINK_INSECURE", "")
	if _, err := Join(ctx, WithRank(0, 1), WithRoot(root)); !errors.Is(err, ErrInsecure) || !strings.Contains(err.Error(), ip) {
		t.Fatalf("Join on %s without a key: %v, want ErrInsecure naming the address", root, err)
	}
	key, _ := NewJobKey()
	for name, opt := range map[string]Option{"insecure": WithInsecure(true), "key": WithJobKey(key)} {
		g, err := Join(ctx, WithRank(0, 1), WithRoot(root), opt)
		if err != nil {
			t.Fatalf("Join on %s with %s: %v", root, name, err)
		}
		if err := g.Close(); err != nil {
			t.Error(err)
		}
	}
	if _, err := Join(ctx, WithRank(0, 1), WithJobKey("short")); err == nil || !strings.Contains(err.Error(), "at least 16") {
		t.Errorf("a short key: %v", err)
	}
}

// TestKeyEnvironment: the variables behind WithJobKey and WithInsecure, and
// their refusals.
func TestKeyEnvironment(t *testing.T) {
	env := func(kv ...string) func(string) (string, bool) {
		return func(k string) (string, bool) {
			for i := 0; i+1 < len(kv); i += 2 {
				if kv[i] == k {
					return kv[i+1], true
				}
			}
			return "", false
		}
	}
	c, err := fromEnv(env("GDRLINK_JOB_KEY", "0123456789abcdef0123", "GDRLINK_INSECURE", "1"))
	if err != nil || c.key.IsZero() || c.keySource != "GDRLINK_JOB_KEY" || !c.insecure {
		t.Errorf("key and insecure from the environment: %+v, %v", c, err)
	}
	c, err = fromEnv(env())
	if err != nil || !c.key.IsZero() || c.insecure {
		t.Errorf("no key: %v", err)
	}
	for _, bad := range [][]string{
		{"GDRLINK_JOB_KEY", "short"},
		{"GDRLINK_JOB_KEY_FILE", "/nonexistent/key"},
		{"GDRLINK_INSECURE", "maybe"},
		{"GDRLINK_JOB_KEY", "0123456789abcdef0123", "GDRLINK_JOB_KEY_FILE", "/etc/hostname"},
	} {
		if _, err := fromEnv(env(bad...)); err == nil || !strings.Contains(err.Error(), bad[0]) {
			t.Errorf("%v: %v, want an error naming %s", bad, err, bad[0])
		}
	}
}

// TestJobID: two jobs that share a key file but not a job id cannot join
// each other. Rank 0 runs as a process of job "a"; a rank 1 of job "b",
// with the same key, is refused at once with ErrNotAuthenticated; then a
// rank 1 of job "a" joins and the pair job runs.
func TestJobID(t *testing.T) {
	key, err := NewJobKey()
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	lf, err := ln.(*net.TCPListener).File()
	if err != nil {
		t.Fatal(err)
	}
	root := ln.Addr().String()
	ln.Close()
	defer lf.Close()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	start := func(rank int) (*exec.Cmd, *bytes.Buffer, *bytes.Buffer) {
		cmd := exec.Command(self, "-test.run=^$")
		cmd.Env = append(os.Environ(), "GDRLINK_TEST_JOB=pair", "GDRLINK_RANK="+strconv.Itoa(rank), "GDRLINK_SIZE=2", "GDRLINK_ROOT="+root,
			"GDRLINK_PROVIDER=tcp", "GDRLINK_JOB_KEY="+key, "GDRLINK_JOB_ID=a")
		if rank == 0 {
			cmd.ExtraFiles = []*os.File{lf}
			cmd.Env = append(cmd.Env, "GDRLINK_TEST_ROOT_FD=3")
		}
		var out, errb bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &errb
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			if cmd.ProcessState == nil {
				cmd.Process.Kill()
				cmd.Wait()
			}
		})
		return cmd, &out, &errb
	}
	r0, out0, err0 := start(0)

	t.Setenv("GDRLINK_JOB_ID", "b")
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	began := time.Now()
	g, err := Join(ctx, WithRank(1, 2), WithRoot(root), WithJobKey(key), WithProvider("tcp"))
	if err == nil {
		g.Close()
		t.Fatal("a rank of job b joined job a")
	}
	took := time.Since(began)
	t.Logf("job b's rank 1 refused after %v: %v", took.Round(time.Millisecond), err)
	if !errors.Is(err, ErrNotAuthenticated) || !strings.Contains(err.Error(), `job "b"`) || !strings.Contains(err.Error(), "GDRLINK_JOB_ID") {
		t.Errorf("Join: %v; want ErrNotAuthenticated naming job b and GDRLINK_JOB_ID", err)
	}
	if took > 10*time.Second {
		t.Errorf("refused after %v, want at once", took)
	}

	r1, out1, err1 := start(1)
	for r, c := range []*exec.Cmd{r0, r1} {
		done := make(chan error, 1)
		go func() { done <- c.Wait() }()
		select {
		case err := <-done:
			if err != nil {
				t.Fatalf("rank %d of job a: %v\n%s%s", r, err, []*bytes.Buffer{err0, err1}[r], []*bytes.Buffer{out0, out1}[r])
			}
		case <-time.After(60 * time.Second):
			t.Fatalf("rank %d of job a did not end within 60 s", r)
		}
	}
	var rep childReport
	if err := json.Unmarshal(out1.Bytes(), &rep); err != nil || rep.Received != 15 {
		t.Fatalf("rank 1 of job a: report %s (%v), want 15 tensors received", out1, err)
	}
}

// TestJobIdentity: the job id comes from the environment, else the root
// address as given; the key bound to it differs with the id and stays
// none without a key.
func TestJobIdentity(t *testing.T) {
	env := func(kv ...string) func(string) (string, bool) {
		return func(k string) (string, bool) {
			for i := 0; i+1 < len(kv); i += 2 {
				if kv[i] == k {
					return kv[i+1], true
				}
			}
			return "", false
		}
	}
	secret := "0123456789abcdef0123"
	bound := func(kv ...string) config {
		t.Helper()
		c, err := fromEnv(env(append([]string{"GDRLINK_JOB_KEY", secret}, kv...)...))
		if err != nil {
			t.Fatal(err)
		}
		c.bindJob(bootstrap.Config{Root: "node7:29500"})
		return c
	}
	for _, tc := range []struct {
		env        []string
		id, source string
	}{
		{nil, "node7:29500", "the root address"},
		{[]string{"SLURM_JOB_ID", "4242"}, "4242", "SLURM_JOB_ID"},
		{[]string{"SLURM_JOB_ID", "4242", "GDRLINK_JOB_ID", "mine"}, "mine", "GDRLINK_JOB_ID"},
	} {
		if c := bound(tc.env...); c.jobID != tc.id || c.jobIDSource != tc.source {
			t.Errorf("%v: job id %q from %q, want %q from %q", tc.env, c.jobID, c.jobIDSource, tc.id, tc.source)
		}
	}
	a, a2, b := bound("GDRLINK_JOB_ID", "a"), bound("GDRLINK_JOB_ID", "a"), bound("GDRLINK_JOB_ID", "b")
	if !bytes.Equal(a.jobKey.Bytes(), a2.jobKey.Bytes()) || bytes.Equal(a.jobKey.Bytes(), b.jobKey.Bytes()) || bytes.Equal(a.jobKey.Bytes(), a.key.Bytes()) {
		t.Error("the job keys of ids a, a and b, and the secret's: want a and a equal, the others different")
	}
	var none config
	none.bindJob(bootstrap.Config{Root: "node7:29500"})
	if !none.jobKey.IsZero() {
		t.Error("a job without a key has a job key")
	}
}

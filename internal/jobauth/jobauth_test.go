package jobauth

import (
	"bytes"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

func mustKey(t testing.TB, s string) Key {
	t.Helper()
	k, err := Parse(s)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// tcpPair is a real loopback TCP connection, with its ends as each side
// sees them.
func tcpPair(t testing.TB) (dialled, accepted net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	done := make(chan net.Conn, 1)
	go func() {
		c, _ := ln.Accept()
		done <- c
	}()
	d, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	a := <-done
	if a == nil {
		t.Fatal("accept failed")
	}
	for _, c := range []net.Conn{d, a} {
		c.SetDeadline(time.Now().Add(10 * time.Second))
		t.Cleanup(func() { c.Close() })
	}
	return d, a
}

type result struct {
	rank uint32
	err  error
}

// handshake runs Initiate on one end and Accept on the other.
func handshake(t testing.TB, ki, ka Key, pi, pa string, ei, ea Ends, d, a io.ReadWriter) (ierr error, acc result) {
	t.Helper()
	ch := make(chan result, 1)
	go func() {
		r, err := Accept(a, ka, pa, ea)
		if err != nil {
			if c, ok := a.(net.Conn); ok {
				c.Close()
			}
		}
		ch <- result{r, err}
	}()
	ierr = Initiate(d, ki, pi, 7, ei)
	if ierr != nil {
		if c, ok := d.(net.Conn); ok {
			c.Close()
		}
	}
	return ierr, <-ch
}

func TestHandshake(t *testing.T) {
	k := mustKey(t, "a job key of some length")
	d, a := tcpPair(t)
	ierr, acc := handshake(t, k, k, "bootstrap", "bootstrap", EndsOf(d, true), EndsOf(a, false), d, a)
	if ierr != nil || acc.err != nil || acc.rank != 7 {
		t.Fatalf("same key: initiator %v, acceptor %v rank %d", ierr, acc.err, acc.rank)
	}
	// The connection carries on after the handshake.
	go d.Write([]byte("after"))
	b := make([]byte, 5)
	if _, err := io.ReadFull(a, b); err != nil || string(b) != "after" {
		t.Fatalf("after the handshake: %q %v", b, err)
	}
}

func TestRefusals(t *testing.T) {
	good := mustKey(t, "a job key of some length")
	bad := mustKey(t, "another job key, not it")
	ends := Ends{Initiator: "tcp:10.0.0.1:5000", Acceptor: "tcp:10.0.0.2:6000"}
	relayed := Ends{Initiator: "tcp:10.0.0.9:5000", Acceptor: "tcp:10.0.0.2:6000"}
	for _, tc := range []struct {
		name       string
		ki, ka     Key
		pi, pa     string
		ei, ea     Ends
		initSays   string
		acceptSays string
	}{
		{"wrong key", bad, good, "bootstrap", "bootstrap", ends, ends, "does not hold this job's key", "refused this process's key"},
		{"relayed", good, good, "bootstrap", "bootstrap", relayed, ends, "does not hold this job's key", "refused this process's key"},
		{"other purpose", good, good, "tcp-lane", "onnode", ends, ends, "did not answer as a job peer", `is for "tcp-lane"`},
		{"initiator without key", Key{}, good, "onnode", "onnode", ends, ends, "no job key", "handshake from"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d, a := net.Pipe()
			defer d.Close()
			defer a.Close()
			d.SetDeadline(time.Now().Add(5 * time.Second))
			a.SetDeadline(time.Now().Add(5 * time.Second))
			ierr, acc := handshake(t, tc.ki, tc.ka, tc.pi, tc.pa, tc.ei, tc.ea, d, a)
			if !errors.Is(ierr, ErrRefused) || !strings.Contains(ierr.Error(), tc.initSays) {
				t.Errorf("initiator: %v, want ErrRefused saying %q", ierr, tc.initSays)
			}
			if !errors.Is(acc.err, ErrRefused) || !strings.Contains(acc.err.Error(), tc.acceptSays) {
				t.Errorf("acceptor: %v, want ErrRefused saying %q", acc.err, tc.acceptSays)
			}
		})
	}
}

// recorder keeps what a side wrote.
type recorder struct {
	io.ReadWriter
	mu    sync.Mutex
	wrote [][]byte
}

func (r *recorder) Write(b []byte) (int, error) {
	r.mu.Lock()
	r.wrote = append(r.wrote, append([]byte(nil), b...))
	r.mu.Unlock()
	return r.ReadWriter.Write(b)
}

// TestReplay records a good initiator's messages and plays them to a
// fresh acceptor: the acceptor's new nonce makes the old proof worthless.
func TestReplay(t *testing.T) {
	k := mustKey(t, "a job key of some length")
	ends := Ends{Initiator: "tcp:127.0.0.1:5000", Acceptor: "tcp:127.0.0.1:6000"}
	d, a := net.Pipe()
	rec := &recorder{ReadWriter: d}
	if ierr, acc := handshake(t, k, k, "bootstrap", "bootstrap", ends, ends, rec, a); ierr != nil || acc.err != nil {
		t.Fatalf("recording: %v, %v", ierr, acc.err)
	}
	d.Close()
	a.Close()
	if len(rec.wrote) != 2 {
		t.Fatalf("initiator wrote %d messages", len(rec.wrote))
	}
	d, a = net.Pipe()
	defer d.Close()
	defer a.Close()
	a.SetDeadline(time.Now().Add(5 * time.Second))
	d.SetDeadline(time.Now().Add(5 * time.Second))
	ch := make(chan error, 1)
	go func() {
		_, err := Accept(a, k, "bootstrap", ends)
		ch <- err
	}()
	d.Write(rec.wrote[0])
	io.ReadFull(d, make([]byte, len(magic)+1+nonceSize+macSize))
	d.Write(rec.wrote[1])
	var st [1]byte
	if _, err := io.ReadFull(d, st[:]); err != nil || st[0] != statusBad {
		t.Errorf("acceptor's answer to a replay: %v %v", st, err)
	}
	if err := <-ch; !errors.Is(err, ErrRefused) || !strings.Contains(err.Error(), "does not hold this job's key") {
		t.Fatalf("replayed handshake: %v", err)
	}
}

func TestKeyFile(t *testing.T) {
	dir := t.TempDir()
	write := func(name, content string, mode os.FileMode) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), mode); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(p, mode); err != nil {
			t.Fatal(err)
		}
		return p
	}
	good := write("good", "0123456789abcdef0123\n", 0o600)
	k, err := LoadFile(good)
	if err != nil || !bytes.Equal(k.k, mustKey(t, "0123456789abcdef0123").k) {
		t.Fatalf("0600 key file: %v", err)
	}
	for name, p := range map[string]string{
		"group-readable": write("open", "0123456789abcdef0123", 0o640),
		"short":          write("short", "tooshort", 0o600),
		"directory":      dir,
		"missing":        filepath.Join(dir, "nope"),
	} {
		if _, err := LoadFile(p); !errors.Is(err, ErrBadKey) {
			t.Errorf("%s: %v, want ErrBadKey", name, err)
		}
	}
	if os.Geteuid() == 0 {
		other := write("other", "0123456789abcdef0123", 0o600)
		if err := os.Chown(other, 65534, 65534); err != nil {
			t.Fatal(err)
		}
		if _, err := LoadFile(other); !errors.Is(err, ErrBadKey) || !strings.Contains(err.Error(), "uid 65534") {
			t.Errorf("a key file of another user: %v", err)
		}
	}
	env := func(m map[string]string) func(string) string { return func(k string) string { return m[k] } }
	if k, src, err := FromEnv(env(nil)); err != nil || !k.IsZero() || src != "" {
		t.Errorf("no key: %v %v %q", k, err, src)
	}
	if k, src, err := FromEnv(env(map[string]string{KeyFileEnv: good})); err != nil || k.IsZero() || !strings.Contains(src, good) {
		t.Errorf("key file: %v %q", err, src)
	}
	if _, _, err := FromEnv(env(map[string]string{KeyFileEnv: good, KeyEnv: "0123456789abcdef0123"})); !errors.Is(err, ErrBadKey) {
		t.Errorf("both set: %v", err)
	}
	if _, _, err := FromEnv(env(map[string]string{KeyEnv: "short"})); !errors.Is(err, ErrBadKey) || !strings.Contains(err.Error(), KeyEnv) {
		t.Errorf("short key: %v", err)
	}
}

func TestGenerateAndBytes(t *testing.T) {
	k1, s1, err := Generate()
	if err != nil {
		t.Fatal(err)
	}
	k2, s2, _ := Generate()
	if s1 == s2 || bytes.Equal(k1.k, k2.k) {
		t.Fatal("two generated keys are equal")
	}
	if p := mustKey(t, s1); !bytes.Equal(p.k, k1.k) {
		t.Error("the secret does not parse to the key")
	}
	b, err := FromBytes(k1.Bytes())
	if err != nil || !bytes.Equal(b.k, k1.k) {
		t.Errorf("FromBytes(Bytes()): %v", err)
	}
	if _, err := FromBytes([]byte{1, 2, 3}); !errors.Is(err, ErrBadKey) {
		t.Errorf("short derived key: %v", err)
	}
	if k1.Fingerprint() == k2.Fingerprint() || (Key{}).Fingerprint() != "none" || strings.Contains(s1, k1.Fingerprint()) {
		t.Error("fingerprints")
	}
}

func TestCheckListen(t *testing.T) {
	k := mustKey(t, "a job key of some length")
	for _, tc := range []struct {
		addr     string
		key      Key
		insecure bool
		ok       bool
	}{
		{"127.0.0.1:0", Key{}, false, true},
		{"[::1]:4000", Key{}, false, true},
		{"localhost:4000", Key{}, false, true},
		{"127.0.0.2", Key{}, false, true},
		{"0.0.0.0:4000", Key{}, false, false},
		{":4000", Key{}, false, false},
		{"10.1.2.3:4000", Key{}, false, false},
		{"10.1.2.3:4000", k, false, true},
		{"10.1.2.3:4000", Key{}, true, true},
	} {
		err := CheckListen(tc.key, tc.addr, tc.insecure)
		if (err == nil) != tc.ok || (err != nil && !errors.Is(err, ErrInsecure)) {
			t.Errorf("CheckListen(%s, key %v, insecure %v) = %v", tc.addr, !tc.key.IsZero(), tc.insecure, err)
		}
	}
}

// FuzzAccept feeds arbitrary bytes to the acceptor: it never panics, and
// never accepts without the key's proof.
func FuzzAccept(f *testing.F) {
	f.Add([]byte("GDRA\x01\x09bootstrap\x00\x00\x00\x07" + strings.Repeat("n", 32) + "\x00" + strings.Repeat("m", 32)))
	f.Add([]byte("GDRA\x01\xffx"))
	f.Add([]byte("HELO"))
	f.Add([]byte{})
	k := mustKey(f, "a job key of some length")
	f.Fuzz(func(t *testing.T, in []byte) {
		rw := struct {
			io.Reader
			io.Writer
		}{bytes.NewReader(in), io.Discard}
		if _, err := Accept(rw, k, "bootstrap", Ends{"a", "b"}); err == nil {
			t.Fatalf("accepted %q", in)
		}
	})
}

// TestForJob: a job's key is derived from the secret's and the job id,
// deterministically; another id, or another secret, gives another key,
// under which a handshake with the first is refused; no key stays none.
func TestForJob(t *testing.T) {
	k := mustKey(t, "a key file shared by two jobs")
	a, a2, b := k.ForJob("job-a"), k.ForJob("job-a"), k.ForJob("job-b")
	other := mustKey(t, "another secret altogether").ForJob("job-a")
	if !bytes.Equal(a.Bytes(), a2.Bytes()) {
		t.Error("ForJob is not deterministic")
	}
	for name, x := range map[string]Key{"another id": b, "no id": k.ForJob(""), "the secret's own key": k, "another secret": other} {
		if bytes.Equal(a.Bytes(), x.Bytes()) {
			t.Errorf("job-a's key equals that of %s", name)
		}
	}
	if len(a.Bytes()) != 32 {
		t.Errorf("derived key of %d bytes, want 32", len(a.Bytes()))
	}
	if z := (Key{}).ForJob("job-a"); !z.IsZero() {
		t.Error("no key derived a key")
	}
	d, c := tcpPair(t)
	ierr, acc := handshake(t, b, a, "bootstrap", "bootstrap", EndsOf(d, true), EndsOf(c, false), d, c)
	if !errors.Is(ierr, ErrRefused) || !errors.Is(acc.err, ErrRefused) {
		t.Errorf("handshake between two jobs of one secret: initiator %v, acceptor %v; want both refused", ierr, acc.err)
	}
	d, c = tcpPair(t)
	if ierr, acc := handshake(t, a2, a, "bootstrap", "bootstrap", EndsOf(d, true), EndsOf(c, false), d, c); ierr != nil || acc.err != nil {
		t.Errorf("handshake within one job: initiator %v, acceptor %v", ierr, acc.err)
	}
}

// TestJobIDFromEnv: the job id comes from the first variable set, ours
// before the launchers', the most specific launcher first.
func TestJobIDFromEnv(t *testing.T) {
	for _, tc := range []struct {
		env        map[string]string
		id, source string
	}{
		{map[string]string{}, "", ""},
		{map[string]string{"SLURM_JOB_ID": "4242"}, "4242", "SLURM_JOB_ID"},
		{map[string]string{"SLURM_JOB_ID": "4242", "PMIX_NAMESPACE": "prterun-n1-77@1"}, "prterun-n1-77@1", "PMIX_NAMESPACE"},
		{map[string]string{"PMIX_NAMESPACE": "1170079745", "OMPI_MCA_ess_base_jobid": "1170079745"}, "1170079745", "OMPI_MCA_ess_base_jobid"},
		{map[string]string{"SLURM_JOB_ID": "4242", "TORCHELASTIC_RUN_ID": "run7"}, "run7", "TORCHELASTIC_RUN_ID"},
		{map[string]string{"SLURM_JOB_ID": "4242", "TORCHELASTIC_RUN_ID": "run7", JobIDEnv: " mine "}, "mine", JobIDEnv},
		{map[string]string{JobIDEnv: " ", "SLURM_JOB_ID": "4242"}, "4242", "SLURM_JOB_ID"},
	} {
		id, src := JobIDFromEnv(func(k string) string { return tc.env[k] })
		if id != tc.id || src != tc.source {
			t.Errorf("%v: %q from %q, want %q from %q", tc.env, id, src, tc.id, tc.source)
		}
	}
}

package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/gdrlink/gdrlink/internal/jobauth"
)

// env is a fixed environment for run.
func env(m map[string]string) func(string) string {
	return func(k string) string { return m[k] }
}

func fingerprint(t *testing.T, secret string) string {
	t.Helper()
	k, err := jobauth.Parse(secret)
	if err != nil {
		t.Fatal(err)
	}
	return k.Fingerprint()
}

// keyFile writes secret to a file with the mode in a fresh directory.
func keyFile(t *testing.T, secret string, mode os.FileMode) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "key")
	if err := os.WriteFile(p, []byte(secret+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(p, mode); err != nil { // not subject to the umask
		t.Fatal(err)
	}
	return p
}

// TestJobAuth runs gdrcheck on the dgx fixture (ready) in each job key
// setting and checks the JSON, the human line, the verdict, the node label
// and the metric, and that no secret is printed.
func TestJobAuth(t *testing.T) {
	t.Setenv("GDRLINK_NET_GDR_LEVEL", "")
	schema := compileSchema(t)
	const secret = "correct horse battery staple"
	good := keyFile(t, secret, 0o600)
	readOnly := keyFile(t, secret, 0o400)
	open := keyFile(t, secret, 0o644)
	cases := []struct {
		name   string
		env    map[string]string
		layout string // default dgx
		mode   string
		source string
		fp     string // fingerprint
		detail []string
		human  string // the Host line after "job key: ", a prefix
		code   int
		// jobID and jobIDSource, where set, are the job id's fields.
		jobID, jobIDSource string
	}{
		{
			name: "key from env", env: map[string]string{jobauth.KeyEnv: "  " + secret + "\n"},
			mode: authKey, source: jobauth.KeyEnv, fp: fingerprint(t, secret),
			detail: []string{"every connection proves it", "bound to the job id: " + rootAsJobID},
			human:  "yes (GDRLINK_JOB_KEY, fingerprint " + fingerprint(t, secret) + "); job id from " + rootAsJobID, code: exitReady,
			jobIDSource: rootAsJobID,
		},
		{
			name: "key and job id", env: map[string]string{jobauth.KeyEnv: secret, jobauth.JobIDEnv: "run-7", "SLURM_JOB_ID": "42"},
			mode: authKey, source: jobauth.KeyEnv, fp: fingerprint(t, secret),
			detail: []string{`bound to the job id "run-7" from GDRLINK_JOB_ID`},
			human:  "yes (GDRLINK_JOB_KEY, fingerprint " + fingerprint(t, secret) + `); job id "run-7" from GDRLINK_JOB_ID`, code: exitReady,
			jobID: "run-7", jobIDSource: jobauth.JobIDEnv,
		},
		{
			name: "key and launcher's job id", env: map[string]string{jobauth.KeyEnv: secret, "SLURM_JOB_ID": "42"},
			mode: authKey, source: jobauth.KeyEnv, fp: fingerprint(t, secret),
			human: "yes (GDRLINK_JOB_KEY, fingerprint " + fingerprint(t, secret) + `); job id "42" from SLURM_JOB_ID`, code: exitReady,
			jobID: "42", jobIDSource: "SLURM_JOB_ID",
		},
		{
			name: "key file 0600", env: map[string]string{jobauth.KeyFileEnv: good},
			mode: authKey, source: jobauth.KeyFileEnv + "=" + good, fp: fingerprint(t, secret),
			detail: []string{"job key from GDRLINK_JOB_KEY_FILE=" + good},
			human:  "yes (GDRLINK_JOB_KEY_FILE=" + good + ", fingerprint " + fingerprint(t, secret) + ")", code: exitReady,
		},
		{
			name: "key file 0400", env: map[string]string{jobauth.KeyFileEnv: readOnly},
			mode: authKey, source: jobauth.KeyFileEnv + "=" + readOnly, fp: fingerprint(t, secret),
			human: "yes (GDRLINK_JOB_KEY_FILE=" + readOnly, code: exitReady,
		},
		{
			name: "key file 0644", env: map[string]string{jobauth.KeyFileEnv: open},
			mode: authError, source: jobauth.KeyFileEnv + "=" + open,
			detail: []string{"group or others may read it", "chmod 600 " + open, "every Join with this environment fails"},
			human:  "unusable: GDRLINK_JOB_KEY_FILE: ", code: exitNotReady,
		},
		{
			name: "key file missing", env: map[string]string{jobauth.KeyFileEnv: filepath.Join(t.TempDir(), "none")},
			mode: authError, detail: []string{"no such file"}, human: "unusable: ", code: exitNotReady,
		},
		{
			name: "key too short", env: map[string]string{jobauth.KeyEnv: "hunter2"},
			mode: authError, source: jobauth.KeyEnv, detail: []string{"7 bytes, at least 16 needed"},
			human: "unusable: GDRLINK_JOB_KEY: ", code: exitNotReady,
		},
		{
			name: "both set", env: map[string]string{jobauth.KeyEnv: secret, jobauth.KeyFileEnv: good},
			mode: authError, source: jobauth.KeyEnv + ", " + jobauth.KeyFileEnv + "=" + good,
			detail: []string{"both GDRLINK_JOB_KEY and GDRLINK_JOB_KEY_FILE are set"}, human: "unusable: ", code: exitNotReady,
		},
		{
			name: "insecure", env: map[string]string{jobauth.InsecureEnv: "1"},
			mode: authInsecure, detail: []string{"accept unauthenticated peers"},
			human: "none, GDRLINK_INSECURE=1: jobs accept unauthenticated peers beyond loopback", code: exitReady,
		},
		{
			name: "insecure not 0 or 1", env: map[string]string{jobauth.InsecureEnv: "yes"},
			mode: authError, source: jobauth.InsecureEnv, detail: []string{`GDRLINK_INSECURE="yes", want 0 or 1`},
			human: `unusable: GDRLINK_INSECURE="yes"`, code: exitNotReady,
		},
		{
			name: "key and insecure", env: map[string]string{jobauth.KeyEnv: secret, jobauth.InsecureEnv: "1"},
			mode: authKey, source: jobauth.KeyEnv, fp: fingerprint(t, secret),
			detail: []string{"GDRLINK_INSECURE=1 has no effect with a key"}, human: "yes (GDRLINK_JOB_KEY, ", code: exitReady,
		},
		{
			name: "insecure 0", env: map[string]string{jobauth.InsecureEnv: "0"},
			mode: authLoopback, detail: []string{"loopback only"}, human: "none: jobs listen on loopback only (", code: exitReady,
		},
		{
			name: "none", env: map[string]string{},
			mode: authLoopback, detail: []string{"set GDRLINK_JOB_KEY or GDRLINK_JOB_KEY_FILE on every rank"},
			human: "none: jobs listen on loopback only (", code: exitReady,
		},
		{
			// Already not ready: the verdict stays, the summary gains the key.
			name: "unusable on a broken node", env: map[string]string{jobauth.KeyFileEnv: open}, layout: "broken",
			mode: authError, source: jobauth.KeyFileEnv + "=" + open, detail: []string{"group or others may read it"},
			human: "unusable: ", code: exitNotReady,
		},
		{
			name: "insecure on a degraded node", env: map[string]string{jobauth.InsecureEnv: "1"}, layout: "two-socket",
			mode: authInsecure, human: "none, GDRLINK_INSECURE=1", code: exitDegraded,
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			layout := c.layout
			if layout == "" {
				layout = "dgx"
			}
			root := "testdata/nodes/" + layout
			dir := t.TempDir()
			js, errs, code := runEnv(t, env(c.env), "--root", root, "--json", "--nfd", dir, "--textfile", dir)
			if code != c.code {
				t.Errorf("exit %d, want %d; stderr %s", code, c.code, errs)
			}
			validate(t, schema, js)
			var r struct {
				Verdict string  `json:"verdict"`
				Exit    int     `json:"exit_code"`
				Summary string  `json:"summary"`
				JobAuth JobAuth `json:"job_auth"`
			}
			if err := json.Unmarshal([]byte(js), &r); err != nil {
				t.Fatal(err)
			}
			a := r.JobAuth
			if a.Mode != c.mode || a.Fingerprint != c.fp {
				t.Errorf("mode %q fingerprint %q, want %q %q", a.Mode, a.Fingerprint, c.mode, c.fp)
			}
			if c.jobIDSource != "" && (a.JobID != c.jobID || a.JobIDSource != c.jobIDSource) {
				t.Errorf("job id %q from %q, want %q from %q", a.JobID, a.JobIDSource, c.jobID, c.jobIDSource)
			}
			if c.mode != authKey && (a.JobID != "" || a.JobIDSource != "") {
				t.Errorf("job id %q from %q without a key", a.JobID, a.JobIDSource)
			}
			if c.source != "" && a.Source != c.source || c.mode != authError && c.source == "" && a.Source != "" {
				t.Errorf("source %q, want %q", a.Source, c.source)
			}
			for _, s := range c.detail {
				if !strings.Contains(a.Detail, s) {
					t.Errorf("detail %q lacks %q", a.Detail, s)
				}
			}
			if r.Exit != c.code {
				t.Errorf("exit_code %d, want %d", r.Exit, c.code)
			}
			if hasKey := strings.Contains(r.Summary, "job key unusable: "+a.Detail); hasKey != (c.mode == authError) {
				t.Errorf("summary %q (mode %s)", r.Summary, c.mode)
			}

			human, _, hcode := runEnv(t, env(c.env), "--root", root, "--color", "never")
			if hcode != c.code {
				t.Errorf("human: exit %d, want %d", hcode, c.code)
			}
			var line string
			for _, l := range strings.Split(human, "\n") {
				if rest, ok := strings.CutPrefix(l, "  job key: "); ok {
					if line != "" {
						t.Errorf("two job key lines")
					}
					line = rest
				}
			}
			t.Logf("job key: %s", line)
			if !strings.HasPrefix(line, c.human) {
				t.Errorf("job key line %q, want it to begin %q", line, c.human)
			}
			if c.mode == authError && !strings.HasSuffix(line, a.Detail) {
				t.Errorf("job key line %q lacks the detail %q", line, a.Detail)
			}

			nfd, err := os.ReadFile(filepath.Join(dir, nfdFile))
			if err != nil {
				t.Fatal(err)
			}
			prom, err := os.ReadFile(filepath.Join(dir, textfileFile))
			if err != nil {
				t.Fatal(err)
			}
			labels := checkFeatures(t, string(nfd))
			if got := labels["gdrlink.io/job-auth"]; got != c.mode {
				t.Errorf("label job-auth=%q, want %q", got, c.mode)
			}
			if ready := labels["gdrlink.io/gpudirect.ready"] == "true"; ready != (c.code == exitReady && layout == "dgx") {
				t.Errorf("gpudirect.ready %v with exit %d", ready, c.code)
			}
			samples := parseProm(t, string(prom))
			if v, ok := value(samples, "gdrlink_job_auth_info", "mode", c.mode); !ok || v != 1 {
				t.Errorf("gdrlink_job_auth_info{mode=%q} %v (%v)", c.mode, v, ok)
			}
			n := 0
			for _, s := range samples {
				if s.name == "gdrlink_job_auth_info" {
					n++
				}
			}
			if n != 1 {
				t.Errorf("%d gdrlink_job_auth_info samples, want 1", n)
			}

			for _, s := range []string{secret, "hunter2"} {
				for what, out := range map[string]string{"json": js, "human": human, "nfd": string(nfd), "prom": string(prom)} {
					if strings.Contains(out, s) {
						t.Errorf("the %s output holds the secret %q", what, s)
					}
				}
			}
		})
	}
}

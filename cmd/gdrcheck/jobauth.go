package main

import (
	"fmt"
	"strings"

	"github.com/gdrlink/gdrlink/internal/jobauth"
)

// Modes of JobAuth.
const (
	authKey      = "key"           // a usable job key: every connection proves it
	authLoopback = "loopback-only" // no key: jobs listen on loopback only
	authInsecure = "insecure"      // no key, GDRLINK_INSECURE=1: unauthenticated beyond loopback
	authError    = "error"         // the key, or GDRLINK_INSECURE, is unusable: Join fails
)

// JobAuth is how a gdrlink job started with gdrcheck's environment would
// authenticate its connections. It is read from the environment of the
// gdrcheck process (and the key file it names), never from --root: a
// snapshot does not hold the environment, and must not hold a key.
type JobAuth struct {
	// Mode is "key", "loopback-only", "insecure" or "error".
	Mode string `json:"mode"`
	// Source is where the key came from ("GDRLINK_JOB_KEY",
	// "GDRLINK_JOB_KEY_FILE=/etc/gdrlink/key"), or for mode error the
	// variables that were unusable; "" without a key.
	Source string `json:"source"`
	// Fingerprint names the key without revealing it (Key.Fingerprint);
	// "" without a key.
	Fingerprint string `json:"fingerprint"`
	// JobID is the job id the key is bound to (jobauth.JobIDFromEnv), and
	// JobIDSource the variable it came from; with a key and no such
	// variable, JobID is "" and JobIDSource says that the root address is
	// used. "" without a key.
	JobID       string `json:"job_id"`
	JobIDSource string `json:"job_id_source"`
	// Detail says what the mode means for the job, or what is wrong.
	Detail string `json:"detail"`
}

// rootAsJobID is JobAuth.JobIDSource where no variable names the job.
const rootAsJobID = "the bootstrap root address as each rank is given it"

// jobAuthOf reads the job key settings as gdrlink's Join does: values with
// surrounding white space removed, the key from jobauth.FromEnv, and
// GDRLINK_INSECURE "", "0" or "1" (anything else fails Join).
func jobAuthOf(getenv func(string) string) JobAuth {
	get := func(k string) string { return strings.TrimSpace(getenv(k)) }
	k, src, err := jobauth.FromEnv(get)
	if err != nil {
		return JobAuth{Mode: authError, Source: keyVars(get), Detail: err.Error() + ": every Join with this environment fails"}
	}
	insecure := get(jobauth.InsecureEnv)
	if insecure != "" && insecure != "0" && insecure != "1" {
		s := keyVars(get)
		if s != "" {
			s += ", "
		}
		return JobAuth{Mode: authError, Source: s + jobauth.InsecureEnv,
			Detail: fmt.Sprintf("%s=%q, want 0 or 1: every Join with this environment fails", jobauth.InsecureEnv, insecure)}
	}
	switch {
	case !k.IsZero():
		id, idSrc := jobauth.JobIDFromEnv(get)
		bound := fmt.Sprintf("job id %q from %s", id, idSrc)
		if idSrc == "" {
			idSrc, bound = rootAsJobID, "job id: "+rootAsJobID+" (set "+jobauth.JobIDEnv+" where ranks are given it differently)"
		}
		a := JobAuth{Mode: authKey, Source: src, Fingerprint: k.Fingerprint(), JobID: id, JobIDSource: idSrc,
			Detail: fmt.Sprintf("job key from %s (fingerprint %s): every connection proves it, bound to the %s; every rank needs the same key and job id", src, k.Fingerprint(), bound)}
		if insecure == "1" {
			a.Detail += "; " + jobauth.InsecureEnv + "=1 has no effect with a key"
		}
		return a
	case insecure == "1":
		return JobAuth{Mode: authInsecure,
			Detail: "no job key and " + jobauth.InsecureEnv + "=1: jobs listen beyond loopback and accept unauthenticated peers; any host that reaches their ports may join"}
	}
	return JobAuth{Mode: authLoopback,
		Detail: "no job key: jobs listen on loopback only; set " + jobauth.KeyEnv + " or " + jobauth.KeyFileEnv + " on every rank"}
}

// keyVars names the key variables that are set, as Source does.
func keyVars(get func(string) string) string {
	var s []string
	if get(jobauth.KeyEnv) != "" {
		s = append(s, jobauth.KeyEnv)
	}
	if f := get(jobauth.KeyFileEnv); f != "" {
		s = append(s, jobauth.KeyFileEnv+"="+f)
	}
	return strings.Join(s, ", ")
}

// setJobAuth records the job key settings in the report. An unusable key
// makes every Join fail, so it makes the node not ready, as a failed
// selftest does; no key, or GDRLINK_INSECURE=1, leaves the verdict alone.
func (r *Report) setJobAuth(a JobAuth) {
	r.JobAuth = a
	if a.Mode != authError {
		return
	}
	if r.ExitCode < exitNotReady {
		r.ExitCode, r.Verdict = exitNotReady, "not-ready"
	}
	r.Summary += "; job key unusable: " + a.Detail
}

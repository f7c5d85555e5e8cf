package gdr

import (
	"errors"
	"github.com/gdrlink/gdrlink/internal/sysfs"
	"os"
	"testing"
)

func TestParseLevel(t *testing.T) {
	for in, want := range map[string]PathType{"PIX": PathPIX, "pxb": PathPXB, " PHB ": PathPHB, "NODE": PathNODE, "SYS": PathSYS, "LOC": PathLOC,
		"0": PathLOC, "1": PathPIX, "2": PathPXB, "3": PathPHB, "4": PathSYS, "5": PathSYS} {
		if got, err := ParseLevel(in); err != nil || got != want {
			t.Errorf("%q: %s, %v; want %s", in, got, err, want)
		}
	}
	for _, bad := range []string{"", "6", "-1", "NV1", "?"} {
		if _, err := ParseLevel(bad); !errors.Is(err, errBadLevel) {
			t.Errorf("%q: %v, want ErrBadLevel", bad, err)
		}
	}
	env := map[string]string{EnvLevel: "sys"}
	p, err := policyFromLookup(func(k string) (string, bool) { v, ok := env[k]; return v, ok })
	if err != nil || p.Level != PathSYS || p.LevelSource != "env "+EnvLevel {
		t.Errorf("env policy %+v %v", p, err)
	}
	env[EnvLevel] = "bogus"
	if _, err := policyFromLookup(func(k string) (string, bool) { v, ok := env[k]; return v, ok }); !errors.Is(err, errBadLevel) {
		t.Errorf("bad env level: %v", err)
	}
	if p, _ := policyFromLookup(func(string) (string, bool) { return "", false }); p != defaultPolicy() || p.Level != PathPXB {
		t.Errorf("default policy %+v", p)
	}
}

func TestCheck(t *testing.T) {
	if c := checkOf(nil, "ok"); !c.ok() || c.err() != nil {
		t.Fatal(c)
	}
	c := checkOf(errors.Join(errors.New("x"), ErrNotSupported), "")
	if c.Status != StatusNotSupported || !errors.Is(c.err(), ErrNotSupported) {
		t.Fatal(c)
	}
	c = checkOf(os.ErrPermission, "")
	if c.Status != StatusUnknown || c.err() == nil || errors.Is(c.err(), ErrNotSupported) {
		t.Fatal(c)
	}
	var s Status
	if err := s.UnmarshalText([]byte("nope")); !errors.Is(err, sysfs.ErrMalformed) {
		t.Fatal(err)
	}
}

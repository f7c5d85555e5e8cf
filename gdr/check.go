package gdr

import (
	"errors"
	"fmt"
	"strings"

	"github.com/gdrlink/gdrlink/internal/sysfs"
)

// Status is a probe's outcome.
type Status uint8

// Probe outcomes.
const (
	// StatusUnknown: the probe could not tell (a file it needed was
	// unreadable, a library failed).
	StatusUnknown Status = iota
	// StatusAvailable: what was probed for is there.
	StatusAvailable
	// StatusNotSupported: what was probed for is missing; the detail says
	// what.
	StatusNotSupported
)

var statusNames = [...]string{"unknown", "available", "not-supported"}

// String names the status.
func (s Status) String() string {
	if int(s) < len(statusNames) {
		return statusNames[s]
	}
	return fmt.Sprintf("Status(%d)", uint8(s))
}

// MarshalText writes the name.
func (s Status) MarshalText() ([]byte, error) { return []byte(s.String()), nil }

// UnmarshalText reads a name.
func (s *Status) UnmarshalText(b []byte) error {
	for i, n := range statusNames {
		if n == string(b) {
			*s = Status(i)
			return nil
		}
	}
	return fmt.Errorf("%w: probe status %q", sysfs.ErrMalformed, b)
}

// Check is a probe's outcome with the detail behind it: what was found, what
// is missing, or why it could not tell.
type Check struct {
	Status Status `json:"status"`
	Detail string `json:"detail"`
}

// available returns a Check that found what it looked for.
func available(detail string) Check { return Check{Status: StatusAvailable, Detail: detail} }

// missing returns a Check that found something missing.
func missing(format string, args ...any) Check {
	return Check{Status: StatusNotSupported, Detail: fmt.Sprintf(format, args...)}
}

// checkOf turns a probe's error into a Check: nil is available (with
// okDetail), an error wrapping ErrNotSupported is not supported, anything
// else is unknown.
func checkOf(err error, okDetail string) Check {
	switch {
	case err == nil:
		return available(okDetail)
	case errors.Is(err, ErrNotSupported):
		return Check{Status: StatusNotSupported, Detail: strings.Replace(err.Error(), ErrNotSupported.Error()+": ", "", 1)}
	default:
		return Check{Status: StatusUnknown, Detail: err.Error()}
	}
}

// ok reports whether the check found what it looked for.
func (c Check) ok() bool { return c.Status == StatusAvailable }

// err turns the check back into a probe error: nil when available, an error
// wrapping ErrNotSupported when missing, another error when unknown.
func (c Check) err() error {
	switch c.Status {
	case StatusAvailable:
		return nil
	case StatusNotSupported:
		return fmt.Errorf("%w: %s", ErrNotSupported, c.Detail)
	}
	return fmt.Errorf("gdr: could not tell: %s", c.Detail)
}

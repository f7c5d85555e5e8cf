package verbsio

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// bootIDPath is where Linux publishes a random identifier drawn at every boot.
const bootIDPath = "proc/sys/kernel/random/boot_id"

// HostID identifies this machine for Endpoint.Host: the kernel's boot id
// (/proc/sys/kernel/random/boot_id), which differs between machines and
// between boots of one machine. Two processes with the same HostID share a
// kernel, so the same-host provider can reach one another (containers of one
// host share it too; a provider that needs more, such as a shared IPC
// namespace, checks that itself when it connects).
func HostID() (string, error) { return HostIDAt("/") }

// HostIDAt is HostID reading the procfs tree under root (tests point it at a
// fixture tree; containers may point it at "/host").
func HostIDAt(root string) (string, error) {
	p := filepath.Join(root, bootIDPath)
	b, err := os.ReadFile(p)
	if err != nil {
		return "", fmt.Errorf("%w: reading boot id: %w", ErrNotSupported, err)
	}
	id, err := ParseBootID(string(b))
	if err != nil {
		return "", fmt.Errorf("%s: %w", p, err)
	}
	return id, nil
}

// ParseBootID checks and normalizes the content of a boot_id file: a UUID
// in its 36-character text form, optionally followed by a newline.
func ParseBootID(s string) (string, error) {
	s = strings.TrimSpace(strings.ToLower(s))
	if len(s) != 36 {
		return "", fmt.Errorf("%w: boot id %q is not a UUID", ErrBadConfig, s)
	}
	for i, c := range s {
		switch i {
		case 8, 13, 18, 23:
			if c != '-' {
				return "", fmt.Errorf("%w: boot id %q is not a UUID", ErrBadConfig, s)
			}
		default:
			if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
				return "", fmt.Errorf("%w: boot id %q is not a UUID", ErrBadConfig, s)
			}
		}
	}
	return s, nil
}

// SameHost reports whether an endpoint was made on this machine: both host
// ids are known and equal. An endpoint without a host id is treated as
// remote, the safe answer.
func SameHost(localHost string, remote Endpoint) bool {
	return localHost != "" && remote.Host == localHost
}

// ChooseFor is Choose for a peer whose endpoint (or host id, from the
// bootstrap) is known: the peer shares this host when its Host equals this
// machine's HostID. When this machine's host id cannot be read, the peer
// counts as remote and Choice.Skipped says why the same-host provider was
// passed over.
func ChooseFor(peerHost string) (Choice, error) {
	local, err := HostID()
	same := err == nil && peerHost != "" && peerHost == local
	c, cerr := Choose(same)
	if err != nil && c.Skipped != nil {
		if _, ok := c.Skipped["onnode"]; ok {
			c.Skipped["onnode"] = fmt.Errorf("cannot tell whether the peer shares this host: %w", err)
		}
	}
	return c, cerr
}

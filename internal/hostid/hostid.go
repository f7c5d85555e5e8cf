// Package hostid identifies the machine a process runs on, so that peers can
// tell whether they share a host: the verbs providers put it in
// verbsio.Endpoint.Host, the protocol in its hello, and ChooseFor compares
// a peer's with this machine's to pick a provider.
package hostid

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/gdrlink/gdrlink/verbsio"
)

// bootIDPath is where Linux publishes a random identifier drawn at every boot.
const bootIDPath = "proc/sys/kernel/random/boot_id"

// Get identifies this machine for verbsio.Endpoint.Host: the kernel's boot
// id (/proc/sys/kernel/random/boot_id), which differs between machines and
// between boots of one machine. Two processes with the same host id share a
// kernel, so the same-host provider can reach one another (containers of one
// host share it too; a provider that needs more, such as a shared IPC
// namespace, checks that itself when it connects).
func Get() (string, error) { return At("/") }

// At is Get reading the procfs tree under root (tests point it at a fixture
// tree; containers may point it at "/host").
func At(root string) (string, error) {
	p := filepath.Join(root, bootIDPath)
	b, err := os.ReadFile(p)
	if err != nil {
		return "", fmt.Errorf("%w: reading boot id: %w", verbsio.ErrNotSupported, err)
	}
	id, err := Parse(string(b))
	if err != nil {
		return "", fmt.Errorf("%s: %w", p, err)
	}
	return id, nil
}

// Parse checks and normalizes the content of a boot_id file: a UUID in its
// 36-character text form, optionally followed by a newline.
func Parse(s string) (string, error) {
	s = strings.TrimSpace(strings.ToLower(s))
	if len(s) != 36 {
		return "", fmt.Errorf("%w: boot id %q is not a UUID", verbsio.ErrBadConfig, s)
	}
	for i, c := range s {
		switch i {
		case 8, 13, 18, 23:
			if c != '-' {
				return "", fmt.Errorf("%w: boot id %q is not a UUID", verbsio.ErrBadConfig, s)
			}
		default:
			if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
				return "", fmt.Errorf("%w: boot id %q is not a UUID", verbsio.ErrBadConfig, s)
			}
		}
	}
	return s, nil
}

// Same reports whether an endpoint was made on this machine: both host ids
// are known and equal. An endpoint without a host id is treated as remote,
// the safe answer.
func Same(localHost string, remote verbsio.Endpoint) bool {
	return localHost != "" && remote.Host == localHost
}

// ChooseFor is verbsio.Choose for a peer whose endpoint (or host id, from
// the bootstrap) is known: the peer shares this host when its Host equals
// this machine's host id. When this machine's host id cannot be read, the
// peer counts as remote and Choice.Skipped says why the same-host provider
// was passed over.
func ChooseFor(peerHost string) (verbsio.Choice, error) {
	local, err := Get()
	same := err == nil && peerHost != "" && peerHost == local
	c, cerr := verbsio.Choose(same)
	if err != nil && c.Skipped != nil {
		if _, ok := c.Skipped["onnode"]; ok {
			c.Skipped["onnode"] = fmt.Errorf("cannot tell whether the peer shares this host: %w", err)
		}
	}
	return c, cerr
}

// Package hostcard describes where a process runs, for the front door to
// choose a provider per peer: the kernel it runs on (boot id), the network
// and PID namespaces it sits in, the process, and the providers it can
// use. Ranks trade
// cards through the bootstrap; Candidates turns two cards into the
// providers to try, best first.
package hostcard

import (
	"encoding/binary"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/gdrlink/gdrlink/internal/hostid"
	"github.com/gdrlink/gdrlink/verbsio"
)

// Card is what one rank tells the others about where it runs.
type Card struct {
	// Host is the kernel's boot id: equal on two processes of one machine
	// (and one boot), different otherwise; "" when unknown.
	Host string
	// NetNS and PIDNS identify the network and PID namespaces
	// ("net:[4026531840]"); "" when unknown. Abstract Unix sockets are per
	// network namespace, and process ids per PID namespace, so two
	// processes of one kernel in different namespaces (two pods of one
	// node) cannot use the on-node provider.
	NetNS, PIDNS string
	// Providers are the providers usable here, best first.
	Providers []string
	// Process is the process id within PIDNS ("4242"); "" when unknown (a
	// card of a release before it). Two ranks of one process (goroutines
	// of a test, say) share its CPUs rather than compete for them.
	Process string
}

// Local reads this process's card under the procfs root ("/" normally),
// listing the given usable providers.
func Local(root string, providers []string) Card {
	c := Card{Providers: slices.Clone(providers)}
	if id, err := hostid.At(root); err == nil {
		c.Host = id
	}
	c.NetNS = readNS(root, "net")
	c.PIDNS = readNS(root, "pid")
	if pid, err := os.Readlink(filepath.Join(root, "proc/self")); err == nil {
		// /proc/self names this process as the procfs's PID namespace
		// numbers it.
		c.Process = pid
	}
	return c
}

func readNS(root, kind string) string {
	s, err := os.Readlink(filepath.Join(root, "proc/self/ns", kind))
	if err != nil {
		return ""
	}
	return s
}

// SameNode reports whether two cards are of processes that can use the
// on-node provider with each other: one kernel, one network namespace,
// one PID namespace, each known.
func SameNode(a, b Card) bool {
	return a.Host != "" && a.Host == b.Host &&
		a.NetNS != "" && a.NetNS == b.NetNS &&
		a.PIDNS != "" && a.PIDNS == b.PIDNS
}

// SameProcess reports whether two cards are of one process: one host and
// PID namespace, one process id, each known.
func SameProcess(a, b Card) bool {
	return a.Host != "" && a.Host == b.Host &&
		a.PIDNS != "" && a.PIDNS == b.PIDNS &&
		a.Process != "" && a.Process == b.Process
}

// Candidates returns the providers to try between two ranks, best first,
// and the same list on both sides (it is symmetric): onnode when SameNode,
// then ibverbs, then tcp, each only when both cards list it. forced, when
// not "", names the candidates instead, in order ("ibverbs" or
// "ibverbs,tcp"): those both sides can use. The reason says why the list is
// empty, or why onnode (or a forced provider) was left out.
func Candidates(me, peer Card, forced string) ([]string, string) {
	has := func(c Card, p string) bool { return slices.Contains(c.Providers, p) }
	if forced != "" {
		var out, whys []string
		for _, p := range strings.Split(forced, ",") {
			switch {
			case slices.Contains(out, p):
			case !has(me, p):
				whys = append(whys, fmt.Sprintf("provider %s is not usable here", p))
			case !has(peer, p):
				whys = append(whys, fmt.Sprintf("provider %s is not usable at the peer", p))
			case p == "onnode" && !SameNode(me, peer):
				whys = append(whys, "provider onnode needs the peer on this node: "+whyNotSameNode(me, peer))
			default:
				out = append(out, p)
			}
		}
		return out, strings.Join(whys, "; ")
	}
	var out []string
	why := ""
	for _, p := range []string{"onnode", "ibverbs", "tcp"} {
		if !has(me, p) || !has(peer, p) {
			continue
		}
		if p == "onnode" && !SameNode(me, peer) {
			why = "onnode: " + whyNotSameNode(me, peer)
			continue
		}
		out = append(out, p)
	}
	if len(out) == 0 {
		why = fmt.Sprintf("no provider in common (here: %s; peer: %s)", strings.Join(me.Providers, ","), strings.Join(peer.Providers, ","))
	}
	return out, why
}

func whyNotSameNode(a, b Card) string {
	switch {
	case a.Host == "" || b.Host == "":
		return "cannot tell whether the peer shares this host (no boot id)"
	case a.Host != b.Host:
		return "the peer is on another host"
	case a.NetNS == "" || b.NetNS == "" || a.NetNS != b.NetNS:
		return "the peer is in another network namespace"
	}
	return "the peer is in another PID namespace"
}

// cardVersion is the first byte of an encoded card.
const cardVersion = 1

// maxField bounds each string of an encoded card, and maxProviders the
// number of providers.
const (
	maxField     = 256
	maxProviders = 16
)

// Append appends the encoded card to b.
func (c Card) Append(b []byte) []byte {
	b = append(b, cardVersion)
	for _, s := range []string{c.Host, c.NetNS, c.PIDNS} {
		b = appendString(b, s)
	}
	b = append(b, byte(len(c.Providers)))
	for _, p := range c.Providers {
		b = appendString(b, p)
	}
	if c.Process != "" {
		b = appendString(b, c.Process)
	}
	return b
}

func appendString(b []byte, s string) []byte {
	b = binary.BigEndian.AppendUint16(b, uint16(len(s)))
	return append(b, s...)
}

// Decode parses an encoded card; hostile or truncated input is an error
// wrapping verbsio.ErrBadFrame.
func Decode(b []byte) (Card, error) {
	if len(b) < 1 || b[0] != cardVersion {
		return Card{}, fmt.Errorf("%w: host card: no version %d header", verbsio.ErrBadFrame, cardVersion)
	}
	b = b[1:]
	var c Card
	var err error
	for _, f := range []*string{&c.Host, &c.NetNS, &c.PIDNS} {
		if *f, b, err = readString(b); err != nil {
			return Card{}, err
		}
	}
	if len(b) < 1 || int(b[0]) > maxProviders {
		return Card{}, fmt.Errorf("%w: host card: bad provider count", verbsio.ErrBadFrame)
	}
	n := int(b[0])
	b = b[1:]
	for range n {
		var p string
		if p, b, err = readString(b); err != nil {
			return Card{}, err
		}
		c.Providers = append(c.Providers, p)
	}
	if len(b) != 0 {
		// The process id, which a card of an earlier release lacks.
		if c.Process, b, err = readString(b); err != nil {
			return Card{}, err
		}
	}
	if len(b) != 0 {
		return Card{}, fmt.Errorf("%w: host card: %d trailing bytes", verbsio.ErrBadFrame, len(b))
	}
	return c, nil
}

func readString(b []byte) (string, []byte, error) {
	if len(b) < 2 {
		return "", nil, fmt.Errorf("%w: host card: truncated", verbsio.ErrBadFrame)
	}
	n := int(binary.BigEndian.Uint16(b))
	if n > maxField || len(b) < 2+n {
		return "", nil, fmt.Errorf("%w: host card: string of %d bytes with %d left", verbsio.ErrBadFrame, n, len(b)-2)
	}
	return string(b[2 : 2+n]), b[2+n:], nil
}

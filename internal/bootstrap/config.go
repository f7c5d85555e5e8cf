// Package bootstrap lets the processes of a job find each other and trade
// the small messages that set up a verbs mesh (queue pair endpoints, region
// addresses and keys) over plain TCP.
//
// Rank 0 listens at the root address; the other ranks dial it (retrying
// until their context ends) and announce the address where they accept
// pairwise connections; the root sends everyone the list. After Join,
// AllGather and Barrier go through the root, and Exchange goes straight to
// the peer. Every message is length-prefixed with a maximum size, and every
// wait honours its context: a rank that never shows up is reported by
// number and address, in an error wrapping verbsio.ErrTimeout.
//
// A job is the set of processes that hold its key (Config.Key). With a key,
// every connection (a rank's hello to the root, a pairwise connection, a
// Call) opens with jobauth's mutual challenge-response, purpose
// "bootstrap", before any bootstrap message: the side that dialled claims
// its rank, and the hello or Call that follows must claim the same rank or
// is refused. The side that accepts gives a stranger 10 seconds to prove
// the key, then closes the connection without reading anything else; a
// refused connection takes no rank's place, so the job's own ranks still
// join. A listener keeps at most 2*Size+64 accepted connections waiting,
// and Size+16 unproven from one address (IP); past an address's share its
// own oldest is closed, and on a full listener the address holding the
// most loses its oldest, so one address's flood never closes another's.
// Every connection turned away is logged (Config.Logger). A rank whose key differs is refused at once: its Join fails with
// an error wrapping jobauth.ErrRefused (and ErrRefused), it does not wait
// for its context to end. Without a key nothing is authenticated, and Join
// refuses to listen beyond loopback (an error wrapping jobauth.ErrInsecure
// that names the address) unless Config.Insecure says otherwise.
//
// The job launcher is somebody else's: FromEnv reads what Slurm, Open MPI
// and torchrun already set.
package bootstrap

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/gdrlink/gdrlink/internal/jobauth"
	"github.com/gdrlink/gdrlink/verbsio"
)

// Config says who this process is in the job and where the root listens.
type Config struct {
	// Rank is this process's number, 0..Size-1; rank 0 is the root.
	Rank int
	// Size is the number of processes.
	Size int
	// Root is the root's "host:port". Rank 0 listens there (port 0 picks
	// one; see Group.RootAddr), unless Listener is set.
	Root string
	// RejoinData is what this process hands every peer if it joins in
	// place of a dead process of its rank (see Group.Rejoined); each
	// peer's OnRejoin answers with its own, which PeerData returns.
	RejoinData []byte
	// OnRejoin, when set, is told of a rank that rejoined (see
	// RejoinHandler).
	OnRejoin RejoinHandler
	// Peers, when set, lists every rank's contact address ("host:port"),
	// where that rank accepts pairwise connections; Peers[0] is the root
	// when Root is empty. When nil, each rank listens on an ephemeral port
	// of the address it reaches the root from.
	Peers []string
	// Listener, when set on rank 0, is used instead of listening at Root,
	// so a caller can learn the port before the other ranks start.
	Listener net.Listener
	// MaxMessage bounds every message received, in bytes (0: 16 MiB).
	MaxMessage int
	// OnCall, when set, answers the Calls of other ranks (see Group.Call).
	// It is part of the Config so that no Call can arrive before it is in
	// place: another rank may Call as soon as its own Join returns.
	OnCall Handler
	// Key is the job's key (see package jobauth), the same on every rank.
	// When set, every connection of the group starts with jobauth's
	// challenge-response (purpose "bootstrap"), bound to the rank of the
	// side that dialled; a connection that does not prove the key is closed
	// before anything of the job is read from it or written to it. The zero
	// Key authenticates nothing, and Join then listens on loopback only
	// unless Insecure is set.
	Key jobauth.Key
	// Insecure lets a group without a Key listen beyond loopback, where
	// any process that reaches the address can join the job in a rank's
	// place (GDRLINK_INSECURE=1 in jobauth's words). It has no effect with
	// a Key.
	Insecure bool
	// Logger receives the connections the group's listener turns away
	// (a stranger without the key, a rank claimed twice, a flood evicted),
	// at Warn, at most a line a second with how many went unlogged. nil
	// logs to slog.Default().
	Logger *slog.Logger

	// dial, when set (by tests), opens the group's connections.
	dial func(ctx context.Context, addr string) (net.Conn, error)
}

// Handler answers a Call from rank from: what it returns goes back as the
// reply, an error as a refusal that the caller's error quotes. ctx ends
// when the group closes or after CallTimeout. Handlers run concurrently,
// one goroutine per Call, and must not block on a Call back to from.
type Handler func(ctx context.Context, from int, req []byte) ([]byte, error)

// CallTimeout bounds how long a Handler may take to answer.
const CallTimeout = 30 * time.Second

// DefaultMaxMessage is the default of Config.MaxMessage.
const DefaultMaxMessage = 16 << 20

// Validate checks the configuration; errors wrap verbsio.ErrBadConfig.
func (c Config) Validate() error {
	switch {
	case c.Size < 1:
		return fmt.Errorf("%w: bootstrap size %d, want at least 1", verbsio.ErrBadConfig, c.Size)
	case c.Rank < 0 || c.Rank >= c.Size:
		return fmt.Errorf("%w: bootstrap rank %d, want 0..%d", verbsio.ErrBadConfig, c.Rank, c.Size-1)
	case c.Peers != nil && len(c.Peers) != c.Size:
		return fmt.Errorf("%w: %d peer addresses for %d ranks", verbsio.ErrBadConfig, len(c.Peers), c.Size)
	case c.MaxMessage < 0:
		return fmt.Errorf("%w: maximum message size %d", verbsio.ErrBadConfig, c.MaxMessage)
	}
	if c.Size > 1 && c.root() == "" && (c.Rank != 0 || c.Listener == nil) {
		return fmt.Errorf("%w: no root address (set Root, Peers, GDRLINK_ROOT or MASTER_ADDR and MASTER_PORT)", verbsio.ErrBadConfig)
	}
	if r := c.root(); r != "" {
		if _, _, err := net.SplitHostPort(r); err != nil {
			return fmt.Errorf("%w: root address %q: %w", verbsio.ErrBadConfig, r, err)
		}
	}
	return nil
}

func (c Config) root() string {
	if c.Root != "" {
		return c.Root
	}
	if len(c.Peers) > 0 {
		return c.Peers[0]
	}
	return ""
}

// FromEnv builds a Config from the environment. The rank and size come from
// the first of these that is set and not empty, most specific first:
//
//  1. GDRLINK_RANK and GDRLINK_SIZE (set by hand, overriding any launcher);
//  2. torchrun: RANK and WORLD_SIZE;
//  3. Open MPI (mpirun): OMPI_COMM_WORLD_RANK and OMPI_COMM_WORLD_SIZE;
//  4. Slurm (srun): SLURM_PROCID and SLURM_NTASKS.
//
// torchrun comes before the launchers it may run under (a torchrun job in a
// Slurm allocation also has SLURM_PROCID, for the wrong process count), and
// Open MPI before Slurm for the same reason.
//
// The root address is GDRLINK_ROOT ("host:port"), else MASTER_ADDR and
// MASTER_PORT (as torchrun sets them). GDRLINK_PEERS, a comma-separated
// list of every rank's contact address, is optional. A malformed or
// inconsistent value is an error wrapping verbsio.ErrBadConfig that names
// the variable.
func FromEnv() (Config, error) { return fromLookup(os.LookupEnv) }

func fromLookup(lookup func(string) (string, bool)) (Config, error) {
	var c Config
	sources := [][2]string{
		{"GDRLINK_RANK", "GDRLINK_SIZE"},
		{"RANK", "WORLD_SIZE"},
		{"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"},
		{"SLURM_PROCID", "SLURM_NTASKS"},
	}
	found := false
	for _, s := range sources {
		// A variable that is set but empty counts as unset, so that a
		// launcher's leftover RANK= falls through to the next launcher.
		rv, rok := lookup(s[0])
		rok = rok && strings.TrimSpace(rv) != ""
		sv, sok := lookup(s[1])
		sok = sok && strings.TrimSpace(sv) != ""
		if !rok && !sok {
			continue
		}
		if !rok || !sok {
			missing := s[0]
			if rok {
				missing = s[1]
			}
			return c, fmt.Errorf("%w: %s is not set (it goes with %s)", verbsio.ErrBadConfig, missing, map[bool]string{true: s[0], false: s[1]}[rok])
		}
		var err error
		if c.Rank, err = envInt(s[0], rv); err != nil {
			return c, err
		}
		if c.Size, err = envInt(s[1], sv); err != nil {
			return c, err
		}
		if c.Size < 1 {
			return c, fmt.Errorf("%w: %s=%q, want at least 1", verbsio.ErrBadConfig, s[1], sv)
		}
		if c.Rank >= c.Size {
			return c, fmt.Errorf("%w: %s=%d is not below %s=%d", verbsio.ErrBadConfig, s[0], c.Rank, s[1], c.Size)
		}
		found = true
		break
	}
	if !found {
		return c, fmt.Errorf("%w: no rank in the environment (GDRLINK_RANK, RANK, OMPI_COMM_WORLD_RANK or SLURM_PROCID)", verbsio.ErrBadConfig)
	}
	if v, ok := lookup("GDRLINK_ROOT"); ok && v != "" {
		if _, _, err := net.SplitHostPort(v); err != nil {
			return c, fmt.Errorf("%w: GDRLINK_ROOT=%q is not host:port: %w", verbsio.ErrBadConfig, v, err)
		}
		c.Root = v
	} else if a, ok := lookup("MASTER_ADDR"); ok && a != "" {
		p, ok := lookup("MASTER_PORT")
		if !ok || p == "" {
			return c, fmt.Errorf("%w: MASTER_ADDR is set but MASTER_PORT is not", verbsio.ErrBadConfig)
		}
		if _, err := envInt("MASTER_PORT", p); err != nil {
			return c, err
		}
		c.Root = net.JoinHostPort(a, p)
	}
	if v, ok := lookup("GDRLINK_PEERS"); ok && v != "" {
		c.Peers = strings.Split(v, ",")
		if len(c.Peers) != c.Size {
			return c, fmt.Errorf("%w: GDRLINK_PEERS has %d addresses for %d ranks", verbsio.ErrBadConfig, len(c.Peers), c.Size)
		}
		for _, p := range c.Peers {
			if _, _, err := net.SplitHostPort(p); err != nil {
				return c, fmt.Errorf("%w: GDRLINK_PEERS entry %q: %w", verbsio.ErrBadConfig, p, err)
			}
		}
	}
	if c.Size > 1 && c.root() == "" {
		return c, fmt.Errorf("%w: %w: set GDRLINK_ROOT=host:port (or MASTER_ADDR and MASTER_PORT)", verbsio.ErrBadConfig, ErrNoRoot)
	}
	return c, nil
}

// ErrNoRoot means a job of several ranks with no root address: FromEnv
// returns the rest of the configuration with it, for a caller that has the
// root from elsewhere.
var ErrNoRoot = errors.New("no root address")

func envInt(name, v string) (int, error) {
	n, err := strconv.Atoi(strings.TrimSpace(v))
	if err != nil || n < 0 {
		return 0, fmt.Errorf("%w: %s=%q is not a non-negative integer", verbsio.ErrBadConfig, name, v)
	}
	return n, nil
}

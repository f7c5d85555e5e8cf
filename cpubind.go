package gdrlink

import (
	"errors"
	"fmt"
	"os"
	"runtime"

	"github.com/gdrlink/gdrlink/internal/cpubind"
)

// bindCPUs binds every thread of this process to its share of the CPUs it
// may run on, among the ranks of the job on this host (the host cards
// tell which), in rank order (WithCPUBinding). Too few CPUs, or a rank
// whose card is missing (a rejoin some peer did not answer), leave it
// unbound, and Stats.Unbound says why; an error is one binding could not
// be made.
func (g *Group) bindCPUs() error {
	index, count := 0, 0
	for r, c := range g.cards {
		if c.Host == "" {
			g.unbound = fmt.Sprintf("rank %d's host is not known", r)
			g.log.Warn("gdrlink: CPU binding skipped", "rank", g.Rank(), "why", g.unbound)
			return nil
		}
		if c.Host != g.me.Host {
			continue
		}
		if r == g.Rank() {
			index = count
		}
		count++
	}
	allowed, err := cpubind.Allowed()
	if err != nil {
		return err
	}
	cpus, err := cpubind.Share(allowed, index, count)
	if errors.Is(err, cpubind.ErrTooFew) {
		g.unbound = err.Error()
		g.log.Info("gdrlink: CPU binding skipped", "rank", g.Rank(), "why", g.unbound)
		return nil
	}
	if err != nil {
		return err
	}
	threads, err := cpubind.Bind(cpus)
	if err != nil {
		return err
	}
	g.cpus = cpus
	if os.Getenv("GOMAXPROCS") == "" {
		runtime.GOMAXPROCS(len(cpus))
	}
	g.log.Info("gdrlink: bound to CPUs", "rank", g.Rank(), "cpus", cpus, "of", allowed, "local_rank", index, "local_ranks", count, "threads", threads)
	return nil
}

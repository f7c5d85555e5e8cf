package gdrlink

import (
	"errors"
	"fmt"
	"os"
	"runtime"

	"github.com/gdrlink/gdrlink/internal/cpubind"
	"github.com/gdrlink/gdrlink/internal/hostcard"
)

// bindCPUs binds every thread of this process to its share of the CPUs it
// may run on, among the ranks of the job on this host (the host cards
// tell which), in rank order (WithCPUBinding). Too few CPUs, or a rank
// whose card is missing (a rejoin some peer did not answer), leave it
// unbound, and Stats.Unbound says why; an error is one binding could not
// be made.
func (g *Group) bindCPUs() error {
	index, count, why := g.localRanks()
	if why != "" {
		g.unbound = why
		g.log.Warn("gdrlink: CPU binding skipped", "rank", g.Rank(), "why", g.unbound)
		return nil
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

// localRanks says which of the job's ranks on this host this one is
// (index, in rank order) and how many there are (count), from the host
// cards; why says why that is not known (a rank whose card is missing: a
// rejoin some peer did not answer).
func (g *Group) localRanks() (index, count int, why string) {
	for r, c := range g.cards {
		if c.Host == "" {
			return 0, 0, fmt.Sprintf("rank %d's host is not known", r)
		}
		if c.Host != g.me.Host {
			continue
		}
		if r == g.Rank() {
			index = count
		}
		count++
	}
	return index, count, ""
}

// shareProcs lowers GOMAXPROCS to this process's share of the CPUs it may
// run on, where this host runs more ranks of the job than those CPUs (the
// case in which GDRLINK_YIELD=auto makes polls yield) and this process
// reaches the others over onnode: the CPUs times this process's ranks
// over the host's, at least 1. There a second Go processor only lets the
// runtime's idle threads spin and hand work between threads, on CPUs that
// other ranks wait for: 8 ranks of a 1 MiB AllReduce on 2 CPUs ran 12-40%
// faster with one (README, Collectives). Where the GOMAXPROCS variable is
// set, or this rank is bound to CPUs (the binding set it), it is left as
// it is; Close puts back what it was if nothing else changed it since.
func (g *Group) shareProcs() error {
	if g.cpus != nil || os.Getenv("GOMAXPROCS") != "" {
		return nil
	}
	_, count, why := g.localRanks()
	if why != "" || count == 0 {
		return nil
	}
	allowed, err := cpubind.Allowed()
	if err != nil {
		return err
	}
	if count <= len(allowed) {
		return nil
	}
	mine := 0
	for _, c := range g.cards {
		if hostcard.SameProcess(c, g.me) {
			mine++
			continue
		}
		if c.Host != g.me.Host {
			continue
		}
		if cands, _ := hostcard.Candidates(g.me, c, g.cfg.provider); len(cands) == 0 || cands[0] != "onnode" {
			// A peer of this host over tcp (another network namespace,
			// or the provider forced): the kernel's socket copies run
			// in this process's system calls, which a second processor
			// overlaps (4 ranks of a 1 MiB AllReduce over tcp on 2 CPUs
			// took 1.6 times as long with one).
			return nil
		}
	}
	share := max(1, len(allowed)*max(mine, 1)/count)
	prev := runtime.GOMAXPROCS(0)
	if share >= prev {
		return nil
	}
	runtime.GOMAXPROCS(share)
	g.procs, g.procsBefore = share, prev
	g.log.Info("gdrlink: GOMAXPROCS set to this process's share of the CPUs", "rank", g.Rank(), "gomaxprocs", share, "was", prev, "local_ranks", count, "in_this_process", mine, "cpus", len(allowed))
	return nil
}

// restoreProcs puts GOMAXPROCS back as it was before shareProcs lowered
// it, unless something else has changed it since.
func (g *Group) restoreProcs() {
	if g.procs > 0 && runtime.GOMAXPROCS(0) == g.procs {
		runtime.GOMAXPROCS(g.procsBefore)
	}
}

// yieldCPUs says whether this process's completion queues yield their CPU
// between polls (verbsio.Config.Yield): as GDRLINK_YIELD says, and by
// default (auto) where this host runs more ranks of the job than this
// process may use CPUs, where a poller would hold the CPU that the rank it
// waits for needs. asked is what the caller's verbs configuration says,
// which auto keeps when it is set.
func (g *Group) yieldCPUs(asked bool) (bool, string, error) {
	switch g.cfg.yield {
	case "on":
		return true, "GDRLINK_YIELD=on", nil
	case "off":
		return false, "", nil
	}
	if asked {
		return true, "the verbs configuration asks it", nil
	}
	_, count, why := g.localRanks()
	if why != "" || g.cpus != nil {
		// Unknown, or bound to CPUs of its own (Allowed is now the
		// share), which takes a CPU per rank.
		return false, "", nil
	}
	allowed, err := cpubind.Allowed()
	if err != nil {
		return false, "", err
	}
	if count > len(allowed) {
		return true, fmt.Sprintf("%d ranks on this host, %d CPUs", count, len(allowed)), nil
	}
	return false, "", nil
}

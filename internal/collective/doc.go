// Package collective runs gdrlink's collectives: AllReduce (sum,
// average), Broadcast and AllGather over every rank of a job, in place on
// tensors of a registered pool.
//
// A Backend runs them for one rank; the front door holds one per group.
// The built-in one is Ring, which needs of the job only a Transport: its
// rank, its size and zero-copy links to its neighbours (the front door's
// connections, rendezvous channels under them). Another backend (an
// in-network aggregator, say) implements Backend over what it needs.
// Every rank calls the same collectives in the same order with the same
// sequence number; a failure anywhere fails every rank's call with a
// collective.RankError naming the rank at fault. Results and errors are
// the public package collective's.
package collective

package collective_test

import (
	"errors"
	"fmt"

	"github.com/gdrlink/gdrlink/collective"
	"github.com/gdrlink/gdrlink/verbsio"
)

// A collective that lost a rank fails on every other rank with a
// RankError naming it (here made by hand, as AllReduce would return it,
// wrapped).
func ExampleRankError() {
	err := fmt.Errorf("gdrlink: rank 0: %w", &collective.RankError{Op: "allreduce", Rank: 2, Err: fmt.Errorf("rank 2 lost: %w", verbsio.ErrPeerLost)})
	var re *collective.RankError
	if errors.As(err, &re) {
		fmt.Println(re.Op, "failed at rank", re.Rank, errors.Is(err, verbsio.ErrPeerLost))
	}
	// Output: allreduce failed at rank 2 true
}

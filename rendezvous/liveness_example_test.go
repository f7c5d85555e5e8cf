package rendezvous_test

import (
	"errors"
	"fmt"
	"time"

	"github.com/gdrlink/gdrlink/rendezvous"
	"github.com/gdrlink/gdrlink/verbsio"
)

// A channel made with WithPeerTimeout fails, once its peer has been silent
// that long with work pending, with an error that matches ErrPeerTimeout
// and, as every lost peer, verbsio.ErrPeerLost.
func ExampleWithPeerTimeout() {
	opt := rendezvous.WithPeerTimeout(5 * time.Second)
	_ = opt // passed to rendezvous.New with the device, domain and memory

	err := fmt.Errorf("%w: rank 1 (tcp on tcp0) sent nothing for 5.2s with work pending (peer timeout 5s)", rendezvous.ErrPeerTimeout)
	fmt.Println(errors.Is(err, rendezvous.ErrPeerTimeout), errors.Is(err, verbsio.ErrPeerLost))
	// Output: true true
}

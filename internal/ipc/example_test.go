package ipc_test

import (
	"fmt"

	"github.com/gdrlink/gdrlink/internal/ipc"
)

type device struct{ up bool }

func (d device) Ready() bool                     { return d.up }
func (d device) CanReach(peerDevice string) bool { return peerDevice == "0000:3b:00.0" }

// Two ranks set the path up lazily: rank 0's first transfer asks, rank 1
// (whose GPU is up and can reach rank 0's) answers, and both end in OK.
func ExampleSetup() {
	a := ipc.NewSetup(0, 1, "0000:3b:00.0", device{up: true})
	b := ipc.NewSetup(1, 0, "0000:5e:00.0", device{up: true})
	toB := a.Start()
	for len(toB) > 0 {
		var toA []ipc.Msg
		for _, m := range toB {
			out, err := b.Receive(m)
			if err != nil {
				panic(err)
			}
			toA = append(toA, out...)
		}
		toB = nil
		for _, m := range toA {
			out, err := a.Receive(m)
			if err != nil {
				panic(err)
			}
			toB = append(toB, out...)
		}
	}
	fmt.Println(a.State(), b.State())
	// Output: OK OK
}

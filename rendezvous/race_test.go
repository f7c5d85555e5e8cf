//go:build race

package rendezvous

// raceEnabled: the race detector slows the channel down some tenfold, so
// the stress tests run fewer rounds.
const raceEnabled = true

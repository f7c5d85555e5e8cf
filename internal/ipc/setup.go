package ipc

import "fmt"

// State is where a pair of ranks stands in setting up the IPC path.
type State uint8

// States of Setup, as in smcuda.
const (
	// Init: nothing asked yet (or the peer was not ready; the next transfer
	// asks again).
	Init State = iota
	// Sent: this side asked the peer and waits for its answer.
	Sent
	// Acking: this side is answering a request (checking its device).
	Acking
	// Acked: this side answered yes and waits for the starter's confirmation.
	Acked
	// OK: the IPC path is usable between the pair.
	OK
	// Bad: the IPC path is not usable; transfers stage through host memory.
	Bad
)

// MaxTries is how many "not ready" answers a starter takes before giving up.
const MaxTries = 5

func (s State) String() string {
	switch s {
	case Init:
		return "INIT"
	case Sent:
		return "SENT"
	case Acking:
		return "ACKING"
	case Acked:
		return "ACKED"
	case OK:
		return "OK"
	case Bad:
		return "BAD"
	}
	return fmt.Sprintf("State(%d)", uint8(s))
}

// Local answers the questions the answering side asks itself.
type Local interface {
	// Ready reports whether this side's device is up.
	Ready() bool
	// CanReach reports whether this side's device and the peer's device
	// (as the peer named it) can reach each other's memory (the same device,
	// or peer access).
	CanReach(peerDevice string) bool
}

// Setup is the state machine of one pair of ranks, seen from one side. It
// does no I/O: Start and Receive return the messages to send to the peer.
// It is not safe for concurrent use; its owner serialises calls.
type Setup struct {
	self, peer uint32
	device     string
	local      Local
	state      State
	tries      int
}

// NewSetup returns the machine of rank self towards rank peer, in INIT.
// device names this side's device for the peer's reachability check.
func NewSetup(self, peer uint32, device string, local Local) *Setup {
	return &Setup{self: self, peer: peer, device: device, local: local}
}

// State is the current state.
func (s *Setup) State() State { return s.state }

// Tries is how many requests this side has sent that were answered "not
// ready" or are outstanding.
func (s *Setup) Tries() int { return s.tries }

// Start is called on each transfer to or from the peer. In INIT it sends a
// request and moves to SENT; in any other state it sends nothing.
func (s *Setup) Start() []Msg {
	if s.state != Init {
		return nil
	}
	s.tries++
	s.state = Sent
	return []Msg{{Kind: KindRequest, From: s.self, Try: uint8(s.tries), Device: s.device}}
}

// Unanswered says this side's request got no answer (the peer could not
// be reached, or answered with an error rather than a message): in SENT it
// counts as a "not ready", back to INIT, or BAD after MaxTries; in any
// other state it changes nothing.
func (s *Setup) Unanswered() {
	if s.state != Sent {
		return
	}
	if s.tries >= MaxTries {
		s.state = Bad
	} else {
		s.state = Init
	}
}

// Fail moves the pair to BAD: the path was set up, but using it failed
// (an arena that would not open, a copy that failed), and transfers go
// through host memory from now on.
func (s *Setup) Fail() { s.state = Bad }

// Receive applies a message from the peer and returns the answers to send.
// A message that makes no sense in the current state is an error wrapping
// ErrProtocol and changes nothing.
func (s *Setup) Receive(m Msg) ([]Msg, error) {
	if m.From != s.peer {
		return nil, fmt.Errorf("%w: message from rank %d on the pair %d-%d", ErrProtocol, m.From, s.self, s.peer)
	}
	switch m.Kind {
	case KindRequest:
		return s.request(m), nil
	case KindNotReady:
		if s.state != Sent {
			return nil, s.unexpected(m)
		}
		if s.tries >= MaxTries {
			s.state = Bad
		} else {
			s.state = Init
		}
		return nil, nil
	case KindAck:
		if s.state != Sent {
			return nil, s.unexpected(m)
		}
		s.state = Bad
		if m.Reach {
			s.state = OK
		}
		return []Msg{{Kind: KindConfirm, From: s.self, Reach: m.Reach}}, nil
	case KindConfirm:
		if (s.state == OK && m.Reach) || (s.state == Bad && !m.Reach) {
			return nil, nil // the confirmation of an answer a decided side gave
		}
		if s.state != Acked {
			return nil, s.unexpected(m)
		}
		s.state = Bad
		if m.Reach {
			s.state = OK
		}
		return nil, nil
	}
	return nil, fmt.Errorf("%w: message kind %d", ErrProtocol, m.Kind)
}

// request answers the peer's request. When both sides started at once, the
// lower rank stays the starter: the higher rank answers and the lower rank
// ignores the higher rank's request (its own request gets the answer).
func (s *Setup) request(m Msg) []Msg {
	switch s.state {
	case OK, Bad:
		// Already decided (the peer restarted or lost an answer): tell it.
		return []Msg{{Kind: KindAck, From: s.self, Reach: s.state == OK}}
	case Acking, Acked:
		return nil // a duplicate: the answer is on its way
	case Sent:
		if s.self < s.peer {
			return nil
		}
		// The starter's role goes to the lower rank: this request no
		// longer counts as a try.
		s.tries--
	}
	s.state = Acking
	if !s.local.Ready() {
		s.state = Init
		return []Msg{{Kind: KindNotReady, From: s.self}}
	}
	reach := s.local.CanReach(m.Device)
	s.state = Acked
	return []Msg{{Kind: KindAck, From: s.self, Reach: reach, Device: s.device}}
}

func (s *Setup) unexpected(m Msg) error {
	return fmt.Errorf("%w: %s in state %s", ErrProtocol, m.Kind, s.state)
}

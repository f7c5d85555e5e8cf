package ipc

import (
	"errors"
	"testing"
)

type local struct{ ready, reach bool }

func (l *local) Ready() bool              { return l.ready }
func (l *local) CanReach(dev string) bool { return l.reach && dev != "" }

// TestSetupTransitions drives one side through every transition from every
// state and checks the state reached and the message kinds sent.
func TestSetupTransitions(t *testing.T) {
	const self, peer = 1, 2
	req := Msg{Kind: KindRequest, From: peer, Try: 1, Device: "gpu0"}
	cases := []struct {
		name  string
		from  State
		tries int
		local local
		in    *Msg // nil: Start
		want  State
		out   []Kind
		err   bool
	}{
		{name: "start", from: Init, want: Sent, out: []Kind{KindRequest}},
		{name: "start in SENT", from: Sent, want: Sent},
		{name: "start in ACKING", from: Acking, want: Acking},
		{name: "start in ACKED", from: Acked, want: Acked},
		{name: "start in OK", from: OK, want: OK},
		{name: "start in BAD", from: Bad, want: Bad},
		{name: "request, ready, reach", from: Init, local: local{true, true}, in: &req, want: Acked, out: []Kind{KindAck}},
		{name: "request, ready, no reach", from: Init, local: local{true, false}, in: &req, want: Acked, out: []Kind{KindAck}},
		{name: "request, not ready", from: Init, local: local{false, true}, in: &req, want: Init, out: []Kind{KindNotReady}},
		{name: "request in ACKING", from: Acking, in: &req, want: Acking},
		{name: "request in ACKED", from: Acked, in: &req, want: Acked},
		{name: "request in OK", from: OK, in: &req, want: OK, out: []Kind{KindAck}},
		{name: "request in BAD", from: Bad, in: &req, want: Bad, out: []Kind{KindAck}},
		{name: "request in SENT, lower rank keeps starting", from: Sent, tries: 1, local: local{true, true}, in: &req, want: Sent},
		{name: "ack yes", from: Sent, in: &Msg{Kind: KindAck, From: peer, Reach: true}, want: OK, out: []Kind{KindConfirm}},
		{name: "ack no", from: Sent, in: &Msg{Kind: KindAck, From: peer}, want: Bad, out: []Kind{KindConfirm}},
		{name: "ack in INIT", from: Init, in: &Msg{Kind: KindAck, From: peer}, want: Init, err: true},
		{name: "ack in OK", from: OK, in: &Msg{Kind: KindAck, From: peer}, want: OK, err: true},
		{name: "not ready, retry later", from: Sent, tries: 1, in: &Msg{Kind: KindNotReady, From: peer}, want: Init},
		{name: "not ready, 4th", from: Sent, tries: MaxTries - 1, in: &Msg{Kind: KindNotReady, From: peer}, want: Init},
		{name: "not ready, 5th: BAD", from: Sent, tries: MaxTries, in: &Msg{Kind: KindNotReady, From: peer}, want: Bad},
		{name: "not ready in ACKED", from: Acked, in: &Msg{Kind: KindNotReady, From: peer}, want: Acked, err: true},
		{name: "confirm yes", from: Acked, in: &Msg{Kind: KindConfirm, From: peer, Reach: true}, want: OK},
		{name: "confirm no", from: Acked, in: &Msg{Kind: KindConfirm, From: peer}, want: Bad},
		{name: "confirm when decided", from: OK, in: &Msg{Kind: KindConfirm, From: peer, Reach: true}, want: OK},
		{name: "confirm contradicting", from: OK, in: &Msg{Kind: KindConfirm, From: peer}, want: OK, err: true},
		{name: "confirm in SENT", from: Sent, in: &Msg{Kind: KindConfirm, From: peer, Reach: true}, want: Sent, err: true},
		{name: "wrong rank", from: Sent, in: &Msg{Kind: KindAck, From: 9, Reach: true}, want: Sent, err: true},
		{name: "data kind", from: Init, in: &Msg{Kind: KindPull, From: peer}, want: Init, err: true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			l := c.local
			s := NewSetup(self, peer, "gpu1", &l)
			s.state, s.tries = c.from, c.tries
			var out []Msg
			var err error
			if c.in == nil {
				out = s.Start()
			} else {
				out, err = s.Receive(*c.in)
			}
			if (err != nil) != c.err || (err != nil && !errors.Is(err, ErrProtocol)) {
				t.Fatalf("err = %v, want error %v", err, c.err)
			}
			if s.State() != c.want {
				t.Errorf("state %s, want %s", s.State(), c.want)
			}
			if len(out) != len(c.out) {
				t.Fatalf("sent %v, want kinds %v", out, c.out)
			}
			for i := range out {
				if out[i].Kind != c.out[i] || out[i].From != self {
					t.Errorf("sent %+v, want kind %s from %d", out[i], c.out[i], self)
				}
			}
			if c.in != nil && c.in.Kind == KindRequest && len(out) == 1 && out[0].Kind == KindAck && c.from == Init {
				if out[0].Reach != (c.local.ready && c.local.reach) {
					t.Errorf("ack reach %v with local %+v", out[0].Reach, c.local)
				}
			}
		})
	}
}

// pair runs two sides, delivering messages in order until none is left.
type pair struct {
	s    [2]*Setup
	q    [2][]Msg // q[i]: messages for side i
	errs []error
}

func newPair(l0, l1 Local) *pair {
	return &pair{s: [2]*Setup{NewSetup(0, 1, "gpu0", l0), NewSetup(1, 0, "gpu1", l1)}}
}

func (p *pair) start(i int) { p.q[1-i] = append(p.q[1-i], p.s[i].Start()...) }

// step delivers one message to side i, if one waits.
func (p *pair) step(i int) bool {
	if len(p.q[i]) == 0 {
		return false
	}
	m := p.q[i][0]
	p.q[i] = p.q[i][1:]
	out, err := p.s[i].Receive(m)
	if err != nil {
		p.errs = append(p.errs, err)
	}
	p.q[1-i] = append(p.q[1-i], out...)
	return true
}

func (p *pair) run() {
	for p.step(0) || p.step(1) {
	}
}

func TestSetupPairs(t *testing.T) {
	up, down, apart := &local{true, true}, &local{false, true}, &local{true, false}
	cases := []struct {
		name   string
		l0, l1 *local
		starts []int
		want   [2]State
	}{
		{"0 starts", up, up, []int{0}, [2]State{OK, OK}},
		{"1 starts", up, up, []int{1}, [2]State{OK, OK}},
		{"both start", up, up, []int{0, 1}, [2]State{OK, OK}},
		{"both start, other order", up, up, []int{1, 0}, [2]State{OK, OK}},
		{"both start, no reach", apart, apart, []int{0, 1}, [2]State{Bad, Bad}},
		{"answerer cannot reach", up, apart, []int{0}, [2]State{Bad, Bad}},
		{"answerer not ready", up, down, []int{0}, [2]State{Init, Init}},
		{"both start, higher not ready", up, down, []int{0, 1}, [2]State{Init, Init}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			l0, l1 := *c.l0, *c.l1
			p := newPair(&l0, &l1)
			for _, i := range c.starts {
				p.start(i)
			}
			p.run()
			if p.errs != nil {
				t.Fatal(p.errs)
			}
			if got := [2]State{p.s[0].State(), p.s[1].State()}; got != c.want {
				t.Errorf("states %v, want %v", got, c.want)
			}
		})
	}
}

// TestSetupRaceInterleavings delivers the both-start exchange in every
// order of the two queues: both sides always end in OK.
func TestSetupRaceInterleavings(t *testing.T) {
	for mask := 0; mask < 1<<8; mask++ {
		p := newPair(&local{true, true}, &local{true, true})
		p.start(0)
		p.start(1)
		for bit := 0; ; bit++ {
			i := (mask >> (bit % 8)) & 1
			if !p.step(i) && !p.step(1-i) {
				break
			}
		}
		if p.errs != nil || p.s[0].State() != OK || p.s[1].State() != OK {
			t.Fatalf("order %08b: states %s %s, errors %v", mask, p.s[0].State(), p.s[1].State(), p.errs)
		}
	}
}

// TestSetupNotReadyRetries: the answerer's device comes up on the third
// try; before that, every transfer retries, and the pair ends in OK.
// Without the device ever up, the fifth "not ready" makes it BAD and no
// further transfer asks.
func TestSetupNotReadyRetries(t *testing.T) {
	l1 := &local{false, true}
	p := newPair(&local{true, true}, l1)
	for try := 1; try <= 3; try++ {
		if try == 3 {
			l1.ready = true
		}
		p.start(0)
		p.run()
		if p.s[0].Tries() != try {
			t.Fatalf("try %d: Tries() = %d", try, p.s[0].Tries())
		}
	}
	if p.s[0].State() != OK || p.s[1].State() != OK {
		t.Fatalf("states %s %s", p.s[0].State(), p.s[1].State())
	}

	p = newPair(&local{true, true}, &local{false, true})
	for try := 1; try <= MaxTries; try++ {
		if p.s[0].State() != Init {
			t.Fatalf("before try %d: %s", try, p.s[0].State())
		}
		p.start(0)
		p.run()
	}
	if p.s[0].State() != Bad {
		t.Fatalf("after %d not-ready answers: %s", MaxTries, p.s[0].State())
	}
	p.start(0)
	if len(p.q[1]) != 0 || p.s[0].Tries() != MaxTries {
		t.Errorf("BAD side asked again: %v", p.q[1])
	}
	// The peer, once up, asks by itself and learns the pair is BAD.
	p.s[1].local = &local{true, true}
	p.start(1)
	p.run()
	if p.errs != nil || p.s[1].State() != Bad {
		t.Errorf("peer: %s, %v", p.s[1].State(), p.errs)
	}
}

// A request nobody answered counts as a "not ready": back to INIT, and
// BAD after MaxTries; Fail makes a set-up pair BAD.
func TestSetupUnansweredAndFail(t *testing.T) {
	s := NewSetup(0, 1, "gpu0", &local{true, true})
	s.Unanswered() // in INIT: nothing
	if s.State() != Init || s.Tries() != 0 {
		t.Fatalf("Unanswered in INIT: %s, %d tries", s.State(), s.Tries())
	}
	for try := 1; try <= MaxTries; try++ {
		if len(s.Start()) != 1 || s.State() != Sent {
			t.Fatalf("try %d: no request, state %s", try, s.State())
		}
		s.Unanswered()
		want := Init
		if try == MaxTries {
			want = Bad
		}
		if s.State() != want {
			t.Fatalf("after unanswered try %d: %s, want %s", try, s.State(), want)
		}
	}
	p := newPair(&local{true, true}, &local{true, true})
	p.start(0)
	p.run()
	if p.s[0].State() != OK {
		t.Fatalf("pair: %s", p.s[0].State())
	}
	p.s[0].Fail()
	if p.s[0].State() != Bad || len(p.s[0].Start()) != 0 {
		t.Fatalf("after Fail: %s", p.s[0].State())
	}
}

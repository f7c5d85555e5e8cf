package worker

import "time"

// resendTimer learns how long a message waits for its result before it is
// resent, as TCP learns its retransmission timeout (RFC 6298): a smoothed
// round trip and its mean deviation, taken from messages answered on their
// first send only (Karn's rule: a result after a resend may answer either
// send), and a timeout of the smoothed round trip plus four deviations,
// within [min, max].
//
// A timeout backs the learned timeout off: it doubles, at most once per
// timeout's length (the worker's queue pairs have messages in flight at
// the same time, and they time out together when the aggregator is
// slow), and stays doubled until a message is answered on its first send
// again. Without that, Karn's rule would sample only the quick messages
// where the workers are skewed (the aggregator answers a slot when the
// slowest worker's message has arrived): the timeout would fall below
// the usual wait and most messages would be resent for nothing, as with
// eight workers on two cores. A message that times out also waits twice
// as long before each next resend of its own, up to max.
//
// A round trip here is the time from a message's send to its result, so
// it includes the wait for the slowest worker.
type resendTimer struct {
	initial, min, max time.Duration
	srtt, rttvar      time.Duration
	samples           uint64
	backoff           uint // doublings since the last sample
	backedOff         time.Time
}

// sample takes the round trip of a message answered on its first send.
func (r *resendTimer) sample(rtt time.Duration) {
	if rtt <= 0 {
		rtt = time.Microsecond
	}
	if r.samples == 0 {
		r.srtt, r.rttvar = rtt, rtt/2
	} else {
		dev := r.srtt - rtt
		if dev < 0 {
			dev = -dev
		}
		r.rttvar += (dev - r.rttvar) / 4
		r.srtt += (rtt - r.srtt) / 8
	}
	r.samples++
	r.backoff = 0
}

// timedOut backs the learned timeout off after a message timed out at
// now, unless it was backed off less than a timeout ago.
func (r *resendTimer) timedOut(now time.Time) {
	t := r.timeout()
	if t >= r.max || now.Sub(r.backedOff) < t {
		return
	}
	r.backoff++
	r.backedOff = now
}

// timeout is the learned timeout (initial before the first sample),
// backed off.
func (r *resendTimer) timeout() time.Duration {
	t := r.initial
	if r.samples > 0 {
		t = r.srtt + 4*r.rttvar
	}
	t = max(t, r.min)
	for i := uint(0); i < r.backoff && t < r.max; i++ {
		t *= 2
	}
	return min(t, r.max)
}

// wait is how long a message waits after its send number try (0: the
// first): the timeout, doubled for each resend before, at most max.
func (r *resendTimer) wait(try int) time.Duration {
	t := r.timeout()
	for ; try > 0 && t < r.max; try-- {
		t *= 2
	}
	return min(t, r.max)
}

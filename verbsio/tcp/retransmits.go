package tcp

import (
	"errors"
	"fmt"
	"net"

	"golang.org/x/sys/unix"

	"github.com/gdrlink/gdrlink/verbsio"
)

// Retransmits is the number of TCP segments this host's kernel retransmitted
// on the connections (lanes) of the device's queue pairs since the device
// was opened, on the lanes it dialed and on those its peers dialed:
// TCP_INFO's tcpi_total_retrans of every lane still open, plus the count
// each closed lane had when its queue pair closed it, so the figure never
// goes down. Retransmits on loopback are rare; on a network they mean loss
// or congestion. An error says which lanes could not be read; the count is
// then of the others.
//
// It is not part of verbsio.Device: callers find it with a type assertion,
// as the gdrlink front door does for its transport metrics.
func (d *device) Retransmits() (uint64, error) {
	d.lanesMu.Lock()
	defer d.lanesMu.Unlock()
	n := d.retransGone
	var errs []error
	for c := range d.lanes {
		k, err := d.retransOf(c)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		n += k
	}
	return n, errors.Join(errs...)
}

// addLane records a connection of a queue pair, for Retransmits.
func (d *device) addLane(c net.Conn) {
	d.lanesMu.Lock()
	d.lanes[c] = struct{}{}
	d.lanesMu.Unlock()
}

// closeLane closes a connection of a queue pair, keeping its retransmits
// in the device's count. Closing a lane twice counts it once.
func (d *device) closeLane(c net.Conn) {
	d.lanesMu.Lock()
	if _, ok := d.lanes[c]; ok {
		delete(d.lanes, c)
		// A lane that cannot be read any more takes its count with it.
		if k, err := d.retransOf(c); err == nil {
			d.retransGone += k
		}
	}
	d.lanesMu.Unlock()
	c.Close()
}

// tcpRetransmits is the kernel's count of segments retransmitted on c
// (TCP_INFO's tcpi_total_retrans).
func tcpRetransmits(c net.Conn) (uint64, error) {
	info, err := tcpInfo(c)
	if err != nil {
		return 0, err
	}
	return uint64(info.Total_retrans), nil
}

// tcpInfo reads TCP_INFO of a TCP connection. Other connections fail with
// an error wrapping verbsio.ErrNotSupported.
func tcpInfo(c net.Conn) (*unix.TCPInfo, error) {
	tc, ok := c.(*net.TCPConn)
	if !ok {
		return nil, fmt.Errorf("%w: TCP_INFO of a %T", verbsio.ErrNotSupported, c)
	}
	rc, err := tc.SyscallConn()
	if err != nil {
		return nil, fmt.Errorf("tcp: TCP_INFO of %s: %w", tc.RemoteAddr(), err)
	}
	var info *unix.TCPInfo
	var serr error
	if err := rc.Control(func(fd uintptr) {
		info, serr = unix.GetsockoptTCPInfo(int(fd), unix.IPPROTO_TCP, unix.TCP_INFO)
	}); err != nil {
		return nil, fmt.Errorf("tcp: TCP_INFO of %s: %w", tc.RemoteAddr(), err)
	}
	if serr != nil {
		return nil, fmt.Errorf("tcp: getsockopt TCP_INFO of %s: %w", tc.RemoteAddr(), serr)
	}
	return info, nil
}

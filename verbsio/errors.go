package verbsio

import (
	"errors"

	"github.com/gdrlink/gdrlink/internal/closed"
)

// Errors of the verbs layer, one per condition. Providers wrap them with the
// device, key or address concerned; match them with errors.Is.
var (
	// ErrNotSupported: the device or provider cannot do this here; the
	// wrapping message says what is missing.
	ErrNotSupported = errors.New("verbsio: not supported")
	// ErrNoDevice: no device of this provider on this host.
	ErrNoDevice = errors.New("verbsio: no device")
	// ErrNoProvider: no provider registered under that name, or none usable.
	ErrNoProvider = errors.New("verbsio: no provider")
	// ErrBadConfig: a configuration value (RDMA_* variable or option) that is
	// malformed or names something that does not exist.
	ErrBadConfig = errors.New("verbsio: bad configuration")
	// ErrRemoteAccess: a wrong rkey, an address outside the region, or a
	// region without the needed remote access.
	ErrRemoteAccess = errors.New("verbsio: remote access error")
	// ErrRemoteOperation: the peer could not carry out the operation.
	ErrRemoteOperation = errors.New("verbsio: remote operation error")
	// ErrLocalProtection: a local key or access that does not allow the operation.
	ErrLocalProtection = errors.New("verbsio: local protection error")
	// ErrLocalLength: a bad local length, or a receive buffer too small.
	ErrLocalLength = errors.New("verbsio: local length error")
	// ErrFlushed: a work request flushed because its queue pair failed or closed.
	ErrFlushed = errors.New("verbsio: work request flushed")
	// ErrPeerLost: the peer is gone (closed connection, transport retries
	// exhausted, process died).
	ErrPeerLost = errors.New("verbsio: peer lost")
	// ErrCompletion: a completion with any other failure status.
	ErrCompletion = errors.New("verbsio: completion error")
	// ErrQueueFull: more outstanding work requests than the queue holds.
	ErrQueueFull = errors.New("verbsio: queue full")
	// ErrQPState: an operation that the queue pair's state does not allow
	// (posting before Connect, or after an error).
	ErrQPState = errors.New("verbsio: wrong queue pair state")
	// ErrBadFrame: wire data from a peer that is truncated, oversized or
	// malformed.
	ErrBadFrame = errors.New("verbsio: malformed frame")
	// ErrBusy: closing a resource that still has live children.
	ErrBusy = errors.New("verbsio: resource busy")
	// ErrClosed: use of a closed resource. It is the one closed error of every layer
	// (the same value as gdrlink.ErrClosed and verbsio.ErrClosed), so
	// errors.Is matches it whichever layer noticed.
	ErrClosed = closed.Err
	// ErrTimeout: a peer or operation that did not answer in time.
	ErrTimeout = errors.New("verbsio: timeout")
	// ErrBadAddress: memory to register or to post that is empty, wraps
	// around the address space or is not mapped.
	ErrBadAddress = errors.New("verbsio: bad address")
)

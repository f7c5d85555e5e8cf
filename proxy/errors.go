package proxy

import (
	"errors"

	"github.com/gdrlink/gdrlink/internal/closed"
)

// Errors of this package and of Device implementations, one per condition;
// match them with errors.Is.
var (
	// ErrDeviceLost: the device stopped working (Xid error, ECC error, fell
	// off the bus, simulated loss); no further copy to it can succeed.
	ErrDeviceLost = errors.New("proxy: device lost")
	// ErrCopyFailed: an asynchronous copy failed.
	ErrCopyFailed = errors.New("proxy: copy failed")
	// ErrWrongMemory: memory of the wrong kind (a device pointer handed in as
	// host memory, host memory where device memory is needed, pageable memory
	// where pinned memory is needed).
	ErrWrongMemory = errors.New("proxy: wrong memory type")
	// ErrOutOfRange: a copy or chunk outside the memory it names.
	ErrOutOfRange = errors.New("proxy: out of range")
	// ErrDeviceMemory: device memory could not be allocated.
	ErrDeviceMemory = errors.New("proxy: device out of memory")
	// ErrClosed: use of a closed proxy, device, stream or event. It is the one closed error of every layer
	// (the same value as gdrlink.ErrClosed and verbsio.ErrClosed), so
	// errors.Is matches it whichever layer noticed.
	ErrClosed = closed.Err
	// ErrCanceled: a receive abandoned by its caller (Receiver.Abort, a
	// canceled context) before it completed.
	ErrCanceled = errors.New("proxy: canceled")
)

// Errors of a transport's or an operator's mistakes, which the message
// explains.
var (
	// errBadChunk: a chunk reported twice, overlapping another, or empty.
	errBadChunk = errors.New("proxy: bad chunk")
	// errBadFlushSetting: GDRLINK_GDR_FLUSH set to something other than
	// 0, 1 or auto.
	errBadFlushSetting = errors.New("proxy: bad GDRLINK_GDR_FLUSH setting")
)

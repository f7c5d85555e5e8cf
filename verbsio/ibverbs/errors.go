package ibverbs

import (
	"errors"
	"fmt"
	"syscall"

	"github.com/gdrlink/gdrlink/internal/ibv"
	"github.com/gdrlink/gdrlink/verbsio"
)

// wrap maps a failed verb to the verbsio sentinel for its errno, keeping the
// verb's error (and so its errno) in the chain. Errnos with no sentinel are
// returned as they are: the caller "could not tell".
func wrap(err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, ibv.ErrUnavailable) {
		return fmt.Errorf("%w: %w", verbsio.ErrNotSupported, err)
	}
	var e *ibv.Error
	if !errors.As(err, &e) {
		return err
	}
	switch e.Errno {
	case syscall.EOPNOTSUPP, syscall.ENOSYS, syscall.EPROTONOSUPPORT:
		return fmt.Errorf("%w: %w", verbsio.ErrNotSupported, err)
	case syscall.EBUSY:
		return fmt.Errorf("%w: %w", verbsio.ErrBusy, err)
	case syscall.EBADF:
		return fmt.Errorf("%w: %w", verbsio.ErrClosed, err)
	case syscall.ENODEV:
		return fmt.Errorf("%w: %w", verbsio.ErrNoDevice, err)
	}
	return err
}

// statusOf maps an ibv_wc_status to a verbsio.Status.
func statusOf(s uint32) verbsio.Status {
	switch s {
	case ibv.WCSuccess:
		return verbsio.StatusSuccess
	case ibv.WCLocLenErr:
		return verbsio.StatusLocalLength
	case ibv.WCLocProtErr, ibv.WCLocAccessErr:
		return verbsio.StatusLocalProtection
	case ibv.WCFlushErr:
		return verbsio.StatusFlushed
	case ibv.WCRemAccessErr:
		return verbsio.StatusRemoteAccess
	case ibv.WCRemOpErr, ibv.WCRemInvReqErr, ibv.WCRemAbortErr:
		return verbsio.StatusRemoteOperation
	case ibv.WCRetryExcErr, ibv.WCRNRRetryExc, ibv.WCRespTimeout:
		return verbsio.StatusRetryExceeded
	}
	return verbsio.StatusGeneral
}

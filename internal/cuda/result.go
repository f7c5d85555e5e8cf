package cuda

import (
	"errors"
	"fmt"

	"github.com/gdrlink/gdrlink/internal/closed"
)

// Result is a CUresult code of the driver API.
type Result int32

// CUresult codes that this package names (cuda.h's cudaError_enum).
const (
	Success                          Result = 0
	ErrorInvalidValue                Result = 1
	ErrorOutOfMemory                 Result = 2
	ErrorNotInitialized              Result = 3
	ErrorDeinitialized               Result = 4
	ErrorStubLibrary                 Result = 34
	ErrorInsufficientDriver          Result = 35
	ErrorDeviceUnavailable           Result = 46
	ErrorNoDevice                    Result = 100
	ErrorInvalidDevice               Result = 101
	ErrorDeviceNotLicensed           Result = 102
	ErrorInvalidContext              Result = 201
	ErrorContextAlreadyCurrent       Result = 202
	ErrorMapFailed                   Result = 205
	ErrorUnmapFailed                 Result = 206
	ErrorAlreadyMapped               Result = 208
	ErrorNotMapped                   Result = 211
	ErrorECCUncorrectable            Result = 214
	ErrorContextAlreadyInUse         Result = 216
	ErrorPeerAccessUnsupported       Result = 217
	ErrorNVLinkUncorrectable         Result = 220
	ErrorOperatingSystem             Result = 304
	ErrorInvalidHandle               Result = 400
	ErrorIllegalState                Result = 401
	ErrorNotFound                    Result = 500
	ErrorNotReady                    Result = 600
	ErrorIllegalAddress              Result = 700
	ErrorLaunchOutOfResources        Result = 701
	ErrorLaunchTimeout               Result = 702
	ErrorPeerAccessAlreadyEnabled    Result = 704
	ErrorPeerAccessNotEnabled        Result = 705
	ErrorPrimaryContextActive        Result = 708
	ErrorContextIsDestroyed          Result = 709
	ErrorAssert                      Result = 710
	ErrorTooManyPeers                Result = 711
	ErrorHostMemoryAlreadyRegistered Result = 712
	ErrorHostMemoryNotRegistered     Result = 713
	ErrorHardwareStackError          Result = 714
	ErrorIllegalInstruction          Result = 715
	ErrorMisalignedAddress           Result = 716
	ErrorInvalidAddressSpace         Result = 717
	ErrorInvalidPC                   Result = 718
	ErrorLaunchFailed                Result = 719
	ErrorNotPermitted                Result = 800
	ErrorNotSupported                Result = 801
	ErrorSystemNotReady              Result = 802
	ErrorSystemDriverMismatch        Result = 803
	ErrorCompatNotSupportedOnDevice  Result = 804
	ErrorTimeout                     Result = 909
	ErrorUnknown                     Result = 999
)

var resultNames = map[Result]string{
	Success:                          "CUDA_SUCCESS",
	ErrorInvalidValue:                "CUDA_ERROR_INVALID_VALUE",
	ErrorOutOfMemory:                 "CUDA_ERROR_OUT_OF_MEMORY",
	ErrorNotInitialized:              "CUDA_ERROR_NOT_INITIALIZED",
	ErrorDeinitialized:               "CUDA_ERROR_DEINITIALIZED",
	ErrorStubLibrary:                 "CUDA_ERROR_STUB_LIBRARY",
	ErrorInsufficientDriver:          "CUDA_ERROR_INSUFFICIENT_DRIVER",
	ErrorDeviceUnavailable:           "CUDA_ERROR_DEVICE_UNAVAILABLE",
	ErrorNoDevice:                    "CUDA_ERROR_NO_DEVICE",
	ErrorInvalidDevice:               "CUDA_ERROR_INVALID_DEVICE",
	ErrorDeviceNotLicensed:           "CUDA_ERROR_DEVICE_NOT_LICENSED",
	ErrorInvalidContext:              "CUDA_ERROR_INVALID_CONTEXT",
	ErrorContextAlreadyCurrent:       "CUDA_ERROR_CONTEXT_ALREADY_CURRENT",
	ErrorMapFailed:                   "CUDA_ERROR_MAP_FAILED",
	ErrorUnmapFailed:                 "CUDA_ERROR_UNMAP_FAILED",
	ErrorAlreadyMapped:               "CUDA_ERROR_ALREADY_MAPPED",
	ErrorNotMapped:                   "CUDA_ERROR_NOT_MAPPED",
	ErrorECCUncorrectable:            "CUDA_ERROR_ECC_UNCORRECTABLE",
	ErrorContextAlreadyInUse:         "CUDA_ERROR_CONTEXT_ALREADY_IN_USE",
	ErrorPeerAccessUnsupported:       "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED",
	ErrorNVLinkUncorrectable:         "CUDA_ERROR_NVLINK_UNCORRECTABLE",
	ErrorOperatingSystem:             "CUDA_ERROR_OPERATING_SYSTEM",
	ErrorInvalidHandle:               "CUDA_ERROR_INVALID_HANDLE",
	ErrorIllegalState:                "CUDA_ERROR_ILLEGAL_STATE",
	ErrorNotFound:                    "CUDA_ERROR_NOT_FOUND",
	ErrorNotReady:                    "CUDA_ERROR_NOT_READY",
	ErrorIllegalAddress:              "CUDA_ERROR_ILLEGAL_ADDRESS",
	ErrorLaunchOutOfResources:        "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
	ErrorLaunchTimeout:               "CUDA_ERROR_LAUNCH_TIMEOUT",
	ErrorPeerAccessAlreadyEnabled:    "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED",
	ErrorPeerAccessNotEnabled:        "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED",
	ErrorPrimaryContextActive:        "CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE",
	ErrorContextIsDestroyed:          "CUDA_ERROR_CONTEXT_IS_DESTROYED",
	ErrorAssert:                      "CUDA_ERROR_ASSERT",
	ErrorTooManyPeers:                "CUDA_ERROR_TOO_MANY_PEERS",
	ErrorHostMemoryAlreadyRegistered: "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
	ErrorHostMemoryNotRegistered:     "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
	ErrorHardwareStackError:          "CUDA_ERROR_HARDWARE_STACK_ERROR",
	ErrorIllegalInstruction:          "CUDA_ERROR_ILLEGAL_INSTRUCTION",
	ErrorMisalignedAddress:           "CUDA_ERROR_MISALIGNED_ADDRESS",
	ErrorInvalidAddressSpace:         "CUDA_ERROR_INVALID_ADDRESS_SPACE",
	ErrorInvalidPC:                   "CUDA_ERROR_INVALID_PC",
	ErrorLaunchFailed:                "CUDA_ERROR_LAUNCH_FAILED",
	ErrorNotPermitted:                "CUDA_ERROR_NOT_PERMITTED",
	ErrorNotSupported:                "CUDA_ERROR_NOT_SUPPORTED",
	ErrorSystemNotReady:              "CUDA_ERROR_SYSTEM_NOT_READY",
	ErrorSystemDriverMismatch:        "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
	ErrorCompatNotSupportedOnDevice:  "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE",
	ErrorTimeout:                     "CUDA_ERROR_TIMEOUT",
	ErrorUnknown:                     "CUDA_ERROR_UNKNOWN",
}

// Name is the code's name in cuda.h ("CUDA_ERROR_OUT_OF_MEMORY"), or
// "CUresult(N)" for a code this package does not know.
func (r Result) Name() string {
	if n, ok := resultNames[r]; ok {
		return n
	}
	return fmt.Sprintf("CUresult(%d)", int32(r))
}

// String is Name.
func (r Result) String() string { return r.Name() }

// Errors of this package, one per condition; match them with errors.Is.
var (
	// ErrNoDriver: libcuda.so.1 could not be loaded, or it lacks a symbol
	// this package needs. The wrapping message carries the loader's words.
	ErrNoDriver = errors.New("cuda: no CUDA driver")
	// ErrClosed: use of a closed handle. It is the one closed error of every layer
	// (the same value as gdrlink.ErrClosed and verbsio.ErrClosed), so
	// errors.Is matches it whichever layer noticed.
	ErrClosed = closed.Err
	// ErrBusy: closing a context whose allocations, streams or events live.
	ErrBusy = errors.New("cuda: context busy")
	// ErrBadArgument: an argument refused before calling the driver (a zero
	// or negative size, a nil stream).
	ErrBadArgument = errors.New("cuda: invalid argument")
	// ErrWrongMemoryType: memory of one kind handed in where another is
	// needed (a device pointer given as host memory, pageable memory where
	// pinned memory is needed).
	ErrWrongMemoryType = errors.New("cuda: wrong memory type")

	// ErrDeviceLost matches the codes after which the context cannot be used
	// again (illegal address, launch failure, uncorrectable ECC or NVLink
	// error, device unavailable, hardware exceptions).
	ErrDeviceLost = errors.New("cuda: device lost")

	// Sentinels of single CUresult codes.
	ErrInvalidValue                = &codeSentinel{ErrorInvalidValue}
	ErrOutOfMemory                 = &codeSentinel{ErrorOutOfMemory}
	ErrNotInitialized              = &codeSentinel{ErrorNotInitialized}
	ErrNoDevice                    = &codeSentinel{ErrorNoDevice}
	ErrInvalidDevice               = &codeSentinel{ErrorInvalidDevice}
	ErrInvalidContext              = &codeSentinel{ErrorInvalidContext}
	ErrInvalidHandle               = &codeSentinel{ErrorInvalidHandle}
	ErrNotReady                    = &codeSentinel{ErrorNotReady}
	ErrNotSupported                = &codeSentinel{ErrorNotSupported}
	ErrNotPermitted                = &codeSentinel{ErrorNotPermitted}
	ErrHostMemoryAlreadyRegistered = &codeSentinel{ErrorHostMemoryAlreadyRegistered}
	ErrHostMemoryNotRegistered     = &codeSentinel{ErrorHostMemoryNotRegistered}
	ErrIllegalAddress              = &codeSentinel{ErrorIllegalAddress}
	ErrSystemDriverMismatch        = &codeSentinel{ErrorSystemDriverMismatch}
)

// codeSentinel is the sentinel error of one CUresult code.
type codeSentinel struct{ code Result }

// Error names the code.
func (s *codeSentinel) Error() string { return "cuda: " + s.code.Name() }

// Code is the CUresult the sentinel stands for.
func (s *codeSentinel) Code() Result { return s.code }

// lostCodes are the codes after which a context is unusable.
var lostCodes = map[Result]bool{
	ErrorDeviceUnavailable: true, ErrorECCUncorrectable: true, ErrorNVLinkUncorrectable: true,
	ErrorIllegalAddress: true, ErrorLaunchTimeout: true, ErrorContextIsDestroyed: true,
	ErrorAssert: true, ErrorHardwareStackError: true, ErrorIllegalInstruction: true,
	ErrorMisalignedAddress: true, ErrorInvalidAddressSpace: true, ErrorInvalidPC: true,
	ErrorLaunchFailed: true,
}

// IsDeviceLost reports whether r leaves the context unusable.
func (r Result) IsDeviceLost() bool { return lostCodes[r] }

// Error is a failed driver call: the call's name, the code and what it
// was applied to.
type Error struct {
	// Op is the driver symbol called ("cuMemAlloc_v2").
	Op string
	// Code is what it returned.
	Code Result
	// Detail says what the call was applied to ("4194304 bytes on gpu:0").
	Detail string
}

// Error prints "cuda: cuMemAlloc_v2 (4194304 bytes): CUDA_ERROR_OUT_OF_MEMORY (2)".
func (e *Error) Error() string {
	d := ""
	if e.Detail != "" {
		d = " (" + e.Detail + ")"
	}
	return fmt.Sprintf("cuda: %s%s: %s (%d)", e.Op, d, e.Code.Name(), int32(e.Code))
}

// Is matches the sentinel of the error's code, and ErrDeviceLost for codes
// after which the context is unusable.
func (e *Error) Is(target error) bool {
	if target == ErrDeviceLost {
		return e.Code.IsDeviceLost()
	}
	if s, ok := target.(*codeSentinel); ok {
		return s.code == e.Code
	}
	return false
}

// check turns a CUresult into nil or an *Error.
func check(op string, r Result, detail string) error {
	if r == Success {
		return nil
	}
	return &Error{Op: op, Code: r, Detail: detail}
}

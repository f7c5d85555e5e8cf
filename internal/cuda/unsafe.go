package cuda

import "unsafe"

// goString copies a NUL-terminated C string owned by the driver.
func goString(p uintptr) string {
	if p == 0 {
		return ""
	}
	var n int
	for *(*byte)(ptrAt(p, n)) != 0 {
		n++
	}
	return string(unsafe.Slice((*byte)(ptrAt(p, 0)), n))
}

// ptrAt is p+off as a pointer to memory the driver owns (off the Go heap).
func ptrAt(p uintptr, off int) unsafe.Pointer {
	return unsafe.Add(*(*unsafe.Pointer)(unsafe.Pointer(&p)), off)
}

// cString returns b up to its first NUL.
func cString(b []byte) string {
	for i, c := range b {
		if c == 0 {
			return string(b[:i])
		}
	}
	return string(b)
}

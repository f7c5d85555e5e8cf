package adaptspin

import (
	"time"

	"golang.org/x/sys/unix"
)

// Pause sleeps for about d, for a poll loop that has nothing to block on
// (a counter in another process's memory, a device that raises no event
// for what it waits for). Under a millisecond it sleeps in nanosleep(2),
// holding its thread as the runtime's own short sleeps do: a Go timer that
// short (time.Sleep, time.After, time.AfterFunc) fires after about a
// millisecond when the process is otherwise idle, because the runtime's
// network poller then sleeps in whole milliseconds.
func Pause(d time.Duration) {
	if d <= 0 {
		return
	}
	if d >= time.Millisecond {
		time.Sleep(d)
		return
	}
	ts := unix.NsecToTimespec(int64(d))
	for unix.Nanosleep(&ts, &ts) == unix.EINTR {
	}
}

// Package onnode is the verbsio provider for peers on the same host: an RDMA
// WRITE moves the bytes with exactly one copy, from the sender's registered
// source straight into the receiver's registered region.
//
// Two mechanisms carry the copy:
//
//   - MechVM: process_vm_writev(2) from the sender's memory into the peer's
//     address space. It works for any registered host memory of the peer and
//     needs the right to ptrace the peer (same user, no Yama restriction).
//   - MechSHM: when the receiver's region is a shared mapping of a memfd (or
//     another file), the receiver passes the file descriptor to the sender
//     over the queue pair's unix socket (SCM_RIGHTS); the sender maps it and
//     copies with a plain memmove.
//
// Both trust the peer process as ptrace would: process_vm_writev needs the
// right to ptrace the receiver, and a peer holding a region's file could
// write past the region if it bypassed this package. Only regions registered
// with remote-write access, or that gave a grant, are handed out as files.
//
// # Grants
//
// Regions implement verbsio.Granter (Caps.Grants is true): a grant is an
// entry of the region table of its own, with its key, the granted range,
// remote write only, the queue pair it was given to and the region it lies
// in. The sender's provider checks each write against it before it copies:
// a write through a grant from another queue pair, outside its range, after
// its last write with immediate completed here (the write with immediate's
// ring record names the key it wrote through) or after Revoke completes with
// verbsio.StatusRemoteAccess and copies nothing. Once a region has given a
// grant, its own rkey admits no remote access. Revoking waits for the writes
// announced for the grant as deregistration does (below). This bounds a
// peer that uses this package, perhaps with a bug; a hostile peer of the
// same user skips the check (see above).
//
// Options.Mechanism picks one; the default, MechAuto, uses MechSHM where the
// region allows it and MechVM elsewhere (see bench scenario "xfer" and
// BenchmarkWrite for the figures behind this choice).
//
// # Who may connect
//
// Each queue pair listens on an abstract unix socket, which has no file
// permissions: its name shows in /proc/net/unix and any process of the
// host can connect to it. Before anything of this process crosses (the
// ring, the eventfd, the region table, and the hello that carries them):
//
//   - both sides check the other end with SO_PEERCRED: it must be the
//     peer's own process (the pid in its endpoint; the pid its hello
//     claims must match too) and run as this process's user (the effective
//     uid). Otherwise the dialling side's Connect fails with an error
//     wrapping verbsio.ErrRemoteAccess that names the pid and uid; the
//     accepting side closes a connection of another process at once and
//     keeps waiting for the peer's (a timeout's error names the last one
//     refused), and fails Connect the same way when the peer's own process
//     runs as another user;
//   - when the job has a key (verbsio.Config.JobKey), the first exchange
//     on the socket is the job's challenge-response (internal/jobauth,
//     purpose "onnode"; the dialler claims its pid as its rank, and both
//     ends are named by the queue pairs' sockets). A peer with another key,
//     or without one, fails Connect on both sides with an error wrapping
//     jobauth.ErrRefused. Without a key the exchange is skipped: onnode
//     never leaves the host, and the credential check still holds;
//   - then the dialler sends its hello and descriptors, and the acceptor,
//     having checked them, answers with its own.
//
// The accepting side runs the handshakes of accepted connections
// concurrently, each bounded by 5 s and at most 64 at once (more are closed
// unanswered), so no connection can hold up the peer's. Once connected, a
// queue pair closes its socket.
//
// The region table is sealed (F_SEAL_FUTURE_WRITE, Linux 5.1 and later):
// peers can map it read-only and never writable. The files peers map (the
// ring, the table, the write counters) are sealed against shrinking and
// growing, and a peer's are refused unless they are, so that no peer can
// make an access to a mapping fail with SIGBUS.
//
// # Keys and deregistration
//
// Each protection domain publishes its memory regions in a table in a memfd
// that connected peers map read-only. A sender looks the rkey up there before
// it writes (wrong key, address out of bounds, or no remote-write access: the
// work request completes with verbsio.StatusRemoteAccess and the target is
// untouched). Entries carry a sequence number, and a sender announces each
// write, before it checks the entry, in a per-entry write counter. The
// counters are a memfd per queue pair, which only that queue pair's peer
// maps (read-write).
//
// Closing a region removes its entry, so no write starts after that, and
// then waits for the writes announced before it to finish, with these rules:
//
//   - Only writes that can still land are waited for: those announced in
//     the counters of queue pairs whose peer is still there. A peer that
//     closed its end (it exited, or closed its queue pair, which waits for
//     its copy under way) has none.
//   - The counters are written by peers, so they are not trusted: the wait
//     is bounded by Options.DeregTimeout (5 s by default), whatever they
//     say. A peer whose counter is still up then, because it is stopped or
//     stuck mid-write or because it wrote garbage there, is fenced: its
//     queue pair moves to the error state (pending work requests complete
//     with verbsio.StatusRetryExceeded, the error wraps
//     verbsio.ErrPeerLost), its connection is closed, so that its side of
//     the queue pair starts no other copy, and its counters are no longer
//     read. Only then is the region's slot in the table used again (by a
//     region with a new key). A peer's garbage in its own counters delays
//     Close at most by the bound and costs that peer its queue pair; it
//     cannot touch another peer's counters.
//   - What a fence cannot do: take back the mappings a peer holds (a
//     region's file, with MechSHM) or its right to process_vm_writev
//     (MechVM). A peer stopped in the middle of one copy finishes that copy
//     into the region's memory when it runs again. Close returns within the
//     bound either way, and the late copy lands in the old region's memory
//     only, never in a region registered after the fence; memory whose
//     region's Close fenced a peer may still take it. As said above, onnode
//     trusts peer processes as ptrace would.
//
// # Notifications
//
// Immediates, receive completions and SEND payloads (small control messages,
// which are copied) travel through a single-producer ring in a memfd that the
// receiving queue pair owns. A completion queue's Wait spins on the rings of
// its queue pairs for as long as it learned pays (at most Options.Spin; on
// a host with more runnable threads than CPUs, where its polls yield the
// CPU, while any wait of the device had a completion within 25 times that,
// waking the device's sleeping waits whose completions are ready) and then
// sleeps on an eventfd that the sender signals only when the receiver
// sleeps. A peer that
// dies closes its end of the unix socket: its queue pairs enter the error
// state and pending work requests complete with verbsio.StatusRetryExceeded
// (errors.Is(status.Err(), verbsio.ErrPeerLost)).
//
// PostSend carries out each work request before it returns (the CPU is the
// NIC here); completions still arrive through the completion queue as with
// any provider.
package onnode

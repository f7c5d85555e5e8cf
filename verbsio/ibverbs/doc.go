// Package ibverbs is gdrlink's RDMA provider over rdma-core's libibverbs:
// any device the kernel's RDMA stack drives (Mellanox/NVIDIA ConnectX,
// Broadcom, Intel, AWS EFA's verbs, Soft-RoCE rxe, siw) through reliable-
// connected queue pairs. Import it for its side effect to make the provider
// "ibverbs" available to verbsio:
//
//	import _ "github.com/gdrlink/gdrlink/verbsio/ibverbs"
//
// The device, port and GID come from verbsio.Config, whose fields carry
// TensorFlow verbs' environment names (RDMA_DEVICE, RDMA_DEVICE_PORT,
// RDMA_GID_INDEX, RDMA_QP_PKEY_INDEX, RDMA_QP_QUEUE_DEPTH, RDMA_QP_TIMEOUT,
// RDMA_QP_RETRY_COUNT, RDMA_QP_SL, RDMA_QP_MTU, RDMA_TRAFFIC_CLASS). Left
// unset, the provider picks the first device with an active port and, on
// RoCE, a RoCE v2 GID (IPv4-mapped first). A name that does not exist is an
// error wrapping verbsio.ErrBadConfig that lists what does.
//
// libibverbs is loaded at run time (internal/ibv), so the provider builds
// with CGO_ENABLED=0 and no rdma-core headers. On a host without RDMA (no
// libibverbs.so.1 or one too old, no /sys/class/infiniband, no libibverbs
// provider for the device), Devices returns an error wrapping
// verbsio.ErrNoDevice that says which, so verbsio.Choose falls back to
// another provider.
//
// Where the device has type 2 memory windows and proves, with a loopback
// probe at open, that it enforces a window's bounds, its memory regions
// implement verbsio.Granter (Caps.Grants): a grant is a window bound over
// the granted range through the given queue pair, and Revoke invalidates
// it (grant.go says what ibverbs grants do not do: they are not counted
// down by writes with immediate, and the region's own rkey stays as
// registered). Soft-RoCE does not enforce a window's bounds, so it gives
// no grants; GDRLINK_IBVERBS_WINDOWS=force turns them on anyway, to test
// the window path there (auto is the default; off turns them off), and
// ibvdiag's GrantsReason says which.
//
// The package is pure Go. Work request chains and completion batches cross
// into libibverbs once per chain and once per batch; the module's
// benchmarks count the crossings through internal/ibvdiag.
package ibverbs

// Package verbsio is gdrlink's verbs layer: devices, protection domains,
// memory regions, completion queues and reliable-connected queue pairs with
// ibverbs semantics (rkeys, access flags, remote-access errors, RDMA WRITE
// WITH IMMEDIATE), implemented by providers that register themselves like
// database/sql drivers.
//
// Providers: "ibverbs" (verbsio/ibverbs, rdma-core's libibverbs loaded at run time),
// "onnode" (verbsio/onnode, one copy between processes of one host) and
// "tcp" (verbsio/tcp, for hosts without RDMA). Code above this package cannot
// tell them apart: the conformance suite in verbsio/verbstest runs against
// every provider.
//
// Choosing a provider: Choose takes ibverbs when it has a device, else
// onnode when the peer shares this host (the same kernel boot id in
// Endpoint.Host), else tcp, and says why each better provider was passed
// over. Peers find each other and trade endpoints through
// internal/bootstrap.
package verbsio

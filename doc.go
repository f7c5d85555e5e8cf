// Package gdrlink moves tensors between the processes of a job with no
// intermediate copy: the receiver's result tensor is written by the
// sender's NIC (or, on one node, by the sender itself) straight from the
// sender's tensor.
//
// # Joining a job
//
// Each process of the job calls Join once. Under mpirun, srun or torchrun
// it needs no argument: it reads the rank, the size and the root address
// the launcher set (OMPI_COMM_WORLD_RANK, SLURM_PROCID, RANK and
// WORLD_SIZE, with GDRLINK_ROOT or MASTER_ADDR and MASTER_PORT naming
// where rank 0 listens). Set by hand, GDRLINK_RANK, GDRLINK_SIZE and
// GDRLINK_ROOT do the same, as WithRank and WithRoot do in Go.
//
//	g, err := gdrlink.Join(ctx)
//	defer g.Close()
//
// # Tensors
//
// Tensors come from the group's pool, whose arenas were registered with
// every provider once, when each arena was made: NewTensor hands out memory
// a peer can write and the NIC can read, at the cost of a pool allocation.
// Package tensor has the dtypes, shapes and typed views.
//
//	t, err := g.NewTensor(tensor.Float32, 512, 512)
//	w, _ := tensor.View[float32](t) // fill w
//
// A group joined WithGPU(ordinal) (GDRLINK_GPU) also allocates on that GPU
// and in page-locked host memory (NewTensorOn), and receives onto the GPU
// (RecvOn). GPU tensors travel through a pinned host proxy registered with
// every provider: a received tensor is copied to the GPU chunk by chunk as
// it lands, and a sent one is staged first.
//
// # Sending and receiving
//
// A tensor is named by a key and a step. Send offers it to one peer and
// never waits on the network; the peer's Recv of the same key and step
// asks for it (with the address of a result tensor it allocated from its
// pool, from a per-key cache of shapes), and the sender writes it there in
// one RDMA write. Either may come first.
//
//	err = g.Send(1, "layer0/out", step, t)            // rank 0
//	r, tr, err := g.Recv(ctx, 0, "layer0/out", step)  // rank 1
//	defer r.Release()
//
// Transfer says how the bytes came (tr.Path: direct, proxy for a GPU
// result through the pinned proxy, serialized for string tensors, none for
// dead and empty ones) and over which provider.
//
// RecvInto receives into a tensor the rank already has (a layer's input
// buffer): the request carries its address, and the peer, granted those
// bytes alone, writes them itself (tr.Placed) where the provider gives
// such grants; elsewhere the result is copied into it.
//
//	tr, err = g.RecvInto(ctx, in, 0, "layer0/out", step) // rank 1
//
// # Collectives
//
// AllReduce (Sum, Average), Broadcast and AllGather work in place on pool
// tensors, over a ring of the same zero-copy connections: each rank talks
// to its two neighbours only, the pieces go out straight from the
// caller's tensor, and the result is the same bits on every rank (the
// order of additions is fixed per element). Every rank calls them in the
// same order; a rank that dies fails every other rank's call with a
// *collective.RankError naming it. The report says how the bytes came,
// as Transfer does for a Recv.
//
//	rep, err := g.AllReduce(ctx, grad, gdrlink.Average)
//
// # Connections and providers
//
// Nothing is connected at Join. The first exchange between two ranks
// connects them, with the best provider both have: onnode for a peer on
// the same node (one kernel, one network and PID namespace), else ibverbs
// where both have an RDMA device, else tcp; a provider that fails to
// connect gives way to the next. A job of a thousand ranks that talk to
// their neighbours opens a few thousand connections, not a million.
// GDRLINK_PROVIDER (WithProvider) forces one provider for every peer.
// Stats counts the connections by provider and says why a provider is not
// usable here.
//
// # Configuration
//
// Every option has an environment variable, and an option given in Go wins:
// GDRLINK_PROVIDER, GDRLINK_POOL_LIMIT, GDRLINK_CHECKSUM, GDRLINK_GPU,
// GDRLINK_CONNECT_TIMEOUT, GDRLINK_PEER_TIMEOUT, GDRLINK_LOG, and the
// verbs device's RDMA_* variables (WithVerbsConfig).
//
// # Layers
//
// The layers below are public for programs that build their own: package
// alloc (the pool), alloc/visitor (registration visitors), verbsio (the
// verbs abstraction and its providers), rendezvous (the tensor protocol on
// one queue pair), proxy and gdr (GPU memory the NIC cannot reach, and the
// GPUDirect policy).
package gdrlink

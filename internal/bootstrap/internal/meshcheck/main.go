// Command meshcheck is a launcher check: started by mpirun, srun, torchrun
// or by hand with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, each rank joins
// the job, connects a queue pair to every other rank over a verbs provider
// (tcp unless -provider says otherwise), RDMA-writes a pattern of its own
// into each peer's memory with an immediate naming itself, checks what the
// peers wrote into its memory, and exits 0 when everything arrived intact.
// The job key comes from GDRLINK_JOB_KEY or GDRLINK_JOB_KEY_FILE; without
// one, GDRLINK_INSECURE=1 lets a job span hosts.
package main

import (
	"context"
	"encoding/binary"
	"flag"
	"fmt"
	"os"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/gdrlink/gdrlink/internal/bootstrap"
	"github.com/gdrlink/gdrlink/internal/jobauth"
	"github.com/gdrlink/gdrlink/verbsio"
	_ "github.com/gdrlink/gdrlink/verbsio/tcp"
)

func main() {
	provider := flag.String("provider", "tcp", "verbs provider")
	chunk := flag.Int("chunk", 256<<10, "bytes each rank writes into each peer")
	timeout := flag.Duration("timeout", 60*time.Second, "time allowed for the whole check")
	flag.Parse()
	if err := run(*provider, *chunk, *timeout); err != nil {
		fmt.Fprintln(os.Stderr, "meshcheck:", err)
		os.Exit(1)
	}
}

// fill writes the bytes that rank from sends to rank to.
func fill(b []byte, from, to int) {
	for i := range b {
		b[i] = byte(from*31 + to*7 + i + i>>8)
	}
}

func run(provider string, chunk int, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cfg, err := bootstrap.FromEnv()
	if err != nil {
		return err
	}
	if cfg.Key, _, err = jobauth.FromEnv(os.Getenv); err != nil {
		return err
	}
	cfg.Insecure = jobauth.Insecure(os.Getenv)
	g, err := bootstrap.Join(ctx, cfg)
	if err != nil {
		return err
	}
	defer g.Close()
	rank, size := g.Rank(), g.Size()
	vcfg, err := verbsio.ConfigFromEnv()
	if err != nil {
		return err
	}
	dev, err := verbsio.Open(provider, vcfg)
	if err != nil {
		return err
	}
	defer dev.Close()

	// One region: slot p receives rank p's bytes; slot rank is the source.
	mem, err := unix.Mmap(-1, 0, size*chunk, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return err
	}
	defer unix.Munmap(mem)
	base := uintptr(unsafe.Pointer(&mem[0]))
	mesh, err := bootstrap.ConnectAll(ctx, g, dev, bootstrap.MeshOptions{
		BeforeConnect: func(peer int, qp verbsio.QueuePair) error {
			return qp.PostRecv([]verbsio.RecvWR{{WRID: uint64(peer)}})
		},
	})
	if err != nil {
		return err
	}
	defer mesh.Close()
	mr, err := mesh.PD.RegisterMemory(base, len(mem), verbsio.AccessLocalWrite|verbsio.AccessRemoteWrite)
	if err != nil {
		return err
	}
	defer mr.Close()
	info := binary.BigEndian.AppendUint64(nil, uint64(base))
	info = binary.BigEndian.AppendUint32(info, mr.RKey())
	all, err := g.AllGather(ctx, info)
	if err != nil {
		return err
	}
	// Sources: one chunk per peer, in this rank's own slot area, taken
	// chunk by chunk from a staging mapping registered alongside.
	src, err := unix.Mmap(-1, 0, size*chunk, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return err
	}
	defer unix.Munmap(src)
	smr, err := mesh.PD.RegisterMemory(uintptr(unsafe.Pointer(&src[0])), len(src), verbsio.AccessLocalWrite)
	if err != nil {
		return err
	}
	defer smr.Close()
	for p := 0; p < size; p++ {
		if p == rank {
			continue
		}
		if len(all[p]) != 12 {
			return fmt.Errorf("rank %d sent %d bytes of region info", p, len(all[p]))
		}
		addr, rkey := binary.BigEndian.Uint64(all[p]), binary.BigEndian.Uint32(all[p][8:])
		s := src[p*chunk : (p+1)*chunk]
		fill(s, rank, p)
		wr := verbsio.SendWR{WRID: uint64(p), Op: verbsio.OpWriteImm, Imm: uint32(rank), Signaled: true,
			SG:         []verbsio.SGE{{Addr: smr.Addr() + uintptr(p*chunk), Length: uint32(chunk), LKey: smr.LKey()}},
			RemoteAddr: addr + uint64(rank*chunk), RKey: rkey}
		if err := mesh.QPs[p].PostSend([]verbsio.SendWR{wr}); err != nil {
			return fmt.Errorf("posting the write to rank %d: %w", p, err)
		}
	}
	buf := make([]verbsio.Completion, size)
	for sent := 0; sent < size-1; {
		n, err := mesh.SendCQ.Wait(ctx, buf)
		if err != nil {
			return fmt.Errorf("waiting for write completions (%d of %d): %w", sent, size-1, err)
		}
		for _, c := range buf[:n] {
			if c.Status != verbsio.StatusSuccess {
				return fmt.Errorf("write to rank %d: %w", c.WRID, c.Status.Err())
			}
		}
		sent += n
	}
	want := make([]byte, chunk)
	seen := map[uint32]bool{}
	for got := 0; got < size-1; {
		n, err := mesh.RecvCQ.Wait(ctx, buf)
		if err != nil {
			return fmt.Errorf("waiting for peers' writes (%d of %d): %w", got, size-1, err)
		}
		for _, c := range buf[:n] {
			q := int(c.Imm)
			switch {
			case c.Status != verbsio.StatusSuccess:
				return fmt.Errorf("receive from rank %d: %w", c.WRID, c.Status.Err())
			case !c.HasImm || q >= size || q == rank || seen[c.Imm] || c.WRID != uint64(q):
				return fmt.Errorf("unexpected completion %+v", c)
			case c.ByteLen != uint32(chunk):
				return fmt.Errorf("rank %d wrote %d bytes, want %d", q, c.ByteLen, chunk)
			}
			seen[c.Imm] = true
			fill(want, q, rank)
			if string(mem[q*chunk:(q+1)*chunk]) != string(want) {
				return fmt.Errorf("the bytes rank %d wrote differ", q)
			}
		}
		got += n
	}
	if err := g.Barrier(ctx); err != nil {
		return err
	}
	fmt.Printf("rank %d of %d: %d peers wrote %d bytes each, intact\n", rank, size, size-1, chunk)
	return nil
}

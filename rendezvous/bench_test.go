package rendezvous

import (
	"context"
	"fmt"
	"testing"

	"github.com/gdrlink/gdrlink/gpusim"
	"github.com/gdrlink/gdrlink/tensor"
)

// benchSides opens two sides of provider for a benchmark, closed when it
// ends; it skips where the provider is unavailable.
func benchSides(b *testing.B, provider string) (a, c *side) {
	b.Helper()
	a, err := openSide(provider, "a")
	if err != nil {
		b.Skipf("provider %s unavailable here: %v", provider, err)
	}
	b.Cleanup(func() { _ = a.close() })
	c, err = openSide(provider, "b")
	if err != nil {
		b.Skipf("provider %s unavailable here: %v", provider, err)
	}
	b.Cleanup(func() { _ = c.close() })
	return a, c
}

// BenchmarkRecv is one steady-state Recv (meta-data cached, Send already
// in) between two channels of this process, per provider and size.
func BenchmarkRecv(b *testing.B) {
	for _, provider := range providersUnderTest() {
		for _, size := range []int64{4 << 10, 16 << 20} {
			b.Run(fmt.Sprintf("%s/%dB", provider, size), func(b *testing.B) {
				a, c := benchSides(b, provider)
				benchRecvLoop(b, a, c, size, nil)
			})
		}
	}
}

// BenchmarkRecvSmall is one steady-state exchange of a small tensor (8 B
// and 4 KiB: a SendFunc and the Recv that takes it, meta-data cached)
// between two channels of this process, per provider, with the
// allocations of both sides per exchange (the README's allocs/op).
func BenchmarkRecvSmall(b *testing.B) {
	for _, provider := range providersUnderTest() {
		for _, size := range []int64{8, 4 << 10} {
			b.Run(fmt.Sprintf("%s/%dB", provider, size), func(b *testing.B) {
				a, c := benchSides(b, provider)
				b.ReportAllocs()
				benchRecvLoop(b, a, c, size, nil)
			})
		}
	}
}

// BenchmarkRecvRails compares one steady-state Recv of a large tensor over
// one tcp device with the same Recv striped over two (two devices on
// loopback per side, standing in for two NICs).
func BenchmarkRecvRails(b *testing.B) {
	const size = 64 << 20
	for _, rails := range []int{1, 2} {
		b.Run(fmt.Sprintf("tcp/%drails/%dB", rails, size), func(b *testing.B) {
			listen := make([]string, rails)
			for i := range listen {
				listen[i] = "127.0.0.1:0"
			}
			a, err := openSideRails("tcp", "a", listen, withStripeMin(1<<20))
			if err != nil {
				b.Skipf("tcp unavailable: %v", err)
			}
			defer a.close()
			c, err := openSideRails("tcp", "b", listen, withStripeMin(1<<20))
			if err != nil {
				b.Skipf("tcp unavailable: %v", err)
			}
			defer c.close()
			benchRecvLoop(b, a, c, size, nil)
			if rails > 1 && a.ch.Stats().Striped == 0 {
				b.Fatal("nothing was striped")
			}
		})
	}
}

// BenchmarkRecvProxy is one steady-state Recv of a 64 MiB result onto a
// simulated GPU the NIC cannot write, whose copies run at 500 MB/s (paced
// by sleeping, so they leave the CPU to the network): in one write then one
// copy (WithProxyChunk(0)), and pipelined in 4 MiB chunks, each copied as
// it lands, which approaches the copy's time alone. The figures are of tcp
// on loopback and a simulated device: the ratio shows the overlap, not any
// real hardware.
func BenchmarkRecvProxy(b *testing.B) {
	const size = 64 << 20
	for _, chunk := range []int{0, defaultProxyChunk} {
		name := "one-write"
		if chunk > 0 {
			name = fmt.Sprintf("chunks-of-%dMiB", chunk>>20)
		}
		b.Run(fmt.Sprintf("tcp/%s/%dB", name, size), func(b *testing.B) {
			a, err := openSide("tcp", "a")
			if err != nil {
				b.Skipf("tcp unavailable: %v", err)
			}
			defer a.close()
			c, err := openProxySideOn("tcp", "b", gpusim.Config{Bandwidth: 500e6}, WithProxyChunk(chunk))
			if err != nil {
				b.Skipf("tcp unavailable: %v", err)
			}
			defer c.close()
			benchRecvLoop(b, a, c.side, size, func(tr Transfer) error {
				if tr.Path != PathProxy || (chunk > 0) != (tr.Chunks > 1) {
					return fmt.Errorf("path %s in %d chunks", tr.Path, tr.Chunks)
				}
				return nil
			}, OnDevice(tensor.GPUDevice(0)))
		})
	}
}

// benchRecvLoop connects a and c, then times b.N steady-state transfers of
// a size-byte tensor from a to c (the first, untimed, makes the meta-data
// round trip). check, when not nil, vets every transfer.
func benchRecvLoop(b *testing.B, a, c *side, size int64, check func(Transfer) error, opts ...RecvOption) {
	b.Helper()
	ctx := context.Background()
	errc := make(chan error, 1)
	go func() { errc <- a.ch.Connect(ctx, c.ch.Hello()) }()
	if err := c.ch.Connect(ctx, a.ch.Hello()); err != nil {
		b.Fatal(err)
	}
	if err := <-errc; err != nil {
		b.Fatal(err)
	}
	meta, _ := tensor.MetaFor(tensor.Uint8, tensor.Shape{size})
	src, err := a.pool.NewTensor(meta)
	if err != nil {
		b.Fatal(err)
	}
	defer src.Release()
	step := int64(0)
	recv := func() {
		if err := a.ch.SendFunc("x", step, src, func(error) {}); err != nil {
			b.Fatal(err)
		}
		got, tr, err := c.ch.Recv(ctx, "x", step, opts...)
		if err != nil {
			b.Fatal(err)
		}
		if check != nil {
			if err := check(tr); err != nil {
				b.Fatal(err)
			}
		}
		_ = got.Release()
		step++
	}
	recv()
	b.SetBytes(size)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		recv()
	}
	b.StopTimer()
}

// BenchmarkRecvChecksum is BenchmarkRecv with checksum mode off, on, and
// on without confirmations (as with a peer of the first release), side by
// side per provider and size: what the CRC-32C of the source, its check
// on arrival and the receiver's CONFIRM cost. Run it with -count (better:
// each case alternately, as scripts/checksum-cost.sh does) and compare
// medians (the README's figures).
func BenchmarkRecvChecksum(b *testing.B) {
	noConfirm := func(o *options) error { o.firstRelease = true; return nil }
	for _, provider := range providersUnderTest() {
		for _, size := range []int64{4 << 10, 1 << 20, 16 << 20} {
			for _, mode := range []string{"off", "on", "on-noconfirm"} {
				b.Run(fmt.Sprintf("%s/%dB/checksum=%s", provider, size, mode), func(b *testing.B) {
					// The write path's checksums: nothing goes eagerly.
					opts := []Option{WithChecksum(mode != "off"), WithEager(0)}
					if mode == "on-noconfirm" {
						opts = append(opts, noConfirm)
					}
					a, err := openSide(provider, "a", opts...)
					if err != nil {
						b.Skipf("provider %s unavailable here: %v", provider, err)
					}
					defer a.close()
					c, err := openSide(provider, "b", opts...)
					if err != nil {
						b.Skipf("provider %s unavailable here: %v", provider, err)
					}
					defer c.close()
					benchRecvLoop(b, a, c, size, func(tr Transfer) error {
						if tr.Checksummed != (mode != "off") {
							return fmt.Errorf("checksummed %v in mode %s", tr.Checksummed, mode)
						}
						return nil
					})
					if want := mode == "on"; (c.ch.Stats().ConfirmsOut > 0) != want {
						b.Fatalf("mode %s: %d confirmations", mode, c.ch.Stats().ConfirmsOut)
					}
				})
			}
		}
	}
}

package rendezvous

import (
	"context"
	"fmt"
	"testing"

	"github.com/gdrlink/gdrlink/tensor"
)

// BenchmarkRecv is one steady-state Recv (meta-data cached, Send already
// in) between two channels of this process, per provider and size.
func BenchmarkRecv(b *testing.B) {
	for _, provider := range providersUnderTest() {
		for _, size := range []int64{4 << 10, 16 << 20} {
			b.Run(fmt.Sprintf("%s/%dB", provider, size), func(b *testing.B) {
				a, err := openSide(provider, "a")
				if err != nil {
					b.Skipf("provider %s unavailable here: %v", provider, err)
				}
				defer a.close()
				c, err := openSide(provider, "b")
				if err != nil {
					b.Skipf("provider %s unavailable here: %v", provider, err)
				}
				defer c.close()
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
					got, _, err := c.ch.Recv(ctx, "x", step)
					if err != nil {
						b.Fatal(err)
					}
					_ = got.Release()
					step++
				}
				recv() // the meta-data round trip
				b.SetBytes(size)
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					recv()
				}
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
			a, err := openSideRails("tcp", "a", listen, WithStripeMin(1<<20))
			if err != nil {
				b.Skipf("tcp unavailable: %v", err)
			}
			defer a.close()
			c, err := openSideRails("tcp", "b", listen, WithStripeMin(1<<20))
			if err != nil {
				b.Skipf("tcp unavailable: %v", err)
			}
			defer c.close()
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
				got, _, err := c.ch.Recv(ctx, "x", step)
				if err != nil {
					b.Fatal(err)
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
			if rails > 1 && a.ch.Stats().Striped == 0 {
				b.Fatal("nothing was striped")
			}
		})
	}
}

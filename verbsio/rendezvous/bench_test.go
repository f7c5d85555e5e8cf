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

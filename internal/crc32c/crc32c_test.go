package crc32c

import (
	"fmt"
	"hash/crc32"
	"math/rand/v2"
	"runtime"
	"testing"
)

// TestCombine: the CRC of A and B combined is hash/crc32's CRC of A
// followed by B, for lengths around the powers of two and at random.
func TestCombine(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	buf := make([]byte, 1<<16)
	for i := range buf {
		buf[i] = byte(rng.Uint32())
	}
	lens := []int{0, 1, 2, 3, 7, 8, 9, 255, 256, 257, 4095, 4096, 65535, 1 << 16}
	for range 50 {
		lens = append(lens, rng.IntN(len(buf)+1))
	}
	for _, la := range lens {
		for _, lb := range []int{0, 1, 5, 64, 1000, len(buf) - la} {
			if lb < 0 || la+lb > len(buf) {
				continue
			}
			a, b := buf[:la], buf[la:la+lb]
			want := crc32.Checksum(buf[:la+lb], table)
			if got := Combine(crc32.Checksum(a, table), crc32.Checksum(b, table), int64(lb)); got != want {
				t.Fatalf("Combine of %d and %d bytes: %#x, want %#x", la, lb, got, want)
			}
		}
	}
}

// TestChecksum: Checksum equals hash/crc32's for sizes below, at and above
// the parallel threshold, with several GOMAXPROCS.
func TestChecksum(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	buf := make([]byte, 9*MinPart+12345)
	for i := range buf {
		buf[i] = byte(rng.Uint32())
	}
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(0))
	for _, procs := range []int{1, 2, 3, 8} {
		runtime.GOMAXPROCS(procs)
		for _, n := range []int{0, 1, MinPart, 2*MinPart - 1, 2 * MinPart, 2*MinPart + 1, 5*MinPart + 7, len(buf)} {
			if got, want := Checksum(buf[:n]), crc32.Checksum(buf[:n], table); got != want {
				t.Errorf("GOMAXPROCS %d, %d bytes: %#x, want %#x", procs, n, got, want)
			}
		}
	}
}

// FuzzCombine: any split of any buffer combines to the whole's CRC.
func FuzzCombine(f *testing.F) {
	f.Add([]byte("123456789"), 4)
	f.Add([]byte{}, 0)
	f.Fuzz(func(t *testing.T, b []byte, cut int) {
		if cut < 0 || cut > len(b) {
			return
		}
		want := crc32.Checksum(b, table)
		if got := Combine(crc32.Checksum(b[:cut], table), crc32.Checksum(b[cut:], table), int64(len(b)-cut)); got != want {
			t.Fatalf("split at %d of %d: %#x, want %#x", cut, len(b), got, want)
		}
	})
}

// BenchmarkChecksum: the parallel CRC against hash/crc32 on one core,
// 16 MiB, in the same run.
func BenchmarkChecksum(b *testing.B) {
	buf := make([]byte, 16<<20)
	for i := range buf {
		buf[i] = byte(i * 7)
	}
	for _, c := range []struct {
		name string
		f    func([]byte) uint32
	}{
		{"hash-crc32", func(p []byte) uint32 { return crc32.Checksum(p, table) }},
		{"update", func(p []byte) uint32 { return Update(0, p) }},
		{"parallel", Checksum},
	} {
		for _, n := range []int{64 << 10, len(buf)} {
			b.Run(fmt.Sprintf("%s/%dKiB", c.name, n>>10), func(b *testing.B) {
				b.SetBytes(int64(n))
				for b.Loop() {
					c.f(buf[:n])
				}
			})
		}
	}
}

// ExampleChecksum takes the CRC-32C of the standard check string.
func ExampleChecksum() {
	fmt.Printf("%#x\n", Checksum([]byte("123456789")))
	// Output: 0xe3069283
}

package flush

import (
	"context"
	"errors"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/gdrlink/gdrlink/proxy"
	"github.com/gdrlink/gdrlink/verbsio"
	_ "github.com/gdrlink/gdrlink/verbsio/tcp"
)

// TestFlusherLoopbackRead runs the GPUDirect flush's loopback read on the TCP
// provider, with host memory standing in for the GPU region: the read is
// real, and a wrong key fails as a remote access error.
func TestFlusherLoopbackRead(t *testing.T) {
	dev, err := verbsio.Open("tcp", verbsio.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Close()
	pd, err := dev.AllocPD()
	if err != nil {
		t.Fatal(err)
	}
	defer pd.Close()
	target, err := unix.Mmap(-1, 0, 1<<16, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(target)
	base := uintptr(unsafe.Pointer(&target[0]))
	mr, err := pd.RegisterMemory(base, len(target), verbsio.AccessLocalWrite|verbsio.AccessRemoteRead|verbsio.AccessRemoteWrite)
	if err != nil {
		t.Fatal(err)
	}
	defer mr.Close()
	key := mr.RKey()
	keyOf := func(addr uintptr) (uint32, bool) {
		if addr >= base && addr < base+uintptr(len(target)) {
			return key, true
		}
		return 0, false
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	f, err := New(ctx, dev, pd, keyOf)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for i := 0; i < 3; i++ {
		if err := f.Flush(ctx, base+uintptr(i*4096)); err != nil {
			t.Fatalf("flush %d: %v", i, err)
		}
	}
	if err := f.Flush(ctx, base-1<<20); !errors.Is(err, verbsio.ErrRemoteAccess) {
		t.Fatalf("flush of an unregistered address: %v, want ErrRemoteAccess", err)
	}
	key ^= 0x5a5a
	if err := f.Flush(ctx, base); !errors.Is(err, verbsio.ErrRemoteAccess) {
		t.Fatalf("flush with a wrong rkey: %v, want ErrRemoteAccess", err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if err := f.Flush(ctx, base); !errors.Is(err, proxy.ErrClosed) {
		t.Fatalf("flush after Close: %v", err)
	}
}

package ibverbs

import (
	"fmt"
	"strings"
	"syscall"
	"testing"

	"github.com/gdrlink/gdrlink/verbsio"
)

// TestDMABufProbeVerdict: only the EBADF of a device that has the verb (or
// an unexpected success) counts as dma-buf support; EOPNOTSUPP and ENOSYS
// say there is none, and any other answer is not counted, with its reason.
func TestDMABufProbeVerdict(t *testing.T) {
	for _, c := range []struct {
		err  error
		ok   bool
		want string
	}{
		{nil, true, ""},
		{fmt.Errorf("ibv_reg_dmabuf_mr: %w", syscall.EBADF), true, ""},
		{fmt.Errorf("ibv_reg_dmabuf_mr: %w", syscall.EOPNOTSUPP), false, "has no dma-buf registration"},
		{fmt.Errorf("ibv_reg_dmabuf_mr: %w", syscall.ENOSYS), false, "has no dma-buf registration"},
		{fmt.Errorf("ibv_reg_dmabuf_mr: %w", syscall.EINVAL), false, "not counted as support"},
		{fmt.Errorf("ibv_reg_dmabuf_mr: %w", syscall.EPERM), false, "not counted as support"},
	} {
		ok, why := dmabufProbeVerdict("mlx5_0", c.err)
		if ok != c.ok || (c.want == "") != (why == "") || !strings.Contains(why, c.want) {
			t.Errorf("probe %v: %v %q, want %v and a reason with %q", c.err, ok, why, c.ok, c.want)
		}
	}
}

// TestDMABufFirstRegistrationSettles: a device whose probe counted dma-buf
// as supported reports it no more once a real registration is refused as
// unsupported, with the refusal as the reason; other failures (a bad
// descriptor) leave it supported.
func TestDMABufFirstRegistrationSettles(t *testing.T) {
	d := &device{caps: verbsio.Caps{DMABuf: true}}
	for _, err := range []error{nil, syscall.EBADF, syscall.EINVAL} {
		if why := dmabufRefusal("mlx5_0", err); why != "" {
			t.Fatalf("registration answer %v counted as a refusal: %q", err, why)
		}
	}
	if !d.Caps().DMABuf || d.DMABufReason() != "" {
		t.Fatalf("before any refusal: %v %q", d.Caps().DMABuf, d.DMABufReason())
	}
	why := dmabufRefusal("mlx5_0", fmt.Errorf("ibv_reg_dmabuf_mr: %w", syscall.EOPNOTSUPP))
	if why == "" {
		t.Fatal("EOPNOTSUPP from a real registration is no refusal")
	}
	d.dmabufRefused.CompareAndSwap(nil, &why)
	if d.Caps().DMABuf || !strings.Contains(d.DMABufReason(), "refused a dma-buf registration") {
		t.Fatalf("after a refusal: %v %q", d.Caps().DMABuf, d.DMABufReason())
	}
}

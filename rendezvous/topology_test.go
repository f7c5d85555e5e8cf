package rendezvous

import (
	"errors"
	"strings"
	"testing"

	"github.com/gdrlink/gdrlink/gdr"
	"github.com/gdrlink/gdrlink/verbsio"
)

func TestClosest(t *testing.T) {
	d := func(name string, node int) verbsio.DeviceInfo { return verbsio.DeviceInfo{Name: name, NUMANode: node} }
	cases := []struct {
		devs []verbsio.DeviceInfo
		node int
		want string
	}{
		{[]verbsio.DeviceInfo{d("mlx5_0", 0)}, 1, "mlx5_0"},
		{[]verbsio.DeviceInfo{d("mlx5_0", 0), d("mlx5_1", 1)}, 1, "mlx5_1"},
		{[]verbsio.DeviceInfo{d("mlx5_0", 0), d("mlx5_1", 1)}, 0, "mlx5_0"},
		{[]verbsio.DeviceInfo{d("mlx5_0", 0), d("rxe0", -1)}, 1, "rxe0"},
		{[]verbsio.DeviceInfo{d("mlx5_0", 0), d("mlx5_1", 1)}, 3, "mlx5_0"},
		{[]verbsio.DeviceInfo{d("mlx5_0", 0), d("mlx5_1", 1)}, -1, "mlx5_0"},
	}
	for _, c := range cases {
		got, reason, err := closest(c.devs, c.node)
		if err != nil || got.Name != c.want || reason == "" {
			t.Errorf("closest(%v, %d) = %s (%q), %v; want %s", c.devs, c.node, got.Name, reason, err, c.want)
		}
	}
	if _, _, err := closest(nil, 0); !errors.Is(err, verbsio.ErrNoDevice) {
		t.Errorf("closest of nothing = %v", err)
	}
}

func TestForGPU(t *testing.T) {
	devs := []verbsio.DeviceInfo{{Name: "mlx5_0", NUMANode: 0}, {Name: "mlx5_1", NUMANode: 1}}
	got, reason, err := forGPU(devs, gdr.Decision{GPU: 3, Mode: gdr.Direct, NIC: "mlx5_1", PathType: gdr.PathPIX, Reasons: []string{"same switch"}}, 0)
	if err != nil || got.Name != "mlx5_1" || !strings.Contains(reason, "gdr") {
		t.Fatalf("gdr's NIC: %s %q %v", got.Name, reason, err)
	}
	got, reason, err = forGPU(devs, gdr.Decision{GPU: 3, Mode: gdr.Unavailable}, 1)
	if err != nil || got.Name != "mlx5_1" || !strings.Contains(reason, "no RDMA path") {
		t.Fatalf("no decision: %s %q %v", got.Name, reason, err)
	}
	got, reason, err = forGPU(devs, gdr.Decision{GPU: 3, Mode: gdr.Proxy, NIC: "rxe0"}, 0)
	if err != nil || got.Name != "mlx5_0" || !strings.Contains(reason, "does not have") {
		t.Fatalf("other provider's NIC: %s %q %v", got.Name, reason, err)
	}
}

package rendezvous

import (
	"errors"
	"testing"

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
		got, reason, err := Closest(c.devs, c.node)
		if err != nil || got.Name != c.want || reason == "" {
			t.Errorf("Closest(%v, %d) = %s (%q), %v; want %s", c.devs, c.node, got.Name, reason, err, c.want)
		}
	}
	if _, _, err := Closest(nil, 0); !errors.Is(err, verbsio.ErrNoDevice) {
		t.Errorf("Closest of nothing = %v", err)
	}
}

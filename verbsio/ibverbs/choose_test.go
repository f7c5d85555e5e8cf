package ibverbs

import (
	"errors"
	"strings"
	"testing"

	"github.com/gdrlink/gdrlink/internal/ibv"
	"github.com/gdrlink/gdrlink/verbsio"
)

func gid(s string) ibv.GID {
	var g ibv.GID
	switch s {
	case "v4":
		g = ibv.GID{10: 0xff, 11: 0xff, 12: 10, 13: 0, 14: 0, 15: 1}
	case "ll":
		g = ibv.GID{0: 0xfe, 1: 0x80, 15: 1}
	case "v6":
		g = ibv.GID{0: 0x20, 1: 0x01, 2: 0x0d, 3: 0xb8, 15: 1}
	}
	return g
}

func rocePort(num int, state int, gids ...ibv.GIDEntry) portFacts {
	return portFacts{Num: num, Attr: ibv.PortAttr{State: state, ActiveMTU: 1024, MaxMTU: 4096, LinkLayer: ibv.LinkLayerEthernet, PKeyTblLen: 1}, GIDs: gids}
}

func TestChoose(t *testing.T) {
	mixed := rocePort(1, ibv.PortActive,
		ibv.GIDEntry{Index: 0, GID: gid("ll"), Type: ibv.GIDTypeRoCEv1},
		ibv.GIDEntry{Index: 1, GID: gid("ll"), Type: ibv.GIDTypeRoCEv2},
		ibv.GIDEntry{Index: 2, GID: gid("v4"), Type: ibv.GIDTypeRoCEv1},
		ibv.GIDEntry{Index: 3, GID: gid("v4"), Type: ibv.GIDTypeRoCEv2},
		ibv.GIDEntry{Index: 4, GID: gid("v6"), Type: ibv.GIDTypeRoCEv2})
	ib := portFacts{Num: 1, Attr: ibv.PortAttr{State: ibv.PortActive, ActiveMTU: 4096, MaxMTU: 4096, LID: 12, LinkLayer: ibv.LinkLayerInfiniBand},
		GIDs: []ibv.GIDEntry{{Index: 0, GID: gid("ll"), Type: ibv.GIDTypeIB}}}
	down := rocePort(1, ibv.PortDown, ibv.GIDEntry{Index: 0, GID: gid("v4"), Type: ibv.GIDTypeRoCEv2})
	devs := []deviceFacts{{Name: "mlx5_0", Ports: []portFacts{down}}, {Name: "mlx5_1", Ports: []portFacts{mixed}}, {Name: "mlx5_2", Ports: []portFacts{ib}}}
	def := verbsio.DefaultConfig()
	with := func(f func(*verbsio.Config)) verbsio.Config { c := def; f(&c); return c }
	for _, tc := range []struct {
		name   string
		devs   []deviceFacts
		cfg    verbsio.Config
		dev    string
		gid    int
		global bool
		mtu    int
		err    error
		says   string
	}{
		{name: "first active, RoCE v2 IPv4", devs: devs, cfg: def, dev: "mlx5_1", gid: 3, global: true, mtu: 1024},
		{name: "named IB device routes by LID", devs: devs, cfg: with(func(c *verbsio.Config) { c.Device = "mlx5_2" }), dev: "mlx5_2", gid: 0, mtu: 4096},
		{name: "explicit GID index", devs: devs, cfg: with(func(c *verbsio.Config) { c.GIDIndex = 4 }), dev: "mlx5_1", gid: 4, global: true, mtu: 1024},
		{name: "explicit MTU", devs: devs, cfg: with(func(c *verbsio.Config) { c.MTU = 2048 }), dev: "mlx5_1", gid: 3, global: true, mtu: 2048},
		{name: "v2 link-local beats v1", devs: []deviceFacts{{Name: "a", Ports: []portFacts{rocePort(1, ibv.PortActive,
			ibv.GIDEntry{Index: 0, GID: gid("v4"), Type: ibv.GIDTypeRoCEv1}, ibv.GIDEntry{Index: 1, GID: gid("ll"), Type: ibv.GIDTypeRoCEv2})}}},
			cfg: def, dev: "a", gid: 1, global: true, mtu: 1024},
		{name: "unknown device", devs: devs, cfg: with(func(c *verbsio.Config) { c.Device = "rxe9" }), err: verbsio.ErrBadConfig, says: "mlx5_0, mlx5_1, mlx5_2"},
		{name: "unknown port", devs: devs, cfg: with(func(c *verbsio.Config) { c.Device = "mlx5_1"; c.Port = 2 }), err: verbsio.ErrBadConfig, says: "ports: 1"},
		{name: "unknown GID", devs: devs, cfg: with(func(c *verbsio.Config) { c.GIDIndex = 9 }), err: verbsio.ErrBadConfig, says: "3 10.0.0.1 (RoCE v2)"},
		{name: "MTU above port", devs: devs, cfg: with(func(c *verbsio.Config) { c.Device = "mlx5_1"; c.MTU = 4096; c.Port = 1 }), dev: "mlx5_1", gid: 3, global: true, mtu: 4096},
		{name: "port down", devs: devs, cfg: with(func(c *verbsio.Config) { c.Device = "mlx5_0" }), err: verbsio.ErrNoDevice, says: "mlx5_0 port 1 is DOWN"},
		{name: "RoCE without GIDs", devs: []deviceFacts{{Name: "a", Ports: []portFacts{rocePort(1, ibv.PortActive)}}}, cfg: def, err: verbsio.ErrNoDevice, says: "no GID"},
		{name: "device error", devs: []deviceFacts{{Name: "a", Err: errors.New("permission denied")}}, cfg: def, err: verbsio.ErrNoDevice, says: "permission denied"},
		{name: "pkey index", devs: devs, cfg: with(func(c *verbsio.Config) { c.PKeyIndex = 3 }), err: verbsio.ErrBadConfig, says: "RDMA_QP_PKEY_INDEX=3"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := choose(tc.devs, tc.cfg)
			if tc.err != nil {
				if !errors.Is(err, tc.err) || !strings.Contains(err.Error(), tc.says) {
					t.Fatalf("choose: %v, want %v saying %q", err, tc.err, tc.says)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if c.Device != tc.dev || c.GID.Index != tc.gid || c.Global != tc.global || c.MTU != tc.mtu {
				t.Fatalf("chose %s gid %d global %v mtu %d; want %s gid %d global %v mtu %d", c.Device, c.GID.Index, c.Global, c.MTU, tc.dev, tc.gid, tc.global, tc.mtu)
			}
		})
	}
	// An MTU above the port's largest is refused.
	small := rocePort(1, ibv.PortActive, ibv.GIDEntry{Index: 0, GID: gid("v4"), Type: ibv.GIDTypeRoCEv2})
	small.Attr.MaxMTU = 1024
	if _, err := choose([]deviceFacts{{Name: "a", Ports: []portFacts{small}}}, with(func(c *verbsio.Config) { c.MTU = 4096 })); !errors.Is(err, verbsio.ErrBadConfig) {
		t.Errorf("MTU above the port's: %v", err)
	}
}

func TestSysfsFixture(t *testing.T) {
	s := sysfs{root: "testdata/sys"}
	names, err := s.devices()
	if err != nil || len(names) != 1 || names[0] != "rxe0" {
		t.Fatalf("devices: %v, %v", names, err)
	}
	if got := s.gidType("rxe0", 1, 1); got != ibv.GIDTypeRoCEv2 {
		t.Errorf("gid type 1: %v", got)
	}
	if got := s.gidType("rxe0", 1, 0); got != ibv.GIDTypeRoCEv1 {
		t.Errorf("gid type 0: %v", got)
	}
	if got := s.gidType("rxe0", 1, 7); got != ibv.GIDTypeUnknown {
		t.Errorf("missing gid type: %v", got)
	}
	if got := s.netdev("rxe0", 1); got != "lo" {
		t.Errorf("netdev %q", got)
	}
	if numa, pci := s.location("rxe0"); numa != -1 || pci != "" {
		t.Errorf("software device located at numa %d pci %q", numa, pci)
	}
}

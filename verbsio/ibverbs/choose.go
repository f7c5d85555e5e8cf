package ibverbs

import (
	"fmt"
	"sort"
	"strings"

	"github.com/gdrlink/gdrlink/internal/ibv"
	"github.com/gdrlink/gdrlink/verbsio"
)

// portFacts is what the provider learned of one port.
type portFacts struct {
	Num  int
	Attr ibv.PortAttr
	// GIDs are the valid (non-zero) entries of the GID table.
	GIDs []ibv.GIDEntry
}

// deviceFacts is what the provider learned of one device.
type deviceFacts struct {
	Name  string
	Ports []portFacts
	// Err is why the device could not be queried, if it could not.
	Err error
}

// choice is a device, port, GID and MTU.
type choice struct {
	Device string
	Port   portFacts
	GID    ibv.GIDEntry
	// Global: the route needs a GRH (RoCE, or a GID index chosen on IB).
	Global bool
	MTU    int
}

// gidRank orders GIDs of a RoCE port: RoCE v2 before v1, IPv4-mapped before
// other addresses, link-local last. Lower is better.
func gidRank(e ibv.GIDEntry) int {
	r := 0
	switch e.Type {
	case ibv.GIDTypeRoCEv2:
	case ibv.GIDTypeRoCEv1:
		r += 10
	default:
		r += 20
	}
	switch {
	case e.GID.IsIPv4Mapped():
	case e.GID.IsLinkLocal():
		r += 2
	default:
		r++
	}
	return r
}

// choose picks a device, port, GID and MTU from the facts and the
// configuration. Names that do not exist are errors wrapping ErrBadConfig
// that list what exists; no usable device is an error wrapping ErrNoDevice.
func choose(devs []deviceFacts, cfg verbsio.Config) (choice, error) {
	var ch choice
	names := make([]string, len(devs))
	for i, d := range devs {
		names[i] = d.Name
	}
	cands := devs
	if cfg.Device != "" {
		cands = nil
		for _, d := range devs {
			if d.Name == cfg.Device {
				cands = []deviceFacts{d}
			}
		}
		if cands == nil {
			return ch, fmt.Errorf("%w: RDMA_DEVICE=%q does not exist; devices here: %s", verbsio.ErrBadConfig, cfg.Device, strings.Join(names, ", "))
		}
	}
	var why []string
	for _, d := range cands {
		if d.Err != nil {
			why = append(why, fmt.Sprintf("%s: %v", d.Name, d.Err))
			continue
		}
		ports := d.Ports
		if cfg.Port != 0 {
			ports = nil
			var have []string
			for _, p := range d.Ports {
				have = append(have, fmt.Sprint(p.Num))
				if p.Num == cfg.Port {
					ports = []portFacts{p}
				}
			}
			if ports == nil {
				return ch, fmt.Errorf("%w: RDMA_DEVICE_PORT=%d does not exist on %s; ports: %s", verbsio.ErrBadConfig, cfg.Port, d.Name, strings.Join(have, ", "))
			}
		}
		for _, p := range ports {
			if p.Attr.State != ibv.PortActive {
				why = append(why, fmt.Sprintf("%s port %d is %s", d.Name, p.Num, ibv.PortStateName(p.Attr.State)))
				continue
			}
			c, err := choosePort(d.Name, p, cfg)
			if err != nil {
				return ch, err
			}
			return c, nil
		}
	}
	if len(why) == 0 {
		why = append(why, "no devices")
	}
	return ch, fmt.Errorf("%w: no active RDMA port (%s)", verbsio.ErrNoDevice, strings.Join(why, "; "))
}

func choosePort(dev string, p portFacts, cfg verbsio.Config) (choice, error) {
	c := choice{Device: dev, Port: p}
	roce := p.Attr.LinkLayer == ibv.LinkLayerEthernet
	if cfg.GIDIndex >= 0 {
		found := false
		for _, g := range p.GIDs {
			if g.Index == cfg.GIDIndex {
				c.GID, found = g, true
			}
		}
		if !found {
			return c, fmt.Errorf("%w: RDMA_GID_INDEX=%d is not a valid GID of %s port %d; GIDs: %s", verbsio.ErrBadConfig, cfg.GIDIndex, dev, p.Num, describeGIDs(p.GIDs))
		}
		c.Global = true
	} else if roce {
		if len(p.GIDs) == 0 {
			return c, fmt.Errorf("%w: %s port %d is RoCE and has no GID (no IP address on its network interface?)", verbsio.ErrNoDevice, dev, p.Num)
		}
		gids := append([]ibv.GIDEntry(nil), p.GIDs...)
		sort.SliceStable(gids, func(i, j int) bool {
			ri, rj := gidRank(gids[i]), gidRank(gids[j])
			if ri != rj {
				return ri < rj
			}
			return gids[i].Index < gids[j].Index
		})
		c.GID, c.Global = gids[0], true
	} else if len(p.GIDs) > 0 {
		// InfiniBand: route by LID; the GID still travels for reference.
		c.GID = p.GIDs[0]
	}
	if roce {
		c.Global = true
	}
	if !c.Global && p.Attr.LID == 0 {
		return c, fmt.Errorf("%w: %s port %d has no LID (no subnet manager?) and no GID was chosen", verbsio.ErrNoDevice, dev, p.Num)
	}
	c.MTU = p.Attr.ActiveMTU
	if cfg.MTU != 0 {
		if cfg.MTU > p.Attr.MaxMTU {
			return c, fmt.Errorf("%w: RDMA_QP_MTU=%d exceeds the largest MTU %d of %s port %d", verbsio.ErrBadConfig, cfg.MTU, p.Attr.MaxMTU, dev, p.Num)
		}
		c.MTU = cfg.MTU
	}
	if ibv.MTUEnum(c.MTU) == 0 {
		return c, fmt.Errorf("%w: %s port %d reports no usable MTU (%d)", verbsio.ErrNoDevice, dev, p.Num, c.MTU)
	}
	if cfg.PKeyIndex >= p.Attr.PKeyTblLen && p.Attr.PKeyTblLen > 0 {
		return c, fmt.Errorf("%w: RDMA_QP_PKEY_INDEX=%d, %s port %d has %d P_Keys", verbsio.ErrBadConfig, cfg.PKeyIndex, dev, p.Num, p.Attr.PKeyTblLen)
	}
	return c, nil
}

func describeGIDs(gids []ibv.GIDEntry) string {
	if len(gids) == 0 {
		return "none"
	}
	parts := make([]string, len(gids))
	for i, g := range gids {
		parts[i] = fmt.Sprintf("%d %s (%s)", g.Index, g.GID, g.Type)
	}
	return strings.Join(parts, ", ")
}

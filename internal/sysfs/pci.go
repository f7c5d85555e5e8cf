package sysfs

import (
	"encoding/binary"
	"fmt"
	"path"
	"strconv"
	"strings"
)

// PCI vendor and class codes gdr looks for.
const (
	VendorNVIDIA    = 0x10de
	VendorMellanox  = 0x15b3
	ClassVGA        = 0x0300 // display controller, VGA compatible
	Class3D         = 0x0302 // display controller, 3D (data-center GPUs)
	ClassPCIBridge  = 0x0604
	ClassInfiniBand = 0x0207
	ClassEthernet   = 0x0200
)

// ParsePCIAddress returns the canonical form ("0000:3b:00.0") of a PCI
// address written as "0000:3b:00.0", "3b:00.0" or NVML's "00000000:3B:00.0".
func ParsePCIAddress(s string) (string, error) {
	bad := func(why string) (string, error) {
		return "", fmt.Errorf("%w: %q: %s", ErrBadPCIAddress, s, why)
	}
	dom, rest := "0", s
	if i := strings.IndexByte(s, ':'); i >= 0 && strings.Count(s, ":") == 2 {
		dom, rest = s[:i], s[i+1:]
	}
	bus, devfn, ok := strings.Cut(rest, ":")
	if !ok {
		return bad("want domain:bus:device.function")
	}
	dev, fn, ok := strings.Cut(devfn, ".")
	if !ok {
		return bad("want device.function")
	}
	parse := func(v string, bits int) (uint64, bool) {
		if v == "" || len(v) > 8 {
			return 0, false
		}
		n, err := strconv.ParseUint(v, 16, bits)
		return n, err == nil
	}
	d, ok1 := parse(dom, 32)
	b, ok2 := parse(bus, 8)
	v, ok3 := parse(dev, 8)
	f, ok4 := parse(fn, 8)
	if !ok1 || !ok2 || !ok3 || !ok4 || v > 0x1f || f > 7 {
		return bad("field out of range")
	}
	return fmt.Sprintf("%04x:%02x:%02x.%x", d, b, v, f), nil
}

// PCIPath is where a PCI device sits: its host bridge (root complex) and the
// bridges from the root port down to it, as the sysfs device path shows them
// (/sys/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0).
type PCIPath struct {
	// HostBridge names the root complex ("pci0000:3a").
	HostBridge string `json:"host_bridge"`
	// Bridges are the PCI addresses of the bridges above the device, from
	// the root port down.
	Bridges []string `json:"bridges"`
	// Device is the device's own PCI address.
	Device string `json:"device"`
}

// ParsePCIPath parses a sysfs device path, or the target of a link to one
// ("../../../devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0"), into a PCIPath.
// Components after the last PCI address (".../infiniband/mlx5_0") are
// ignored. Virtual machines that put PCI buses under other buses
// (".../VMBUS:00/<id>/pci7870:00/7870:00:00.0") work: the last "pciDDDD:BB"
// component is the host bridge.
func ParsePCIPath(p string) (PCIPath, error) {
	parts := strings.Split(path.Clean(p), "/")
	hb := -1
	for i, c := range parts {
		if isHostBridgeName(c) {
			hb = i
		}
	}
	if hb < 0 {
		return PCIPath{}, fmt.Errorf("%w: %q has no PCI host bridge (pciDDDD:BB) component", ErrMalformed, p)
	}
	out := PCIPath{HostBridge: parts[hb]}
	var addrs []string
	for _, c := range parts[hb+1:] {
		a, err := ParsePCIAddress(c)
		if err != nil || len(c) < 7 {
			break
		}
		addrs = append(addrs, a)
	}
	if len(addrs) == 0 {
		return PCIPath{}, fmt.Errorf("%w: %q has no PCI device below %s", ErrMalformed, p, out.HostBridge)
	}
	out.Device = addrs[len(addrs)-1]
	out.Bridges = addrs[:len(addrs)-1]
	if out.Bridges == nil {
		out.Bridges = []string{}
	}
	return out, nil
}

func isHostBridgeName(c string) bool {
	rest, ok := strings.CutPrefix(c, "pci")
	if !ok {
		return false
	}
	dom, bus, ok := strings.Cut(rest, ":")
	if !ok || dom == "" || len(dom) > 8 || len(bus) != 2 {
		return false
	}
	_, err1 := strconv.ParseUint(dom, 16, 32)
	_, err2 := strconv.ParseUint(bus, 16, 8)
	return err1 == nil && err2 == nil
}

// PCIDevice is what sysfs says about one PCI function.
type PCIDevice struct {
	Address string  `json:"address"`
	Path    PCIPath `json:"path"`
	Vendor  uint16  `json:"vendor"`
	Device  uint16  `json:"device"`
	// Class is the 24-bit class code (0x030200 for a 3D controller).
	Class uint32 `json:"class"`
	// NUMANode is nil when sysfs says -1 (no affinity) or has no numa_node.
	NUMANode *int `json:"numa_node"`
	// LocalCPUs is the CPU list close to the device ("0-27,56-83").
	LocalCPUs string `json:"local_cpus,omitempty"`
	// Driver is the bound driver's name, "" when none.
	Driver string `json:"driver,omitempty"`
	// ACS is the device's Access Control Services capability, nil when the
	// device has none or its config space could not be read (ACSErr says).
	ACS    *ACS   `json:"acs,omitempty"`
	ACSErr string `json:"acs_error,omitempty"`
}

// IsGPU reports whether the device is an NVIDIA display or 3D controller.
func (d *PCIDevice) IsGPU() bool {
	c := d.Class >> 8
	return d.Vendor == VendorNVIDIA && (c == Class3D || c == ClassVGA)
}

// IsBridge reports whether the device is a PCI-to-PCI bridge (a root port or
// a switch port).
func (d *PCIDevice) IsBridge() bool { return d.Class>>8 == ClassPCIBridge }

// ACS control bits (PCIe base specification, ACS extended capability).
const (
	ACSSourceValidation      = 1 << 0
	ACSTranslationBlocking   = 1 << 1
	ACSP2PRequestRedirect    = 1 << 2
	ACSP2PCompletionRedirect = 1 << 3
	ACSUpstreamForwarding    = 1 << 4
	ACSP2PEgressControl      = 1 << 5
	ACSDirectTranslatedP2P   = 1 << 6
)

// extCapACS is the PCIe extended capability ID of Access Control Services.
const extCapACS = 0x000d

// ACS is a bridge's Access Control Services capability and control words.
type ACS struct {
	// Offset is where the capability sits in config space.
	Offset int `json:"offset"`
	// Capability and Control are the 16-bit registers at Offset+4 and +6.
	Capability uint16 `json:"capability"`
	Control    uint16 `json:"control"`
}

// RedirectsP2P reports whether ACS forces peer-to-peer requests or
// completions up to the root complex (request or completion redirect, or
// egress control), which defeats a PCIe switch's direct peer path.
func (a *ACS) RedirectsP2P() bool {
	return a != nil && a.Control&(ACSP2PRequestRedirect|ACSP2PCompletionRedirect|ACSP2PEgressControl) != 0
}

// ParseACS finds the ACS extended capability in a PCI config space image (as
// read from /sys/bus/pci/devices/X/config). It returns (nil, nil) when the
// device has no ACS capability, and an error wrapping ErrNotSupported when
// the image stops before the extended space (unprivileged reads see only
// the first 256 bytes), or ErrMalformed when the capability list is broken.
func ParseACS(config []byte) (*ACS, error) {
	if len(config) < 0x100+4 {
		return nil, fmt.Errorf("%w: config space image has %d bytes, the extended capabilities start at 256 (reading them needs root)", ErrNotSupported, len(config))
	}
	off := 0x100
	for seen := 0; seen < (4096-0x100)/4; seen++ {
		if off+4 > len(config) {
			return nil, fmt.Errorf("%w: extended capability at %#x past the end of config space (%d bytes)", ErrMalformed, off, len(config))
		}
		hdr := binary.LittleEndian.Uint32(config[off:])
		if hdr == 0 || hdr == 0xffffffff {
			return nil, nil
		}
		id := hdr & 0xffff
		next := int(hdr >> 20)
		if id == extCapACS {
			if off+8 > len(config) {
				return nil, fmt.Errorf("%w: ACS capability at %#x is cut short", ErrMalformed, off)
			}
			return &ACS{Offset: off, Capability: binary.LittleEndian.Uint16(config[off+4:]), Control: binary.LittleEndian.Uint16(config[off+6:])}, nil
		}
		if next == 0 {
			return nil, nil
		}
		if next < 0x100 || next&3 != 0 {
			return nil, fmt.Errorf("%w: extended capability at %#x points to %#x", ErrMalformed, off, next)
		}
		off = next
	}
	return nil, fmt.Errorf("%w: extended capability list loops", ErrMalformed)
}

// parseHex parses a sysfs hex value such as "0x10de" or "0x030200".
func parseHex(s string, bits int) (uint64, error) {
	s = strings.TrimSpace(s)
	v, err := strconv.ParseUint(strings.TrimPrefix(strings.TrimPrefix(s, "0x"), "0X"), 16, bits)
	if err != nil {
		return 0, fmt.Errorf("%w: %q is not a %d-bit hex number", ErrMalformed, s, bits)
	}
	return v, nil
}

// ReadPCIDevice reads one device from /sys/bus/pci/devices/<addr> under root.
// Vendor and class are required; numa_node, local_cpulist, driver and
// config are optional.
func ReadPCIDevice(root *Root, addr string) (*PCIDevice, error) {
	a, err := ParsePCIAddress(addr)
	if err != nil {
		return nil, err
	}
	dir := "/sys/bus/pci/devices/" + a
	target, err := root.Readlink(dir)
	if err != nil {
		return nil, err
	}
	p, err := ParsePCIPath(target)
	if err != nil {
		return nil, err
	}
	d := &PCIDevice{Address: a, Path: p}
	v, err := root.ReadString(dir + "/vendor")
	if err != nil {
		return nil, err
	}
	vendor, err := parseHex(v, 16)
	if err != nil {
		return nil, fmt.Errorf("%s/vendor: %w", dir, err)
	}
	d.Vendor = uint16(vendor)
	if s, err := root.ReadString(dir + "/device"); err == nil {
		if n, err := parseHex(s, 16); err == nil {
			d.Device = uint16(n)
		}
	}
	c, err := root.ReadString(dir + "/class")
	if err != nil {
		return nil, err
	}
	class, err := parseHex(c, 24)
	if err != nil {
		return nil, fmt.Errorf("%s/class: %w", dir, err)
	}
	d.Class = uint32(class)
	if s, err := root.ReadString(dir + "/numa_node"); err == nil {
		if n, err := strconv.Atoi(s); err == nil && n >= 0 {
			d.NUMANode = &n
		}
	}
	if s, err := root.ReadString(dir + "/local_cpulist"); err == nil {
		d.LocalCPUs = s
	}
	if t, err := root.Readlink(dir + "/driver"); err == nil {
		d.Driver = path.Base(t)
	}
	if d.IsBridge() {
		cfg, err := root.ReadFile(dir + "/config")
		if err != nil {
			d.ACSErr = err.Error()
		} else if acs, err := ParseACS(cfg); err != nil {
			d.ACSErr = err.Error()
		} else {
			d.ACS = acs
		}
	}
	return d, nil
}

// ReadPCIDevices reads every device under /sys/bus/pci/devices. A device
// that cannot be read is left out and reported in the returned notes.
func ReadPCIDevices(root *Root) (map[string]*PCIDevice, []string, error) {
	names, err := root.ReadDir("/sys/bus/pci/devices")
	if err != nil {
		return nil, nil, err
	}
	out := make(map[string]*PCIDevice, len(names))
	var notes []string
	for _, n := range names {
		d, err := ReadPCIDevice(root, n)
		if err != nil {
			notes = append(notes, fmt.Sprintf("PCI device %s skipped: %v", n, err))
			continue
		}
		out[d.Address] = d
	}
	return out, notes, nil
}

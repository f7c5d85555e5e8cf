package ibverbs

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"

	"github.com/gdrlink/gdrlink/internal/ibv"
)

// sysfs reads the RDMA part of a sysfs tree mounted at root ("/sys" on a
// host; a fixture tree in tests; "/host/sys" in a container).
type sysfs struct{ root string }

func (s sysfs) classDir() string { return filepath.Join(s.root, "class", "infiniband") }

// devices lists the names under class/infiniband; a missing directory is
// reported as os.ErrNotExist.
func (s sysfs) devices() ([]string, error) {
	ents, err := os.ReadDir(s.classDir())
	if err != nil {
		return nil, err
	}
	out := make([]string, 0, len(ents))
	for _, e := range ents {
		out = append(out, e.Name())
	}
	return out, nil
}

// gidType reads ports/N/gid_attrs/types/IDX.
func (s sysfs) gidType(dev string, port, index int) ibv.GIDType {
	b, err := os.ReadFile(filepath.Join(s.classDir(), dev, "ports", strconv.Itoa(port), "gid_attrs", "types", strconv.Itoa(index)))
	if err != nil {
		return ibv.GIDTypeUnknown
	}
	return ibv.ParseGIDType(string(b))
}

// gidNetdev reads ports/N/gid_attrs/ndevs/IDX.
func (s sysfs) gidNetdev(dev string, port, index int) string {
	b, err := os.ReadFile(filepath.Join(s.classDir(), dev, "ports", strconv.Itoa(port), "gid_attrs", "ndevs", strconv.Itoa(index)))
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}

var pciAddr = regexp.MustCompile(`^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$`)

// location reads the device's NUMA node (-1 when unknown) and PCI address
// ("" for software devices such as rxe).
func (s sysfs) location(dev string) (numa int, pci string) {
	numa = -1
	d := filepath.Join(s.classDir(), dev, "device")
	if b, err := os.ReadFile(filepath.Join(d, "numa_node")); err == nil {
		if n, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil && n >= 0 {
			numa = n
		}
	}
	if t, err := os.Readlink(d); err == nil && pciAddr.MatchString(filepath.Base(t)) {
		pci = filepath.Base(t)
	}
	return numa, pci
}

// netdev reads the network interface of the device's port from
// ports/N/gid_attrs/ndevs/0, or the parent attribute rxe devices have.
func (s sysfs) netdev(dev string, port int) string {
	if n := s.gidNetdev(dev, port, 0); n != "" {
		return n
	}
	if b, err := os.ReadFile(filepath.Join(s.classDir(), dev, "parent")); err == nil {
		return strings.TrimSpace(string(b))
	}
	return ""
}

func (s sysfs) String() string { return fmt.Sprintf("sysfs at %s", s.root) }

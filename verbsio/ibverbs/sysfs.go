package ibverbs

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"

	"github.com/gdrlink/gdrlink/internal/ibv"
	"github.com/gdrlink/gdrlink/verbsio"
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

// peerMemModules are the kernel modules with which ibv_reg_mr resolves a
// GPU device pointer: NVIDIA's nvidia_peermem (driver 470 and later) and
// Mellanox's older nv_peer_mem, in that order.
var peerMemModules = []string{"nvidia_peermem", "nv_peer_mem"}

// peerMem says which GPU peer-memory module is loaded, from module/NAME.
// None loaded is an error wrapping verbsio.ErrNotSupported; any other
// error (no module directory at all: sysfs not mounted there; a directory
// that cannot be read) means sysfs could not tell.
func (s sysfs) peerMem() (string, error) {
	modDir := filepath.Join(s.root, "module")
	for _, m := range peerMemModules {
		fi, err := os.Stat(filepath.Join(modDir, m))
		switch {
		case err == nil && fi.IsDir():
			return m, nil
		case err == nil:
			return "", fmt.Errorf("could not tell whether %s is loaded: %s is not a directory", m, filepath.Join(modDir, m))
		case !errors.Is(err, fs.ErrNotExist):
			return "", fmt.Errorf("could not tell whether %s is loaded: %w", m, err)
		}
	}
	if _, err := os.Stat(modDir); err != nil {
		return "", fmt.Errorf("could not tell whether a GPU peer-memory module is loaded: %w", err)
	}
	return "", fmt.Errorf("%w: GPU memory registration: neither %s nor %s is loaded (%s; modprobe nvidia-peermem)",
		verbsio.ErrNotSupported, peerMemModules[0], peerMemModules[1], modDir)
}

func (s sysfs) String() string { return fmt.Sprintf("sysfs at %s", s.root) }

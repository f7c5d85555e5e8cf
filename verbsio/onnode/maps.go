package onnode

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
)

// mapping is one line of /proc/<pid>/maps.
type mapping struct {
	Start, End uint64
	Perms      string
	Offset     uint64
	DevMajor   uint32
	DevMinor   uint32
	Inode      uint64
	Path       string
}

// Shared reports whether the mapping is MAP_SHARED.
func (m mapping) Shared() bool { return len(m.Perms) == 4 && m.Perms[3] == 's' }

var errMapsLine = errors.New("malformed maps line")

// parseMapsLine parses "start-end perms offset maj:min inode [path]".
func parseMapsLine(line string) (mapping, error) {
	var m mapping
	f := strings.Fields(line)
	if len(f) < 5 {
		return m, fmt.Errorf("%w: %q", errMapsLine, line)
	}
	lo, hi, ok := strings.Cut(f[0], "-")
	if !ok {
		return m, fmt.Errorf("%w: range %q", errMapsLine, f[0])
	}
	var err error
	if m.Start, err = strconv.ParseUint(lo, 16, 64); err != nil {
		return m, fmt.Errorf("%w: start %q", errMapsLine, lo)
	}
	if m.End, err = strconv.ParseUint(hi, 16, 64); err != nil || m.End < m.Start {
		return m, fmt.Errorf("%w: end %q", errMapsLine, hi)
	}
	if len(f[1]) != 4 {
		return m, fmt.Errorf("%w: perms %q", errMapsLine, f[1])
	}
	m.Perms = f[1]
	if m.Offset, err = strconv.ParseUint(f[2], 16, 64); err != nil {
		return m, fmt.Errorf("%w: offset %q", errMapsLine, f[2])
	}
	maj, min, ok := strings.Cut(f[3], ":")
	if !ok {
		return m, fmt.Errorf("%w: device %q", errMapsLine, f[3])
	}
	a, err1 := strconv.ParseUint(maj, 16, 32)
	b, err2 := strconv.ParseUint(min, 16, 32)
	if err1 != nil || err2 != nil {
		return m, fmt.Errorf("%w: device %q", errMapsLine, f[3])
	}
	m.DevMajor, m.DevMinor = uint32(a), uint32(b)
	if m.Inode, err = strconv.ParseUint(f[4], 10, 64); err != nil {
		return m, fmt.Errorf("%w: inode %q", errMapsLine, f[4])
	}
	if len(f) > 5 {
		m.Path = strings.Join(f[5:], " ")
	}
	return m, nil
}

// mappingsCovering returns the mappings of maps (the text of /proc/self/maps)
// that cover [addr, addr+n), in order, or an error if a byte of the range is
// not mapped.
func mappingsCovering(maps []byte, addr, n uint64) ([]mapping, error) {
	end := addr + n
	if end < addr {
		return nil, fmt.Errorf("range %#x+%d wraps", addr, n)
	}
	var out []mapping
	next := addr
	sc := bufio.NewScanner(bytes.NewReader(maps))
	sc.Buffer(make([]byte, 0, 4096), 1<<20)
	for sc.Scan() && next < end {
		m, err := parseMapsLine(sc.Text())
		if err != nil {
			return nil, err
		}
		if m.End <= next {
			continue
		}
		if m.Start > next {
			break
		}
		out = append(out, m)
		next = m.End
	}
	if next < end {
		return nil, fmt.Errorf("%#x..%#x is not mapped (first gap at %#x)", addr, end, next)
	}
	return out, nil
}

func readSelfMaps() ([]byte, error) { return os.ReadFile("/proc/self/maps") }

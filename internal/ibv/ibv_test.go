package ibv

import (
	"errors"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

func TestMTU(t *testing.T) {
	for e, b := range map[int]int{1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096} {
		if MTUBytes(e) != b || MTUEnum(b) != e {
			t.Errorf("enum %d <-> %d bytes: %d, %d", e, b, MTUBytes(e), MTUEnum(b))
		}
	}
	for _, bad := range []int{0, 6, -1} {
		if MTUBytes(bad) != 0 {
			t.Errorf("MTUBytes(%d) = %d", bad, MTUBytes(bad))
		}
	}
	if MTUEnum(1500) != 0 {
		t.Error("MTUEnum(1500) != 0")
	}
}

func TestParseGIDType(t *testing.T) {
	for s, want := range map[string]GIDType{"IB/RoCE v1\n": GIDTypeRoCEv1, "RoCE v2\n": GIDTypeRoCEv2, "RoCE v2": GIDTypeRoCEv2, "IB": GIDTypeIB, "": GIDTypeUnknown, "v3\n": GIDTypeUnknown} {
		if got := ParseGIDType(s); got != want {
			t.Errorf("ParseGIDType(%q) = %v, want %v", s, got, want)
		}
	}
}

func TestGID(t *testing.T) {
	v4 := GID{10: 0xff, 11: 0xff, 12: 192, 13: 168, 14: 1, 15: 2}
	ll := GID{0: 0xfe, 1: 0x80, 15: 1}
	if !v4.IsIPv4Mapped() || v4.IsLinkLocal() || v4.String() != "192.168.1.2" {
		t.Errorf("v4 %s", v4)
	}
	if ll.IsIPv4Mapped() || !ll.IsLinkLocal() || ll.String() != "fe80::1" {
		t.Errorf("ll %s", ll)
	}
	if !(GID{}).IsZero() || v4.IsZero() {
		t.Error("IsZero")
	}
}

func TestCheckSGEs(t *testing.T) {
	spans := [][2]uint32{{0, 1}, {1, 2}}
	span := func(i int) (uint32, uint32) { return spans[i][0], spans[i][1] }
	if err := checkSGEs(3, span, 2); err != nil {
		t.Errorf("in range: %v", err)
	}
	if err := checkSGEs(2, span, 2); err == nil {
		t.Error("out of range accepted")
	}
	spans[0] = [2]uint32{^uint32(0), 2}
	if err := checkSGEs(3, span, 1); err == nil {
		t.Error("overflowing span accepted")
	}
}

func TestErrorMatchesErrno(t *testing.T) {
	err := error(&Error{Op: "ibv_reg_mr", Device: "rxe0", Errno: syscall.EOPNOTSUPP, Detail: "len 4096"})
	if !errors.Is(err, syscall.EOPNOTSUPP) || err.Error() != "ibv_reg_mr rxe0 (len 4096): operation not supported" {
		t.Errorf("%v", err)
	}
}

// testDevice opens the device that SOFTROCE_DEV or RDMA_DEVICE names, or
// the first one libibverbs lists; without one the test skips, or fails
// when GDRLINK_REQUIRE_RDMA=1.
func testDevice(t *testing.T) *Context {
	t.Helper()
	skip := func(why string, args ...any) {
		if os.Getenv("GDRLINK_REQUIRE_RDMA") == "1" {
			t.Fatalf("GDRLINK_REQUIRE_RDMA=1 but "+why, args...)
		}
		t.Skipf("skipping: "+why, args...)
	}
	if err := Load(); err != nil {
		skip("%v", err)
	}
	if _, err := os.Stat("/sys/class/infiniband"); err != nil {
		skip("no RDMA device (/sys/class/infiniband: %v)", err)
	}
	name := os.Getenv("SOFTROCE_DEV")
	if name == "" {
		name = os.Getenv("RDMA_DEVICE")
	}
	if name == "" {
		devs, err := Devices()
		if err != nil || len(devs) == 0 {
			skip("libibverbs lists no device (%v)", err)
		}
		name = devs[0].Name
	}
	c, err := Open(name)
	if err != nil {
		t.Fatalf("open %s: %v", name, err)
	}
	t.Cleanup(func() {
		if err := c.Close(); err != nil {
			t.Errorf("close: %v", err)
		}
	})
	return c
}

func TestDeviceVerbs(t *testing.T) {
	c := testDevice(t)
	attr, err := c.QueryDevice()
	if err != nil {
		t.Fatal(err)
	}
	if attr.PhysPortCount < 1 || attr.MaxQPWR < 1 || attr.MaxSGE < 1 {
		t.Fatalf("device attributes %+v", attr)
	}
	pa, err := c.QueryPort(1)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%s: fw %s vendor %#x, port 1 %s mtu %d/%d link layer %d, %d GIDs", c.Name(), attr.FWVersion, attr.VendorID,
		PortStateName(pa.State), pa.ActiveMTU, pa.MaxMTU, pa.LinkLayer, pa.GIDTblLen)
	if _, err := c.QueryPort(0); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("port 0: %v", err)
	}
	valid := 0
	for i := 0; i < pa.GIDTblLen; i++ {
		e, err := c.QueryGID(1, i)
		if err != nil || e.GID.IsZero() {
			continue
		}
		valid++
		t.Logf("gid %d %s %s", i, e.GID, e.Type)
	}
	if pa.LinkLayer == LinkLayerEthernet && valid == 0 {
		t.Error("RoCE port without a valid GID")
	}
	// The whole table in one call agrees with the entries read one by one.
	before := c.Counters().Snapshot()
	table, err := c.GIDTable(pa.GIDTblLen * attr.PhysPortCount)
	if errors.Is(err, syscall.EOPNOTSUPP) {
		t.Logf("no ibv_query_gid_table: %v", err)
	} else if err != nil {
		t.Fatal(err)
	} else {
		if got := c.Counters().Snapshot().Sub(before).Crossings(); got != 1 {
			t.Errorf("GIDTable took %d crossings", got)
		}
		port1 := 0
		for _, e := range table {
			if e.Port != 1 {
				continue
			}
			port1++
			one, err := c.QueryGID(1, e.Index)
			if err != nil || one.GID != e.GID || one.Type != e.Type {
				t.Errorf("gid %d: table %s %s, one by one %s %s (%v)", e.Index, e.GID, e.Type, one.GID, one.Type, err)
			}
		}
		if port1 != valid {
			t.Errorf("table has %d entries of port 1, one by one found %d", port1, valid)
		}
	}
	pd, err := c.AllocPD()
	if err != nil {
		t.Fatal(err)
	}
	defer pd.Close()
	mem, err := unix.Mmap(-1, 0, 1<<16, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(mem)
	mr, err := pd.RegMR(uintptr(unsafe.Pointer(&mem[0])), len(mem), AccessLocalWrite|AccessRemoteWrite)
	if err != nil {
		t.Fatal(err)
	}
	if mr.Len() != len(mem) || mr.LKey() == 0 && mr.RKey() == 0 {
		t.Errorf("region %+v", mr)
	}
	if err := pd.Close(); !errors.Is(err, syscall.EBUSY) {
		t.Errorf("dealloc of a domain with a region: %v", err)
	}
	if err := mr.Close(); err != nil || mr.Close() != nil {
		t.Errorf("dereg: %v", err)
	}
	cq, err := c.CreateCQ(16)
	if err != nil {
		t.Fatal(err)
	}
	defer cq.Close()
	if cq.Depth() < 16 {
		t.Errorf("cq depth %d", cq.Depth())
	}
	wc := make([]WC, 8)
	before = c.Counters().Snapshot()
	if n, err := cq.Poll(wc); n != 0 || err != nil {
		t.Errorf("poll of an empty queue: %d, %v", n, err)
	}
	if got := c.Counters().Snapshot().Sub(before); got.Poll != 1 || got.Crossings() != 1 {
		t.Errorf("one poll counted as %+v", got)
	}
	// A waiter polls in a loop: a poll allocates nothing.
	if a := testing.AllocsPerRun(100, func() { cq.Poll(wc) }); a != 0 {
		t.Errorf("a poll allocates %v times", a)
	}
	qp, err := pd.CreateQP(cq, cq, QPCaps{MaxSendWR: 8, MaxRecvWR: 8, MaxSendSGE: 1, MaxRecvSGE: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer qp.Close()
	if s, err := qp.State(); err != nil || s != QPSReset {
		t.Errorf("new queue pair state %d, %v", s, err)
	}
	// SGE spans outside the slice never reach C.
	before = c.Counters().Snapshot()
	if _, err := qp.PostSend([]SendWR{{NumSGE: 2}}, []SGE{{}}); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("bad span: %v", err)
	}
	if got := c.Counters().Snapshot().Sub(before); got.PostSend != 0 {
		t.Errorf("a rejected chain crossed into C: %+v", got)
	}
	// Posting on a RESET queue pair is refused by the device.
	if _, err := qp.PostSend([]SendWR{{Opcode: WRSend}}, nil); err == nil {
		t.Error("post on a RESET queue pair accepted")
	}
	if err := qp.ToInit(1, 0, AccessRemoteWrite); err != nil {
		t.Fatal(err)
	}
	if s, _ := qp.State(); s != QPSInit {
		t.Errorf("state after INIT: %d", s)
	}
	if err := qp.ToError(); err != nil {
		t.Fatal(err)
	}
	if err := qp.Close(); err != nil || qp.Close() != nil {
		t.Errorf("destroy: %v", err)
	}
	if _, err := qp.State(); !errors.Is(err, syscall.EBADF) {
		t.Errorf("state of a destroyed queue pair: %v", err)
	}
}

// TestLoadMissing: a library that is not there leaves the package
// unavailable with the loader's reason and the path.
func TestLoadMissing(t *testing.T) {
	_, err := open("/nonexistent/libibverbs.so.1")
	if !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), "/nonexistent/libibverbs.so.1") || !strings.Contains(err.Error(), "install rdma-core") {
		t.Fatalf("open of a missing library: %v", err)
	}
}

// TestLoadTooOld: a library without the verbs (libc stands in for a
// libibverbs too old to have them) is refused, naming what it lacks.
func TestLoadTooOld(t *testing.T) {
	_, err := open("libc.so.6")
	if !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), "lacks ibv_get_device_list") {
		t.Fatalf("open of a library without the verbs: %v", err)
	}
}

// TestLoadEnv runs this test binary again with GDRLINK_LIBIBVERBS naming a
// missing file: Load, and every verb, fail with that path.
func TestLoadEnv(t *testing.T) {
	if os.Getenv("IBV_TEST_CHILD") == "1" {
		err := Load()
		_, derr := Devices()
		_, oerr := Open("rxe0")
		for _, e := range []error{err, derr, oerr} {
			if !errors.Is(e, ErrUnavailable) || !strings.Contains(e.Error(), "/nonexistent/libibverbs.so") {
				t.Fatalf("with %s=/nonexistent/libibverbs.so: %v", LibraryEnv, e)
			}
		}
		return
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestLoadEnv$", "-test.v")
	cmd.Env = append(os.Environ(), "IBV_TEST_CHILD=1", LibraryEnv+"=/nonexistent/libibverbs.so")
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "--- PASS: TestLoadEnv") {
		t.Fatalf("child: %v\n%s", err, out)
	}
}

// TestLoadHere loads the system's libibverbs where it is installed and
// reports what it lacks; without it the test skips and says so.
func TestLoadHere(t *testing.T) {
	path, missing, err := LibraryInfo()
	if err != nil {
		if os.Getenv("GDRLINK_REQUIRE_RDMA") == "1" {
			t.Fatalf("GDRLINK_REQUIRE_RDMA=1 but %v", err)
		}
		t.Skipf("skipping: %v", err)
	}
	t.Logf("loaded %s; optional verbs missing: %v", path, missing)
	devs, err := Devices()
	if _, serr := os.Stat("/sys/class/infiniband"); serr == nil && err != nil {
		t.Errorf("Devices with libibverbs loaded and /sys/class/infiniband present: %v", err)
	}
	t.Logf("devices %v, err %v", devs, err)
}

// TestOlderLibrary runs the verbs as they run on a libibverbs that predates
// the optional functions (rdma-core before 32 has no _ibv_query_gid_ex or
// _ibv_query_gid_table, before 34 no ibv_reg_dmabuf_mr): the device's
// context is given a copy of the library with those symbols cleared. GIDs
// still read (through ibv_query_gid, type unknown), the table and dma-buf
// registration fail with EOPNOTSUPP naming the library, and the rest works.
func TestOlderLibrary(t *testing.T) {
	c := testDevice(t)
	old := *c.l
	for _, s := range []sym{symQueryGIDEx, symQueryGIDTable, symRegDMABufMR} {
		if !symbols[s].optional {
			t.Fatalf("%s is not optional", symbols[s].name)
		}
		old.fn[s] = 0
	}
	real := c.l
	c.l = &old
	defer func() { c.l = real }()
	pa, err := c.QueryPort(1)
	if err != nil {
		t.Fatal(err)
	}
	valid := 0
	for i := 0; i < pa.GIDTblLen; i++ {
		e, err := c.QueryGID(1, i)
		if err != nil || e.GID.IsZero() {
			continue
		}
		valid++
		if e.Type != GIDTypeUnknown {
			t.Errorf("gid %d: type %s without ibv_query_gid_ex", i, e.Type)
		}
	}
	if pa.LinkLayer == LinkLayerEthernet && valid == 0 {
		t.Error("no GID read through ibv_query_gid")
	}
	if _, err := c.GIDTable(pa.GIDTblLen); !errors.Is(err, syscall.EOPNOTSUPP) || !strings.Contains(err.Error(), "rdma-core 32") {
		t.Errorf("GIDTable without _ibv_query_gid_table: %v", err)
	}
	pd, err := c.AllocPD()
	if err != nil {
		t.Fatal(err)
	}
	defer pd.Close()
	if _, err := pd.RegDMABufMR(0, 4096, 0, 0, AccessLocalWrite); !errors.Is(err, syscall.EOPNOTSUPP) || !strings.Contains(err.Error(), "rdma-core 34") {
		t.Errorf("RegDMABufMR without ibv_reg_dmabuf_mr: %v", err)
	}
	mem, err := unix.Mmap(-1, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(mem)
	mr, err := pd.RegMR(uintptr(unsafe.Pointer(&mem[0])), len(mem), AccessLocalWrite)
	if err != nil {
		t.Fatalf("RegMR on the older library: %v", err)
	}
	if err := mr.Close(); err != nil {
		t.Error(err)
	}
}

package verbsio

import (
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"
	"time"
)

func TestConfigFromEnv(t *testing.T) {
	env := map[string]string{
		"RDMA_DEVICE": "mlx5_1", "RDMA_DEVICE_PORT": "2", "RDMA_GID_INDEX": "3", "RDMA_QP_PKEY_INDEX": "1",
		"RDMA_QP_QUEUE_DEPTH": "512", "RDMA_QP_TIMEOUT": "18", "RDMA_QP_RETRY_COUNT": "5", "RDMA_QP_SL": "3",
		"RDMA_QP_MTU": "4096", "RDMA_TRAFFIC_CLASS": "106", "GDRLINK_LISTEN_ADDR": "10.0.0.1:0", "GDRLINK_CONNECT_TIMEOUT": "5s",
		"GDRLINK_PEER_TIMEOUT": "90s",
	}
	c, err := configFromLookup(func(k string) (string, bool) { v, ok := env[k]; return v, ok })
	if err != nil {
		t.Fatal(err)
	}
	want := Config{Device: "mlx5_1", Port: 2, GIDIndex: 3, PKeyIndex: 1, QueueDepth: 512, Timeout: 18, RetryCount: 5, SL: 3,
		MTU: 4096, TrafficClass: 106, ListenAddr: "10.0.0.1:0", ConnectTimeout: 5 * time.Second, PeerTimeout: 90 * time.Second}
	if !reflect.DeepEqual(c, want) {
		t.Errorf("got %+v\nwant %+v", c, want)
	}
	d, err := configFromLookup(func(string) (string, bool) { return "", false })
	if err != nil || !reflect.DeepEqual(d, DefaultConfig()) {
		t.Errorf("empty environment: %+v, %v; want the defaults", d, err)
	}
	if DefaultConfig().validate() != nil || (Config{}).withDefaults().QueueDepth != defaultQueueDepth {
		t.Error("defaults do not validate or fill")
	}
}

func TestConfigFromEnvBad(t *testing.T) {
	for _, tc := range []struct{ name, value string }{
		{"RDMA_DEVICE_PORT", "x"}, {"RDMA_DEVICE_PORT", "256"}, {"RDMA_DEVICE_PORT", "-1"},
		{"RDMA_GID_INDEX", "-2"}, {"RDMA_GID_INDEX", "1.5"}, {"RDMA_QP_PKEY_INDEX", "65536"},
		{"RDMA_QP_QUEUE_DEPTH", "0"}, {"RDMA_QP_QUEUE_DEPTH", "70000"}, {"RDMA_QP_TIMEOUT", "32"},
		{"RDMA_QP_RETRY_COUNT", "8"}, {"RDMA_QP_SL", "16"}, {"RDMA_QP_MTU", "1500"},
		{"RDMA_TRAFFIC_CLASS", "256"}, {"GDRLINK_CONNECT_TIMEOUT", "soon"}, {"GDRLINK_CONNECT_TIMEOUT", "-1s"},
		{"GDRLINK_PEER_TIMEOUT", "soon"}, {"GDRLINK_PEER_TIMEOUT", "0"}, {"GDRLINK_PEER_TIMEOUT", "-3s"}, {"GDRLINK_PEER_TIMEOUT", "25h"},
	} {
		t.Run(tc.name+"="+tc.value, func(t *testing.T) {
			_, err := configFromLookup(func(k string) (string, bool) {
				if k == tc.name {
					return tc.value, true
				}
				return "", false
			})
			if !errors.Is(err, ErrBadConfig) || !strings.Contains(err.Error(), tc.name) {
				t.Errorf("error %v, want ErrBadConfig naming %s", err, tc.name)
			}
		})
	}
}

func TestStrings(t *testing.T) {
	for _, tc := range []struct {
		got, want string
	}{
		{Access(0).String(), "none"},
		{AccessLocalWrite.String(), "local-write"},
		{(AccessLocalWrite | AccessRemoteWrite | AccessRemoteRead).String(), "local-write|remote-write|remote-read"},
		{(AccessRemoteRead).String(), "remote-read"},
		{StatusSuccess.String(), "success"},
		{StatusRemoteAccess.String(), "remote access error"},
		{StatusGeneral.String(), "general error"},
		{Status(99).String(), "Status(99)"},
		{OpWriteImm.String(), "write-imm"},
		{OpRecvImm.String(), "recv-imm"},
		{Opcode(0).String(), "Opcode(0)"},
		{Opcode(200).String(), "Opcode(200)"},
		{QPReady.String(), "ready"},
		{QPError.String(), "error"},
		{QPState(9).String(), "QPState(9)"},
	} {
		if tc.got != tc.want {
			t.Errorf("got %q, want %q", tc.got, tc.want)
		}
	}
}

func TestStatusErr(t *testing.T) {
	for _, tc := range []struct {
		s    Status
		want error
	}{
		{StatusRemoteAccess, ErrRemoteAccess}, {StatusFlushed, ErrFlushed}, {StatusRetryExceeded, ErrPeerLost},
		{StatusLocalProtection, ErrLocalProtection}, {StatusLocalLength, ErrLocalLength},
		{StatusRemoteOperation, ErrRemoteOperation}, {StatusGeneral, ErrCompletion}, {Status(77), ErrCompletion},
	} {
		if err := tc.s.Err(); !errors.Is(err, tc.want) {
			t.Errorf("%v.Err() = %v, want %v", tc.s, err, tc.want)
		}
	}
	if StatusSuccess.Err() != nil {
		t.Error("StatusSuccess.Err() is not nil")
	}
}

// fakeProvider is a provider with or without devices, for Choose.
type fakeProvider struct {
	name  string
	noDev error
}

func (f fakeProvider) Name() string { return f.name }
func (f fakeProvider) Devices() ([]DeviceInfo, error) {
	if f.noDev != nil {
		return nil, f.noDev
	}
	return []DeviceInfo{{Provider: f.name, Name: f.name + "0"}}, nil
}
func (f fakeProvider) Open(Config) (Device, error) {
	return nil, fmt.Errorf("%w: fake", ErrNotSupported)
}

// registerOnce registers p unless a provider of its name is already there
// (from an earlier run of the test in this process, with -count).
func registerOnce(p Provider) {
	if _, err := Lookup(p.Name()); err != nil {
		Register(p)
	}
}

func TestChoose(t *testing.T) {
	registerOnce(fakeProvider{name: "fake-rdma", noDev: fmt.Errorf("%w: no RDMA device in /sys/class/infiniband", ErrNoDevice)})
	registerOnce(fakeProvider{name: "fake-node"})
	registerOnce(fakeProvider{name: "fake-net"})
	pref := []string{"fake-rdma", "fake-node", "fake-net"}
	local := map[string]bool{"fake-node": true}
	c, err := choose(pref, local, true)
	if err != nil || c.Provider != "fake-node" || !errors.Is(c.Skipped["fake-rdma"], ErrNoDevice) {
		t.Errorf("same host: %+v, %v; want fake-node with fake-rdma skipped for no device", c, err)
	}
	c, err = choose(pref, local, false)
	if err != nil || c.Provider != "fake-net" || !errors.Is(c.Skipped["fake-node"], ErrNotSupported) {
		t.Errorf("other host: %+v, %v; want fake-net with fake-node skipped", c, err)
	}
	c, err = choose([]string{"fake-rdma", "fake-missing"}, local, true)
	if !errors.Is(err, ErrNoProvider) || !errors.Is(err, ErrNoDevice) || !strings.Contains(err.Error(), "fake-missing") {
		t.Errorf("nothing usable: %v", err)
	}
	if _, err := Lookup("fake-missing"); !errors.Is(err, ErrNoProvider) {
		t.Errorf("Lookup of an unregistered name: %v", err)
	}
	func() {
		defer func() {
			if recover() == nil {
				t.Error("registering a name twice did not panic")
			}
		}()
		Register(fakeProvider{name: "fake-net"})
	}()
}

func TestResolve(t *testing.T) {
	c, err := Config{Device: "x", ListenAddr: "127.0.0.1:0"}.Resolve()
	want := Config{Device: "x", ListenAddr: "127.0.0.1:0", QueueDepth: defaultQueueDepth, Timeout: defaultTimeout,
		RetryCount: defaultRetryCount, ConnectTimeout: defaultConnectTimeout, PeerTimeout: defaultPeerTimeout}
	if err != nil || !reflect.DeepEqual(c, want) {
		t.Errorf("Resolve of a zero config: %+v, %v; want %+v", c, err, want)
	}
	if _, err := (Config{SL: 16}).Resolve(); !errors.Is(err, ErrBadConfig) || !strings.Contains(err.Error(), "RDMA_QP_SL") {
		t.Errorf("Resolve with SL 16: %v, want ErrBadConfig naming RDMA_QP_SL", err)
	}
	if _, err := (Config{PeerTimeout: -time.Second}).Resolve(); !errors.Is(err, ErrBadConfig) || !strings.Contains(err.Error(), "GDRLINK_PEER_TIMEOUT") {
		t.Errorf("Resolve with a negative peer timeout: %v, want ErrBadConfig naming GDRLINK_PEER_TIMEOUT", err)
	}
}

package tcp_test

import (
	"bytes"
	"context"
	"errors"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/verbsio"
	"github.com/gdrlink/gdrlink/verbsio/tcp"
)

type qpSide struct {
	dev verbsio.Device
	pd  verbsio.ProtectionDomain
	cq  verbsio.CompletionQueue
	qp  verbsio.QueuePair
}

func newQPSide(t *testing.T) *qpSide {
	t.Helper()
	dev, err := tcp.OpenDevice(verbsio.Config{}, tcp.Options{})
	if err != nil {
		t.Fatal(err)
	}
	s := &qpSide{dev: dev}
	s.pd, _ = dev.AllocPD()
	s.cq, _ = dev.CreateCQ(16)
	if s.qp, err = s.pd.CreateQP(verbsio.QPConfig{SendCQ: s.cq, RecvCQ: s.cq}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, err := range []error{s.qp.Close(), s.cq.Close(), s.pd.Close(), s.dev.Close()} {
			if err != nil {
				t.Errorf("cleanup: %v", err)
			}
		}
	})
	return s
}

func TestConnectPeerNeverConnectsBack(t *testing.T) {
	a, z := newQPSide(t), newQPSide(t)
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	// z never calls Connect, so its lanes never arrive.
	err := a.qp.Connect(ctx, z.qp.Endpoint())
	if !errors.Is(err, verbsio.ErrTimeout) || !strings.Contains(err.Error(), "did not connect back") {
		t.Errorf("Connect: %v, want ErrTimeout saying the peer did not connect back", err)
	}
	if st := a.qp.State(); st != verbsio.QPError {
		t.Errorf("state after a failed Connect = %v, want error", st)
	}
	if err := a.qp.PostSend([]verbsio.SendWR{{Op: verbsio.OpWrite}}); !errors.Is(err, verbsio.ErrQPState) {
		t.Errorf("PostSend after a failed Connect: %v, want ErrQPState", err)
	}
}

func TestConnectStaleEndpoint(t *testing.T) {
	a, z := newQPSide(t), newQPSide(t)
	stale := z.qp.Endpoint()
	z.qp.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err := a.qp.Connect(ctx, stale)
	if !errors.Is(err, verbsio.ErrPeerLost) || !strings.Contains(err.Error(), "no queue pair") {
		t.Errorf("Connect to a closed queue pair: %v, want ErrPeerLost naming the missing queue pair", err)
	}
}

func TestConnectBadEndpoint(t *testing.T) {
	a := newQPSide(t)
	ctx := context.Background()
	if err := a.qp.Connect(ctx, verbsio.Endpoint{Provider: "ibverbs", Data: []byte{1}}); !errors.Is(err, verbsio.ErrBadConfig) {
		t.Errorf("endpoint of another provider: %v, want ErrBadConfig", err)
	}
	if err := a.qp.Connect(ctx, verbsio.Endpoint{Provider: "tcp", Data: []byte{1, 2, 3}}); !errors.Is(err, verbsio.ErrBadFrame) {
		t.Errorf("malformed endpoint: %v, want ErrBadFrame", err)
	}
	// The endpoint of a peer of wire version 1 is refused as such.
	old := a.qp.Endpoint()
	old.Data = bytes.Clone(old.Data)
	old.Data[0] = 1
	if err := a.qp.Connect(ctx, old); !errors.Is(err, verbsio.ErrBadFrame) || !strings.Contains(err.Error(), "version 1") {
		t.Errorf("endpoint of wire version 1: %v, want ErrBadFrame naming the version", err)
	}
	if err := a.qp.PostSend([]verbsio.SendWR{{Op: verbsio.OpWrite}}); !errors.Is(err, verbsio.ErrQPState) {
		t.Errorf("PostSend before Connect: %v, want ErrQPState", err)
	}
}

func TestOptionsFromEnv(t *testing.T) {
	t.Setenv("GDRLINK_TCP_LANES", "17")
	if _, err := tcp.OptionsFromEnv(); !errors.Is(err, verbsio.ErrBadConfig) || !strings.Contains(err.Error(), "GDRLINK_TCP_LANES") {
		t.Errorf("GDRLINK_TCP_LANES=17: %v", err)
	}
	t.Setenv("GDRLINK_TCP_LANES", "3")
	t.Setenv("GDRLINK_TCP_SOCKET_BUFFER", "lots")
	if _, err := tcp.OptionsFromEnv(); !errors.Is(err, verbsio.ErrBadConfig) || !strings.Contains(err.Error(), "GDRLINK_TCP_SOCKET_BUFFER") {
		t.Errorf("GDRLINK_TCP_SOCKET_BUFFER=lots: %v", err)
	}
	t.Setenv("GDRLINK_TCP_SOCKET_BUFFER", "4194304")
	if o, err := tcp.OptionsFromEnv(); err != nil || o.Lanes != 3 || o.SocketBuffer != 4<<20 {
		t.Errorf("got %+v, %v", o, err)
	}
}

// TestInfoAddress checks that an open device says where peers reach it,
// through verbsio.DeviceInfo alone, and that the registered provider's
// device list (of devices not yet open) leaves the address empty.
func TestInfoAddress(t *testing.T) {
	dev, err := verbsio.Open("tcp", verbsio.Config{ListenAddr: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Close()
	addr := dev.Info().Address
	if !strings.HasPrefix(addr, "127.0.0.1:") || addr == "127.0.0.1:0" {
		t.Errorf("Info().Address = %q, want the listener's 127.0.0.1 port", addr)
	}
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatalf("dialing Info().Address: %v", err)
	}
	c.Close()
	p, err := verbsio.Lookup("tcp")
	if err != nil {
		t.Fatal(err)
	}
	infos, err := p.Devices()
	if err != nil || len(infos) != 1 || infos[0].Address != "" {
		t.Errorf("Devices() = %+v, %v; want one device without an address", infos, err)
	}
}

package tcp

import (
	"context"
	"errors"
	"io"
	"net"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gdrlink/gdrlink/verbsio"
)

// loopbackPair is a connected pair of TCP connections on loopback.
func loopbackPair(t *testing.T) (client, server net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	if client, err = net.Dial("tcp", ln.Addr().String()); err != nil {
		t.Fatal(err)
	}
	if server, err = ln.Accept(); err != nil {
		client.Close()
		t.Fatal(err)
	}
	t.Cleanup(func() { client.Close(); server.Close() })
	return client, server
}

// TCP_INFO is read from the connection's own socket: established, with the
// bytes it sent acknowledged, and a retransmit count; a connection that is
// not TCP is not supported, and a closed one cannot be read.
func TestTCPInfoRetransmitsLoopback(t *testing.T) {
	client, server := loopbackPair(t)
	const n = 256 << 10
	go func() { client.Write(make([]byte, n)) }()
	if _, err := io.ReadFull(server, make([]byte, n)); err != nil {
		t.Fatal(err)
	}
	var info *unix.TCPInfo
	var err error
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
		if info, err = tcpInfo(client); err != nil {
			t.Fatal(err)
		}
		if info.Bytes_acked >= n || time.Now().After(deadline) {
			break
		}
	}
	if info.State != unix.BPF_TCP_ESTABLISHED || info.Bytes_acked < n {
		t.Errorf("TCP_INFO of the sender: state %d, %d bytes acked; want established (%d) and at least %d", info.State, info.Bytes_acked, unix.BPF_TCP_ESTABLISHED, n)
	}
	if _, err := tcpRetransmits(client); err != nil {
		t.Errorf("retransmits of a live loopback connection: %v", err)
	}
	p1, p2 := net.Pipe()
	defer p1.Close()
	defer p2.Close()
	if _, err := tcpRetransmits(p1); !errors.Is(err, verbsio.ErrNotSupported) {
		t.Errorf("retransmits of a pipe: %v, want ErrNotSupported", err)
	}
	client.Close()
	if _, err := tcpRetransmits(client); err == nil {
		t.Error("retransmits of a closed connection: no error")
	}
}

// retransPair is a connected pair of queue pairs on two devices with the
// given options.
func retransPair(t *testing.T, opt Options, fake func(net.Conn) (uint64, error)) (a, z *device, qa, qz verbsio.QueuePair) {
	t.Helper()
	open := func() (*device, verbsio.QueuePair) {
		d, err := openDevice(verbsio.Config{}, opt)
		if err != nil {
			t.Fatal(err)
		}
		if fake != nil {
			d.retransOf = fake
		}
		pd, err := d.AllocPD()
		if err != nil {
			t.Fatal(err)
		}
		cq, err := d.CreateCQ(16)
		if err != nil {
			t.Fatal(err)
		}
		q, err := pd.CreateQP(verbsio.QPConfig{SendCQ: cq, RecvCQ: cq})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			for _, err := range []error{q.Close(), cq.Close(), pd.Close(), d.Close()} {
				if err != nil {
					t.Errorf("cleanup: %v", err)
				}
			}
		})
		return d, q
	}
	a, qa = open()
	z, qz = open()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	errc := make(chan error, 1)
	go func() { errc <- qz.Connect(ctx, qa.Endpoint()) }()
	if err := qa.Connect(ctx, qz.Endpoint()); err != nil {
		t.Fatal(err)
	}
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	return a, z, qa, qz
}

// A live pair's retransmits can be read from the device.
func TestRetransmitsLivePair(t *testing.T) {
	a, z, _, _ := retransPair(t, Options{}, nil)
	for name, d := range map[string]*device{"a": a, "z": z} {
		if n, err := d.Retransmits(); err != nil {
			t.Errorf("device %s: %v", name, err)
		} else {
			t.Logf("device %s: %d segments retransmitted", name, n)
		}
	}
}

// The device counts every lane of its queue pairs, the ones it dialed and
// the ones the peer dialed, and keeps a lane's count when the lane closes:
// the figure never goes down.
func TestRetransmitsKeptAfterClose(t *testing.T) {
	const lanes, each = 2, 3
	fake := func(net.Conn) (uint64, error) { return each, nil }
	a, _, qa, _ := retransPair(t, Options{Lanes: lanes}, fake)
	want := uint64(2 * lanes * each) // lanes out and lanes in
	if n, err := a.Retransmits(); err != nil || n != want {
		t.Fatalf("connected: %d retransmits (%v), want %d", n, err, want)
	}
	if err := qa.Close(); err != nil {
		t.Fatal(err)
	}
	a.lanesMu.Lock()
	open := len(a.lanes)
	a.lanesMu.Unlock()
	if open != 0 {
		t.Errorf("%d lanes still recorded after the queue pair closed", open)
	}
	if n, err := a.Retransmits(); err != nil || n != want {
		t.Fatalf("after Close: %d retransmits (%v), want still %d", n, err, want)
	}
}

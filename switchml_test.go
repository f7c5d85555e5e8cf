package gdrlink

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/internal/jobauth"
	"github.com/gdrlink/gdrlink/internal/switchml/aggsrv"
	"github.com/gdrlink/gdrlink/tensor"
)

// switchmlJob all-reduces through the aggregator: a random float32 tensor
// (within the block-floating-point bound of the float64 sums, digest
// compared across ranks), an exact int32 sum, and an int64 tensor, which
// the ring takes.
func switchmlJob(ctx context.Context, g *Group, rep *childReport) error {
	n, r := g.Size(), g.Rank()
	const rn = 100_003
	t, err := g.NewTensor(tensor.Float32, rn)
	if err != nil {
		return err
	}
	v, _ := tensor.View[float32](t)
	val := func(r, i int) float32 { return float32(rand.New(rand.NewPCG(uint64(r), uint64(i))).NormFloat64()) }
	for i := range v {
		v[i] = val(r, i)
	}
	cr, err := g.AllReduce(ctx, t, Sum)
	if err != nil {
		return err
	}
	if cr.Backend != "switchml" || cr.Sent < int64(4*rn) || cr.Received < int64(4*rn) {
		return fmt.Errorf("float32 report %+v", cr)
	}
	rep.Paths = append(rep.Paths, fmt.Sprintf("sent %d received %d for %d bytes", cr.Sent, cr.Received, cr.Bytes))
	for i := 0; i < rn; i += 13 {
		var s float64
		for q := range n {
			s += float64(val(q, i))
		}
		// |x| < 8 for these values: the unit is at most 2^(3+h-31).
		if d := math.Abs(float64(v[i]) - s); d > float64(n)*math.Ldexp(1, 3+3-31)+math.Abs(s)*0x1p-23 {
			return fmt.Errorf("float32 element %d: %v, float64 sum %v", i, v[i], s)
		}
	}
	rep.Digests = append(rep.Digests, digest(t))
	_ = t.Release()

	x, err := g.NewTensor(tensor.Int32, 77_777)
	if err != nil {
		return err
	}
	xv, _ := tensor.View[int32](x)
	for i := range xv {
		xv[i] = int32(r*100_000 - i)
	}
	if _, err := g.AllReduce(ctx, x, Sum); err != nil {
		return err
	}
	for i := range xv {
		want := int32(0)
		for q := range n {
			want += int32(q*100_000 - i)
		}
		if xv[i] != want {
			return fmt.Errorf("int32 element %d: %d, want %d", i, xv[i], want)
		}
	}
	rep.Digests = append(rep.Digests, digest(x))
	_ = x.Release()

	y, err := g.NewTensor(tensor.Int64, 1000)
	if err != nil {
		return err
	}
	yv, _ := tensor.View[int64](y)
	for i := range yv {
		yv[i] = int64(r + i)
	}
	cr, err = g.AllReduce(ctx, y, Sum)
	if err != nil {
		return err
	}
	if cr.Backend != "ring" {
		return fmt.Errorf("int64 AllReduce ran on %q, want the ring", cr.Backend)
	}
	rep.Digests = append(rep.Digests, digest(y))
	return nil
}

// TestAllReduceSwitchML runs 2 and 4 ranks with GDRLINK_AGGREGATOR set to
// an aggregator in this (the parent) process.
func TestAllReduceSwitchML(t *testing.T) {
	for _, size := range []int{2, 4} {
		t.Run(strconv.Itoa(size), func(t *testing.T) {
			key, secret, err := jobauth.Generate()
			if err != nil {
				t.Fatal(err)
			}
			port := switchmlPort(t, size)
			cl, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			dc, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1), Port: port})
			if err != nil {
				t.Skip("aggregator port taken:", err)
			}
			s, err := aggsrv.New(aggsrv.Config{Key: key, Control: cl, Data: dc, PeerPort: uint16(port), SetupTimeout: 60 * time.Second})
			if err != nil {
				t.Fatal(err)
			}
			go s.Serve()
			defer s.Close()
			j := startJob(t, "switchml", size, "127.0.0.1", func(int) []string { return nil }, func(int) []string {
				return []string{"GDRLINK_PROVIDER=tcp", "GDRLINK_JOB_KEY=" + secret, "GDRLINK_AGGREGATOR=" + cl.Addr().String(),
					"GDRLINK_AGGREGATOR_PORT=" + strconv.Itoa(port)}
			})
			reps := j.wait(3 * time.Minute)
			for r, rep := range reps {
				if len(rep.Digests) != 3 {
					t.Fatalf("rank %d: %d results", r, len(rep.Digests))
				}
				for i, d := range rep.Digests {
					if d != reps[0].Digests[i] {
						t.Errorf("rank %d: result %d differs from rank 0's", r, i)
					}
				}
			}
			t.Logf("rank 0: %v; aggregator %+v", reps[0].Paths, s.Stats())
		})
	}
}

// switchmlPort finds a UDP port free on 127.0.0.1 .. 127.0.0.(1+n).
func switchmlPort(t *testing.T, n int) int {
	for range 10 {
		c, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
		if err != nil {
			t.Skip("cannot bind 127.0.0.1:", err)
		}
		port := c.LocalAddr().(*net.UDPAddr).Port
		c.Close()
		ok := true
		for r := range n {
			c, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, byte(2+r)), Port: port})
			if err != nil {
				ok = false
				break
			}
			c.Close()
		}
		if ok {
			return port
		}
	}
	t.Skip("no UDP port free on every loopback address")
	return 0
}

// TestAggregatorEnv: GDRLINK_AGGREGATOR and GDRLINK_AGGREGATOR_PORT are
// read, and bad values refused.
func TestAggregatorEnv(t *testing.T) {
	env := func(kv ...string) func(string) (string, bool) {
		m := map[string]string{}
		for i := 0; i < len(kv); i += 2 {
			m[kv[i]] = kv[i+1]
		}
		return func(k string) (string, bool) { v, ok := m[k]; return v, ok }
	}
	c, err := fromEnv(env("GDRLINK_AGGREGATOR", "10.0.0.5:4792", "GDRLINK_AGGREGATOR_PORT", "5000"))
	if err != nil || c.aggregator != "10.0.0.5:4792" || c.aggregatorPort != 5000 {
		t.Fatalf("%q %d %v", c.aggregator, c.aggregatorPort, err)
	}
	for _, kv := range [][]string{{"GDRLINK_AGGREGATOR", "10.0.0.5"}, {"GDRLINK_AGGREGATOR_PORT", "0"}, {"GDRLINK_AGGREGATOR_PORT", "70000"}} {
		if _, err := fromEnv(env(kv...)); err == nil {
			t.Errorf("%s=%s accepted", kv[0], kv[1])
		}
	}
}

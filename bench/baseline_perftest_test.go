package main

import (
	"errors"
	"fmt"
	"math"
	"reflect"
	"strings"
	"testing"

	"github.com/gdrlink/gdrlink/verbsio"
)

// perftestLatSample is ib_write_lat's client report (perftest 4.5+0.17,
// Debian 12) of 200 ping-pongs of 8 B in the Soft-RoCE guest: the
// emulated CPU's millisecond stalls show in t_max and t_avg, not in
// t_typical.
const perftestLatSample = `---------------------------------------------------------------------------------------
                    RDMA_Write Latency Test
 Dual-port       : OFF		Device         : rxe0
 Number of qps   : 1		Transport type : IB
 Connection type : RC		Using SRQ      : OFF
 PCIe relax order: OFF
 ibv_wr* API     : OFF
 TX depth        : 1
 Mtu             : 4096[B]
 Link type       : Ethernet
 GID index       : 1
 Max inline data : 0[B]
 rdma_cm QPs	 : OFF
 Data ex. method : Ethernet
---------------------------------------------------------------------------------------
 local address: LID 0000 QPN 0x0012 PSN 0xba8bd9 RKey 0x0003bc VAddr 0x0055e2d213c000
 GID: 00:00:00:00:00:00:00:00:00:00:255:255:127:00:00:01
 remote address: LID 0000 QPN 0x0011 PSN 0x41997a RKey 0x0002e5 VAddr 0x00564bf3ef1000
 GID: 00:00:00:00:00:00:00:00:00:00:255:255:127:00:00:01
---------------------------------------------------------------------------------------
 #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] 
 8       200          12.14          10440.65      39.80    	       1907.39     	2468.93		10047.78 		10440.65
---------------------------------------------------------------------------------------
`

// perftestLat4KSample is the same at 4 KiB.
const perftestLat4KSample = `---------------------------------------------------------------------------------------
                    RDMA_Write Latency Test
 Dual-port       : OFF		Device         : rxe0
 Number of qps   : 1		Transport type : IB
 Connection type : RC		Using SRQ      : OFF
 PCIe relax order: OFF
 ibv_wr* API     : OFF
 TX depth        : 1
 Mtu             : 4096[B]
 Link type       : Ethernet
 GID index       : 1
 Max inline data : 0[B]
 rdma_cm QPs	 : OFF
 Data ex. method : Ethernet
---------------------------------------------------------------------------------------
 local address: LID 0000 QPN 0x0014 PSN 0xa244a9 RKey 0x00058e VAddr 0x0055a1f3829000
 GID: 00:00:00:00:00:00:00:00:00:00:255:255:127:00:00:01
 remote address: LID 0000 QPN 0x0013 PSN 0x75b896 RKey 0x0004d0 VAddr 0x0055e510bac000
 GID: 00:00:00:00:00:00:00:00:00:00:255:255:127:00:00:01
---------------------------------------------------------------------------------------
 #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] 
 4096    200          59.13          4175.28      62.12    	       456.90      	985.48 		4021.17 		4175.28
---------------------------------------------------------------------------------------
`

// perftestLatOld is the report of perftest 2.x and 3.x, before t_avg,
// t_stdev and the percentiles.
const perftestLatOld = ` #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]
 2       1000          0.86           5.37         0.89
`

func TestParsePerftestLat(t *testing.T) {
	f := func(v float64) *float64 { return &v }
	for _, tc := range []struct {
		name string
		out  string
		want perftestLatReport
	}{
		{"8B", perftestLatSample, perftestLatReport{Bytes: 8, Iters: 200, Min: 12.14, Max: 10440.65, Typical: 39.80,
			Avg: f(1907.39), Stdev: f(2468.93), P99: f(10047.78), P999: f(10440.65)}},
		{"4KiB", perftestLat4KSample, perftestLatReport{Bytes: 4096, Iters: 200, Min: 59.13, Max: 4175.28, Typical: 62.12,
			Avg: f(456.90), Stdev: f(985.48), P99: f(4021.17), P999: f(4175.28)}},
		{"perftest 3", perftestLatOld, perftestLatReport{Bytes: 2, Iters: 1000, Min: 0.86, Max: 5.37, Typical: 0.89}},
		{"a later column", strings.Replace(strings.Replace(perftestLatOld, "t_typical[usec]", "t_typical[usec] t_new[usec]", 1), "0.89", "0.89 7", 1),
			perftestLatReport{Bytes: 2, Iters: 1000, Min: 0.86, Max: 5.37, Typical: 0.89}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := parsePerftestLat([]byte(tc.out))
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, tc.want) {
				t.Errorf("got %s, want %s", fmtLatReport(got), fmtLatReport(tc.want))
			}
		})
	}
}

// fmtLatReport prints a report with its optional figures' values.
func fmtLatReport(r perftestLatReport) string {
	opt := func(p *float64) any {
		if p == nil {
			return "nil"
		}
		return *p
	}
	return fmt.Sprintf("{bytes %d iters %d min %v max %v typical %v avg %v stdev %v p99 %v p99.9 %v}",
		r.Bytes, r.Iters, r.Min, r.Max, r.Typical, opt(r.Avg), opt(r.Stdev), opt(r.P99), opt(r.P999))
}

// TestParsePerftestLatMalformed: reports that must not yield a figure.
func TestParsePerftestLatMalformed(t *testing.T) {
	header := " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] \n"
	for name, out := range map[string]string{
		"empty":       "",
		"no report":   "Couldn't connect to 127.0.0.1:18515\n",
		"header only": header,
		"short row":   header + " 8       200          12.14\n",
		"duration":    " #bytes        #iterations       t_avg[usec]    tps average\n 8       1000            11.59          86255.77\n",
		"cycles (-C)": strings.ReplaceAll(perftestLatSample, "[usec]", "[cycles]"),
		"bad typical": strings.Replace(perftestLatSample, "39.80", "x", 1),
		"negative":    strings.Replace(perftestLatSample, "39.80", "-39.80", 1),
		"inf":         strings.Replace(perftestLatSample, "39.80", "inf", 1),
		"nan":         strings.Replace(perftestLatSample, "1907.39", "nan", 1),
		"bad bytes":   strings.Replace(perftestLatSample, " 8       200", " 8x      200", 1),
		"no t_min":    strings.Replace(perftestLatOld, "t_min[usec]", "t_low[usec]", 1),
	} {
		if r, err := parsePerftestLat([]byte(out)); err == nil {
			t.Errorf("%s: parsed %s", name, fmtLatReport(r))
		}
	}
	// What ib_write_lat -F printed in a Soft-RoCE guest run where it could
	// not measure the clock rate: a failure to measure, tried again.
	if _, err := parsePerftestLat([]byte(perftestLatNoClock)); !errors.Is(err, errPerftestNoClock) {
		t.Errorf("a report of inf: %v, want errPerftestNoClock", err)
	}
}

// perftestLatNoClock is the table of an ib_write_lat -F run that could
// not measure the CPU clock rate (Soft-RoCE guest).
const perftestLatNoClock = " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] \n" +
	" 8       200          inf            inf          inf      \t       inf         \t-nan   \t\tinf     \t\tinf    \n"

// FuzzParsePerftestLat feeds the report parser arbitrary text: it must
// return finite, non-negative figures or an error, never panic.
func FuzzParsePerftestLat(f *testing.F) {
	f.Add([]byte(perftestLatSample))
	f.Add([]byte(perftestLatOld))
	f.Add([]byte(perftestLatNoClock))
	f.Fuzz(func(t *testing.T, b []byte) {
		r, err := parsePerftestLat(b)
		if err != nil {
			if !reflect.DeepEqual(r, perftestLatReport{}) {
				t.Fatalf("report %s with an error", fmtLatReport(r))
			}
			return
		}
		for _, v := range []*float64{&r.Min, &r.Max, &r.Typical, r.Avg, r.Stdev, r.P99, r.P999} {
			if v != nil && (!(*v >= 0) || math.IsInf(*v, 0)) {
				t.Fatalf("figure %v without an error in %s", *v, fmtLatReport(r))
			}
		}
		if r.Bytes < 0 || r.Iters < 0 {
			t.Fatalf("counts %d and %d without an error", r.Bytes, r.Iters)
		}
	})
}

func TestPerftestLatBaselineNeedsIbverbs(t *testing.T) {
	dev, err := verbsio.Open("tcp", verbsio.DefaultConfig())
	if err != nil {
		t.Skipf("skipping: no tcp device to hand the ib_write_lat baseline: %v", err)
	}
	defer dev.Close()
	for _, prog := range []string{"ib_write_lat", "ib_send_lat"} {
		if _, err := perftestLatBaseline(dev, prog); !errors.Is(err, verbsio.ErrNotSupported) {
			t.Fatalf("perftestLatBaseline(%s) of a tcp device: %v", prog, err)
		}
	}
}

package rocev2

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestWireshark has Wireshark's InfiniBand dissector, written independently
// of this package, read the frames this package writes, and compares the
// fields it decodes (BTH, RETH, ImmDt, payload) with those written. It
// needs tshark (Debian's tshark package); Wireshark 4.0 does not check the
// ICRC, which TestScapyVectors covers.
func TestWireshark(t *testing.T) {
	tshark, err := exec.LookPath("tshark")
	if err != nil {
		t.Skip("tshark not installed (apt-get install tshark): the layout check against Wireshark's dissector is skipped")
	}
	ip := IPv4{Src: [4]byte{10, 0, 0, 1}, Dst: [4]byte{10, 0, 0, 2}, TTL: 64, DontFragment: true, SrcPort: 0xc001}
	pkts := []Packet{
		{Opcode: WriteFirst, PKey: 0xffff, DestQP: 0x123456, PSN: 0xabcdef, VA: 0x7f0011223344, RKey: 0x00010006, DMALen: 3072, Payload: bytes.Repeat([]byte{1}, 1024)},
		{Opcode: WriteMiddle, PKey: 0xffff, DestQP: 0x123456, PSN: 0xabcdf0, Payload: bytes.Repeat([]byte{2}, 1024)},
		{Opcode: WriteLastWithImm, PKey: 0xffff, DestQP: 0x123456, PSN: 0xabcdf1, Imm: 0x7f7e7d7c, Payload: bytes.Repeat([]byte{3}, 1024)},
		{Opcode: WriteOnlyWithImm, Solicited: true, PKey: 0x8001, DestQP: 1, AckReq: true, PSN: 0, VA: 0xffffffffffffffff, RKey: 0xdeadbeef, DMALen: 3, Imm: 0x01020304, Payload: []byte("abc")},
		{Opcode: WriteOnly, MigReq: true, PKey: 0xffff, DestQP: 0xffffff, PSN: 0xffffff, VA: 16, RKey: 5, DMALen: 256, Payload: bytes.Repeat([]byte{0xa5}, 256)},
		{Opcode: WriteLast, PKey: 0xffff, DestQP: 2, PSN: 7, Payload: []byte{9}},
	}
	// A pcap file of raw IPv4 packets (link type 101).
	var pcap bytes.Buffer
	hdr := []uint32{0xa1b2c3d4, 0x00040002, 0, 0, 65535, 101}
	for i, v := range hdr {
		if i == 1 {
			binary.Write(&pcap, binary.LittleEndian, uint16(2))
			binary.Write(&pcap, binary.LittleEndian, uint16(4))
			continue
		}
		binary.Write(&pcap, binary.LittleEndian, v)
	}
	for i := range pkts {
		f, err := AppendFrame(nil, &ip, &pkts[i])
		if err != nil {
			t.Fatal(err)
		}
		for _, v := range []uint32{uint32(i), 0, uint32(len(f)), uint32(len(f))} {
			binary.Write(&pcap, binary.LittleEndian, v)
		}
		pcap.Write(f)
	}
	file := filepath.Join(t.TempDir(), "rocev2.pcap")
	if err := os.WriteFile(file, pcap.Bytes(), 0o600); err != nil {
		t.Fatal(err)
	}
	fields := []string{"infiniband.bth.opcode", "infiniband.bth.se", "infiniband.bth.m", "infiniband.bth.padcnt", "infiniband.bth.p_key",
		"infiniband.bth.destqp", "infiniband.bth.a", "infiniband.bth.psn", "infiniband.reth.va", "infiniband.reth.r_key",
		"infiniband.reth.dmalen", "infiniband.immdt", "infiniband.invariant.crc"}
	args := []string{"-r", file, "-T", "fields", "-E", "separator=|"}
	for _, f := range fields {
		args = append(args, "-e", f)
	}
	cmd := exec.Command(tshark, args...)
	cmd.Env = append(os.Environ(), "HOME="+t.TempDir())
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("tshark: %v", err)
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	if len(lines) != len(pkts) {
		t.Fatalf("tshark decoded %d packets, want %d:\n%s", len(lines), len(pkts), out)
	}
	b := func(v bool) string {
		if v {
			return "1"
		}
		return "0"
	}
	icrcs := 0
	for i, line := range lines {
		p := pkts[i]
		f, _ := AppendFrame(nil, &ip, &p)
		want := []string{fmt.Sprint(uint8(p.Opcode)), b(p.Solicited), b(p.MigReq), fmt.Sprint(p.pad()), fmt.Sprint(p.PKey),
			fmt.Sprintf("0x%06x", p.DestQP), b(p.AckReq), fmt.Sprint(p.PSN), "", "", "", "", fmt.Sprintf("0x%08x", binary.BigEndian.Uint32(f[len(f)-4:]))}
		if p.Opcode.HasRETH() {
			want[8], want[9], want[10] = fmt.Sprintf("0x%016x", p.VA), fmt.Sprintf("0x%08x", p.RKey), fmt.Sprint(p.DMALen)
		}
		if p.Opcode.HasImm() {
			want[11] = fmt.Sprintf("%08x", p.Imm)
		}
		got := strings.Split(line, "|")
		for k := range got {
			// A field shown twice in the tree comes as "v,v".
			got[k], _, _ = strings.Cut(got[k], ",")
		}
		if len(got) == len(fields) && got[12] == "" && p.pad() != 0 {
			// Wireshark 4.0 shows no payload nor ICRC for a padded
			// packet with the solicited event bit.
			want[12] = ""
		}
		if len(got) == len(fields) && got[12] != "" {
			icrcs++
		}
		for k := range fields {
			if k >= len(got) || !strings.EqualFold(got[k], want[k]) {
				t.Errorf("packet %d %s: Wireshark reads %q, written %q", i, fields[k], got[min(k, len(got)-1)], want[k])
			}
		}
	}
	if icrcs < len(pkts)-1 {
		t.Errorf("Wireshark found the ICRC where this package put it in %d of %d packets", icrcs, len(pkts))
	}
}

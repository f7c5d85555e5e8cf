#!/usr/bin/env python3
"""Writes scapy.txt: RoCEv2 UC RDMA WRITE packets built by Scapy's RoCE layer
(scapy.contrib.roce, whose BTH computes the ICRC), for the rocev2 package's
tests. Run with Debian's python3-scapy (2.5.0 produced the committed file):

    python3 scapy_vectors.py > scapy.txt

Each line: name, then key=value fields of the packet (integers in hex,
payload in hex), then frame=<hex of the IPv4 packet>. Scapy has no RETH or
ImmDt layer, so they are raw bytes after the BTH, which its ICRC covers.
"""
import random
import struct

from scapy.all import IP, UDP, Raw, raw
from scapy.contrib.roce import BTH

ops = {0x26: "FIRST", 0x27: "MIDDLE", 0x28: "LAST", 0x29: "LAST_IMM",
       0x2a: "ONLY", 0x2b: "ONLY_IMM"}
rng = random.Random(4791)


def vector(name, op, payload, psn, dqpn, va=0, rkey=0, dmalen=0, imm=0,
           tos=0, ttl=64, ipid=0, df=True, sport=49152, udpsum=0,
           se=0, mig=0, pkey=0xffff, fecn=0, becn=0, ackreq=0,
           src="10.0.0.1", dst="10.0.0.2"):
    pad = -len(payload) & 3
    rest = b""
    if op in (0x26, 0x2a, 0x2b):
        rest += struct.pack("!QII", va, rkey, dmalen)
    if op in (0x29, 0x2b):
        rest += struct.pack("!I", imm)
    rest += payload + b"\0" * pad
    udp = UDP(sport=sport, dport=4791)
    if udpsum == 0:
        udp.chksum = 0
    pkt = (IP(src=src, dst=dst, tos=tos, ttl=ttl, id=ipid,
              flags="DF" if df else 0) / udp /
           BTH(opcode=op, solicited=se, migreq=mig, padcount=pad, pkey=pkey,
               fecn=fecn, becn=becn, dqpn=dqpn, ackreq=ackreq, psn=psn) /
           Raw(rest))
    frame = raw(pkt)
    fields = dict(op=op, se=se, mig=mig, pkey=pkey, fecn=fecn, becn=becn,
                  dqpn=dqpn, ackreq=ackreq, psn=psn, va=va, rkey=rkey,
                  dmalen=dmalen, imm=imm, tos=tos, ttl=ttl, id=ipid,
                  df=int(df), sport=sport, udpsum=int(udpsum != 0),
                  src=src, dst=dst)
    kv = " ".join("%s=%s" % (k, v if isinstance(v, str) else "%x" % v)
                  for k, v in fields.items())
    print("%s %s payload=%s frame=%s" % (name, kv, payload.hex() or "-",
                                          frame.hex()))


# A 3-packet message of 1024-byte SwitchML slots, as a worker sends it.
msg = bytes(rng.getrandbits(8) for _ in range(3 * 1024))
vector("msg-first", 0x26, msg[:1024], psn=0x123456, dqpn=0x000011,
       va=0x7f0000001000, rkey=0x00010006, dmalen=3072)
vector("msg-middle", 0x27, msg[1024:2048], psn=0x123457, dqpn=0x000011)
vector("msg-last-imm", 0x29, msg[2048:], psn=0x123458, dqpn=0x000011,
       imm=0x7f7e7d7c)
# Single packets with and without immediate, 256-byte slots.
vector("only-imm-256", 0x2b, bytes(range(256)), psn=0, dqpn=0xabcdef,
       va=0x1000, rkey=0xdead0002, dmalen=256, imm=0x01020304)
vector("only-256", 0x2a, bytes(255 - i for i in range(256)), psn=0xffffff,
       dqpn=1, va=0xffffffffffffffff, rkey=0xffffffff, dmalen=256)
vector("last-noimm", 0x28, b"\x55" * 64, psn=7, dqpn=0x800000)
# Padding, flags the ICRC masks (TOS, TTL, FECN/BECN, UDP checksum) and
# flags it covers (SE, M, A, P_Key).
vector("pad1", 0x2b, b"abc", psn=9, dqpn=0x42, va=0x10, rkey=0x5, dmalen=3,
       imm=0xffffffff, se=1)
vector("pad3", 0x2a, b"x", psn=10, dqpn=0x42, va=0x10, rkey=0x5, dmalen=1,
       mig=1, ackreq=1, pkey=0x8001)
vector("empty-only", 0x2a, b"", psn=11, dqpn=0x42, va=0x10, rkey=0x5)
vector("masked-ecn-ttl", 0x27, b"\x01\x02\x03\x04" * 16, psn=12, dqpn=0x42,
       tos=0x68 | 3, ttl=3, fecn=1, becn=1, ipid=0xbeef, df=False,
       sport=0xc000 | 0x1234, src="192.168.7.9", dst="172.16.0.254")
vector("udp-checksum", 0x2b, b"\xa5" * 32, psn=13, dqpn=0x42, va=0x20,
       rkey=0x7, dmalen=32, imm=0x00ff00ff, udpsum=1)

package main

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"time"
)

// The raw TCP baseline: one loopback TCP stream between the bench process
// and its peer process, no framing beyond a length and a one-byte answer,
// what the tcp provider is held against.

// serveTCPSink accepts one connection on ln and, for each request, reads an
// 8-byte length, reads and discards that many bytes, and answers one byte.
func serveTCPSink(ln net.Listener, bufSize int) {
	c, err := ln.Accept()
	ln.Close()
	if err != nil {
		return
	}
	defer c.Close()
	buf := make([]byte, bufSize)
	var hdr [8]byte
	for {
		if _, err := io.ReadFull(c, hdr[:]); err != nil {
			return
		}
		left := binary.LittleEndian.Uint64(hdr[:])
		for left > 0 {
			n, err := c.Read(buf[:min(uint64(len(buf)), left)])
			if err != nil {
				return
			}
			left -= uint64(n)
		}
		if _, err := c.Write(hdr[:1]); err != nil {
			return
		}
	}
}

// rawTCP is the sending end of the baseline.
type rawTCP struct {
	c   net.Conn
	src []byte
}

func dialRawTCP(ctx context.Context, addr string, src []byte) (*rawTCP, error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("raw TCP baseline: %w", err)
	}
	return &rawTCP{c: c, src: src}, nil
}

// send sends size bytes iters times and returns when the peer has read
// them all.
func (r *rawTCP) send(ctx context.Context, size, iters int) error {
	if dl, ok := ctx.Deadline(); ok {
		r.c.SetDeadline(dl)
	} else {
		r.c.SetDeadline(time.Now().Add(5 * time.Minute))
	}
	var hdr [8]byte
	binary.LittleEndian.PutUint64(hdr[:], uint64(size)*uint64(iters))
	if _, err := r.c.Write(hdr[:]); err != nil {
		return fmt.Errorf("raw TCP baseline: %w", err)
	}
	for range iters {
		if _, err := r.c.Write(r.src[:size]); err != nil {
			return fmt.Errorf("raw TCP baseline: %w", err)
		}
	}
	if _, err := io.ReadFull(r.c, hdr[:1]); err != nil {
		return fmt.Errorf("raw TCP baseline: %w", err)
	}
	return nil
}

// Close closes the connection; idempotent.
func (r *rawTCP) Close() error {
	if r.c == nil {
		return nil
	}
	err := r.c.Close()
	r.c = nil
	return err
}

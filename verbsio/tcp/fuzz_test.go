package tcp

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/internal/offheap"
	"github.com/gdrlink/gdrlink/verbsio"
)

// FuzzFrame decodes arbitrary bytes as a frame header (a header that parses
// must re-encode to the same bytes), then feeds them as a request stream to a
// queue pair whose one registered page lies between guard pages: whatever
// the stream says, the guards must not change and serve must return. The
// first header's address, when not zero, is mapped into the three pages and, when the low
// bit of its key is set, its key becomes the region's, so the fuzzer reaches
// the checks behind the key lookup.
func FuzzFrame(f *testing.F) {
	tg := newTargetRNR(f, verbsio.AccessLocalWrite|verbsio.AccessRemoteWrite|verbsio.AccessRemoteRead, time.Millisecond)
	f.Fuzz(func(t *testing.T, data []byte) {
		h, err := parseHeader(data)
		if err == nil {
			if re := h.Append(nil); !bytes.Equal(re, data[:headerLen]) || h.Len() != len(re) {
				t.Fatalf("header %+v re-encodes to %x, from %x", h, re, data[:headerLen])
			}
		} else if !errors.Is(err, verbsio.ErrBadFrame) {
			t.Fatalf("parse error %v does not wrap ErrBadFrame", err)
		}
		stream := bytes.Clone(data)
		if len(stream) >= headerLen && binary.BigEndian.Uint64(stream[16:]) != 0 {
			off := binary.BigEndian.Uint64(stream[16:]) % uint64(len(tg.mem))
			binary.BigEndian.PutUint64(stream[16:], uint64(offheap.Addr(tg.mem))+off)
			if stream[27]&1 == 1 {
				binary.BigEndian.PutUint32(stream[24:], tg.mr.RKey())
			}
		}
		c1, c2 := net.Pipe()
		done := make(chan struct{})
		tg.qp.wg.Add(1)
		go func() {
			tg.qp.serve(newInLane(c1, srcKey{qp: 4242, nonce: 1}))
			close(done)
		}()
		go io.Copy(io.Discard, c2)
		c2.Write(stream)
		c2.Close()
		<-done
		tg.intact(t, false)
	})
}

// FuzzHello checks the hello decoder: no panic, errors wrap ErrBadFrame,
// and a hello that parses re-encodes to the same bytes.
func FuzzHello(f *testing.F) {
	f.Fuzz(func(t *testing.T, data []byte) {
		h, err := parseHello(data)
		if err != nil {
			if !errors.Is(err, verbsio.ErrBadFrame) {
				t.Fatalf("error %v does not wrap ErrBadFrame", err)
			}
			return
		}
		if re := h.Append(nil); !bytes.Equal(re, data) || h.Len() != len(re) {
			t.Fatalf("hello %+v re-encodes to %x, from %x", h, re, data)
		}
	})
}

// FuzzEndpoint checks the endpoint decoder the same way.
func FuzzEndpoint(f *testing.F) {
	f.Fuzz(func(t *testing.T, data []byte) {
		e, err := parseEndpointData(data)
		if err != nil {
			if !errors.Is(err, verbsio.ErrBadFrame) {
				t.Fatalf("error %v does not wrap ErrBadFrame", err)
			}
			return
		}
		if re := e.Append(nil); !bytes.Equal(re, data) || e.Len() != len(re) {
			t.Fatalf("endpoint %+v re-encodes to %x, from %x", e, re, data)
		}
	})
}

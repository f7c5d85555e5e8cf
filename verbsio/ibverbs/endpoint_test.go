package ibverbs

import (
	"bytes"
	"errors"
	"testing"

	"github.com/gdrlink/gdrlink/internal/ibv"
	"github.com/gdrlink/gdrlink/verbsio"
)

func roceEndpoint() *endpointData {
	return &endpointData{Flags: epGlobal, MTU: 4096, QPN: 0x11, PSN: 0xabcdef, GID: ibv.GID{10: 0xff, 11: 0xff, 12: 127, 15: 1}}
}

func TestEndpointRoundTrip(t *testing.T) {
	for _, e := range []*endpointData{roceEndpoint(), {MTU: 2048, QPN: 1<<24 - 1, PSN: 0, LID: 7}} {
		b := e.Append(nil)
		if len(b) != e.Len() {
			t.Fatalf("Append wrote %d bytes, Len says %d", len(b), e.Len())
		}
		got, err := parseEndpoint(b)
		if err != nil || got != *e {
			t.Fatalf("round trip of %+v: %+v, %v", e, got, err)
		}
	}
}

func TestEndpointRejects(t *testing.T) {
	good := roceEndpoint().Append(nil)
	mod := func(f func(b []byte) []byte) []byte { return f(bytes.Clone(good)) }
	for name, b := range map[string][]byte{
		"empty":      nil,
		"version":    mod(func(b []byte) []byte { b[0] = 2; return b }),
		"short":      good[:len(good)-1],
		"long":       append(bytes.Clone(good), 0),
		"flags":      mod(func(b []byte) []byte { b[1] = 0x80; return b }),
		"mtu":        mod(func(b []byte) []byte { b[2], b[3] = 0x03, 0x00; return b }),
		"qpn zero":   mod(func(b []byte) []byte { copy(b[4:8], []byte{0, 0, 0, 0}); return b }),
		"qpn 25 bit": mod(func(b []byte) []byte { b[4] = 1; return b }),
		"psn 25 bit": mod(func(b []byte) []byte { b[8] = 1; return b }),
		"no gid":     mod(func(b []byte) []byte { clear(b[14:]); return b }),
		"no route":   mod(func(b []byte) []byte { b[1] = 0; b[12], b[13] = 0, 0; return b }),
	} {
		if _, err := parseEndpoint(b); !errors.Is(err, verbsio.ErrBadFrame) {
			t.Errorf("%s: %v, want ErrBadFrame", name, err)
		}
	}
}

// FuzzEndpoint parses arbitrary bytes; whatever parses must re-encode to
// the same bytes.
func FuzzEndpoint(f *testing.F) {
	f.Add(roceEndpoint().Append(nil))
	f.Add((&endpointData{MTU: 1024, QPN: 3, LID: 1}).Append(nil))
	f.Add([]byte{1})
	f.Fuzz(func(t *testing.T, b []byte) {
		e, err := parseEndpoint(b)
		if err != nil {
			if !errors.Is(err, verbsio.ErrBadFrame) {
				t.Fatalf("error %v does not wrap ErrBadFrame", err)
			}
			return
		}
		out := e.Append(nil)
		if len(out) != e.Len() || !bytes.Equal(out, b) {
			t.Fatalf("re-encoded %x as %x", b, out)
		}
	})
}

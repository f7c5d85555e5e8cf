package ipc

import (
	"bytes"
	"errors"
	"reflect"
	"testing"
)

var sampleMsgs = []Msg{
	{Kind: KindRequest, From: 3, Try: 2, Device: "0000:3b:00.0"},
	{Kind: KindNotReady, From: 1},
	{Kind: KindAck, From: 7, Reach: true, Device: "host"},
	{Kind: KindConfirm, From: 0},
	{Kind: KindExport, From: 2, Arena: 5, Size: 1 << 20, Handle: bytes.Repeat([]byte{0xab}, 64)},
	{Kind: KindRelease, From: 2, Arena: 5},
	{Kind: KindPull, From: 2, Arena: 5, Offset: 4096, Size: 8192},
	{Kind: KindDone, From: 1, Arena: 5, Offset: 4096, Size: 8192},
}

func TestMsgRoundTrip(t *testing.T) {
	for _, m := range sampleMsgs {
		got, err := Decode(m.Append(nil))
		if err != nil || !reflect.DeepEqual(got, m) {
			t.Errorf("%+v -> %+v, %v", m, got, err)
		}
	}
}

func TestDecodeRejects(t *testing.T) {
	good := sampleMsgs[0].Append(nil)
	mut := func(f func(b []byte) []byte) []byte { return f(append([]byte(nil), good...)) }
	for name, b := range map[string][]byte{
		"empty":      nil,
		"short":      good[:10],
		"magic":      mut(func(b []byte) []byte { b[0] = 'X'; return b }),
		"version":    mut(func(b []byte) []byte { b[2] = 9; return b }),
		"kind 0":     mut(func(b []byte) []byte { b[3] = 0; return b }),
		"kind 99":    mut(func(b []byte) []byte { b[3] = 99; return b }),
		"reach 2":    mut(func(b []byte) []byte { b[9] = 2; return b }),
		"long dev":   mut(func(b []byte) []byte { b[34] = MaxDevice + 1; return b }),
		"trailing":   append(append([]byte(nil), good...), 0),
		"truncated":  good[:len(good)-1],
		"wrap":       (Msg{Kind: KindPull, Offset: ^uint64(0), Size: 2}).Append(nil),
		"big handle": mut(func(b []byte) []byte { b[35] = MaxHandle + 1; return b }),
	} {
		if _, err := Decode(b); !errors.Is(err, ErrBadMessage) {
			t.Errorf("%s: err = %v", name, err)
		}
	}
}

func FuzzDecode(f *testing.F) {
	for _, m := range sampleMsgs {
		f.Add(m.Append(nil))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := Decode(b)
		if err != nil {
			if !errors.Is(err, ErrBadMessage) {
				t.Fatalf("untyped error %v", err)
			}
			return
		}
		if again := m.Append(nil); !bytes.Equal(again, b) {
			t.Fatalf("re-encoding differs: %x vs %x", again, b)
		}
	})
}

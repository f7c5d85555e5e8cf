package rendezvous

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"
	"unsafe"

	"github.com/gdrlink/gdrlink/tensor"
)

// Into has the sender write the caller's tensor itself: the result shares
// its memory, whatever the step, and a smaller tensor of the same type
// fills its front and leaves the rest as it was. A provider that gives no
// grants (Caps.Grants; Soft-RoCE's memory windows are not bounded in
// space) cannot: every result then gets a buffer of its own, and the
// tensor given is left alone, unless the tensor came eagerly (copied into
// it here).
func TestRecvInto(t *testing.T) {
	forEachProvider(t, func(t *testing.T, provider string) {
		a, b := pair(t, provider)
		ctx := recvCtx(t)
		grants := b.dev.Caps().Grants
		if !grants {
			t.Logf("%s gives no grants here: checking that every result gets a buffer of its own", provider)
		}
		dst, err := makeTensor(b.pool, "float32", tensor.Shape{1024}, "dst", 0)
		if err != nil {
			t.Fatal(err)
		}
		defer dst.Release()
		db, _ := dst.Bytes()
		for step, shape := range []tensor.Shape{{1024}, {1024}, {32, 32}, {256}} {
			before := bytes.Clone(db)
			src, err := makeTensor(a.pool, "float32", shape, "x", int64(step))
			if err != nil {
				t.Fatal(err)
			}
			if err := a.ch.Send("x", int64(step), src); err != nil {
				t.Fatal(err)
			}
			got, tr, err := b.ch.Recv(ctx, "x", int64(step), Into(dst))
			if err != nil {
				t.Fatalf("step %d: %v", step, err)
			}
			// A tensor that came eagerly is copied into it here, grants
			// or not (nobody writes it remotely).
			want := grants || tr.Path == PathEager
			if placed := got.Addr() == dst.Addr(); placed != want || tr.Placed != want {
				_ = got.Release()
				t.Fatalf("step %d: result at %#x (placed %v, path %s), tensor given at %#x; want it written there: %v", step, got.Addr(), tr.Placed, tr.Path, dst.Addr(), want)
			}
			if err := checkTensor(got, "float32", shape, "x", int64(step)); err != nil {
				t.Fatalf("step %d: %v", step, err)
			}
			n := got.Meta().ByteSize
			if !want {
				n = 0 // nothing of the tensor given may change
			}
			if !bytes.Equal(db[n:], before[n:]) {
				t.Fatalf("step %d: bytes past the %d written changed", step, n)
			}
			if err := got.Release(); err != nil {
				t.Fatalf("step %d: releasing the result: %v", step, err)
			}
			if _, err := dst.Bytes(); err != nil {
				t.Fatalf("step %d: releasing the result released the tensor lent to it: %v", step, err)
			}
		}
		if st := b.ch.Stats(); st.ReRequests != 0 {
			t.Errorf("%d re-requests; the tensor given says the meta-data, so none was needed", st.ReRequests)
		}
	})
}

// Where the tensor given cannot take the result (another type, too small,
// or memory the channel did not register), the result gets a buffer of
// its own, and the tensor given is left alone.
func TestRecvIntoFallsBack(t *testing.T) {
	forEachProvider(t, func(t *testing.T, provider string) {
		a, b := pair(t, provider)
		ctx := recvCtx(t)
		small, err := makeTensor(b.pool, "float32", tensor.Shape{16}, "small", 0)
		if err != nil {
			t.Fatal(err)
		}
		defer small.Release()
		other, err := makeTensor(b.pool, "int32", tensor.Shape{64}, "other", 0)
		if err != nil {
			t.Fatal(err)
		}
		defer other.Release()
		m, _ := tensor.MetaFor(tensor.Float32, tensor.Shape{64})
		heap, err := tensor.New(m, heapBuffer(make([]byte, m.ByteSize)))
		if err != nil {
			t.Fatal(err)
		}
		for step, into := range []*tensor.Tensor{small, other, heap} {
			before, _ := into.Bytes()
			before = bytes.Clone(before)
			src, err := makeTensor(a.pool, "float32", tensor.Shape{64}, "y", int64(step))
			if err != nil {
				t.Fatal(err)
			}
			if err := a.ch.Send("y", int64(step), src); err != nil {
				t.Fatal(err)
			}
			got, tr, err := b.ch.Recv(ctx, "y", int64(step), Into(into))
			if err != nil {
				t.Fatalf("step %d: %v", step, err)
			}
			if got.Addr() == into.Addr() || tr.Placed {
				t.Fatalf("step %d: result written into a tensor of %s that cannot take it", step, into.Meta())
			}
			if err := checkTensor(got, "float32", tensor.Shape{64}, "y", int64(step)); err != nil {
				t.Fatalf("step %d: %v", step, err)
			}
			_ = got.Release()
			if after, _ := into.Bytes(); !bytes.Equal(after, before) {
				t.Fatalf("step %d: the tensor given changed", step)
			}
		}
	})
}

// errTo is a RecvFunc callback that releases the result and sends the
// error to res.
func errTo(res chan<- error) func(*tensor.Tensor, Transfer, error) {
	return func(t *tensor.Tensor, _ Transfer, err error) {
		if t != nil {
			_ = t.Release()
		}
		res <- err
	}
}

// waitErr waits up to 10 s for what errTo sends; what names the receive.
func waitErr(t *testing.T, res <-chan error, what string) error {
	t.Helper()
	select {
	case err := <-res:
		return err
	case <-time.After(10 * time.Second):
		t.Fatalf("%s never reported", what)
		return nil
	}
}

// heapBuffer is host memory no channel registered.
type heapBuffer []byte

func (h heapBuffer) Bytes() []byte         { return h }
func (h heapBuffer) Addr() uintptr         { return uintptr(unsafe.Pointer(unsafe.SliceData(h))) }
func (h heapBuffer) Len() int              { return len(h) }
func (h heapBuffer) Device() tensor.Device { return tensor.Host }
func (h heapBuffer) Free() error           { return nil }

// A receive into a tensor that is cancelled reports so, and the tensor is
// not written after it did: the tensor sent later goes to the next
// receive of its key and step instead. A receive pending when the peer's
// channel closes fails, and its tensor is not written either.
func TestRecvIntoCancelled(t *testing.T) {
	forEachProvider(t, func(t *testing.T, provider string) {
		a, b := pair(t, provider)
		dst, err := makeTensor(b.pool, "float32", tensor.Shape{256}, "dst", 0)
		if err != nil {
			t.Fatal(err)
		}
		defer dst.Release()
		db, _ := dst.Bytes()
		before := bytes.Clone(db)

		cctx, cancel := context.WithCancel(context.Background())
		res := make(chan error, 1)
		b.ch.RecvFunc(cctx, "z", 0, errTo(res), Into(dst))
		waitParked(t, a.ch, 1) // the request reached the sender
		cancel()
		if err := waitErr(t, res, "a cancelled receive into a tensor"); !errors.Is(err, ErrCancelled) {
			t.Fatalf("cancelled receive: %v, want ErrCancelled", err)
		}
		// Without grants the cancel reports at once: the Send below
		// must not find the withdrawn request still there.
		waitParked(t, a.ch, 0)
		src, err := makeTensor(a.pool, "float32", tensor.Shape{256}, "z", 0)
		if err != nil {
			t.Fatal(err)
		}
		if err := a.ch.Send("z", 0, src); err != nil {
			t.Fatal(err)
		}
		ctx := recvCtx(t)
		got, _, err := b.ch.Recv(ctx, "z", 0)
		if err != nil {
			t.Fatal(err)
		}
		if err := checkTensor(got, "float32", tensor.Shape{256}, "z", 0); err != nil {
			t.Fatal(err)
		}
		_ = got.Release()
		if !bytes.Equal(db, before) {
			t.Fatal("the tensor of the cancelled receive was written")
		}

		b.ch.RecvFunc(ctx, "w", 0, errTo(res), Into(dst))
		waitParked(t, a.ch, 1)
		if err := a.ch.Close(); err != nil {
			t.Fatal(err)
		}
		if err := waitErr(t, res, "a receive into a tensor whose sender closed"); err == nil {
			t.Fatal("a receive whose sender closed its channel succeeded")
		}
		if !bytes.Equal(db, before) {
			t.Fatal("the tensor of the failed receive was written")
		}
	})
}

// A receive into a tensor cancelled while the peer's write is under way
// reports only once the write is over: after it reports, the tensor does
// not change.
func TestRecvIntoCancelledMidWrite(t *testing.T) {
	forEachProvider(t, func(t *testing.T, provider string) {
		a, b := pair(t, provider)
		if !b.dev.Caps().Grants {
			t.Skipf("%s gives no grants here, so its results never land in the tensor given (TestRecvInto checks that)", provider)
		}
		shape := tensor.Shape{16 << 20} // 64 MiB: the write takes a while
		dst, err := makeTensor(b.pool, "float32", shape, "dst", 0)
		if err != nil {
			t.Skipf("no room for a 64 MiB tensor: %v", err)
		}
		defer dst.Release()
		db, _ := dst.Bytes()
		first := bytes.Clone(db[:64])
		src, err := makeTensor(a.pool, "float32", shape, "v", 0)
		if err != nil {
			t.Skipf("no room for a 64 MiB tensor: %v", err)
		}
		if err := a.ch.Send("v", 0, src); err != nil {
			t.Fatal(err)
		}
		cctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		res := make(chan error, 1)
		b.ch.RecvFunc(cctx, "v", 0, errTo(res), Into(dst))
		deadline := time.Now().Add(10 * time.Second)
		for bytes.Equal(db[:64], first) {
			if time.Now().After(deadline) {
				t.Fatal("the write never began")
			}
		}
		cancel()
		err2 := waitErr(t, res, "a receive cancelled mid-write")
		snap := bytes.Clone(db)
		time.Sleep(50 * time.Millisecond)
		if !bytes.Equal(db, snap) {
			t.Fatalf("the tensor changed after its receive reported (%v)", err2)
		}
		if err2 == nil {
			// The write was over before the cancel took: a whole result.
			if err := checkTensor(dst, "float32", shape, "v", 0); err != nil {
				t.Fatal(err)
			}
		} else if !errors.Is(err2, ErrCancelled) {
			t.Fatalf("cancelled mid-write: %v, want ErrCancelled", err2)
		}
	})
}

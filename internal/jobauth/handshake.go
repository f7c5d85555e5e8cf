package jobauth

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"net/netip"
)

// Wire format of the handshake, version 1 (all integers big-endian):
//
//	initiator -> acceptor: "GDRA" version=1 u8, purpose length u8, purpose,
//	                       claimed rank u32, initiator nonce [32]
//	acceptor -> initiator: "GDRA" status u8 (0), acceptor nonce [32],
//	                       acceptor MAC [32]
//	initiator -> acceptor: status u8 (0 = MAC good, 1 = refused),
//	                       initiator MAC [32] (only with status 0)
//	acceptor -> initiator: status u8 (0 = accepted, 1 = refused)
//
// Each MAC is HMAC-SHA-256 under the key over a role byte ('A' or 'I')
// and the transcript: version, purpose, rank, both nonces and both
// endpoints' addresses (the initiator's, then the acceptor's, each as the
// caller sees the connection).
const (
	magic     = "GDRA"
	version   = 1
	nonceSize = 32
	macSize   = sha256.Size
	statusOK  = 0
	statusBad = 1
)

// Ends names the two endpoints of a connection the same way on both sides:
// Initiator is the address of the side that dialled, Acceptor that of the
// side that accepted.
type Ends struct {
	Initiator, Acceptor string
}

// EndsOf reads a connection's Ends; dialled says whether this side dialled.
func EndsOf(c net.Conn, dialled bool) Ends {
	l, r := addrString(c.LocalAddr()), addrString(c.RemoteAddr())
	if dialled {
		return Ends{Initiator: l, Acceptor: r}
	}
	return Ends{Initiator: r, Acceptor: l}
}

func addrString(a net.Addr) string {
	if a == nil {
		return ""
	}
	return a.Network() + ":" + a.String()
}

func transcript(purpose string, rank uint32, ni, na []byte, e Ends) []byte {
	b := []byte{version, byte(len(purpose))}
	b = append(b, purpose...)
	b = binary.BigEndian.AppendUint32(b, rank)
	b = append(b, ni...)
	b = append(b, na...)
	b = binary.BigEndian.AppendUint16(b, uint16(len(e.Initiator)))
	b = append(b, e.Initiator...)
	b = binary.BigEndian.AppendUint16(b, uint16(len(e.Acceptor)))
	return append(b, e.Acceptor...)
}

func mac(k Key, role byte, t []byte) []byte {
	h := hmac.New(sha256.New, k.k)
	h.Write([]byte{role})
	h.Write(t)
	return h.Sum(nil)
}

func nonce() ([]byte, error) {
	b := make([]byte, nonceSize)
	if _, err := rand.Read(b); err != nil {
		return nil, fmt.Errorf("jobauth: nonce: %w", err)
	}
	return b, nil
}

// Initiate proves the key to the acceptor at the other end of rw, and has
// it prove the key to us, claiming rank for this side. purpose names what
// the connection is for ("bootstrap", "tcp-lane", "onnode"), so a handshake
// made for one cannot serve another. The caller bounds the exchange with a
// deadline on rw. It returns nil once both sides have proven the key, or an
// error wrapping ErrRefused that says which side failed.
func Initiate(rw io.ReadWriter, k Key, purpose string, rank uint32, e Ends) error {
	if k.IsZero() {
		return fmt.Errorf("%w: this process has no job key", ErrRefused)
	}
	if len(purpose) > 255 {
		return fmt.Errorf("jobauth: purpose of %d bytes", len(purpose))
	}
	ni, err := nonce()
	if err != nil {
		return err
	}
	hello := append([]byte(magic), version, byte(len(purpose)))
	hello = append(hello, purpose...)
	hello = binary.BigEndian.AppendUint32(hello, rank)
	hello = append(hello, ni...)
	if _, err := rw.Write(hello); err != nil {
		return fmt.Errorf("jobauth: %s handshake to %s: %w", purpose, e.Acceptor, err)
	}
	resp := make([]byte, len(magic)+1+nonceSize+macSize)
	if _, err := io.ReadFull(rw, resp); err != nil {
		return fmt.Errorf("%w: %s handshake: %s did not answer as a job peer: %w", ErrRefused, purpose, e.Acceptor, err)
	}
	if string(resp[:4]) != magic || resp[4] != statusOK {
		return fmt.Errorf("%w: %s handshake: %s answered as no job peer (%q)", ErrRefused, purpose, e.Acceptor, resp[:5])
	}
	na, macA := resp[5:5+nonceSize], resp[5+nonceSize:]
	t := transcript(purpose, rank, ni, na, e)
	if !hmac.Equal(macA, mac(k, 'A', t)) {
		rw.Write([]byte{statusBad})
		return fmt.Errorf("%w: %s handshake: %s does not hold this job's key", ErrRefused, purpose, e.Acceptor)
	}
	if _, err := rw.Write(append([]byte{statusOK}, mac(k, 'I', t)...)); err != nil {
		return fmt.Errorf("jobauth: %s handshake to %s: %w", purpose, e.Acceptor, err)
	}
	var st [1]byte
	if _, err := io.ReadFull(rw, st[:]); err != nil {
		return fmt.Errorf("%w: %s handshake: %s closed before accepting: %w", ErrRefused, purpose, e.Acceptor, err)
	}
	if st[0] != statusOK {
		return fmt.Errorf("%w: %s handshake: %s refused this process's key (wrong job key?)", ErrRefused, purpose, e.Acceptor)
	}
	return nil
}

// Accept answers Initiate on an accepted connection: it proves the key,
// checks the initiator's proof, and returns the rank the initiator claimed,
// now bound to a holder of the key. The purpose must be the one expected
// here. Errors wrap ErrRefused and name the initiator's address.
func Accept(rw io.ReadWriter, k Key, purpose string, e Ends) (rank uint32, err error) {
	if k.IsZero() {
		return 0, fmt.Errorf("%w: this process has no job key", ErrRefused)
	}
	head := make([]byte, len(magic)+2)
	if _, err := io.ReadFull(rw, head); err != nil {
		return 0, fmt.Errorf("%w: %s handshake from %s: %w", ErrRefused, purpose, e.Initiator, err)
	}
	if string(head[:4]) != magic || head[4] != version {
		return 0, fmt.Errorf("%w: %s handshake from %s: not a job handshake (%q)", ErrRefused, purpose, e.Initiator, head)
	}
	rest := make([]byte, int(head[5])+4+nonceSize)
	if _, err := io.ReadFull(rw, rest); err != nil {
		return 0, fmt.Errorf("%w: %s handshake from %s: %w", ErrRefused, purpose, e.Initiator, err)
	}
	if got := string(rest[:head[5]]); got != purpose {
		return 0, fmt.Errorf("%w: handshake from %s is for %q, this is %q", ErrRefused, e.Initiator, got, purpose)
	}
	rank = binary.BigEndian.Uint32(rest[head[5]:])
	ni := rest[int(head[5])+4:]
	na, err := nonce()
	if err != nil {
		return 0, err
	}
	t := transcript(purpose, rank, ni, na, e)
	resp := append([]byte(magic), statusOK)
	resp = append(resp, na...)
	if _, err := rw.Write(append(resp, mac(k, 'A', t)...)); err != nil {
		return 0, fmt.Errorf("jobauth: %s handshake with %s: %w", purpose, e.Initiator, err)
	}
	var st [1]byte
	if _, err := io.ReadFull(rw, st[:]); err != nil {
		return 0, fmt.Errorf("%w: %s handshake from %s: %w", ErrRefused, purpose, e.Initiator, err)
	}
	if st[0] != statusOK {
		return 0, fmt.Errorf("%w: %s handshake: %s refused this process's key (wrong job key?)", ErrRefused, purpose, e.Initiator)
	}
	macI := make([]byte, macSize)
	if _, err := io.ReadFull(rw, macI); err != nil {
		return 0, fmt.Errorf("%w: %s handshake from %s: %w", ErrRefused, purpose, e.Initiator, err)
	}
	if !hmac.Equal(macI, mac(k, 'I', t)) {
		rw.Write([]byte{statusBad})
		return 0, fmt.Errorf("%w: %s handshake: %s (claiming rank %d) does not hold this job's key", ErrRefused, purpose, e.Initiator, rank)
	}
	if _, err := rw.Write([]byte{statusOK}); err != nil {
		return 0, fmt.Errorf("jobauth: %s handshake with %s: %w", purpose, e.Initiator, err)
	}
	return rank, nil
}

// Insecure reports whether the environment allows a job without a key to
// listen beyond loopback (InsecureEnv=1).
func Insecure(getenv func(string) string) bool { return getenv(InsecureEnv) == "1" }

// CheckListen refuses to listen on addr ("host:port", or a bare host)
// without a key unless the host is a loopback address or insecure is set:
// without a key, nothing but this host's own processes may reach a job.
func CheckListen(k Key, addr string, insecure bool) error {
	if !k.IsZero() || insecure {
		return nil
	}
	host := addr
	if h, _, err := net.SplitHostPort(addr); err == nil {
		host = h
	}
	if host == "localhost" {
		return nil
	}
	if ip, err := netip.ParseAddr(host); err == nil && ip.IsLoopback() {
		return nil
	}
	return fmt.Errorf("%w: refusing to listen on %s without a job key: set %s or %s (the same on every rank), or %s=1 to run unauthenticated", ErrInsecure, addr, KeyEnv, KeyFileEnv, InsecureEnv)
}

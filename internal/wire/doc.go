// Package wire is the binary encoding of the control messages of gdrlink's
// zero-copy tensor protocol (rendezvous): TENSOR_REQUEST,
// META_DATA_RESPONSE, TENSOR_RE_REQUEST, ERROR_STATUS, and the messages that
// go beyond TensorFlow's verbs transport (CREDIT, CHECKSUM, CANCEL, BYE), plus
// the HELLO that two peers trade through the bootstrap before their queue
// pairs connect.
//
// Every message is one frame, little-endian, fixed-width fields only, so each
// value has exactly one encoding:
//
//	version  1 byte, Version
//	type     1 byte, a Type
//	credits  2 bytes, receive credits returned to the peer (piggybacked)
//	length   4 bytes, the frame's whole length, header included
//	body     length-8 bytes, laid out per type (see Message)
//
// Several frames may share one SEND: Decode reports how many bytes the first
// frame took. Encoders append and measure (Append, Len) and never allocate
// when the destination has room; Decode fills a caller's Message and
// allocates nothing, its byte fields aliasing the input. Anything malformed
// is rejected with an error wrapping one of this package's sentinels and the
// offset concerned.
package wire

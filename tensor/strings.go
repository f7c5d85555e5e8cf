package tensor

// StringsEncodedLen is the size of the wire encoding of vals.
// (Placeholder: the encoding is implemented in encoding.go.)
func StringsEncodedLen(vals []string) int {
	n := 0
	for _, s := range vals {
		n += 4 + len(s)
	}
	return n
}

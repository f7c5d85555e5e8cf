package sysfs

import (
	"bytes"
	"debug/elf"
	"fmt"
)

// ELFExports reports whether an ELF shared object's dynamic symbol table
// defines sym.
func ELFExports(image []byte, sym string) (bool, error) {
	ef, err := elf.NewFile(bytes.NewReader(image))
	if err != nil {
		return false, fmt.Errorf("%w: %w", ErrMalformed, err)
	}
	defer ef.Close()
	syms, err := ef.DynamicSymbols()
	if err != nil {
		return false, fmt.Errorf("%w: %w", ErrMalformed, err)
	}
	for _, s := range syms {
		if s.Name == sym && s.Section != elf.SHN_UNDEF {
			return true, nil
		}
	}
	return false, nil
}

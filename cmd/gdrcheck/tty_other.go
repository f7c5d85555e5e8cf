//go:build !linux

package main

import "io"

func isTerminal(io.Writer) bool { return false }

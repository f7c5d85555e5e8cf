package main

import (
	"context"
	"io"
)

// Selftest is the outcome of --selftest.
type Selftest struct {
	Size   int           `json:"size"`
	Runs   []SelftestRun `json:"runs"`
	Failed int           `json:"failed"`
}

// SelftestRun is one provider and memory path.
type SelftestRun struct {
	Provider string `json:"provider"`
	Path     string `json:"path"`
	// Status is "ok", "failed" or "skipped".
	Status string  `json:"status"`
	Detail string  `json:"detail"`
	GBps   float64 `json:"gbps"`
}

func runSelftest(ctx context.Context, size int) *Selftest {
	return &Selftest{Size: size, Runs: []SelftestRun{}}
}

func writeSelftest(w io.Writer, s *Selftest, p painter) {}

// Package gdrseam lets gdrcheck reach what package gdr keeps out of its
// public API: collecting through a Root that gdrcheck opened (and records,
// for snapshots), with the PCI devices read on the way; the snapshot-facts
// file. Package gdr fills the variables when it is initialized; code that
// imports gdr can then use them (gdr cannot be imported here: it imports
// this package).
package gdrseam

// Collect is gdr's func(ctx context.Context, root *sysfs.Root, opts
// gdr.CollectOptions) (*gdr.Facts, map[string]*sysfs.PCIDevice, error): the
// facts of the node under root (opts.Root is not used), and its PCI devices
// by address.
var Collect any

// SnapshotFacts is gdr's func(f *gdr.Facts) (name string, content []byte,
// err error): the file a snapshot of f's node keeps the facts that are not
// files in (NVML's answers, the libibverbs probe), relative to the root, and
// its content.
var SnapshotFacts any

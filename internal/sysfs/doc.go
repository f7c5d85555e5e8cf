// Package sysfs reads a node's sysfs and procfs under a root directory ("/"
// on the node itself, /host in a container, or a copy of another node's tree
// such as a gdrcheck snapshot) for package gdr and for gdrcheck: a confined
// Root that can record what it reads, pure parsers of the files' formats, the
// PCI tree with its bridges' ACS state, and the classification of the PCIe
// path between two devices.
package sysfs

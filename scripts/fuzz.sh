#!/usr/bin/env bash
# Runs every fuzz target of the module for FUZZTIME (default 20s) each, one
# target at a time (go test -fuzz takes one target per run).
set -euo pipefail
cd "$(dirname "$0")/.."
t=${FUZZTIME:-20s}
fail=0
for pkg in $(go list ./...); do
  dir=$(go list -f '{{.Dir}}' "$pkg")
  for f in $(grep -ho '^func Fuzz[A-Za-z0-9_]*' "$dir"/*_test.go 2>/dev/null | sed 's/^func //' | sort -u); do
    echo "== $pkg $f ($t)"
    go test -run '^$' -fuzz "^$f\$" -fuzztime "$t" -parallel 1 "$pkg" || fail=1
  done
done
exit $fail

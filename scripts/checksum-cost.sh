#!/bin/sh
# checksum-cost.sh: the cost of checksum mode per provider and size, each
# case run alternately (off, on, on without confirmations) ROUNDS times so
# that a noisy host's drift falls on all three alike, then the medians.
# Usage: scripts/checksum-cost.sh [ROUNDS] (default 6); GDRLINK_PROVIDER
# picks providers as for the tests (default tcp,onnode).
set -eu
rounds=${1:-6}
cd "$(dirname "$0")/.."
bin=$(mktemp)
out=$(mktemp)
trap 'rm -f "$bin" "$out"' EXIT
go test -c -o "$bin" ./rendezvous
for i in $(seq "$rounds"); do
	for mode in off on on-noconfirm; do
		(cd rendezvous && "$bin" -test.run '^$' -test.bench "BenchmarkRecvChecksum/.*/.*/checksum=$mode\$" -test.benchtime 1s) | grep "^BenchmarkRecvChecksum" >>"$out" || true
	done
done
printf "%-8s %-10s %12s %12s %14s %8s %8s\n" provider size "off MB/s" "on MB/s" no-confirm on/off nc/off
awk '
{
	split($1, f, "/"); p = f[2]; size = f[3]; mode = f[4]; sub(/^checksum=/, "", mode); sub(/-[0-9]+$/, "", mode)
	k = p " " size " " mode; n[k]++; v[k, n[k]] = $(NF-1); keys[p " " size] = 1
}
function median(k,   i, j, t, m, a) {
	m = n[k]
	for (i = 1; i <= m; i++) a[i] = v[k, i]
	for (i = 1; i <= m; i++) for (j = i + 1; j <= m; j++) if (a[j] < a[i]) { t = a[i]; a[i] = a[j]; a[j] = t }
	return m % 2 ? a[(m + 1) / 2] : (a[m / 2] + a[m / 2 + 1]) / 2
}
END {
	for (k in keys) {
		split(k, f, " ")
		off = median(k " off"); on = median(k " on"); nc = median(k " on-noconfirm")
		printf "%-8s %-10s %12.1f %12.1f %14.1f %8.2f %8.2f\n", f[1], f[2], off, on, nc, on / off, nc / off
	}
}' "$out" | sort -k1,1 -k2,2n

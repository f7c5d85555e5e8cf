#!/usr/bin/env bash
# gpu-check: the GPU tests and the GPU benchmarks of gdrlink, run on a GPU node
# in one go.
#
#   scripts/gpu-check.sh [build] [DIR]   build the GPU test binaries, gdrcheck
#                                        and bench into DIR (default gpu-check/)
#   scripts/gpu-check.sh run DIR         on the GPU node: run them all with
#                                        GDRLINK_REQUIRE_GPU=1, print a summary
#
# The GPU node needs neither a Go toolchain nor a network: copy DIR there
# (scp -r gpu-check node:) and run `gpu-check/gpu-check.sh run gpu-check`.
# libibverbs is optional there; the verbs parts of the tests skip without it.
set -euo pipefail

# Packages with GPU tests, and the tests to run in each ("" for all).
PKGS=(
	"./internal/cuda:"
	"./internal/nvml:"
	"./alloc:"
	"./alloc/visitor:"
	"./proxy:"
	"./gdr:"
	"./cmd/gdrcheck:"
	"./bench:IPC"
	".:GPU|CUDA|IPC"
	"./contrib/gorgonia:"
)

# module prints the directory of the Go module that holds pkg: nested
# modules (contrib/...) are built from their own directory.
module() {
	case $1 in
	./contrib/*) echo "$1" ;;
	*) echo . ;;
	esac
}

# name turns a package path into a directory name: ./alloc/visitor → alloc_visitor.
name() {
	local p=${1#./}
	[ -z "$p" ] || [ "$p" = "." ] && p=gdrlink
	echo "${p//\//_}"
}

build() {
	local dir=${1:-gpu-check}
	local go=${GO:-go}
	mkdir -p "$dir"
	local adir
	adir=$(cd "$dir" && pwd)
	rm -rf "${dir:?}/tree"
	: >"$dir/packages"
	for entry in "${PKGS[@]}"; do
		local pkg=${entry%%:*} run=${entry#*:}
		local n
		n=$(name "$pkg")
		# cgo only where the package needs it (NVML through go-nvml);
		# everything else is built static, with no C library to match.
		local cgo=0 mod target out
		mod=$(module "$pkg")
		target=$pkg out=$adir/$n/$n.test
		[ "$mod" != . ] && target=.
		if (cd "$mod" && "$go" list -deps "$target") | grep -q '^github.com/NVIDIA/go-nvml/'; then
			cgo=1
		fi
		# The binary runs in a copy of its package directory (its data
		# files and testdata, symbolic links kept), laid out as in the
		# source tree so links between packages' fixtures still resolve.
		local at="$dir/tree/${pkg#./}"
		rm -rf "${dir:?}/$n"
		mkdir -p "$at" "$dir/$n"
		find "$pkg" -maxdepth 1 -type f ! -name '*.go' -exec cp -a --parents {} "$dir/tree/" \;
		if [ -d "$pkg/testdata" ]; then
			cp -a --parents "$pkg/testdata" "$dir/tree/"
		fi
		echo "build $pkg (CGO_ENABLED=$cgo)"
		(cd "$mod" && CGO_ENABLED=$cgo "$go" test -c -ldflags='-s -w' -o "$out" "$target")
		printf '%s;%s;%s\n' "$n" "$run" "tree/${pkg#./}" >>"$dir/packages"
	done
	# The tools live under bin/: the bench package's test binary already
	# has the directory $dir/bench.
	echo "build ./bench, ./cmd/gdrcheck into $dir/bin"
	mkdir -p "$dir/bin"
	CGO_ENABLED=1 "$go" build -ldflags='-s -w' -o "$dir/bin/bench" ./bench
	CGO_ENABLED=1 "$go" build -ldflags='-s -w' -o "$dir/bin/gdrcheck" ./cmd/gdrcheck
	cp "$0" "$dir/gpu-check.sh"
	echo "built into $dir: copy it to a GPU node and run: $dir/gpu-check.sh run $dir"
}

run() {
	local dir=${1:?usage: gpu-check.sh run DIR}
	dir=$(cd "$dir" && pwd)
	local logs="${GPU_CHECK_LOGS:-$dir/logs}"
	mkdir -p "$logs"
	export GDRLINK_REQUIRE_GPU=1

	echo "== node"
	echo "host: $(uname -n)  kernel: $(uname -r)"
	if command -v nvidia-smi >/dev/null; then
		nvidia-smi --query-gpu=index,name,pci.bus_id,driver_version --format=csv,noheader |
			sed 's/^/gpu: /' || echo "gpu: nvidia-smi failed"
	else
		echo "gpu: no nvidia-smi; see gdrcheck below"
	fi
	"$dir/bin/gdrcheck" >"$logs/gdrcheck.txt" 2>&1 || true
	sed -n '1,40p' "$logs/gdrcheck.txt"

	echo
	echo "== GPU tests (GDRLINK_REQUIRE_GPU=1)"
	local failed=0
	while IFS=';' read -r n filter at; do
		local args=(-test.v -test.count=1 -test.timeout="${GPU_CHECK_TEST_TIMEOUT:-10m}")
		[ -n "$filter" ] && args+=(-test.run "$filter")
		local rc=0
		(cd "$dir/$at" && "$dir/$n/$n.test" "${args[@]}") >"$logs/$n.txt" 2>&1 || rc=$?
		[ "$rc" -ne 0 ] && failed=1
		# Every failure and skip with its messages (go test -v prints a
		# test's messages before its result line), the passes of top-level
		# tests, and the counts.
		awk -v pkg="$n" '
			/^=== (RUN|CONT|PAUSE|NAME)/ { msg = ""; next }
			/^ *--- (PASS|FAIL|SKIP): / {
				res = $2; sub(":", "", res); t = $3
				count[res]++
				if (res != "PASS" || t !~ /\//) printf "%-5s %s %s\n", res, pkg, t
				if (res != "PASS" && msg != "") printf "%s", msg
				msg = ""; next
			}
			/^    / { line = $0; sub(/^ +/, "", line); msg = msg "      " line "\n"; next }
			END { printf "      %s: %d passed, %d failed, %d skipped\n", pkg, count["PASS"], count["FAIL"], count["SKIP"] }
		' "$logs/$n.txt"
		echo "      -> $n: exit $rc (log: $logs/$n.txt)"
	done <"$dir/packages"

	echo
	echo "== bench -scenario proxy (real GPU)"
	if ! "$dir/bin/bench" -scenario proxy -set proxy.device=cuda 2>"$logs/bench-proxy.err"; then
		failed=1
		tail -n 3 "$logs/bench-proxy.err"
	fi
	if "$dir/bin/bench" -list 2>/dev/null | grep -q '^ipc '; then
		echo
		echo "== bench -scenario ipc (real GPU, then the CPU analog and the simulated GPU)"
		if ! "$dir/bin/bench" -scenario ipc -set ipc.mode=cuda,cpu,sim 2>"$logs/bench-ipc.err"; then
			failed=1
			tail -n 3 "$logs/bench-ipc.err"
		fi
	else
		echo "(this bench has no ipc scenario)"
	fi

	echo
	echo "== bench -scenario allreduce (GPU tensors against host tensors, 2 and 4 workers on GPU 0)"
	if ! "$dir/bin/bench" -scenario allreduce -set allreduce.gpu=on -set allreduce.workers=2,4 \
		-set allreduce.mpi=off -max-size 64MiB -reps 5 2>"$logs/bench-allreduce.err"; then
		failed=1
		tail -n 3 "$logs/bench-allreduce.err"
	fi

	echo
	if [ "$failed" -ne 0 ]; then
		echo "gpu-check: FAILED (logs under $logs)"
		return 1
	fi
	echo "gpu-check: all passed (logs under $logs)"
}

case "${1:-build}" in
run) shift; run "$@" ;;
build) shift || true; build "$@" ;;
*) build "$@" ;;
esac

#!/usr/bin/env bash
# test-rdma.sh: gdrlink's verbs tests on a real verbs stack.
#
# The host needs no RDMA NIC and no kernel RDMA support: the script builds
# the test binaries of every package whose tests use the ibverbs provider
# (once, here, with `go test -c`), boots ONE throw-away qemu guest running
# Debian's kernel with Soft-RoCE (rdma_rxe bound to the guest's loopback),
# runs each binary there with -test.v and GDRLINK_REQUIRE_RDMA=1 (so a test
# that would skip for want of a device fails instead), streams their output
# here and exits non-zero if any failed. It leaves no process behind.
#
# The guest sees this machine's root file system read-only over virtio-9p
# (same paths, so the binaries and libibverbs are the host's) and a
# writable scratch directory; nothing leaves the guest: it has no NIC.
#
# Usage: scripts/test-rdma.sh            (make test-rdma)
# Knobs (environment):
#   RDMA_TEST_PKGS      packages to test, space-separated (default: those
#                       of scripts/test-rdma.pkgs)
#   RDMA_TEST_RUN       -test.run pattern for every binary (default: the
#                       package's pattern in scripts/test-rdma.pkgs, or all)
#   RDMA_TEST_RACE=1    build the binaries with the race detector
#   RDMA_TEST_BENCH=0   skip the benchmark program's reg/xfer and allreduce
#                       scenarios
#   RDMA_BENCH_SCENARIOS  which of reg, xfer and allreduce run (comma-
#                       separated; default: all three)
#   RDMA_BENCH_ARGS     bench flags for reg/xfer (default: quick sizes, ibverbs)
#   RDMA_BENCH_PROFILE=1  the bench runs write CPU profiles (bench-*.pprof)
#   RDMA_BENCH_PERF=1   the reg/xfer bench run goes under `perf record -g`
#                       (bench-scenarios.perf.data and the guest's
#                       kallsyms, with RDMA_OUT_DIR)
#   RDMA_OUT_DIR        copy the guest's output (logs, profiles) here
#   RDMA_BENCH_ALLREDUCE_ARGS  bench flags for allreduce (default: quick
#                       sizes, 2 and 4 workers, the ring over ibverbs and
#                       switchml rows of workers on Soft-RoCE, no MPI
#                       baseline)
#   RDMA_TEST_TIMEOUT   seconds per test binary in the guest (default 300)
#   RDMA_GUEST_TIMEOUT  seconds for the whole guest (default 900)
#   RDMA_GUEST_MEM      guest memory in MiB (default 2048)
#   RDMA_GUEST_VERBOSE=1  print the guest's kernel log
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
export PATH=$PATH:/usr/local/go/bin
# The binaries are built without cgo: libibverbs is loaded at run time, so
# this proves that a CGO_ENABLED=0 build has a working ibverbs provider (the
# race detector needs cgo, so RDMA_TEST_RACE=1 builds keep it).
if [ "${RDMA_TEST_RACE:-0}" = 1 ]; then export CGO_ENABLED=1; else export CGO_ENABLED=0; fi
log() { echo "test-rdma: $*" >&2; }
die() { log "$*"; exit 1; }

# --- 1. What the guest needs, from Debian, only if missing. -----------------
need="qemu-system-x86 linux-image-amd64 busybox-static kmod cpio xz-utils zstd
      ibverbs-providers ibverbs-utils perftest libibverbs-dev iproute2 rdma-core"
missing=""
for p in $need; do
  dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q '^install ok installed' || missing="$missing $p"
done
if [ -n "$missing" ]; then
  [ "$(id -u)" = 0 ] || die "missing Debian packages:$missing (run as root, or install them)"
  log "installing:$missing"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2
  apt-get install -y -qq --no-install-recommends $missing >&2
fi

# --- 2. A kernel that ships rdma_rxe, booted uncompressed when possible. ----
kver=""
for k in $(ls /lib/modules | sort -V -r); do
  if [ -e "/boot/vmlinuz-$k" ] && find "/lib/modules/$k" -name 'rdma_rxe.ko*' | grep -q .; then kver=$k; break; fi
done
[ -n "$kver" ] || die "no kernel in /boot with rdma_rxe under /lib/modules"
kernel=/boot/vmlinuz-$kver
cache=${XDG_CACHE_HOME:-/var/cache}/gdrlink
elf=$cache/vmlinux-$kver
if [ ! -s "$elf" ] || [ "$elf" -ot "$kernel" ]; then
  # Debian's bzImage holds an xz-compressed ELF: decompressing it once here
  # saves the guest seconds of emulated decompression at every boot (qemu
  # boots the ELF through its PVH note).
  mkdir -p "$cache" 2>/dev/null || true
  off=$(LC_ALL=C grep -abo -m1 $'\xfd7zXZ\x00' "$kernel" | head -n1 | cut -d: -f1 || true)
  if [ -n "$off" ] && [ -w "$cache" ] &&
     tail -c +$((off + 1)) "$kernel" | xz -dcq --single-stream > "$elf.tmp.$$" 2>/dev/null &&
     [ "$(head -c4 "$elf.tmp.$$" | od -An -c | tr -d ' ')" = '177ELF' ]; then
    mv "$elf.tmp.$$" "$elf"
  else
    rm -f "$elf.tmp.$$"
  fi
fi
[ -s "$elf" ] && kernel=$elf

# --- 3. Scratch space; everything started from here is stopped on exit. -----
work=$(mktemp -d "${TMPDIR:-/tmp}/gdrlink-rdma.XXXXXX")
qemu_pid=""
cleanup() {
  if [ -n "$qemu_pid" ] && kill -0 "$qemu_pid" 2>/dev/null; then
    kill "$qemu_pid" 2>/dev/null || true
    wait "$qemu_pid" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# --- 4. The test binaries, built once on the host. --------------------------
# The packages and their -test.run patterns come from scripts/test-rdma.pkgs
# (or RDMA_TEST_PKGS). Packages whose tests import the provider or the cgo
# package but are not listed are named, so none is forgotten.
if [ -n "${RDMA_TEST_PKGS:-}" ]; then
  plist=$(for p in $RDMA_TEST_PKGS; do echo "$p"; done)
else
  plist=$(sed -e 's/#.*//' -e '/^[[:space:]]*$/d' scripts/test-rdma.pkgs)
fi
[ -n "$plist" ] || die "no packages to test"
listed=$(echo "$plist" | awk '{print $1}' | xargs go list -e 2>/dev/null | sort -u)
detected=$(go list -e -f '{{.ImportPath}}|{{join .TestImports " "}} {{join .XTestImports " "}}' ./... 2>/dev/null |
  awk -F'|' -v m=github.com/gdrlink/gdrlink '
    index(" "$2" ", " "m"/verbsio/ibverbs ") || index(" "$2" ", " "m"/internal/ibv ") { print $1 }' | sort -u)
for p in $(comm -13 <(echo "$listed") <(echo "$detected")); do
  log "note: $p has tests that use the ibverbs provider but is not in scripts/test-rdma.pkgs"
done
race=()
[ "${RDMA_TEST_RACE:-0}" = 1 ] && race=(-race)
mkdir -p "$work/bin" "$work/out"
: > "$work/list"
while read -r p pattern envs; do
  ip=$(go list -e "$p" 2>/dev/null) || ip=$p
  bin=$(echo "${ip#github.com/gdrlink/gdrlink/}" | tr '/' '_')
  # A package listed again (other tests, other variables) runs the same
  # binary under a name of its own: bin.2, bin.3, ...
  name=$bin k=1
  while grep -q "^$name " "$work/list"; do k=$((k + 1)); name=$bin.$k; done
  if [ "$name" = "$bin" ]; then
    log "building $ip"
    go test -c "${race[@]}" -o "$work/bin/$bin.test" "$p" || die "building the tests of $ip failed"
  fi
  if [ -x "$work/bin/$bin.test" ]; then
    printf '%s %s %s %s %s %s\n' "$name" "$bin" "$ip" "$(go list -f '{{.Dir}}' "$p")" "${pattern:-.}" "$envs" >> "$work/list"
  else
    log "$ip has no tests"
  fi
done <<< "$plist"
bench="" bench_scenarios="" bench_allreduce=""
if [ "${RDMA_TEST_BENCH:-1}" = 1 ]; then
  # The scenarios that measure the ibverbs provider, those that exist.
  want=",${RDMA_BENCH_SCENARIOS:-reg,xfer,allreduce},"
  for s in reg xfer; do
    case $want in *",$s,"*) [ -e "bench/scenario_$s.go" ] && bench_scenarios=${bench_scenarios:+$bench_scenarios,}$s ;; esac
  done
  # The allreduce scenario runs apart, with its own flags: the ring over
  # ibverbs and switchml (a software aggregator in the bench process; its
  # workers reach it over UDP on loopback, since rxe holds port 4791 here)
  # side by side.
  case $want in *,allreduce,*) [ -e bench/scenario_allreduce.go ] && bench_allreduce=allreduce ;; esac
  if [ -n "$bench_scenarios$bench_allreduce" ]; then
    log "building the benchmark program"
    if go build -o "$work/bin/bench" ./bench; then bench=$work/bin/bench; else log "bench does not build: its scenarios are left out"; fi
  fi
fi
{
  printf 'RDMA_TEST_RUN=%q\n' "${RDMA_TEST_RUN:-}"
  printf 'per=%q\n' "${RDMA_TEST_TIMEOUT:-300}"
  printf 'bench=%q\n' "$bench"
  printf 'bench_scenarios=%q\n' "$bench_scenarios"
  # Quick sizes, and only the provider under test where xfer has others.
  printf 'bench_args=%q\n' "${RDMA_BENCH_ARGS:--quick -set xfer.providers=ibverbs}"
  printf 'bench_allreduce=%q\n' "$bench_allreduce"
  printf 'bench_profile=%q\n' "${RDMA_BENCH_PROFILE:-0}"
  printf 'bench_perf=%q\n' "${RDMA_BENCH_PERF:-0}"
  # 4 KiB to 1 MiB (-quick), 3 repetitions: the guest has 2 emulated CPUs.
  printf 'bench_allreduce_args=%q\n' "${RDMA_BENCH_ALLREDUCE_ARGS:--quick -set allreduce.providers=ibverbs -set allreduce.switchml=verbs -set allreduce.workers=2,4 -set allreduce.mpi=off}"
} > "$work/env"

# --- 5. The guest: an initramfs that mounts the host's root and runs guest.sh.
modules=$(modprobe -S "$kver" -a --show-depends virtio_pci 9pnet_virtio 9p | awk '$1 == "insmod" { print $2 }' | awk '!seen[$0]++')
[ -n "$modules" ] || die "no virtio/9p modules for $kver"
ird=$work/initramfs
mkdir -p "$ird"/{bin,lib/modules,proc,sys,dev,root}
cp /bin/busybox "$ird/bin/busybox"
for m in $modules; do
  base=$(basename "$m"); base=${base%.xz}; base=${base%.zst}
  case "$m" in
    *.xz) xz -dc "$m" ;;
    *.zst) zstd -qdc "$m" ;;
    *) cat "$m" ;;
  esac > "$ird/lib/modules/$base"
  echo "$base" >> "$ird/lib/modules/load"
done
cat > "$ird/init" <<EOF
#!/bin/busybox sh
bb=/bin/busybox
\$bb mount -t proc proc /proc
\$bb mount -t sysfs sysfs /sys
\$bb mount -t devtmpfs devtmpfs /dev
for m in \$(\$bb cat /lib/modules/load); do \$bb insmod /lib/modules/\$m || echo "test-rdma: insmod \$m failed"; done
opts=trans=virtio,version=9p2000.L,msize=262144
\$bb mount -t 9p -o \$opts,ro,cache=loose host /root || { echo "test-rdma: mounting the host root failed"; \$bb poweroff -f; }
\$bb mount -t 9p -o \$opts work /root$work || { echo "test-rdma: mounting the work directory failed"; \$bb poweroff -f; }
for d in proc sys dev; do \$bb mount --move /\$d /root/\$d; done
exec \$bb switch_root /root /bin/bash $work/guest.sh
EOF
chmod +x "$ird/init"

cat > "$work/guest.sh" <<EOF
# Runs inside the guest as its first process; its output is the console.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root
work=$work
. \$work/env
exec >/dev/ttyS1 2>&1
stty -F /dev/ttyS1 raw -echo 2>/dev/null || true
mkdir -p /dev/shm /dev/pts
# /tmp stays the host's (read-only): the work directory is mounted under it.
for d in /run /var/tmp /dev/shm; do mount -t tmpfs tmpfs \$d; done
mount -t devpts devpts /dev/pts
ulimit -l unlimited
ip link set lo up
modprobe rdma_rxe && rdma link add rxe0 type rxe netdev lo || echo "test-rdma: Soft-RoCE setup failed"
gidx=""
for i in \$(seq 200); do
  if grep -q ACTIVE /sys/class/infiniband/rxe0/ports/1/state 2>/dev/null; then
    for g in /sys/class/infiniband/rxe0/ports/1/gids/*; do
      [ "\$(cat \$g 2>/dev/null)" = 0000:0000:0000:0000:0000:ffff:7f00:0001 ] && gidx=\${g##*/} && break
    done
    [ -n "\$gidx" ] && break
  fi
  sleep 0.1
done
echo "test-rdma: guest: rxe0 \$(cat /sys/class/infiniband/rxe0/ports/1/state 2>&1), RoCE v2 GID index \${gidx:-none}, \$(nproc) CPUs, \$(cut -d' ' -f1 /proc/uptime)s after boot"
export TMPDIR=/var/tmp GDRLINK_REQUIRE_RDMA=1 SOFTROCE_DEV=rxe0 SOFTROCE_GID_INDEX=\${gidx:-1} GOMAXPROCS=\$(nproc)
rc=0
while read -r name bin pkg dir pattern envs; do
  echo "=== test-rdma: \$pkg (\$name)"
  t0=\$(cut -d' ' -f1 /proc/uptime)
  skip=() vars=()
  for kv in \$envs; do
    case "\$kv" in
      skip=*) skip=(-test.skip "\${kv#skip=}"); echo "test-rdma: NOT RUN here (scripts/test-rdma.pkgs): \${kv#skip=}" ;;
      *) vars+=("\$kv") ;;
    esac
  done
  [ \${#vars[@]} = 0 ] || echo "test-rdma: with \${vars[*]}"
  (cd "\$dir" && env "\${vars[@]}" timeout -k 10 \$per "\$work/bin/\$bin.test" -test.v -test.count=1 \
      -test.timeout \$((per - 5))s -test.run "\${RDMA_TEST_RUN:-\$pattern}" "\${skip[@]}" </dev/null 2>&1) |
    tee "\$work/out/\$name.log"
  st=\${PIPESTATUS[0]}
  t1=\$(cut -d' ' -f1 /proc/uptime)
  echo "\$st \$name \$pkg \$t0 \$t1" >> "\$work/out/summary"
  [ "\$st" = 0 ] || rc=1
done < "\$work/list"
if [ -n "\$bench" ] && [ -n "\$bench_scenarios" ]; then
  echo "=== test-rdma: bench -scenario \$bench_scenarios"
  prof=(); [ "\$bench_profile" = 1 ] && prof=(-cpuprofile "\$work/out/bench-scenarios.pprof")
  wrap=(); [ "\$bench_perf" = 1 ] && { wrap=(perf record -q -g -F 999 -o "\$work/out/bench-scenarios.perf.data" --); cat /proc/kallsyms > "\$work/out/kallsyms"; }
  (cd /var/tmp && timeout -k 10 \$per "\${wrap[@]}" "\$bench" -scenario "\$bench_scenarios" "\${prof[@]}" \$bench_args 2>&1) | tee "\$work/out/bench-scenarios.log"
  [ "\${PIPESTATUS[0]}" = 0 ] || { echo "test-rdma: bench failed"; rc=1; }
fi
if [ -n "\$bench" ] && [ -n "\$bench_allreduce" ]; then
  echo "=== test-rdma: bench -scenario allreduce \$bench_allreduce_args"
  prof=(); [ "\$bench_profile" = 1 ] && prof=(-cpuprofile "\$work/out/bench-allreduce.pprof")
  (cd /var/tmp && timeout -k 10 \$per "\$bench" -scenario allreduce "\${prof[@]}" \$bench_allreduce_args 2>&1) | tee "\$work/out/bench-allreduce.log"
  [ "\${PIPESTATUS[0]}" = 0 ] || { echo "test-rdma: bench allreduce failed"; rc=1; }
fi
echo \$rc > "\$work/out/rc"
sync
/bin/busybox poweroff -f
EOF

(cd "$ird" && find . | cpio -o -H newc --quiet | gzip -1) > "$work/initrd.gz"

# --- 6. Boot. ttyS0 is the kernel console (kept in a file), ttyS1 the tests.
# Software emulation (tcg): it needs no /dev/kvm, and CI machines seldom
# give a working one.
log "booting $kver under qemu (tcg, $(nproc) CPUs) for: $(awk '{print $1}' "$work/list" | tr '\n' ' ')"
t0=$SECONDS
timeout -k 15 "${RDMA_GUEST_TIMEOUT:-900}" qemu-system-x86_64 \
  -accel tcg,thread=multi -cpu max -smp "$(nproc)" -m "${RDMA_GUEST_MEM:-2048}" \
  -nodefaults -no-reboot -display none -kernel "$kernel" -initrd "$work/initrd.gz" \
  -append "console=ttyS0 panic=-1 quiet clocksource=tsc tsc=reliable" \
  -fsdev local,id=host,path=/,security_model=none,readonly=on,multidevs=remap -device virtio-9p-pci,fsdev=host,mount_tag=host \
  -fsdev local,id=work,path="$work",security_model=none -device virtio-9p-pci,fsdev=work,mount_tag=work \
  -serial file:"$work/console.log" -serial stdio </dev/null &
qemu_pid=$!
qrc=0
wait "$qemu_pid" || qrc=$?
qemu_pid=""
log "guest ran $((SECONDS - t0))s"
if [ "${RDMA_GUEST_VERBOSE:-0}" = 1 ]; then tr -d '\r' < "$work/console.log" >&2; fi

# --- 7. Verdict. --------------------------------------------------------------
if [ -n "${RDMA_OUT_DIR:-}" ]; then
  mkdir -p "$RDMA_OUT_DIR" && cp -r "$work/out/." "$RDMA_OUT_DIR/" && log "the guest's output is in $RDMA_OUT_DIR"
fi
if [ ! -s "$work/out/rc" ]; then
  log "the guest reported no result (qemu exit $qrc); kernel console tail:"
  tr -d '\r' < "$work/console.log" | tail -n 30 >&2
  exit 1
fi
echo "test-rdma: summary (Soft-RoCE in qemu, $kver):"
fail=0
while read -r st name pkg t0 t1; do
  n_pass=$(grep -c -- '^--- PASS' "$work/out/$name.log" || true)
  n_skip=$(grep -c -- '--- SKIP' "$work/out/$name.log" || true)
  case "$name" in *.[0-9]*) pkg="$pkg (${name##*.})" ;; esac
  verdict=ok; [ "$st" = 0 ] || { verdict=FAIL; fail=1; }
  # A pattern that matches nothing must not look green.
  [ "$n_pass" -gt 0 ] || { verdict=FAIL; fail=1; log "$pkg: no test passed (is its pattern in scripts/test-rdma.pkgs still right?)"; }
  printf 'test-rdma:   %-4s %-45s %3s top-level tests passed, %s skipped, %ss\n' "$verdict" "$pkg" "$n_pass" "$n_skip" "$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')"
done < "$work/out/summary"
[ "$(awk 'END{print NR}' "$work/out/summary")" = "$(awk 'END{print NR}' "$work/list")" ] || { log "not every test binary ran"; fail=1; }
[ "$(cat "$work/out/rc")" = 0 ] || fail=1
exit $fail

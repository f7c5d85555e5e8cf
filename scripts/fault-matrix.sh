#!/usr/bin/env bash
# The fault matrix: a stream of tensors between two network namespaces
# joined by veth (the tcp provider, as between two hosts), one fault per
# cell, each cell printing its outcome, how long after the fault each side
# saw an error, the tensors verified and the corrupt ones accepted (0 with
# the defaults), and the goroutines/descriptors each side left behind
# (after Close, against before Join).
#
# Root only (network namespaces, tc, nftables); it skips, saying what is
# missing, otherwise.
#
#   sudo ./scripts/fault-matrix.sh [CELL...]     # no CELL: every cell
#
# Settings: FM_STEPS (400 tensors), FM_SIZE (262144 bytes), FM_PACE (10ms
# between sends), FM_PEER_TIMEOUT (5s: GDRLINK_PEER_TIMEOUT of both sides;
# the stops last half and twice that).
set -uo pipefail
cd "$(dirname "$0")/.."

skip() { echo "SKIP fault-matrix: $*"; exit 0; }
[ "$(id -u)" = 0 ] || skip "needs root (network namespaces, tc, nftables)"
for t in ip tc nft go ss; do
  command -v "$t" >/dev/null || skip "needs $t (Debian: iproute2, nftables, golang)"
done

STEPS=${FM_STEPS:-400}
SIZE=${FM_SIZE:-262144}
PACE=${FM_PACE:-10ms}
PT=${FM_PEER_TIMEOUT:-5s}
pt_s=${PT%s}
NA=gdrfm-a-$$ NB=gdrfm-b-$$
A=10.231.0.1 B=10.231.0.2
work=$(mktemp -d)
pids=()
recv_env=()
recv_args=()

cleanup() {
  for p in "${pids[@]}"; do kill -CONT "$p" 2>/dev/null; kill -9 "$p" 2>/dev/null; done
  ip netns del "$NA" 2>/dev/null
  ip netns del "$NB" 2>/dev/null
  [ -n "${FM_KEEP:-}" ] && echo "kept $work" || rm -rf "$work"
}
trap cleanup EXIT

go build -o "$work/faultpeer" ./internal/faultpeer || exit 1
peer=$work/faultpeer

ip netns add "$NA" && ip netns add "$NB" || skip "cannot create network namespaces"
ip link add fma$$ type veth peer name fmb$$ || skip "cannot create a veth pair"
ip link set fma$$ netns "$NA" && ip link set fmb$$ netns "$NB"
ip -n "$NA" addr add $A/24 dev fma$$ && ip -n "$NB" addr add $B/24 dev fmb$$
for ns in "$NA" "$NB"; do ip -n "$ns" link set lo up; done
ip -n "$NA" link set fma$$ up && ip -n "$NB" link set fmb$$ up
VA=fma$$ VB=fmb$$

port=29600
# start_rank RANK NS ADDR OUT [ENV...] [-- ARGS...]: starts a rank of the
# cell's job in the background and appends its pid to pids (ip netns exec
# and env exec, so the pid is the peer's own: signals reach it).
start_rank() {
  local rank=$1 ns=$2 addr=$3 out=$4
  shift 4
  local env=() args=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do env+=("$1"); shift; done
  [ "${1:-}" = -- ] && shift
  args=("$@")
  ip netns exec "$ns" env GDRLINK_RANK="$rank" GDRLINK_SIZE=2 GDRLINK_ROOT="$B:$port" \
    GDRLINK_JOB_KEY="$key" GDRLINK_PROVIDER=tcp GDRLINK_LISTEN_ADDR="$addr:0" \
    GDRLINK_PEER_TIMEOUT="$PT" "${env[@]}" \
    "$peer" -steps "$STEPS" -size "$SIZE" -pace "$PACE" -wait 60s "${args[@]}" \
    >"$out" 2>"$out.err" &
  pids+=($!)
  last=$!
}

now() { date +%s%N; }

# nft_rules NS RULES...: a table of the cell's own in NS.
nft_rules() {
  local ns=$1
  shift
  ip netns exec "$ns" nft add table inet fm
  ip netns exec "$ns" nft add chain inet fm in '{ type filter hook input priority 0; }'
  ip netns exec "$ns" nft add chain inet fm out '{ type filter hook output priority 0; }'
  local rule
  for rule in "$@"; do ip netns exec "$ns" nft add rule inet fm $rule; done
}
nft_clear() { ip netns exec "$1" nft delete table inet fm 2>/dev/null; }

# cell NAME FAULT [ENV...]: runs the stream, injects FAULT (a function) a
# second and a half in, and prints the row.
cell() {
  local name=$1 fault=$2
  shift 2
  port=$((port + 1))
  key=$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')
  local r=$work/$name.recv s=$work/$name.send
  pids=()
  start_rank 0 "$NB" $B "$r" "${recv_env[@]}" "$@" -- "${recv_args[@]}"
  recv_pid=$last
  start_rank 1 "$NA" $A "$s" "$@"
  send_pid=$last
  sleep 1.5
  fault_at=$(now)
  $fault
  wait "$recv_pid" 2>/dev/null
  wait "$send_pid" 2>/dev/null
  [ -n "${extra_pid:-}" ] && wait "$extra_pid" 2>/dev/null
  [ -n "${extra_out:-}" ] && s=$extra_out
  "$peer" -row "$name" -fault-at "$fault_at" "$r" "$s"
  nft_clear "$NA"; nft_clear "$NB"
  tc -n "$NA" qdisc del dev $VA root 2>/dev/null
  ip -n "$NA" link set $VA up
  extra_pid= extra_out=
}

f_none() { fault_at=0; }
f_drop1() { nft_rules "$NA" "in iifname $VA numgen random mod 1000 < 10 drop" "out oifname $VA numgen random mod 1000 < 10 drop"; }
f_drop5() { nft_rules "$NA" "in iifname $VA numgen random mod 1000 < 50 drop" "out oifname $VA numgen random mod 1000 < 50 drop"; }
f_rate() { tc -n "$NA" qdisc add dev $VA root tbf rate 40mbit burst 64kb latency 100ms; }
f_cut() { ip -n "$NA" link set $VA down; }
f_flap() { ip -n "$NA" link set $VA down; sleep 2; ip -n "$NA" link set $VA up; }
stop_for() { kill -STOP "$1"; sleep "$2"; kill -CONT "$1"; }
half() { awk -v t="$pt_s" 'BEGIN { print t / 2 }'; }
twice() { awk -v t="$pt_s" 'BEGIN { print t * 2 + 2 }'; }
f_stop_recv_short() { stop_for "$recv_pid" "$(half)"; }
f_stop_recv_long() { stop_for "$recv_pid" "$(twice)"; }
f_stop_send_short() { stop_for "$send_pid" "$(half)"; }
f_stop_send_long() { stop_for "$send_pid" "$(twice)"; }
f_kill_send() { kill -9 "$send_pid"; }
f_kill_rejoin() {
  kill -9 "$send_pid"
  sleep 1
  # A new process in rank 1's place, with the job's key.
  extra_out=$work/rejoin.send
  start_rank 1 "$NA" $A "$extra_out"
  extra_pid=$last
}
# Rewrites 4 bytes of 2% of the data segments towards the receiver (veth
# does not check TCP checksums, as some offloading NICs do not either).
f_rewrite() {
  nft_rules "$NB" "in iifname $VB ip saddr $A meta l4proto tcp meta length > 1200 numgen random mod 100 < 2 @ih,4096,32 set 0x5a5a5a5a"
}
f_flood() {
  local ports
  ports=$(ip netns exec "$NB" ss -Hltn | awk '{print $4}' | grep "^$B:" | tr '\n' ',' | sed 's/,$//')
  [ -n "$ports" ] || ports=$B:$port
  ip netns exec "$NA" "$peer" -flood "$ports" -conns 2000 -hold 5s >/dev/null 2>&1 &
}

declare -A cells=(
  [baseline]=f_none [drop-1%]=f_drop1 [drop-5%]=f_drop5 [rate-40mbit]=f_rate
  [link-cut]=f_cut [link-flap-2s]=f_flap
  [stop-recv-short]=f_stop_recv_short [stop-recv-long]=f_stop_recv_long
  [stop-send-short]=f_stop_send_short [stop-send-long]=f_stop_send_long
  [kill-send]=f_kill_send [kill-send-rejoin]=f_kill_rejoin
  [rewrite-2%]=f_rewrite [rewrite-2%-no-checksum]=f_rewrite
  [conn-flood]=f_flood [pool-limit]=f_none
)
order=(baseline drop-1% drop-5% rate-40mbit link-cut link-flap-2s stop-recv-short stop-recv-long
  stop-send-short stop-send-long kill-send kill-send-rejoin rewrite-2% rewrite-2%-no-checksum conn-flood pool-limit)
[ $# -gt 0 ] && order=("$@")

echo "fault matrix: tcp between two network namespaces, $STEPS tensors of $SIZE bytes every $PACE, peer timeout $PT"
echo "(detection: time from the fault to each side's first error; g/fd: goroutines/descriptors after Close minus before Join)"
"$peer" -row header
for c in "${order[@]}"; do
  f=${cells[$c]:-}
  [ -n "$f" ] || { echo "unknown cell $c (cells: ${order[*]})"; exit 2; }
  case $c in
    rewrite-2%-no-checksum) cell "$c" "$f" GDRLINK_CHECKSUM=0 ;;
    pool-limit) recv_env=(GDRLINK_POOL_LIMIT=2097152); cell "$c" "$f" -- -size 4194304 -steps 20 ;;
    kill-send-rejoin) recv_args=(-rejoin); cell "$c" "$f" ;;
    *) cell "$c" "$f" ;;
  esac
  recv_env=() recv_args=()
done

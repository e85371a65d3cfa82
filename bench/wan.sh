#!/usr/bin/env bash
# The across-a-network benchmark of issue 16: `snapctl pull` and `snapctl lazy` restores
# (tests/src/bin/fake_vmm as the VM: two vCPU threads, each waiting for its fault) from a
# `snapctl serve` reached through netem_proxy (tests/src/netem.rs: half the RTT on every
# byte each way, one RTT for a new connection's handshake, optionally a bandwidth cap per
# direction shared by all connections). Release builds.
#
#   bash bench/wan.sh            2 GiB image (half zero), RTT 0 2 20 50 ms x no cap, 1gbit,
#                                200mbit, 3 runs (long: hours on this 2-core machine)
#   bash bench/wan.sh --quick    256 MiB, RTT 0 20 ms x no cap, 1gbit, 1 run: a smoke test
#
# Options: --runs N  --size SIZE  --rtts "0 2 20 50" (ms)  --rates "0 1gbit 200mbit"
#          --pct P (5)  --all (also --prefetch all --prefetch-rate 0, scattered)  --tag NAME
#          --keep  --no-verify (no `snapctl verify` rows)  --only pull (pull, verify and the curl calibration only, no lazy
#          restores: what `pull` and `verify` get of the link)  --window SIZE (netem_proxy's per-connection window,
#          its default 16MiB)  --pull-args "ARGS" (extra `snapctl pull` flags, e.g.
#          "--jobs 16")
#          --slice-faults on|off (passed to every `snapctl lazy`; default: its own)
#          --lazy-args "ARGS" (extra flags for every `snapctl lazy`, e.g. "--stream-after 10%")
#          --prefetch MODE (the clustered and scattered restores' --prefetch; default: the
#          daemon's own, `trace`, which with no trace streams the rest once misses look
#          scattered; `none` gives faults alone, the rows before issue 16's stream)
#          --run-pages N (the clustered guest's runs of contiguous pages; default 64)
#          --huge (the same guest on 4 KiB pages and on 2 MiB huge pages, below)
#          --plain (also "plain": the scattered restore with the daemon's defaults exactly,
#          no --record-trace, so the stream installs whole chunks ahead of the guest)
#          --vcpus "2 4 8" (fake_vmm's touching threads; each count gets the lazy restores
#          below, from a repository of its own; default 2)
#          --rows "plain variant" (only these lazy rows, for a quick comparison; warm and
#          replay need scattered before them; default: every row the options ask for)
#          --variant "ARGS" (also "variant": the plain restore with ARGS added, e.g.
#          "--stream-jobs 64", measured beside the defaults in the same run)
#          --links "window deep shallow" (netem_proxy's --link: how the bottleneck queues;
#          window, the default: each busy connection waits its turn, pushed back; deep: one
#          FIFO takes every byte at once, only the delay grows; shallow: a small buffer that
#          drops. Each model is a setting of its own, with its own pull, the models taking
#          turns within each run; a capped rate only: uncapped settings run window alone)
#          --queue-limit SIZE (the shallow buffer's size; default netem_proxy's, 30 % of the
#          bandwidth-delay product and at least 256 KiB)
#
# For each setting (RTT x cap x link model) and run, each against a fresh proxy (so its byte counts are
# the command's own) and a fresh, empty chunk cache (cold):
#   pull        `snapctl pull REF DIR --cache FRESH`: wall time; % of the cap achieved
#               (bytes through the proxy x 8 / time / cap)
#   verify      `snapctl verify REF`: every stored chunk read and hashed; the same % of cap
#   clustered   `snapctl lazy REF --once` (--prefetch: see above), fake_vmm touching P% of
#               the pages in runs of 64 contiguous pages (256 KiB; --run-pages) at random offsets
#   scattered   the same with P% of the pages scattered singly, and --record-trace (the
#               trace is stored after the guest is done, outside the timed part)
#   Each run's lazy restores read the image from a repository of their own (the image
#   pushed again as bench/runN:v1, untimed), so clustered and scattered restores never
#   find a trace an earlier run recorded: they are cold and have no trace.
#   warm        the scattered restore again with the chunk cache the scattered restore
#               left (faults served from the cache; the image's metadata still comes
#               through the proxy)
#   nostream    the clustered restore with --prefetch none: the same guest with no stream,
#               for the vCPU's first-touch latency with and without the stream (issue 23 §3)
#   replay      the scattered restore again, cold, --prefetch trace: replays the trace the
#               scattered restore of this run just recorded (the newest trace wins): its
#               working set (the touched slices, one blob fetched in ranges at connect) and
#               its zero chunks
#   all         (with --all) scattered, --prefetch all --prefetch-rate 0, cold and before
#               the scattered restore records a trace (so no trace either)
# And once per setting with a cap, the proxy's own ceiling: `curl` of the largest pack
# through it (% of the cap a plain single download gets).
# With --huge the lazy restores of each run are instead: clustered and scattered (as above,
# no trace recorded, each cold) on 4 KiB pages, then the same two on 2 MiB huge pages
# (fake_vmm --page-size 2MiB: MAP_HUGETLB, the handshake says 2097152), in alternating
# order from run to run; no warm, replay or all rows. The image's size of huge pages is
# reserved (/proc/sys/vm/nr_hugepages raised, given back at exit) and touched once before
# the first run (a fresh pool page costs this VM a host fault at first touch, as
# bench/lib/memory.sh describes for ordinary memory). An extra table gives per page size:
# time, faults reaching the daemon, installs (faults that were not `present`), bytes
# fetched.
# Wake (issue 23 §3), per lazy restore: daemon start to the guest's first touch returned;
# "ready" is daemon start to fake_vmm's connect (the daemon binds its socket once the image's
# manifest, config and index are fetched and checked: the index transfer, plus the process's
# start); handshake to first touch is fake_vmm's own. The goal: first touch within 2 RTT of
# ready, and of the handshake, with no slack (until 2026-12-05 these lines allowed 2 ms
# more). The first touch here is often a zero page, which needs no fetch: bench/wake.sh
# times a data page, and is what BENCHMARKS.md judges the wake by.
# Lazy time = daemon start (it opens the image through the proxy) to fake_vmm's exit
# (every touched page checked against the original). Per row: median time, time / pull's
# median time in the same setting, the vCPU's fault latency p50/p99 (fake_vmm: first
# touches of data (non-zero) pages that found the page missing, by mincore just before;
# most touches find it installed by an earlier fault on the same chunk), the daemon's fault
# latency p50/p99 (fault read -> installed, every kind: zero, fetched, from the cache),
# and bytes through the proxy per byte touched (pages touched x 4 KiB, zero pages
# included). At RTT 0 without a
# cap pull is also timed straight to the server, no proxy, to show what the proxy costs.
# Before each timed command: `sync`, and the image's size of memory touched and freed
# (bench/lib/memory.sh).
#
# Output: markdown on stdout and in bench/results/wan-DATE[-TAG].md (-quick with --quick),
# every run as JSON lines in bench/results/wan-DATE[-TAG].jsonl; progress on stderr. Needs
# root (userfaultfd), jq, python3. SNAPCTL / FAKE_VMM / NETEM pick binaries (default:
# target/release/*, built if missing).
set -euo pipefail
trap 'echo "wan.sh: line $LINENO failed: $BASH_COMMAND" >&2' ERR

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ARGV=("$@")
RUNS=3 SIZE=2GiB RTTS="0 2 20 50" RATES="0 1gbit 200mbit" PCT=5 ALL=0 TAG="" KEEP=0 QUICK=0
ONLY="" WINDOW="" PULL_ARGS="" NO_VERIFY=0
LAZY_EXTRA="" PREFETCH="" RUN_PAGES=64 HUGE=0 VCPUS=2 THREADS=2 PLAIN=0 ROWS="" VARIANT=""
LINKS=window LINK=window QUEUE_LIMIT=""
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) QUICK=1; RUNS=1; SIZE=256MiB; RTTS="0 20"; RATES="0 1gbit" ;;
    --runs) RUNS=$2; shift ;;
    --size) SIZE=$2; shift ;;
    --rtts) RTTS=$2; shift ;;
    --rates) RATES=$2; shift ;;
    --pct) PCT=$2; shift ;;
    --all) ALL=1 ;;
    --tag) TAG=$2; shift ;;
    --keep) KEEP=1 ;;
    --no-verify) NO_VERIFY=1 ;;
    --only) ONLY=$2; shift
      [ "$ONLY" = pull ] || { echo "wan.sh: --only takes pull" >&2; exit 2; } ;;
    --window) WINDOW=$2; shift ;;
    --pull-args) PULL_ARGS=$2; shift ;;
    --slice-faults) LAZY_EXTRA="$LAZY_EXTRA --slice-faults $2"; shift ;;
    --lazy-args) LAZY_EXTRA="$LAZY_EXTRA $2"; shift ;;
    --prefetch) PREFETCH="--prefetch $2"; shift ;;
    --run-pages) RUN_PAGES=$2; shift ;;
    --huge) HUGE=1 ;;
    --vcpus) VCPUS=$2; shift ;;
    --plain) PLAIN=1 ;;
    --rows) ROWS=$2; shift ;;
    --variant) VARIANT=$2; shift ;;
    --links) LINKS=$2; shift
      for l in $LINKS; do case "$l" in window|deep|shallow) ;; *) echo "wan.sh: --links takes window, deep, shallow" >&2; exit 2 ;; esac; done ;;
    --queue-limit) QUEUE_LIMIT=$2; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "wan.sh: unknown option $1 (try --help)" >&2; exit 2 ;;
  esac
  shift
done

# shellcheck source=bench/lib/bins.sh
source "$ROOT/bench/lib/bins.sh"
need wan.sh jq python3
release_bins

W=$(mktemp -d "${TMPDIR:-/tmp}/snapctl-wan.XXXXXX")
PIDS=()
HUGE_RESERVED=0
cleanup() {
  for p in "${PIDS[@]:-}"; do [ -n "$p" ] && { kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; }; done
  # Give back only what this run added (tests may hold some of their own meanwhile).
  if [ "$HUGE_RESERVED" -gt 0 ]; then
    flock /tmp/snapctl-tests-hugepages.lock sh -c "echo \$((\$(cat /proc/sys/vm/nr_hugepages) - $HUGE_RESERVED)) > /proc/sys/vm/nr_hugepages" || true
  fi
  if [ "$KEEP" = 1 ]; then echo "kept $W" >&2; else rm -rf "$W"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM
BENCH_NAME=wan.sh
since() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.3f}')" "$1" "$(now)"; }

SERVER_LOGS=$W
# shellcheck source=bench/lib/servers.sh
source "$ROOT/bench/lib/servers.sh"
# shellcheck source=bench/lib/memory.sh
source "$ROOT/bench/lib/memory.sh"
WARM_BYTES=$(to_bytes "$SIZE")

DATE=$(date -u +%F)
NAME=wan-$DATE${TAG:+-$TAG}
[ "$QUICK" = 1 ] && NAME=$NAME-quick
[ "$ONLY" = pull ] && NAME=$NAME-pull
mkdir -p "$ROOT/bench/results"
# A name taken by an earlier run (its table, or the JSON lines of one that was interrupted)
# gets the time: nothing in bench/results/ is overwritten.
if [ -e "$ROOT/bench/results/$NAME.md" ] || [ -e "$ROOT/bench/results/$NAME.jsonl" ]; then NAME=$NAME-$(date -u +%H%M); fi
OUT=$ROOT/bench/results/$NAME.md
RUNLOG=$ROOT/bench/results/$NAME.jsonl
: > "$RUNLOG"

# ---------------------------------------------------------------- the dialled network
# start_net RTT_MS RATE: a fresh netem_proxy (link model $LINK) in front of the server;
# sets NET_ADDR.
# stop_net: SIGTERM it; sets NET_STATS (its JSON summary: connections, bytes up/down).
NET_PID="" NET_ADDR="" NET_STATS="{}"
start_net() {
  local rtt=$1 rate=$2
  [ "$rtt" = 0 ] || rtt=${rtt}ms
  : > "$W/net.out"
  local shallow=""
  [ "$LINK" = shallow ] && shallow=$QUEUE_LIMIT
  "$NETEM" --upstream "127.0.0.1:$PORT" --rtt "$rtt" --rate "$rate" --link "$LINK" ${shallow:+--queue-limit "$shallow"} ${WINDOW:+--window "$WINDOW"} >"$W/net.out" 2>"$W/net.log" &
  NET_PID=$!
  PIDS+=("$NET_PID")
  for _ in $(seq 500); do [ -s "$W/net.out" ] && break; sleep 0.02; done
  NET_ADDR=$(head -1 "$W/net.out")
  case "$NET_ADDR" in 127.0.0.1:*) ;; *) echo "wan.sh: netem_proxy did not start: $(cat "$W/net.log")" >&2; exit 2 ;; esac
}
stop_net() {
  kill -TERM "$NET_PID"
  wait "$NET_PID" || { echo "wan.sh: netem_proxy failed: $(cat "$W/net.log")" >&2; exit 2; }
  NET_STATS=$(tail -1 "$W/net.out")
}

# record KEY=VALUE...: one JSON line per measured run (values are numbers or strings).
record() { python3 -c 'import json,sys
d={"load": float(open("/proc/loadavg").read().split()[0])}
for a in sys.argv[1:]:
    k,v=a.split("=",1)
    try: d[k]=json.loads(v)
    except ValueError: d[k]=v
print(json.dumps(d))' "$@" >> "$RUNLOG"; }

# ---------------------------------------------------------------- the image
serve_sample "$SIZE"
STORED=$(du -sb "$W/storage" | cut -f1)
if [ "$HUGE" = 1 ]; then
  # The guest's huge pages: the image's size, under the lock the tests use for theirs.
  # The kernel may make fewer than asked (no free 2 MiB runs): what it made is given back
  # at exit, whatever it is. Short, the page cache is dropped and memory compacted once
  # before giving up (a busy host's free memory is mostly page cache, in 4 KiB pieces).
  want=$(( (WARM_BYTES + (2 << 20) - 1) / (2 << 20) ))
  for try in 1 2; do
    got=$(flock /tmp/snapctl-tests-hugepages.lock sh -c "b=\$(cat /proc/sys/vm/nr_hugepages); echo \$((b + $want - $HUGE_RESERVED)) > /proc/sys/vm/nr_hugepages 2>/dev/null; echo \$((\$(cat /proc/sys/vm/nr_hugepages) - b))")
    HUGE_RESERVED=$((HUGE_RESERVED + got))
    [ "$HUGE_RESERVED" -ge "$want" ] && break
    [ "$try" = 1 ] && { log "the kernel made $HUGE_RESERVED of $want huge pages; dropping the page cache, compacting memory"; sync; echo 3 > /proc/sys/vm/drop_caches; echo 1 > /proc/sys/vm/compact_memory; }
  done
  [ "$HUGE_RESERVED" -ge "$want" ] || { echo "wan.sh: --huge needs $want huge pages of 2 MiB, the kernel made $HUGE_RESERVED" >&2; exit 2; }
  log "reserved $want huge pages of 2 MiB; touching them once"
  python3 - "$want" <<'PY'
import mmap, sys
n = int(sys.argv[1]) << 21
m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x40000)  # MAP_HUGETLB
for o in range(0, n, 1 << 21):
    m[o] = 1
m.close()
PY
fi
NONZERO=$(du -B1 "$MEM" | cut -f1)

# ---------------------------------------------------------------- one timed command each
# pull_once SETTING RUN RTT RATE [direct]
pull_once() {
  local setting=$1 run=$2 rtt=$3 rate=$4 direct=${5:-}
  local addr=127.0.0.1:$PORT path=pull
  if [ -z "$direct" ]; then start_net "$rtt" "$rate"; addr=$NET_ADDR; else path=pull_direct; fi
  rm -rf "$W/pulled" "$W/cache"
  sync; warm_memory "$WARM_BYTES"
  local t0; t0=$(now)
  # shellcheck disable=SC2086
  "$SNAPCTL" pull "$addr/bench/vm:v1" "$W/pulled" --cache "$W/cache" --json $PULL_ARGS >"$W/pull.json" 2>"$W/pull.log" \
    || { echo "wan.sh: pull failed: $(tail -5 "$W/pull.log")" >&2; exit 2; }
  local secs; secs=$(since "$t0")
  local down=0
  if [ -z "$direct" ]; then stop_net; down=$(jq .bytes_down <<<"$NET_STATS"); fi
  cmp -s "$MEM" "$W/pulled/vm.mem" || { echo "wan.sh: pulled vm.mem differs" >&2; exit 1; }
  record setting="$setting" rtt_ms="$rtt" rate="$rate" path=$path run="$run" seconds="$secs" bytes_down="$down" \
    bytes_fetched="$(jq .bytes_fetched "$W/pull.json")" range_requests="$(jq .range_requests "$W/pull.json")" \
    ranges_in_flight="$(jq .ranges_in_flight "$W/pull.json")" pull_rtt_ms="$(jq .rtt_ms "$W/pull.json")" max_open="$(jq '.max_open // 0' <<<"$NET_STATS")" \
    link="$LINK" max_queue_ms="$(jq '.max_queue_ms // 0' <<<"$NET_STATS")"
  log "  $path: $secs s, $down B through the proxy"
  rm -rf "$W/pulled" "$W/cache"
}

# verify_once SETTING RUN RTT RATE: `snapctl verify REF` (every stored chunk read and
# hashed, nothing written) through a fresh proxy: how much of the link an audit uses.
verify_once() {
  local setting=$1 run=$2 rtt=$3 rate=$4
  start_net "$rtt" "$rate"
  sync; warm_memory "$WARM_BYTES"
  local t0; t0=$(now)
  "$SNAPCTL" verify "$NET_ADDR/bench/vm:v1" --json >"$W/verify.json" 2>"$W/verify.log" \
    || { echo "wan.sh: verify failed: $(tail -5 "$W/verify.log")" >&2; exit 2; }
  local secs; secs=$(since "$t0")
  stop_net
  record setting="$setting" rtt_ms="$rtt" rate="$rate" path=verify run="$run" seconds="$secs" bytes_down="$(jq .bytes_down <<<"$NET_STATS")" link="$LINK"
  log "  verify: $secs s, $(jq .bytes_down <<<"$NET_STATS") B through the proxy"
}

# lazy_once SETTING RUN RTT RATE PATH TOUCH_ARGS LAZY_ARGS [CACHE]: one restore through a
# fresh proxy. TOUCH_ARGS / LAZY_ARGS are space-separated word lists. CACHE: cold (an empty
# chunk cache, removed after; the default), fill (empty, kept for the next), warm (the one
# kept, removed after).
lazy_once() {
  local setting=$1 run=$2 rtt=$3 rate=$4 path=$5 touch=$6 largs=$7 cache=${8:-cold} repo=${9:-bench/vm}
  start_net "$rtt" "$rate"
  local sock=$W/h.sock
  rm -f "$sock"
  [ "$cache" = warm ] || rm -rf "$W/lcache"
  sync; warm_memory "$WARM_BYTES"
  local t0; t0=$(now)
  # shellcheck disable=SC2086
  "$SNAPCTL" lazy "$NET_ADDR/$repo:v1" --socket "$sock" --once --json --cache "$W/lcache" $largs $LAZY_EXTRA >"$W/handler.json" 2>"$W/handler.log" &
  local hp=$!
  PIDS+=("$hp")
  # shellcheck disable=SC2086
  if ! "$FAKE_VMM" --socket "$sock" --mem-file "$MEM" --threads "$THREADS" --seed 3 --json --timeout 1800 $touch >"$W/vmm.json" 2>"$W/vmm.log"; then
    echo "wan.sh: fake_vmm failed: $(cat "$W/vmm.log") $(cat "$W/vmm.json")" >&2; exit 2
  fi
  local secs; secs=$(since "$t0")
  wait "$hp" || { echo "wan.sh: snapctl lazy failed: $(tail -5 "$W/handler.log")" >&2; exit 2; }
  stop_net
  [ "$(jq .mismatches "$W/vmm.json")" = 0 ] || { echo "wan.sh: fake_vmm saw wrong bytes!" >&2; exit 1; }
  local h=$W/handler.json v=$W/vmm.json
  record setting="$setting" rtt_ms="$rtt" rate="$rate" path="$path" run="$run" seconds="$secs" \
    bytes_down="$(jq .bytes_down <<<"$NET_STATS")" connections="$(jq .connections <<<"$NET_STATS")" \
    pages="$(jq .pages_checked "$v")" missing="$(jq .pages_missing_at_touch "$v")" vcpu_faults="$(jq .fault_latency_us_data.pages "$v")" \
    touch_p50_us="$(jq .fault_latency_us_data.p50 "$v")" touch_p99_us="$(jq .fault_latency_us_data.p99 "$v")" \
    cache_faults="$(jq .faults.cache_hit "$h")" zero_faults="$(jq .faults.zero "$h")" \
    fault_p50_us="$(jq .latency_us.p50 "$h")" fault_p99_us="$(jq .latency_us.p99 "$h")" \
    faults="$(jq .faults.total "$h")" fetched_faults="$(jq .faults.fetched "$h")" present_faults="$(jq .faults.present "$h")" \
    bytes_fetched="$(jq .bytes_fetched "$h")" prefetched_bytes="$(jq .prefetched_bytes "$h")" \
    streamed_bytes="$(jq '.streamed_bytes // 0' "$h")" stream_started_s="$(jq '.stream_started_s // null' "$h")" \
    stream_depth="$(jq '.stream_depth // 0' "$h")" \
    ws_slices="$(jq '.working_set_slices // 0' "$h")" ws_waits="$(jq '.working_set_waits // 0' "$h")" \
    ws_bytes="$(jq '.working_set_bytes // 0' "$h")" ws_s="$(jq '.working_set_s // null' "$h")" \
    ws_recorded="$(jq '.working_set_recorded // 0' "$h")" pacing="$(jq -c '.pacing // null' "$h")" \
    vcpus="$THREADS" data_chunks="$(jq '.data_chunks_touched // 0' "$v")" \
    ready_s="$(jq --arg t0 "$t0" '.connected_unix_us / 1e6 - ($t0 | tonumber)' "$v")" \
    wake_s="$(jq --arg t0 "$t0" '.first_touch_unix_us / 1e6 - ($t0 | tonumber)' "$v")" \
    handshake_first_s="$(jq '(.first_touch_unix_us - .handshake_unix_us) / 1e6' "$v")" guest_s="$(jq .seconds "$v")" \
    link="$LINK" max_queue_ms="$(jq '.max_queue_ms // 0' <<<"$NET_STATS")" drops="$(jq '.drops // 0' <<<"$NET_STATS")"
  log "  $path: $secs s, $(jq -c '{faults, bytes_fetched, prefetched_bytes, streamed_bytes, stream_started_s, stream_depth, pacing, working_set_slices, working_set_waits, working_set_s, working_set_recorded, latency_us}' "$h"), $(jq -c .bytes_down <<<"$NET_STATS") B through the proxy"
  [ "$cache" = fill ] || rm -rf "$W/lcache"
}

# calibrate SETTING RTT RATE: curl the largest pack through a fresh proxy.
BIGGEST=""
calibrate() {
  local setting=$1 rtt=$2 rate=$3
  if [ -z "$BIGGEST" ]; then
    BIGGEST=$(curl -sf -H 'Accept: application/vnd.oci.image.manifest.v1+json' "http://127.0.0.1:$PORT/v2/bench/vm/manifests/v1" | jq -r '.layers | max_by(.size) | .digest')
  fi
  start_net "$rtt" "$rate"
  sync; warm_memory "$WARM_BYTES"
  local t0; t0=$(now)
  curl -sf -o /dev/null "http://$NET_ADDR/v2/bench/vm/blobs/$BIGGEST"
  local secs; secs=$(since "$t0")
  stop_net
  record setting="$setting" rtt_ms="$rtt" rate="$rate" path=calibration run=1 seconds="$secs" bytes_down="$(jq .bytes_down <<<"$NET_STATS")" link="$LINK"
  log "  curl of the largest pack: $secs s, $(jq .bytes_down <<<"$NET_STATS") B"
}

# row NAME: whether --rows asks for this lazy row (every row when --rows is not given).
row() { [ -z "$ROWS" ] || [[ " $ROWS " == *" $1 "* ]]; }
REPOS=0
CLUSTER="--touch $PCT% --run-pages $RUN_PAGES"
SCATTER="--touch $PCT% --run-pages 1"
LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)
for rtt in $RTTS; do
  for rate in $RATES; do
    # Without a cap there is no bottleneck to queue at: the window model alone.
    links=$LINKS; [ "$rate" = 0 ] && links=window
    if [ "$rate" != 0 ]; then for LINK in $links; do calibrate "$rtt ms, $rate, $LINK" "$rtt" "$rate"; done; fi
    for run in $(seq "$RUNS"); do
      # The link models take turns within each run, so a burst of load hits each.
      for LINK in $links; do
      setting="$rtt ms, $rate, $LINK"
      log "RTT $rtt ms, cap $rate, link $LINK: run $run/$RUNS"
      pull_once "$setting" "$run" "$rtt" "$rate"
      if [ "$rtt" = 0 ] && [ "$rate" = 0 ]; then pull_once "$setting" "$run" 0 0 direct; fi
      [ "$NO_VERIFY" = 1 ] || verify_once "$setting" "$run" "$rtt" "$rate"
      [ "$ONLY" = pull ] && continue
      for THREADS in $VCPUS; do
      # A repository of this run's own: no trace from an earlier run (untimed push).
      repo=bench/r$((++REPOS))
      "$SNAPCTL" push "$W/snap" "127.0.0.1:$PORT/$repo:v1" --cache "$W/pushcache" >/dev/null
      rm -rf "$W/pushcache"
      if [ "$HUGE" = 1 ]; then
        # The same guest on each page size, the order alternating from run to run.
        sizes="4k 2m"; [ $((run % 2)) = 0 ] && sizes="2m 4k"
        for ps in $sizes; do
          pa=""; [ "$ps" = 2m ] && pa="--page-size 2MiB"
          lazy_once "$setting" "$run" "$rtt" "$rate" "clustered_$ps" "$CLUSTER $pa" "$PREFETCH" cold "$repo"
          lazy_once "$setting" "$run" "$rtt" "$rate" "scattered_$ps" "$SCATTER $pa" "$PREFETCH" cold "$repo"
        done
        continue
      fi
      if row clustered; then lazy_once "$setting" "$run" "$rtt" "$rate" clustered "$CLUSTER" "$PREFETCH" cold "$repo"; fi
      if row nostream; then lazy_once "$setting" "$run" "$rtt" "$rate" nostream "$CLUSTER" "--prefetch none" cold "$repo"; fi
      # Before the scattered restore records a trace: cold, no trace. The variant and the
      # defaults alternate in order from run to run.
      if [ $((run % 2)) = 0 ] && [ -n "$VARIANT" ] && row variant; then lazy_once "$setting" "$run" "$rtt" "$rate" variant "$SCATTER" "$PREFETCH $VARIANT" cold "$repo"; fi
      if [ "$PLAIN" = 1 ] && row plain; then lazy_once "$setting" "$run" "$rtt" "$rate" plain "$SCATTER" "$PREFETCH" cold "$repo"; fi
      if [ $((run % 2)) = 1 ] && [ -n "$VARIANT" ] && row variant; then lazy_once "$setting" "$run" "$rtt" "$rate" variant "$SCATTER" "$PREFETCH $VARIANT" cold "$repo"; fi
      if [ "$ALL" = 1 ] && row all; then lazy_once "$setting" "$run" "$rtt" "$rate" all "$SCATTER" "--prefetch all --prefetch-rate 0" cold "$repo"; fi
      if row scattered; then lazy_once "$setting" "$run" "$rtt" "$rate" scattered "$SCATTER" "$PREFETCH --record-trace" fill "$repo"; fi
      if row warm; then lazy_once "$setting" "$run" "$rtt" "$rate" warm "$SCATTER" "--prefetch none" warm "$repo"; fi
      if row replay; then lazy_once "$setting" "$run" "$rtt" "$rate" replay "$SCATTER" "--prefetch trace" cold "$repo"; fi
      done
      done
    done
  done
done
stop_server

# ---------------------------------------------------------------- the table
exec > >(tee "$OUT")
echo "### $NAME: \`bash bench/wan.sh ${ARGV[*]}\`, $(date -u '+%Y-%m-%d %H:%M UTC')"
echo
echo "$(nproc) cores, kernel $(uname -r), load average at the start $LOAD_START and at the end $(cut -d' ' -f1-3 /proc/loadavg) (each run's in the JSON lines, \`load\`), snapctl $(git -C "$ROOT" rev-parse --short HEAD)$(git -C "$ROOT" diff --quiet HEAD -- . 2>/dev/null || echo '+changes'); medians of $RUNS run(s)."
echo "Image: \`snapctl sample --size $SIZE --zero-fraction 0.5\`: $NONZERO B allocated in vm.mem, $STORED B in the registry's storage. Guest: fake_vmm, 2 vCPU threads, $PCT% of the pages."
echo
RUN_PAGES=$RUN_PAGES VARIANT=$VARIANT python3 - "$RUNLOG" <<'PY'
import json, os, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
med = lambda xs: statistics.median(xs) if xs else None
def rate_bps(r):
    r = str(r).lower()
    for s, m in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1)):
        if r.endswith(s):
            return float(r[: -len(s)]) * m
    return float(r) or None
order = ["calibration", "pull", "pull_direct", "verify", "clustered", "nostream", "plain", "variant", "scattered", "warm", "replay", "all", "clustered_4k", "clustered_2m", "scattered_4k", "scattered_2m"]
label = {"calibration": "`curl` of the largest pack (the proxy's ceiling)", "pull": "`snapctl pull`", "pull_direct": "`snapctl pull`, no proxy", "verify": "`snapctl verify` (reads every stored chunk)",
         "clustered": f"lazy, clustered (runs of {os.environ.get('RUN_PAGES', '64')} pages)", "scattered": "lazy, scattered (records a trace)",
         "nostream": "lazy, clustered, `--prefetch none` (no stream)",
         "plain": "lazy, scattered, the daemon's defaults exactly (no `--record-trace`)",
         "variant": f"lazy, scattered, the defaults and `{os.environ.get('VARIANT', '')}`",
         "warm": "lazy, scattered again, warm chunk cache", "replay": "lazy, scattered again, cold, `--prefetch trace`",
         "all": "lazy, scattered, cold, no trace, `--prefetch all --prefetch-rate 0`",
         "clustered_4k": f"lazy, clustered (runs of {os.environ.get('RUN_PAGES', '64')} pages), 4 KiB pages",
         "clustered_2m": f"lazy, clustered (runs of {os.environ.get('RUN_PAGES', '64')} pages), 2 MiB huge pages",
         "scattered_4k": "lazy, scattered, 4 KiB pages", "scattered_2m": "lazy, scattered, 2 MiB huge pages"}
settings = []
for r in runs:
    if r["setting"] not in settings:
        settings.append(r["setting"])
f = lambda x, d=2: "-" if x is None else f"{x:.{d}f}"
LAZY = lambda p: p not in ("pull", "pull_direct", "calibration", "verify")
# vCPU counts measured (--vcpus); a lazy row is a path and a count.
VS = sorted({r.get("vcpus", 2) for r in runs if LAZY(r["path"])}) or [2]
vlabel = lambda v: f", {v} vCPUs" if len(VS) > 1 and v is not None else ""
ms = lambda us: f(us / 1000, 2 if us >= 1000 else 3)
print("| RTT | cap | link | what | time s | / pull | % of cap | vCPU data-page fault p50 / p99 ms | daemon fault p50 / p99 ms | bytes fetched per byte touched | touches installed or in flight | deepest queue at the bottleneck ms | runs s |")
print("|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
link_of = lambda r: r.get("link", "window")
# A touch finds its page installed (mincore before it), or faults; a fault on a slice the
# working-set replay is fetching waits for it (in flight, not a fetch of its own).
ready = lambda r: 1 - max(0, r["missing"] - r.get("ws_waits", 0)) / r["pages"]
goals = []
for s in settings:
    rs = [r for r in runs if r["setting"] == s]
    pull_t = med([r["seconds"] for r in rs if r["path"] == "pull"])
    for p, v in [(p, v) for p in order for v in (VS if LAZY(p) else [None])]:
        pr = [r for r in rs if r["path"] == p and (v is None or r.get("vcpus", 2) == v)]
        if not pr:
            continue
        t = med([r["seconds"] for r in pr])
        rtt, rate = pr[0]["rtt_ms"], pr[0]["rate"]
        cap = rate_bps(rate)
        ratio = f(t / pull_t) + "x" if pull_t and p not in ("pull", "calibration") else ""
        pct = ""
        if p in ("pull", "calibration", "verify") and cap:
            pct = f(100 * med([r["bytes_down"] * 8 / r["seconds"] / cap for r in pr]), 0) + "%"
        if p.startswith("pull") or p in ("calibration", "verify"):
            touch = fault = per = inst = ""
        else:
            touch = f"{ms(med([r['touch_p50_us'] for r in pr]))} / {ms(med([r['touch_p99_us'] for r in pr]))}"
            fault = f"{ms(med([r['fault_p50_us'] for r in pr]))} / {ms(med([r['fault_p99_us'] for r in pr]))}"
            per = f(med([r["bytes_down"] / (r["pages"] * 4096) for r in pr]), 1)
            inst = f(100 * med([ready(r) for r in pr]), 1) + "%"
        queue = f(med([r["max_queue_ms"] for r in pr]), 1) if all("max_queue_ms" in r for r in pr) else ""
        print(f"| {rtt} ms | {'none' if not cap else rate} | {link_of(pr[0])} | {label[p]}{vlabel(v)} | **{f(t)}** | {ratio} | {pct} | {touch} | {fault} | {per} | {inst} | {queue} | {', '.join(f(r['seconds']) for r in pr)} |")
    # Issue 16 §4's and issue 23 §3's goals, per setting and vCPU count.
    mark = lambda ok: "met" if ok else "**not met**"
    for v in VS:
      t = lambda p: med([r["seconds"] for r in rs if r["path"] == p and r.get("vcpus", 2) == v])
      where = f"{rs[0]['rtt_ms']} ms, {rs[0]['rate'] if rate_bps(rs[0]['rate']) else 'no cap'}, link {link_of(rs[0])}, {v} vCPUs"
      cl = [r for r in rs if r["path"] == "clustered" and r.get("vcpus", 2) == v]
      cap = rate_bps(rs[0]["rate"])
      # Issue 23 §3's latency floor: the data chunks touched, one round trip each, vCPUs
      # in parallel; plus their bytes at the link's rate (1 MiB chunks).
      # Timed from the handshake (the guest's own run: the daemon's start and the index are
      # the wake goal's), as fake_vmm's `seconds`; older runs: the wall time less the
      # handshake's offset.
      floor = med([r["data_chunks"] / v * rs[0]["rtt_ms"] / 1000 + (r["data_chunks"] * (1 << 20) * 8 / cap if cap else 0) for r in cl])
      guest = lambda r: r.get("guest_s") or (r["seconds"] - (r["wake_s"] - r["handshake_first_s"]))
      if floor:
          g = med([guest(r) for r in cl])
          goals.append(f"{where}: clustered guest {g:.2f} s from the handshake, {g / floor:.2f}x its latency floor of {floor:.2f} s "
                       f"({med([r['data_chunks'] for r in cl]):.0f} chunks) (goal <= 1.3x): {mark(g / floor <= 1.3)}")
      for p in ("clustered", "plain", "scattered", "replay"):
          pr = [r for r in rs if r["path"] == p and r.get("vcpus", 2) == v and r.get("wake_s") is not None]
          if pr:
              rtt_s = rs[0]["rtt_ms"] / 1000
              after_ready = med([r["wake_s"] - r["ready_s"] for r in pr])
              hs = med([r["handshake_first_s"] for r in pr])
              goals.append(f"{where}: {p} wake {med([r['wake_s'] for r in pr]) * 1000:.0f} ms from daemon start (ready, index fetched: "
                           f"{med([r['ready_s'] for r in pr]) * 1000:.0f} ms; first touch {after_ready * 1000:.0f} ms after; "
                           f"{hs * 1000:.0f} ms after the handshake) (goal <= 2 RTT = {2 * rtt_s * 1000:.0f} ms after each): "
                           f"{mark(after_ready <= 2 * rtt_s and hs <= 2 * rtt_s)} (the first touch is often a zero page; bench/wake.sh times a data page)")
      ns = [r for r in rs if r["path"] == "nostream" and r.get("vcpus", 2) == v]
      if ns and cl and rs[0]["rtt_ms"]:
          a, b = med([r["touch_p50_us"] for r in cl]), med([r["touch_p50_us"] for r in ns])
          goals.append(f"{where}: clustered first-touch p50 {a / 1000:.1f} ms with the stream, {b / 1000:.1f} ms without "
                       f"(p99 {med([r['touch_p99_us'] for r in cl]) / 1000:.1f} / {med([r['touch_p99_us'] for r in ns]) / 1000:.1f} ms): "
                       f"+{(a - b) / 1000:.1f} ms (goal <= 25% of the RTT, {rs[0]['rtt_ms'] / 4:.1f} ms): {mark(a - b <= rs[0]['rtt_ms'] * 250)}")
      if pull_t and t("clustered"):
          goals.append(f"{where}: clustered {pull_t / t('clustered'):.2f}x faster than pull (issue 16: >= 5x cross-host: {mark(pull_t / t('clustered') >= 5)}; "
                       f"issue 37, 8 vCPUs: >= 3x: {mark(pull_t / t('clustered') >= 3) if v == 8 else 'not set here'})")
      if t("clustered") and t("nostream"):
          goals.append(f"{where}: clustered with the defaults {t('clustered') / t('nostream'):.2f}x the same guest with --prefetch none "
                       f"(issue 37, 2 vCPUs: <= 1.25x: {mark(t('clustered') / t('nostream') <= 1.25) if v == 2 else 'not set here'})")
      for p in ("scattered", "plain", "variant"):
          if pull_t and t(p):
              goals.append(f"{where}: {p} {t(p) / pull_t:.2f}x pull's time (goal <= 1.1x): {mark(t(p) / pull_t <= 1.1)}")
      if pull_t and t("replay") and t("scattered"):
          share = med([ready(r) for r in rs if r["path"] == "replay" and r.get("vcpus", 2) == v])
          ok = pull_t / t("replay") >= 10 and t("scattered") / t("replay") >= 3.7 and share >= 0.95
          goals.append(f"{where}: replay {pull_t / t('replay'):.2f}x faster than pull, {t('scattered') / t('replay'):.2f}x than the first restore, "
                       f"{100 * share:.1f}% of touches installed or in flight (goal >= 10x pull, >= 3.7x the first, >= 95%): {mark(ok)}")
    cap = rate_bps(rs[0]["rate"])
    pr = [r for r in rs if r["path"] == "pull"]
    if cap and pr:
        share = med([r["bytes_down"] * 8 / r["seconds"] / cap for r in pr])
        goals.append(f"{where}: pull at {100 * share:.0f}% of the cap (goal >= 80%): {mark(share >= 0.8)}")
print()
if any(r["path"].endswith("_2m") for r in runs):
    print("Huge pages: the same guest (same touches) on 4 KiB and on 2 MiB pages, medians per restore. "
          "Faults: events the daemon read; installs: faults that were not `present` (each fills a whole unit: "
          "a 1 MiB chunk on 4 KiB pages, a 2 MiB huge page on huge pages).\n")
    print("| RTT | cap | pattern | time 4 KiB s | time 2 MiB s | 2 MiB / 4 KiB | faults 4 KiB | faults 2 MiB | installs 4 KiB | installs 2 MiB | MB fetched 4 KiB | MB fetched 2 MiB | MB prefetched 4 KiB | MB prefetched 2 MiB | vCPU fault p50 ms 4 KiB / 2 MiB |")
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for s in settings:
        rs = [r for r in runs if r["setting"] == s]
        for pat in ("clustered", "scattered"):
            a = [r for r in rs if r["path"] == pat + "_4k"]
            b = [r for r in rs if r["path"] == pat + "_2m"]
            if not a or not b:
                continue
            m = lambda xs, k: med([x[k] for x in xs])
            inst = lambda xs: med([x["faults"] - x["present_faults"] for x in xs])
            cap = rate_bps(a[0]["rate"])
            print(f"| {a[0]['rtt_ms']} ms | {'none' if not cap else a[0]['rate']} | {pat}{'' if link_of(a[0]) == 'window' else ', link ' + link_of(a[0])} | {f(m(a, 'seconds'))} | {f(m(b, 'seconds'))} | {f(m(b, 'seconds') / m(a, 'seconds'))}x "
                  f"| {m(a, 'faults'):.0f} | {m(b, 'faults'):.0f} | {inst(a):.0f} | {inst(b):.0f} | {m(a, 'bytes_fetched') / 1e6:.0f} | {m(b, 'bytes_fetched') / 1e6:.0f} "
                  f"| {m(a, 'prefetched_bytes') / 1e6:.0f} | {m(b, 'prefetched_bytes') / 1e6:.0f} | {ms(m(a, 'touch_p50_us'))} / {ms(m(b, 'touch_p50_us'))} |")
    print()
if goals:
    print("Goals (issue 16 §4, issue 23 §3, issue 37; the cross-host setting is 20 ms, 1gbit):\n")
    for g in goals:
        print(f"- {g}")
    print()
lz = [r for r in runs if r["path"] not in ("pull", "pull_direct", "calibration", "verify")]
if lz:
    pages = lz[0]["pages"]
    parts = []
    for p in order:
        pr = [r for r in lz if r["path"] == p]
        if pr:
            parts.append(f"{p}: {100 * med([1 - r['missing'] / r['pages'] for r in pr]):.1f}% of touches found their page installed "
                         f"({med([r['missing'] for r in pr]):.0f} missing, {med([r['vcpu_faults'] for r in pr]):.0f} of them data pages); "
                         f"{med([r['faults'] for r in pr]):.0f} faults reached the daemon ({med([r['zero_faults'] for r in pr]):.0f} zero, "
                         f"{med([r['cache_faults'] for r in pr]):.0f} from the cache or a fetch in flight, {med([r['fetched_faults'] for r in pr]):.0f} fetched); "
                         f"{med([r['prefetched_bytes'] for r in pr]) / 1e6:.0f} MB prefetched, "
                         f"{med([r.get('streamed_bytes', 0) for r in pr]) / 1e6:.0f} MB of it streamed; stream started in "
                         f"{sum(1 for r in pr if r.get('stream_started_s') is not None)} of {len(pr)} runs"
                         + (f" (median {med([r['stream_started_s'] for r in pr if r.get('stream_started_s') is not None]):.2f} s after connect)"
                            if any(r.get('stream_started_s') is not None for r in pr) else "")
                         + f", at most {med([r.get('stream_depth', 0) for r in pr]):.0f} requests in flight"
                         + (f"; working set: {med([r.get('ws_slices', 0) for r in pr]):.0f} slices installed "
                            f"({med([r.get('ws_bytes', 0) for r in pr]) / 1e6:.1f} MB read), {med([r.get('ws_waits', 0) for r in pr]):.0f} faults waited for it"
                            + (f", done {med([r['ws_s'] for r in pr if r.get('ws_s') is not None]):.2f} s after connect" if any(r.get('ws_s') is not None for r in pr) else "")
                            if any(r.get('ws_slices', 0) for r in pr) else "")
                         + (f"; recorded a working set of {med([r.get('ws_recorded', 0) for r in pr]):.0f} slices" if any(r.get('ws_recorded', 0) for r in pr) else ""))
    print(f"Per restore, medians: {pages} pages touched ({pages * 4096} B).\n")
    for part in parts:
        print(f"- {part}")
PY
echo
echo "Every run: \`bench/results/$NAME.jsonl\`."

#!/usr/bin/env bash
# The lazy-restore benchmark of issue 5: `snapctl lazy` (release build) serving a restoring
# VM's page faults, with tests/src/bin/fake_vmm as the VM (a Firecracker-like runtime:
# two regions, UFFD handshake, 4 touching threads, every page compared with the original).
#
#   bash bench/lazy.sh            256 MiB warm-cache case + 2 GiB 5%-touch case, 3 runs
#   bash bench/lazy.sh --quick    64 MiB / 256 MiB, 1 run: a smoke test, not a result
#
# Options: --runs N  --size SIZE (warm case)  --big SIZE (cold case)  --pct P  --keep
#
# Measures (medians of --runs; runs alternate between the sides being compared):
#   warm, touch all   every page of a SIZE image, chunk cache warm (filled by one untimed
#                     restore), --prefetch none: snapctl lazy vs bench's uffd_ref (no
#                     verification, UFFDIO_COPY straight from the page-cached memory file,
#                     1 MiB per fault = the daemon's chunk). Time = fake_vmm's touch phase.
#   latency           fake_vmm's first-touch latency of each 4 KiB page (p50/p99, every page
#                     of the warm case), for snapctl lazy, uffd_ref at 1 MiB and uffd_ref at
#                     4 KiB per fault; and the daemon's own per-fault latency.
#   cold, 5% touch    a BIG image in `snapctl serve` on loopback; fresh (empty) chunk cache;
#                     fake_vmm touches PCT% of the pages, clustered (runs of 512 pages at
#                     random offsets) and scattered (single pages). Time = daemon start to
#                     fake_vmm exit. Against: `snapctl pull` of the whole image (fresh cache)
#                     + the same touches served from the pulled file by uffd_ref (at 1 MiB
#                     and at 4 KiB per fault, the faster of the two). The
#                     scattered case also with --prefetch all --prefetch-rate 0.
#   trace             the cold case again after one --record-trace restore: --prefetch
#                     trace vs --prefetch none (if the daemon has --record-trace).
#
# Output: markdown on stdout (also bench/results/lazy-DATE.md), progress on stderr. Needs
# root (userfaultfd), jq, python3. SNAPCTL / UFFD_REF / FAKE_VMM pick binaries (default:
# target/release/*, built if missing).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
RUNS=3 SIZE=256MiB BIG=2GiB PCT=5 KEEP=0
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) RUNS=1; SIZE=64MiB; BIG=256MiB ;;
    --runs) RUNS=$2; shift ;;
    --size) SIZE=$2; shift ;;
    --big) BIG=$2; shift ;;
    --pct) PCT=$2; shift ;;
    --keep) KEEP=1 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "lazy.sh: unknown option $1 (try --help)" >&2; exit 2 ;;
  esac
  shift
done
for p in jq python3; do
  command -v "$p" >/dev/null || { echo "lazy.sh: $p not found (run scripts/setup.sh)" >&2; exit 2; }
done

TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
SNAPCTL=${SNAPCTL:-$TARGET/release/snapctl}
UFFD_REF=${UFFD_REF:-$TARGET/release/uffd_ref}
FAKE_VMM=${FAKE_VMM:-$TARGET/release/fake_vmm}
if [ ! -x "$SNAPCTL" ] || [ ! -x "$UFFD_REF" ] || [ ! -x "$FAKE_VMM" ]; then
  echo "building release binaries in $TARGET" >&2
  (cd "$ROOT" && cargo build --release -q -p snapctl -p snapctl-bench --bin uffd_ref -p snapctl-tests --bin fake_vmm)
fi
"$SNAPCTL" lazy --help >/dev/null 2>&1 || { echo "lazy.sh: $SNAPCTL has no 'lazy' subcommand" >&2; exit 2; }

WORK=$(mktemp -d "${TMPDIR:-/tmp}/snapctl-lazy-bench.XXXXXX")
PIDS=()
cleanup() {
  # Only our servers: a bare `wait` would also wait for the tee below, which waits for us.
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
  if [ "$KEEP" = 1 ]; then echo "kept $WORK" >&2; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
log() { echo "lazy.sh: $*" >&2; }
median() { python3 -c 'import sys,statistics; v=[float(x) for x in sys.argv[1:]]; print(f"{statistics.median(v):.4g}")' "$@"; }
now() { date +%s.%N; }
wait_listening() { # LOGFILE: until the handler says it listens (10 s)
  for _ in $(seq 500); do grep -q "listening on" "$1" 2>/dev/null && return 0; sleep 0.02; done
  echo "lazy.sh: handler did not listen: $(cat "$1")" >&2; exit 2
}
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# shellcheck source=bench/lib/memory.sh
source "$ROOT/bench/lib/memory.sh"
WARM_BYTES=0

# One restore: HANDLER... is started (must print "listening on", exit after one
# connection), then fake_vmm with VMM_ARGS. Leaves fake_vmm's JSON in $WORK/vmm.json, the
# handler's in $WORK/handler.json, and the wall time (handler start -> fake_vmm done) in
# $WALL. Before the clock starts, WARM_BYTES of memory are touched and freed
# (bench/lib/memory.sh): on this VM memory idle for a few seconds costs ~2-3 s/GiB to
# touch again, a cost of the hypervisor that would otherwise land on whichever side runs
# first after a pause.
VMM_ARGS=()
restore() {
  local sock=$WORK/h.sock
  rm -f "$sock"
  warm_memory "$WARM_BYTES"
  local t0; t0=$(now)
  "$@" --socket "$sock" >"$WORK/handler.json" 2>"$WORK/handler.log" &
  local hp=$!
  PIDS+=("$hp")
  wait_listening "$WORK/handler.log"
  if ! "$FAKE_VMM" --socket "$sock" --json --timeout 600 "${VMM_ARGS[@]}" >"$WORK/vmm.json" 2>"$WORK/vmm.log"; then
    echo "lazy.sh: fake_vmm failed: $(cat "$WORK/vmm.log") $(cat "$WORK/vmm.json")" >&2; exit 2
  fi
  # The guest is done here; the daemon may still be writing fetched chunks to its cache.
  WALL=$(python3 -c "print($(now) - $t0)")
  wait "$hp" || { echo "lazy.sh: handler failed: $(tail -5 "$WORK/handler.log")" >&2; exit 2; }
  [ "$(jq .mismatches "$WORK/vmm.json")" = 0 ] || { echo "lazy.sh: wrong bytes seen!" >&2; exit 2; }
}

DATE=$(date -u +%Y-%m-%d)
OUT=$ROOT/bench/results/lazy-$DATE.md
exec > >(tee "$OUT")

echo "### Run of $(date -u '+%Y-%m-%d %H:%M UTC'): $(nproc) cores, kernel $(uname -r), $RUNS runs, medians"
echo

# ---------------------------------------------------------------- warm cache, touch all
log "sample + pack $SIZE"
WARM_BYTES=$(to_bytes "$SIZE")
"$SNAPCTL" sample "$WORK/snap" --size "$SIZE" --seed 1 >/dev/null 2>&1
"$SNAPCTL" pack "$WORK/snap" "oci:$WORK/layout:v1" >/dev/null
MEM=$WORK/snap/vm.mem
CACHE=$WORK/cache-warm
VMM_ARGS=(--mem-file "$MEM" --touch all --threads 4 --seed 1)
log "warming the chunk cache"
restore "$SNAPCTL" lazy "oci:$WORK/layout:v1" --once --json --prefetch none --cache "$CACHE"
cat "$MEM" >/dev/null  # uffd_ref reads the file through the page cache: warm it too
L_T=() R_T=() P_T=() L_P50=() L_P99=() R_P50=() R_P99=() P_P50=() P_P99=() D_P50=() D_P99=()
for i in $(seq "$RUNS"); do
  log "warm run $i/$RUNS: snapctl lazy"
  restore "$SNAPCTL" lazy "oci:$WORK/layout:v1" --once --json --prefetch none --cache "$CACHE"
  L_T+=("$(jq .seconds "$WORK/vmm.json")")
  L_P50+=("$(jq .touch_latency_us.p50 "$WORK/vmm.json")"); L_P99+=("$(jq .touch_latency_us.p99 "$WORK/vmm.json")")
  D_P50+=("$(jq '.latency_us.p50' "$WORK/handler.json")"); D_P99+=("$(jq '.latency_us.p99' "$WORK/handler.json")")
  log "  $(jq -c '{faults, bytes_fetched, latency_us}' "$WORK/handler.json")"
  log "warm run $i/$RUNS: uffd_ref (1 MiB)"
  restore "$UFFD_REF" --mem-file "$MEM" --once --json
  R_T+=("$(jq .seconds "$WORK/vmm.json")")
  R_P50+=("$(jq .touch_latency_us.p50 "$WORK/vmm.json")"); R_P99+=("$(jq .touch_latency_us.p99 "$WORK/vmm.json")")
  log "warm run $i/$RUNS: uffd_ref (4 KiB)"
  restore "$UFFD_REF" --mem-file "$MEM" --once --json --granularity 4096
  P_T+=("$(jq .seconds "$WORK/vmm.json")")
  P_P50+=("$(jq .touch_latency_us.p50 "$WORK/vmm.json")"); P_P99+=("$(jq .touch_latency_us.p99 "$WORK/vmm.json")")
done
LT=$(median "${L_T[@]}"); RT=$(median "${R_T[@]}"); PT=$(median "${P_T[@]}")
echo "#### Warm chunk cache: touch every page of a $SIZE image (4 threads)"
echo
echo "| handler | touch all (s) | first-touch p50 (us) | p99 (us) | runs (s) |"
echo "|---|---|---|---|---|"
echo "| snapctl lazy (verified chunks, 1 MiB) | $LT | $(median "${L_P50[@]}") | $(median "${L_P99[@]}") | ${L_T[*]} |"
echo "| uffd_ref, 1 MiB per fault (no verification) | $RT | $(median "${R_P50[@]}") | $(median "${R_P99[@]}") | ${R_T[*]} |"
echo "| uffd_ref, 4 KiB per fault | $PT | $(median "${P_P50[@]}") | $(median "${P_P99[@]}") | ${P_T[*]} |"
echo
echo "snapctl lazy / uffd_ref (1 MiB): **$(python3 -c "print(f'{$LT/$RT:.2f}')")x** the reference's time (goal: <= 2x)."
echo "The daemon's own fault latency (fault read -> installed), medians: p50 $(median "${D_P50[@]}") us, p99 $(median "${D_P99[@]}") us."
echo

# ---------------------------------------------------------------- cold, PCT% of BIG
log "sample + pack + push $BIG"
WARM_BYTES=$(to_bytes "$BIG")
"$SNAPCTL" sample "$WORK/big" --size "$BIG" --seed 2 >/dev/null 2>&1
"$SNAPCTL" pack "$WORK/big" "oci:$WORK/biglayout:v1" >/dev/null
PORT=$(free_port)
"$SNAPCTL" serve --storage "$WORK/storage" --listen "127.0.0.1:$PORT" >/dev/null 2>"$WORK/serve.log" &
PIDS+=("$!")
for _ in $(seq 300); do (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null && break; sleep 0.05; done
REF=127.0.0.1:$PORT/bench/vm:v1
if "$SNAPCTL" push --help >/dev/null 2>&1; then
  "$SNAPCTL" push "oci:$WORK/biglayout:v1" "$REF" >/dev/null
else
  skopeo copy --quiet --preserve-digests --dest-tls-verify=false "oci:$WORK/biglayout:v1" "docker://$REF"
fi
rm -rf "$WORK/biglayout" "$WORK/cache-warm"  # disk: only the registry's copy is needed now
BIGMEM=$WORK/big/vm.mem
# Two touch patterns over PCT% of the pages: runs of 512 contiguous pages (2 MiB extents at
# random, unaligned offsets: a working set is clustered) and single pages scattered
# uniformly (the worst case for 1 MiB chunks: nearly every chunk gets touched).
CLUSTER=(--touch "$PCT%" --run-pages 512 --threads 4 --seed 3)
SCATTER=(--touch "$PCT%" --run-pages 1 --threads 4 --seed 3)
HAVE_PULL=0; "$SNAPCTL" pull --help >/dev/null 2>&1 && HAVE_PULL=1
C_T=() S_T=() SA_T=() C_CH=() S_CH=() U_T=() US_T=() U_PULL=()
for i in $(seq "$RUNS"); do
  for pat in cluster scatter; do
    sync
    log "cold run $i/$RUNS ($pat): snapctl lazy from snapctl serve"
    rm -rf "$WORK/cache-cold"
    if [ $pat = cluster ]; then VMM_ARGS=(--mem-file "$BIGMEM" "${CLUSTER[@]}"); else VMM_ARGS=(--mem-file "$BIGMEM" "${SCATTER[@]}"); fi
    restore "$SNAPCTL" lazy "$REF" --once --json --prefetch none --cache "$WORK/cache-cold"
    log "  $(jq -c '{faults, bytes_fetched}' "$WORK/handler.json") wall $WALL s"
    if [ $pat = cluster ]; then C_T+=("$WALL"); C_CH+=("$(jq .faults.fetched "$WORK/handler.json")"); else S_T+=("$WALL"); S_CH+=("$(jq .faults.fetched "$WORK/handler.json")"); fi
    rm -rf "$WORK/cache-cold"
    if [ $pat = scatter ]; then
      # Scattered touches hit nearly every chunk: streaming the whole image behind the
      # faults (--prefetch all, no rate bound) is what a user would do for such a guest.
      sync
      log "cold run $i/$RUNS (scatter): snapctl lazy --prefetch all --prefetch-rate 0"
      restore "$SNAPCTL" lazy "$REF" --once --json --prefetch all --prefetch-rate 0 --cache "$WORK/cache-cold"
      log "  $(jq -c '{faults, bytes_fetched}' "$WORK/handler.json") wall $WALL s"
      SA_T+=("$WALL")
      rm -rf "$WORK/cache-cold"
    fi
  done
  if [ "$HAVE_PULL" = 1 ]; then
    sync
    log "cold run $i/$RUNS: snapctl pull + restore from the pulled file"
    rm -rf "$WORK/cache-pull" "$WORK/pulled"
    warm_memory "$WARM_BYTES"
    t0=$(now)
    "$SNAPCTL" pull "$REF" "$WORK/pulled" --cache "$WORK/cache-pull" >/dev/null 2>"$WORK/pull.log"
    t1=$(now)
    PULL=$(python3 -c "print($t1 - $t0)")
    U_PULL+=("$PULL")
    # The restore from the pulled file is uffd_ref at 1 MiB and at 4 KiB per fault, and
    # the faster counts: 1 MiB suits clustered touches, 4 KiB scattered ones (a whole
    # 1 MiB per scattered page fills 20x the memory the guest touches).
    for pat in cluster scatter; do
      best=""
      for g in 1048576 4096; do
        if [ $pat = cluster ]; then VMM_ARGS=(--mem-file "$WORK/pulled/vm.mem" "${CLUSTER[@]}"); else VMM_ARGS=(--mem-file "$WORK/pulled/vm.mem" "${SCATTER[@]}"); fi
        restore "$UFFD_REF" --mem-file "$WORK/pulled/vm.mem" --once --json --granularity "$g"
        log "  pull $PULL s + uffd_ref $pat at $g B/fault: $WALL s"
        best=$(python3 -c "print(min(x for x in [$WALL, ${best:-1e9}]))")
      done
      if [ $pat = cluster ]; then U_T+=("$(python3 -c "print($PULL + $best)")"); else US_T+=("$(python3 -c "print($PULL + $best)")"); fi
    done
    rm -rf "$WORK/cache-pull" "$WORK/pulled"
  fi
done
CHUNKS=$(python3 -c "import os; print(-(-os.path.getsize('$BIGMEM') // (1<<20)))")
echo "#### Cold: touch $PCT% of a $BIG image's pages, from \`snapctl serve\` on loopback"
echo
echo "Empty chunk cache each run; time from starting the daemon to the last page checked."
echo
echo "| path | clustered 5% (s) | scattered 5% (s) | runs clustered / scattered (s) |"
echo "|---|---|---|---|"
echo "| snapctl lazy | $(median "${C_T[@]}") | $(median "${S_T[@]}") | ${C_T[*]} / ${S_T[*]} |"
echo "| snapctl lazy --prefetch all --prefetch-rate 0 | | $(median "${SA_T[@]}") | ${SA_T[*]} |"
if [ "$HAVE_PULL" = 1 ]; then
  echo "| snapctl pull + same touches from the pulled file (uffd_ref, faster of 1 MiB / 4 KiB per fault) | $(median "${U_T[@]}") | $(median "${US_T[@]}") | ${U_T[*]} / ${US_T[*]} |"
  echo
  echo "The pull alone: $(median "${U_PULL[@]}") s. Chunks fetched by the daemon (of $CHUNKS): clustered $(median "${C_CH[@]}"), scattered $(median "${S_CH[@]}")."
  echo "Lazy vs pull: clustered **$(python3 -c "print(f'{$(median "${U_T[@]}")/$(median "${C_T[@]}"):.1f}')")x** faster, scattered **$(python3 -c "print(f'{$(median "${US_T[@]}")/$(median "${S_T[@]}"):.1f}')")x**, scattered with --prefetch all **$(python3 -c "print(f'{$(median "${US_T[@]}")/$(median "${SA_T[@]}"):.1f}')")x** (goal: >= 5x)."
else
  echo
  echo "\`snapctl pull\` is not in this build: the pull side was not measured."
fi
echo

# ---------------------------------------------------------------- recorded trace
if "$SNAPCTL" lazy --help 2>/dev/null | grep -q -- --record-trace; then
  log "recording a trace"
  rm -rf "$WORK/cache-rec"
  VMM_ARGS=(--mem-file "$BIGMEM" "${CLUSTER[@]}")
  restore "$SNAPCTL" lazy "$REF" --once --json --prefetch none --record-trace --cache "$WORK/cache-rec"
  rm -rf "$WORK/cache-rec"
  T_T=() N_T=()
  for i in $(seq "$RUNS"); do
    for mode in trace none; do
      sync
      rm -rf "$WORK/cache-t"
      log "trace run $i/$RUNS: --prefetch $mode"
      restore "$SNAPCTL" lazy "$REF" --once --json --prefetch "$mode" --cache "$WORK/cache-t"
      log "  $(jq -c '{faults, bytes_fetched}' "$WORK/handler.json") vmm $(jq .seconds "$WORK/vmm.json") s"
      if [ "$mode" = trace ]; then T_T+=("$(jq .seconds "$WORK/vmm.json")"); else N_T+=("$(jq .seconds "$WORK/vmm.json")"); fi
      rm -rf "$WORK/cache-t"
    done
  done
  echo "#### Recorded trace: the clustered cold $PCT% restore again (same pages), empty cache"
  echo
  echo "| prefetch | touch phase (s) | runs (s) |"
  echo "|---|---|---|"
  echo "| trace (replayed ahead of the guest) | $(median "${T_T[@]}") | ${T_T[*]} |"
  echo "| none | $(median "${N_T[@]}") | ${N_T[*]} |"
else
  echo "\`snapctl lazy\` has no --record-trace in this build: trace vs no trace not measured."
fi

# What the dialled-network benchmarks (wan.sh, sign.sh, wake.sh) share. Source it after
# setting ROOT (the repository).
#
#   need NAME TOOL...       exit 2 naming the first TOOL not on PATH (NAME: the script)
#   release_bins            sets TARGET, SNAPCTL, FAKE_VMM and NETEM (each may be given in
#                           the environment), building the release binaries unless they are
#                           current (SNAPCTL_BINS_GIVEN=1: use them as they are)
#   work_dir NAME           sets W (a fresh temporary directory) and PIDS (processes to stop);
#                           at exit every PIDS entry is stopped and W removed
#   serve_sample SIZE       `snapctl sample` of SIZE (half zero, seed 2) in $W/snap, pushed
#                           as bench/vm:v1 to a `snapctl serve` on $W/storage (servers.sh's
#                           start_server: sets PORT); sets MEM to its vm.mem
#   log MESSAGE...          a timestamped line on stderr, prefixed with NAME
#   now                     seconds since the epoch, with nanoseconds

need() {
  local who=$1 t
  shift
  for t in "$@"; do
    command -v "$t" >/dev/null || { echo "$who: $t not found (run scripts/setup.sh)" >&2; exit 2; }
  done
}

release_bins() {
  TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
  SNAPCTL=${SNAPCTL:-$TARGET/release/snapctl}
  FAKE_VMM=${FAKE_VMM:-$TARGET/release/fake_vmm}
  NETEM=${NETEM:-$TARGET/release/netem_proxy}
  # Always through cargo (a no-op when they are current): a binary left from an older
  # checkout would be measured under this checkout's commit.
  if [ -z "${SNAPCTL_BINS_GIVEN:-}" ]; then
    echo "building release binaries in $TARGET (if not current)" >&2
    (cd "$ROOT" && cargo build --release -q -p snapctl -p snapctl-tests --bin snapctl --bin fake_vmm --bin netem_proxy)
  fi
  for b in "$SNAPCTL" "$FAKE_VMM" "$NETEM"; do
    [ -x "$b" ] || { echo "release_bins: $b is missing" >&2; exit 2; }
  done
}

BENCH_NAME=bench
work_dir() {
  BENCH_NAME=$1
  W=$(mktemp -d "${TMPDIR:-/tmp}/snapctl-$1.XXXXXX")
  PIDS=()
  trap stop_and_clean EXIT
  trap 'exit 130' INT TERM
}
stop_and_clean() {
  for p in "${PIDS[@]:-}"; do [ -n "$p" ] && { kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; }; done
  rm -rf "$W"
}
serve_sample() {
  log "sample $1 (half zero) + push to snapctl serve"
  "$SNAPCTL" sample "$W/snap" --size "$1" --zero-fraction 0.5 --seed 2 >/dev/null
  start_server snapctl "$W/storage"
  "$SNAPCTL" push "$W/snap" "127.0.0.1:$PORT/bench/vm:v1" --cache "$W/pushcache" >/dev/null
  rm -rf "$W/pushcache"
  MEM=$W/snap/vm.mem
}
log() { echo "[$(date -u +%H:%M:%S) $BENCH_NAME] $*" >&2; }
now() { date +%s.%N; }

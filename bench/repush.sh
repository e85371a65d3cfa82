#!/usr/bin/env bash
# Re-pushing a directory after a small change: bytes sent per push and what
# `~/.cache/snapctl/push-layouts` holds after it. A sample of SIZE (default 38 MiB),
# pushed to REGISTRY (`snapctl serve`, or `distribution`: docker-registry 2.8) on
# loopback, then ROUNDS times (default 3) one 1 MiB block rewritten (`sample --mutate 1`)
# and pushed again, each mode with a fresh registry, cache and sample (same seeds):
#   auto       `push DIR HOST/REPO:latest`             (the closest image as the parent)
#   new-tags   `push DIR HOST/REPO:hN`, a new tag each time (as hibernations are named)
#   no-parent  `push DIR HOST/REPO:latest --no-parent` (a full image each time)
#   parent     `push DIR HOST/REPO:latest --parent HOST/REPO:latest` (named by hand)
#   before     OLD_SNAPCTL (if set: another binary) with no flags
# Bytes are `bytes_sent` of `push --json` (blob bytes uploaded; manifests excluded, a few
# KiB) and allocated bytes (`du -sB1`) of the push layouts. Byte counts do not depend on
# the machine's load, so one run is the result.
#
#   bash bench/repush.sh [--size 38MiB] [--rounds 3] [--registry snapctl|distribution]
#
# Output: markdown on stdout (also bench/results/repush-DATE-REGISTRY.md), progress on stderr.
# SNAPCTL picks the binary (default target/release/snapctl, else target/debug/snapctl).
set -euo pipefail
trap 'echo "repush.sh: line $LINENO failed: $BASH_COMMAND" >&2' ERR

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ARGV=("$@")
SIZE=38MiB ROUNDS=3 REGISTRY=snapctl
while [ $# -gt 0 ]; do
  case "$1" in
    --size) SIZE=$2; shift ;;
    --rounds) ROUNDS=$2; shift ;;
    --registry) REGISTRY=$2; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "repush.sh: unknown option $1 (try --help)" >&2; exit 2 ;;
  esac
  shift
done
for p in jq python3 curl du; do
  command -v "$p" >/dev/null || { echo "repush.sh: $p not found (run scripts/setup.sh)" >&2; exit 2; }
done
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
SNAPCTL=${SNAPCTL:-$TARGET/release/snapctl}
[ -x "$SNAPCTL" ] || SNAPCTL=$TARGET/debug/snapctl
[ -x "$SNAPCTL" ] || { echo "repush.sh: no snapctl binary (cargo build -p snapctl)" >&2; exit 2; }

W=$(mktemp -d "${TMPDIR:-/tmp}/snapctl-repush-bench.XXXXXX")
PIDS=()
cleanup() {
  for p in "${PIDS[@]:-}"; do [ -n "$p" ] && { kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; }; done
  rm -rf "$W"
}
trap cleanup EXIT
log() { echo "repush.sh: $*" >&2; }
SERVER_LOGS=$W
# shellcheck source=bench/lib/servers.sh
source "$ROOT/bench/lib/servers.sh"

DATE=$(date -u +%Y-%m-%d)
OUT=$ROOT/bench/results/repush-$DATE-$REGISTRY.md
exec > >(tee "$OUT")

MODES=(auto new-tags no-parent parent)
[ -n "${OLD_SNAPCTL:-}" ] && MODES+=(before)
declare -A SENT LAYOUTS
for mode in "${MODES[@]}"; do
  bin=$SNAPCTL
  [ "$mode" = before ] && bin=$OLD_SNAPCTL
  m=$W/$mode
  mkdir -p "$m"
  start_server "$REGISTRY" "$m/storage"
  dest=127.0.0.1:$PORT/vm/sandbox:latest
  "$bin" sample "$m/snap" --size "$SIZE" --seed 1 >/dev/null 2>&1
  for r in $(seq 0 "$ROUNDS"); do
    if [ "$r" -gt 0 ]; then
      "$bin" sample "$m/snap" --size "$SIZE" --mutate 1 --seed "$((100 + r))" >/dev/null 2>&1
    fi
    args=()
    to=$dest
    case "$mode" in
      new-tags) to=${dest%:latest}:h$r ;;
      no-parent) args=(--no-parent) ;;
      parent) [ "$r" -gt 0 ] && args=(--parent "$dest") ;;
    esac
    rep=$(SNAPCTL_CACHE=$m/cache "$bin" push "$m/snap" "$to" --json "${args[@]}" 2>"$m/push.log") \
      || { echo "repush.sh: $mode push $r failed: $(tail -5 "$m/push.log")" >&2; exit 2; }
    SENT[$mode,$r]=$(jq .bytes_sent <<<"$rep")
    LAYOUTS[$mode,$r]=$(du -sB1 "$m/cache/push-layouts" | cut -f1)
    log "$mode push $r: sent ${SENT[$mode,$r]} B, push-layouts ${LAYOUTS[$mode,$r]} B, depth $(jq .pack.chain_depth <<<"$rep")$(grep -q 'as the parent' "$m/push.log" && echo ', a parent taken')"
  done
  stop_server
done

mb() { python3 -c "print(f'{$1/1e6:.2f}')"; }
echo "### Run of $(date -u '+%Y-%m-%d %H:%M UTC'): $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg), snapctl $(git -C "$ROOT" rev-parse --short HEAD)$(git -C "$ROOT" diff --quiet HEAD -- . 2>/dev/null || echo '+changes')"
echo
echo "\`bash bench/repush.sh ${ARGV[*]}\`: a $SIZE sample (seed 1), pushed, then $ROUNDS times one 1 MiB block rewritten and pushed again (\`new-tags\`: to a new tag each time) to \`$REGISTRY\` (loopback). MB sent (\`bytes_sent\`) / MB under push-layouts after the push:"
echo
hdr="| mode | first push |"; sep="|---|---|"
for r in $(seq 1 "$ROUNDS"); do hdr+=" re-push $r |"; sep+="---|"; done
echo "$hdr"; echo "$sep"
for mode in "${MODES[@]}"; do
  row="| $mode |"
  for r in $(seq 0 "$ROUNDS"); do row+=" $(mb "${SENT[$mode,$r]}") / $(mb "${LAYOUTS[$mode,$r]}") |"; done
  echo "$row"
done

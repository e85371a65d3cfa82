#!/usr/bin/env bash
# The long-chain benchmark of issue 13 §2: a sandbox hibernated LAYERS times, each
# snapshot packed as a layer over the previous one (`sample --mutate 1`: one 1 MiB block
# rewritten each time), so the chain is rebased every 65 layers (spec/format.md §10). The
# sample has no holes (--zero-fraction 0), so every layer holds the same amount of data
# and only the chain differs (with holes, mutations fill them and later layers hold more).
# `pull`, `unpack`, `verify` and `lazy` of the image at depth 1 (the first layer) against
# the image at depth LAYERS and the deepest chain on the way (the last layer with 64
# ancestors, just before a rebase), all pushed to `snapctl serve` on loopback. Goal (issues
# 13 and 22 §6): within 1.5x of depth 1. Layers are compacted as `pack` does by default
# (spec/format.md §10, "Compaction"); `--pack-args "--compact-after off"` packs the chain
# as before compaction existed.
#
#   bash bench/chain.sh            256 MiB image, 300 layers, 5 runs
#   bash bench/chain.sh --quick    64 MiB, 70 layers, 1 run: a smoke test, not a result
#
# Options: --runs N  --size SIZE  --layers N  --keep  --tag NAME (results file suffix)
#          --pack-args "ARGS": extra options for every `pack` of the chain
#          --rtt MS  --rate RATE: time every command through tests/src/bin/netem_proxy (MS of
#          round-trip time, RATE as tc writes it, default 1gbit; `--rtt 20` is issue 16's
#          cross-host setting), one proxy for the whole run; pushes and inspect go straight
#          to the server. Results then in bench/results/chain-DATE-rttMSms.md.
#
# Measures (medians of --runs; within a run the two images alternate, first one then the
# other, so load from other processes hits both alike; before each timed command `sync`
# and SIZE x 2 of memory touched and freed, bench/lib/memory.sh):
#   pull     `snapctl pull REF DIR --cache FRESH` (every chunk fetched and verified,
#            files fsynced)
#   unpack   `snapctl unpack REF DIR` straight from the registry (no cache: every chunk
#            read, verified and written, files fsynced)
#   unpack-local  the same from the OCI layout the chain was packed into (no network)
#   verify   `snapctl verify REF` straight from the registry (every stored range of the
#            image read and hashed, every root of the chain recomputed)
#   lazy     `snapctl lazy REF --once --prefetch none --cache FRESH` serving
#            tests/src/bin/fake_vmm, which touches every page of vm.mem (4 threads) and
#            compares each with the snapshot's; time = daemon start to fake_vmm exit
#            (bench/lazy.sh's "restore"). Needs root (userfaultfd).
# The chain is built with `pack --parent oci:` (not timed); its depths and rebases are
# reported.
#
# Output: markdown on stdout (also bench/results/chain-DATE.md), progress on stderr.
# Needs jq, python3. SNAPCTL / FAKE_VMM pick binaries (default: target/release/*, built if
# missing).
set -euo pipefail
trap 'echo "chain.sh: line $LINENO failed: $BASH_COMMAND" >&2' ERR

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ARGV=("$@")
RUNS=5 SIZE=256MiB LAYERS=300 KEEP=0 QUICK=0 RTT="" RATE=1gbit PACK_ARGS="" NAME=""
while [ $# -gt 0 ]; do
  case "$1" in
    --pack-args) PACK_ARGS=$2; shift ;;
    --tag) NAME=$2; shift ;;
    --quick) QUICK=1; RUNS=1; SIZE=64MiB; LAYERS=70 ;;
    --runs) RUNS=$2; shift ;;
    --size) SIZE=$2; shift ;;
    --layers) LAYERS=$2; shift ;;
    --keep) KEEP=1 ;;
    --rtt) RTT=$2; shift ;;
    --rate) RATE=$2; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "chain.sh: unknown option $1 (try --help)" >&2; exit 2 ;;
  esac
  shift
done
for p in jq python3 curl; do
  command -v "$p" >/dev/null || { echo "chain.sh: $p not found (run scripts/setup.sh)" >&2; exit 2; }
done

TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
SNAPCTL=${SNAPCTL:-$TARGET/release/snapctl}
FAKE_VMM=${FAKE_VMM:-$TARGET/release/fake_vmm}
NETEM=${NETEM:-$TARGET/release/netem_proxy}
if [ ! -x "$SNAPCTL" ] || [ ! -x "$FAKE_VMM" ] || { [ -n "$RTT" ] && [ ! -x "$NETEM" ]; }; then
  echo "building release binaries in $TARGET" >&2
  (cd "$ROOT" && cargo build --release -q --workspace --bins)
fi
"$SNAPCTL" pack --help | grep -q -- --max-chain || { echo "chain.sh: $SNAPCTL cannot rebase (no --max-chain)" >&2; exit 2; }

W=$(mktemp -d "${TMPDIR:-/tmp}/snapctl-chain-bench.XXXXXX")
PIDS=()
cleanup() {
  for p in "${PIDS[@]:-}"; do [ -n "$p" ] && { kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; }; done
  if [ "$KEEP" = 1 ]; then echo "kept $W" >&2; else rm -rf "$W"; fi
}
trap cleanup EXIT
log() { echo "chain.sh: $*" >&2; }
median() { python3 -c 'import sys,statistics; v=[float(x) for x in sys.argv[1:]]; print(f"{statistics.median(v):.4g}")' "$@"; }
ratio() { python3 -c "print(f'{$1/$2:.2f}')"; }
now() { date +%s.%N; }
since() { python3 -c "print(f'{$(now) - $1:.4f}')"; }

# shellcheck source=bench/lib/memory.sh
source "$ROOT/bench/lib/memory.sh"
SERVER_LOGS=$W
# shellcheck source=bench/lib/servers.sh
source "$ROOT/bench/lib/servers.sh"
WARM_BYTES=$(( $(to_bytes "$SIZE") * 2 ))

DATE=$(date -u +%Y-%m-%d)
OUT=$ROOT/bench/results/chain-$DATE${RTT:+-rtt${RTT}ms}${NAME:+-$NAME}.md
if [ "$QUICK" = 1 ]; then OUT=$W/chain.md; fi
exec > >(tee "$OUT")

# ---------------------------------------------------------------- the chain (not timed)
# Every hibernation is also pushed to the server as `bench/history:latest`, the tag a
# platform pushes again and again, so the store holds the whole history as it would.
start_server snapctl "$W/storage"
HIST=127.0.0.1:$PORT/bench/history
stored_bytes() { find "$W/storage/blobs" -type f -printf '%s\n' | awk '{s += $1} END {print s + 0}'; }
log "sample $SIZE (no holes), then $LAYERS layers, each one 1 MiB block changed"
"$SNAPCTL" sample "$W/snap" --size "$SIZE" --seed 1 --zero-fraction 0 >/dev/null 2>&1
"$SNAPCTL" pack "$W/snap" "oci:$W/layout:l0" >/dev/null 2>&1
"$SNAPCTL" push "oci:$W/layout:l0" "$HIST:latest" >/dev/null 2>&1
REBASES=() COMPACTIONS=() DEPTH=0 DEEP=1 DEEPEST=0 t0=$(now) PACK_BYTES=0 COMPACTED_BYTES=0
for i in $(seq 1 "$LAYERS"); do
  "$SNAPCTL" sample "$W/snap" --size "$SIZE" --mutate 1 --seed "$i" >/dev/null 2>&1
  # shellcheck disable=SC2086
  rep=$("$SNAPCTL" pack "$W/snap" "oci:$W/layout:l$i" --parent "oci:$W/layout:l$((i - 1))" --json $PACK_ARGS 2>"$W/pack.log") \
    || { echo "chain.sh: pack of layer $i failed: $(tail -5 "$W/pack.log")" >&2; exit 2; }
  DEPTH=$(jq .chain_depth <<<"$rep")
  if [ "$(jq .rebased <<<"$rep")" = true ]; then REBASES+=("$i"); fi
  if [ "$(jq '.compacted // false' <<<"$rep")" = true ]; then COMPACTIONS+=("$i"); fi
  PACK_BYTES=$((PACK_BYTES + $(jq .pack_bytes <<<"$rep")))
  COMPACTED_BYTES=$((COMPACTED_BYTES + $(jq '.compacted_bytes // 0' <<<"$rep")))
  "$SNAPCTL" push "oci:$W/layout:l$i" "$HIST:latest" >/dev/null 2>"$W/push.log" \
    || { echo "chain.sh: push of layer $i failed: $(tail -5 "$W/push.log")" >&2; exit 2; }
  if [ "$i" = 1 ]; then cp --sparse=always "$W/snap/vm.mem" "$W/mem-l1"; fi
  # The last layer with the longest chain (not layer 1 or LAYERS themselves).
  if [ "$DEPTH" -ge "$DEEPEST" ] && [ "$i" -gt 1 ] && [ "$i" -lt "$LAYERS" ]; then
    DEEPEST=$DEPTH DEEP=$i
    cp --sparse=always "$W/snap/vm.mem" "$W/mem-deep"
  fi
done
log "packed $LAYERS layers in $(since "$t0") s; rebased at ${REBASES[*]:-none}; compacted at ${COMPACTIONS[*]:-none}; the last has $DEPTH ancestors, layer $DEEP has $DEEPEST"
cp --sparse=always "$W/snap/vm.mem" "$W/mem-l$LAYERS"
mv "$W/mem-deep" "$W/mem-l$DEEP"

# ---------------------------------------------------------------- store growth (not timed)
# What the store holds after the history, against what the image `latest` names now
# needs: its distinct stored ranges (the chunks it reads, wherever they live) and its
# metadata (configs, indexes, outboards of its chain, its manifest). Then `snapctl gc`
# with default retention (untagged manifests go once older than the grace; --grace 0s
# so that is now) and the store again: what is left beyond the image's own bytes is the
# dead part of packs it still reads from.
STORED_HISTORY=$(stored_bytes)
LATEST_JSON=$("$SNAPCTL" inspect "$HIST:latest" --json)
LATEST_DIGEST=$(jq -r .manifest <<<"$LATEST_JSON")
MANIFEST_BYTES=$(curl -s "http://127.0.0.1:$PORT/v2/bench/history/manifests/latest" -H 'Accept: application/vnd.oci.image.manifest.v1+json' | wc -c)
read -r META_BYTES PACK_LISTED <<<"$(curl -s "http://127.0.0.1:$PORT/v2/bench/history/manifests/latest" -H 'Accept: application/vnd.oci.image.manifest.v1+json' \
  | jq -r '[(.config.size + ([.layers[] | select(.mediaType | test("pack") | not) | .size] | add // 0)), ([.layers[] | select(.mediaType | test("pack")) | .size] | add // 0)] | @tsv')"
LIVE_BYTES=$(( $(jq .totals.chain_stored_bytes <<<"$LATEST_JSON") + META_BYTES + MANIFEST_BYTES ))
GC_JSON=$("$SNAPCTL" gc --storage "$W/storage" --grace 0s --json 2>"$W/gc.log") \
  || { echo "chain.sh: gc failed: $(tail -5 "$W/gc.log")" >&2; exit 2; }
STORED_AFTER_GC=$(stored_bytes)
LAYOUT_BYTES=$(find "$W/layout/blobs" -type f -printf '%s\n' | awk '{s += $1} END {print s + 0}')
"$SNAPCTL" verify "$HIST:latest" >/dev/null 2>"$W/verify.log" \
  || { echo "chain.sh: verify of latest after gc failed: $(tail -5 "$W/verify.log")" >&2; exit 2; }
log "store: $STORED_HISTORY bytes after $LAYERS pushes of latest ($LATEST_DIGEST), $STORED_AFTER_GC after gc (manifests removed $(jq .manifests_removed <<<"$GC_JSON"), swept $(jq .swept <<<"$GC_JSON") blobs); latest needs $LIVE_BYTES"

REG=127.0.0.1:$PORT/bench/chain
"$SNAPCTL" push "oci:$W/layout:l1" "$REG:d1" >/dev/null 2>&1
"$SNAPCTL" push "oci:$W/layout:l$LAYERS" "$REG:d$LAYERS" >/dev/null 2>&1
"$SNAPCTL" push "oci:$W/layout:l$DEEP" "$REG:d$DEEP" >/dev/null 2>&1
TAGS=(d1 "d$DEEP" "d$LAYERS")
NET_PID=""
if [ -n "$RTT" ]; then
  # One dialled network in front of the server for every timed command.
  "$NETEM" --upstream "127.0.0.1:$PORT" --rtt "${RTT}ms" --rate "$RATE" >"$W/net.out" 2>"$W/net.log" &
  NET_PID=$!
  PIDS+=("$NET_PID")
  for _ in $(seq 500); do [ -s "$W/net.out" ] && break; sleep 0.02; done
  NET_ADDR=$(head -1 "$W/net.out")
  case "$NET_ADDR" in 127.0.0.1:*) ;; *) echo "chain.sh: netem_proxy did not start: $(cat "$W/net.log")" >&2; exit 2 ;; esac
  REG_DIRECT=$REG
  REG=$NET_ADDR/bench/chain
fi
declare -A ANC PACKS
for tag in "${TAGS[@]}"; do
  ANC[$tag]=$("$SNAPCTL" inspect "${REG_DIRECT:-$REG}:$tag" --json | jq '.chain | length')
  PACKS[$tag]=$("$SNAPCTL" inspect "${REG_DIRECT:-$REG}:$tag" --json | jq .packs)
done

# ---------------------------------------------------------------- timed
wait_listening() { # LOGFILE: until the handler says it listens (10 s)
  for _ in $(seq 500); do grep -q "listening on" "$1" 2>/dev/null && return 0; sleep 0.02; done
  echo "chain.sh: handler did not listen: $(cat "$1")" >&2; exit 2
}
lazy_once() { # TAG MEMFILE: sets WALL
  local sock=$W/h.sock
  rm -rf "$sock" "$W/cache-lazy"
  sync; warm_memory "$WARM_BYTES"
  local t0; t0=$(now)
  "$SNAPCTL" lazy "$REG:$1" --socket "$sock" --once --json --prefetch none --cache "$W/cache-lazy" >"$W/handler.json" 2>"$W/handler.log" &
  local hp=$!
  PIDS+=("$hp")
  wait_listening "$W/handler.log"
  if ! "$FAKE_VMM" --socket "$sock" --json --timeout 600 --mem-file "$2" --touch all --threads 4 --seed 1 >"$W/vmm.json" 2>"$W/vmm.log"; then
    echo "chain.sh: fake_vmm failed: $(cat "$W/vmm.log")" >&2; exit 2
  fi
  WALL=$(since "$t0")
  wait "$hp" || { echo "chain.sh: lazy failed: $(tail -5 "$W/handler.log")" >&2; exit 2; }
  [ "$(jq .mismatches "$W/vmm.json")" = 0 ] || { echo "chain.sh: wrong bytes seen!" >&2; exit 2; }
}
declare -A T
for r in $(seq "$RUNS"); do
  for tag in "${TAGS[@]}"; do
    mem=$W/mem-l${tag#d}
    rm -rf "$W/pulled" "$W/cache-pull"
    sync; warm_memory "$WARM_BYTES"
    t0=$(now)
    "$SNAPCTL" pull "$REG:$tag" "$W/pulled" --cache "$W/cache-pull" >/dev/null 2>"$W/pull.log" \
      || { echo "chain.sh: pull of $tag failed: $(tail -5 "$W/pull.log")" >&2; exit 2; }
    T[pull,$tag]+="$(since "$t0") "
    cmp -s "$W/pulled/vm.mem" "$mem" || { echo "chain.sh: pulled $tag differs" >&2; exit 2; }
    rm -rf "$W/pulled" "$W/cache-pull"
    sync; warm_memory "$WARM_BYTES"
    t0=$(now)
    "$SNAPCTL" verify "$REG:$tag" >/dev/null 2>"$W/verify.log" \
      || { echo "chain.sh: verify of $tag failed: $(tail -5 "$W/verify.log")" >&2; exit 2; }
    T[verify,$tag]+="$(since "$t0") "
    rm -rf "$W/unpacked"
    sync; warm_memory "$WARM_BYTES"
    t0=$(now)
    "$SNAPCTL" unpack "$REG:$tag" "$W/unpacked" >/dev/null 2>"$W/unpack.log" \
      || { echo "chain.sh: unpack of $tag failed: $(tail -5 "$W/unpack.log")" >&2; exit 2; }
    T[unpack,$tag]+="$(since "$t0") "
    cmp -s "$W/unpacked/vm.mem" "$mem" || { echo "chain.sh: unpacked $tag differs" >&2; exit 2; }
    rm -rf "$W/unpacked"
    sync; warm_memory "$WARM_BYTES"
    t0=$(now)
    "$SNAPCTL" unpack "oci:$W/layout:l${tag#d}" "$W/unpacked" >/dev/null 2>"$W/unpack.log" \
      || { echo "chain.sh: local unpack of $tag failed: $(tail -5 "$W/unpack.log")" >&2; exit 2; }
    T[unpack-local,$tag]+="$(since "$t0") "
    rm -rf "$W/unpacked"
    lazy_once "$tag" "$mem"
    T[lazy,$tag]+="$WALL "
    log "run $r/$RUNS $tag: pull $(echo "${T[pull,$tag]}" | awk '{print $NF}') s, unpack $(echo "${T[unpack,$tag]}" | awk '{print $NF}') s, local $(echo "${T[unpack-local,$tag]}" | awk '{print $NF}') s, verify $(echo "${T[verify,$tag]}" | awk '{print $NF}') s, lazy $WALL s"
  done
done

NET_STATS=""
if [ -n "$NET_PID" ]; then
  kill -TERM "$NET_PID"; wait "$NET_PID" || true
  NET_STATS=$(tail -1 "$W/net.out")
fi
echo "### Run of $(date -u '+%Y-%m-%d %H:%M UTC'): $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg), $RUNS runs, medians, snapctl $(git -C "$ROOT" rev-parse --short HEAD)$(git -C "$ROOT" diff --quiet HEAD -- . 2>/dev/null || echo '+changes')"
echo
echo "\`bash bench/chain.sh ${ARGV[*]}\` (runs $RUNS, size $SIZE, layers $LAYERS): a $SIZE sample (no holes, half text), $LAYERS layers of one changed 1 MiB block each,"
echo "packed with \`--parent\` (default \`--max-chain 64\`)${PACK_ARGS:+ and \`$PACK_ARGS\`}: rebased at layers ${REBASES[*]:-none}; compacted at ${#COMPACTIONS[@]} layers (${COMPACTIONS[*]:-none})."
echo "Pack bytes written over the $LAYERS layers: $PACK_BYTES, of which compaction: $COMPACTED_BYTES. Ancestors (packs used):"
echo "layer 1: ${ANC[d1]} (${PACKS[d1]}); layer $DEEP, the deepest: ${ANC[d$DEEP]} (${PACKS[d$DEEP]}); layer $LAYERS: ${ANC[d$LAYERS]} (${PACKS[d$LAYERS]})."
if [ -n "$RTT" ]; then
  echo "All pushed to \`snapctl serve\`; every timed command through netem_proxy at RTT $RTT ms, cap $RATE (proxy totals: $NET_STATS); fresh chunk cache for every pull and lazy restore."
else
  echo "All pushed to \`snapctl serve\` on loopback; fresh chunk cache for every pull and lazy restore."
fi
echo
mib() { python3 -c "print(f'{$1 / 1048576:.1f} MiB')"; }
echo "Store (\`snapctl serve\`, every layer pushed as \`bench/history:latest\` as it was packed): $(mib "$STORED_HISTORY") after $LAYERS pushes;"
echo "after \`snapctl gc --grace 0s\` (default retention: untagged manifests go) $(mib "$STORED_AFTER_GC") ($(jq .manifests_removed <<<"$GC_JSON") manifests removed, $(jq .swept <<<"$GC_JSON") blobs swept)."
echo "The newest image needs $(mib "$LIVE_BYTES") (its stored chunks $(mib "$(jq .totals.chain_stored_bytes <<<"$LATEST_JSON")") + metadata $(mib $((META_BYTES + MANIFEST_BYTES)))); the packs it lists hold $(mib "$PACK_LISTED"):"
echo "after gc the store is $(ratio "$STORED_AFTER_GC" "$LIVE_BYTES")x what it needs, before gc $(ratio "$STORED_HISTORY" "$LIVE_BYTES")x. The local layout holds $(mib "$LAYOUT_BYTES") (no gc there)."
echo
echo "| command | layer 1 (s) | layer $DEEP (s) | ratio | layer $LAYERS (s) | ratio | runs: layer 1 / $DEEP / $LAYERS (s) |"
echo "|---|---|---|---|---|---|---|"
WORST=0
for what in pull unpack unpack-local verify lazy; do
  # shellcheck disable=SC2086
  a=$(median ${T[$what,d1]}); b=$(median ${T[$what,d$DEEP]}); c=$(median ${T[$what,d$LAYERS]})
  qb=$(ratio "$b" "$a"); qc=$(ratio "$c" "$a")
  WORST=$(python3 -c "print(max($WORST, $qb, $qc))")
  echo "| $what | $a | $b | **${qb}x** | $c | **${qc}x** | ${T[$what,d1]}/ ${T[$what,d$DEEP]}/ ${T[$what,d$LAYERS]}|"
done
echo
echo "Worst ratio: **${WORST}x** (goal: within 1.5x of layer 1)."

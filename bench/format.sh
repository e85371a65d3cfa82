#!/usr/bin/env bash
# The format benchmark of issue 2: snapctl pack / verify / unpack against casync, b3sum
# and cp on a generated Firecracker-style memory image, stored bytes against non-zero
# bytes, the chunk-size sweep, and the cost of incremental layers.
#
#   bash bench/format.sh            2 GiB image; 5 warm runs, 3 cold (casync: 3 and 3);
#                                   chunk-size sweeps 3 runs, the zstd one on a 512 MiB
#                                   text-like image (zstd over 2 GiB x 5 sizes x 4 runs
#                                   would take most of an hour on 2 cores)
#   bash bench/format.sh --quick    256 MiB image, 1 run: a smoke test, not a result
#
# Options: --runs N  --cold-runs N  --casync-runs N  --size SIZE  --text-size SIZE
#          --no-cold  --keep
#          --only pack,verify,unpack,stored,chunks,text,layers
#          --tsv FILE (append every timed run there too)
#
# Output: markdown on stdout (paste into BENCHMARKS.md), progress on stderr. Needs only
# what scripts/setup.sh installs (b3sum, casync, hyperfine is not used, jq) and root
# for the cold-cache runs (`echo 3 > /proc/sys/vm/drop_caches`; skipped, and said so,
# when that is not permitted). Everything is written under one temporary directory in
# ${TMPDIR:-/tmp}, removed on exit unless --keep.
#
# Timing: wall clock from `date +%s%N` around `/usr/bin/time` (which gives user/sys CPU
# and max RSS). Runs are interleaved (round 1 of every command, then round 2, ...), so
# a burst of load from other processes hits every command of a table alike rather than
# all runs of one. Before every timed run: outputs removed, `sync` (so write-back of
# the previous run is not billed to the next), and for cold runs the page cache dropped.
set -euo pipefail
trap 'echo "format.sh: line $LINENO failed: $BASH_COMMAND" >&2' ERR

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
QUICK=0 RUNS=5 COLD_RUNS=3 CASYNC_RUNS=3 SIZE=2GiB TEXT_SIZE=512MiB LAYER_SIZE=1GiB COLD=1 KEEP=0 TSV_COPY="" ONLY="pack,verify,unpack,stored,chunks,text,layers"
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) QUICK=1; RUNS=1; COLD_RUNS=1; CASYNC_RUNS=1; SIZE=256MiB; TEXT_SIZE=128MiB; LAYER_SIZE=256MiB ;;
    --runs) RUNS=$2; shift ;;
    --cold-runs) COLD_RUNS=$2; shift ;;
    --text-size) TEXT_SIZE=$2; shift ;;
    --casync-runs) CASYNC_RUNS=$2; shift ;;
    --size) SIZE=$2; shift ;;
    --no-cold) COLD=0 ;;
    --keep) KEEP=1 ;;
    --only) ONLY=$2; shift ;;
    --tsv) TSV_COPY=$2; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "format.sh: unknown option $1 (try --help)" >&2; exit 2 ;;
  esac
  shift
done
want() { [[ ",$ONLY," == *",$1,"* ]]; }
say() { echo "[$(date -u +%H:%M:%S)] $*" >&2; }

for t in b3sum casync jq sha256sum /usr/bin/time; do
  command -v "$t" >/dev/null || { echo "format.sh: $t missing: run 'bash scripts/setup.sh' first" >&2; exit 2; }
done

# ---------------------------------------------------------------- build
say "building snapctl and snapctl-bench (release)"
# Two invocations: built together, feature unification would give snapctl a different
# (and freshly compiled) dependency graph than `cargo build --release -p snapctl`.
(cd "$ROOT" && cargo build --release -q -p snapctl --target-dir "$ROOT/target" && cargo build --release -q -p snapctl-bench --target-dir "$ROOT/target")
SNAPCTL=$ROOT/target/release/snapctl
HELPER=$ROOT/target/release/snapctl-bench

W=$(mktemp -d "${TMPDIR:-/tmp}/snapctl-bench.XXXXXX")
cleanup() { if [ "$KEEP" = 1 ]; then echo "kept $W" >&2; else rm -rf "$W"; fi; }
trap cleanup EXIT
trap 'exit 130' INT TERM
TSV=$W/timings.tsv
: >"$TSV"

if [ "$COLD" = 1 ]; then
  if ! (sync && echo 3 >/proc/sys/vm/drop_caches) 2>/dev/null; then
    COLD=0; COLD_NOTE="cold-cache runs skipped: writing /proc/sys/vm/drop_caches is not permitted here"
  else
    COLD_NOTE="cold = \`sync; echo 3 > /proc/sys/vm/drop_caches\` before every run"
  fi
else
  COLD_NOTE="cold-cache runs skipped (--no-cold)"
fi
drop_caches() { sync; echo 3 >/proc/sys/vm/drop_caches; }

# ---------------------------------------------------------------- machine
echo "## Machine and run"
echo
echo "- date: $(date -u +'%Y-%m-%d %H:%M UTC'), commit $(cd "$ROOT" && git rev-parse --short HEAD)$(cd "$ROOT" && git diff --quiet HEAD -- . 2>/dev/null || echo ' (+ uncommitted changes)')"
echo "- CPU: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), flags: $(grep -m1 -o -w -e sha_ni -e avx2 -e avx512f /proc/cpuinfo | sort -u | tr '\n' ' ' || true)"
echo "- memory: $(free -h | awk '/^Mem:/ {print $2 " total, " $7 " available"}')"
echo "- kernel: $(uname -r)"
dev=$(df --output=source "$W" | tail -1); fstype=$(df --output=fstype "$W" | tail -1)
blk=$(basename "$dev"); rot=$(cat "/sys/block/$blk/queue/rotational" 2>/dev/null || echo "?")
echo "- scratch dir: $W on $dev ($fstype), rotational=$rot"
echo "- tools: $("$SNAPCTL" --version), $(b3sum --version), casync $(casync --version 2>&1 | head -1), $(cp --version | head -1)"
echo "- image: $SIZE vm.mem, half the 1 MiB blocks zero; runs: $RUNS warm, $COLD_RUNS cold (casync $CASYNC_RUNS each), chunk-size sweeps $((RUNS < 3 ? RUNS : 3)) warm$( [ "$QUICK" = 1 ] && echo ' — QUICK MODE, smoke test only')"
echo "- page cache: warm = every command run once untimed first; $COLD_NOTE"
echo "- load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
echo

# ---------------------------------------------------------------- timing
# A table is a list of cases; each case: table name, row, peer row, prep (untimed,
# bash), command (timed, bash), how many runs at most (default: all), and whether the
# warm-cache pass starts with an untimed run of it (default yes; casync's minute-long
# untimed run would only re-read a source the other commands already brought in).
C_TABLE=() C_ROW=() C_PEER=() C_PREP=() C_CMD=() C_MAX=() C_WARMUP=()
cases_reset() { C_TABLE=() C_ROW=() C_PEER=() C_PREP=() C_CMD=() C_MAX=() C_WARMUP=(); }
case_add() { C_TABLE+=("$1"); C_ROW+=("$2"); C_PEER+=("$3"); C_PREP+=("$4"); C_CMD+=("$5"); C_MAX+=("${6:-999}"); C_WARMUP+=("${7:-yes}"); }

# time_one TABLE CACHE ROW PEER RUN CMD: one timed run, appended to $TSV.
time_one() {
  local t0 t1
  t0=$(date +%s%N)
  if ! /usr/bin/time -f '%U	%S	%M' -o "$W/time.out" bash -c "$6" >"$W/cmd.out" 2>"$W/cmd.err"; then
    echo "format.sh: failed: $6" >&2; cat "$W/cmd.err" >&2; exit 1
  fi
  t1=$(date +%s%N)
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" \
    "$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.4f", (b - a) / 1e9 }')" "$(tail -1 "$W/time.out")" >>"$TSV"
}

# run_cases CACHE RUNS: warm = one untimed run of each case first; cold = drop the page
# cache before every run.
run_cases() {
  local cache=$1 runs=$2 r i
  if [ "$cache" = warm ]; then
    for i in "${!C_ROW[@]}"; do
      [ "${C_WARMUP[$i]}" = yes ] || continue
      bash -c "${C_PREP[$i]}"; bash -c "${C_CMD[$i]}" >/dev/null 2>&1
    done
  fi
  for r in $(seq 1 "$runs"); do
    say "  $cache round $r/$runs: ${C_TABLE[0]}"
    for i in "${!C_ROW[@]}"; do
      [ "$r" -le "${C_MAX[$i]}" ] || continue
      bash -c "${C_PREP[$i]}"
      if [ "$cache" = cold ]; then drop_caches; else sync; fi
      time_one "${C_TABLE[$i]}" "$cache" "${C_ROW[$i]}" "${C_PEER[$i]}" "$r" "${C_CMD[$i]}"
    done
  done
}
median() { # TABLE CACHE ROW -> median wall seconds of what is in $TSV
  awk -F'\t' -v t="$1" -v c="$2" -v r="$3" '$1 == t && $2 == c && $3 == r { print $6 }' "$TSV" | sort -g |
    awk '{ v[NR] = $1 } END { if (NR == 0) print "nan"; else if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}
GOALS=()
# goal NAME VALUE OP LIMIT UNIT: record whether VALUE OP LIMIT holds.
goal() {
  local ok
  ok=$(awk -v v="$2" -v l="$4" -v op="$3" 'BEGIN { print ((op == "<=" ? v <= l : v >= l) ? "met" : "NOT met") }')
  GOALS+=("| $1 | $(awk -v v="$2" 'BEGIN { printf (v >= 1000 ? "%.0f" : "%.3g"), v }')$5 | $3 $4$5 | $ok |")
}
# index_bytes LAYOUT: size of the chunk index blob of the layout's (only) image.
index_bytes() {
  local m
  m=$(jq -r '.manifests[0].digest' "$1/index.json" | cut -d: -f2)
  jq '[.layers[] | select(.mediaType == "application/vnd.snapctl.snapshot.index.v1")][0].size' "$1/blobs/sha256/$m"
}
bytes_in_layout() { find "$1" -type f ! -name '.snapctl.lock' -printf '%s\n' | awk '{ s += $1 } END { print s + 0 }'; }
alloc() { du -B1 -s "$1" | cut -f1; }
mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }

# ---------------------------------------------------------------- inputs
SRC=$W/src/sparse DENSE=$W/src/dense TEXT=$W/src/text O=$W/out
mkdir -p "$W/src" "$O"
say "generating $SIZE sample (half zero blocks, random data)"
"$SNAPCTL" sample "$SRC" --size "$SIZE" --zero-fraction 0.5 --text-fraction 0 2>/dev/null
mkdir -p "$DENSE"
cp --sparse=never "$SRC/vm.mem" "$SRC/vm.state" "$DENSE/"
NONZERO=$("$HELPER" nonzero "$SRC/vm.mem" "$SRC/vm.state")
LOGICAL=$(($(stat -c %s "$SRC/vm.mem") + $(stat -c %s "$SRC/vm.state")))
"$SNAPCTL" pack "$SRC" "oci:$W/probe:p" >/dev/null 2>&1
read -r Z_CHUNKS D_CHUNKS < <("$SNAPCTL" inspect "oci:$W/probe:p" --json | jq -r '.files[] | select(.name == "vm.mem") | "\(.zero) \(.stored)"')
rm -rf "$W/probe"
echo "## Input"
echo
echo "\`snapctl sample DIR --size $SIZE --zero-fraction 0.5 --text-fraction 0\`: vm.mem of $(mib "$LOGICAL") MiB with"
echo "$Z_CHUNKS zero and $D_CHUNKS random 1 MiB chunks (per \`snapctl inspect\`), $(mib "$NONZERO") MiB non-zero"
echo "(counted independently, in 4 KiB pages, by \`snapctl-bench nonzero\`), plus a 24 KiB vm.state."
echo "Allocated on disk: sparse copy $(mib "$(alloc "$SRC")") MiB; dense copy (\`cp --sparse=never\`, zero blocks"
echo "written as real zeros) $(mib "$(alloc "$DENSE")") MiB."
echo

CASYNC_NOTE="casync defaults: chunk size min 16 KiB / avg 64 KiB / max 256 KiB (content-defined), digest sha512-256, chunks zstd-compressed into one file each under the store; \`.caidx\` directory archive with default feature flags."

# ---------------------------------------------------------------- pack
if want pack; then
  say "pack vs casync make vs cp"
  cases_reset
  T="pack $SIZE image"
  case_add "$T" "snapctl pack (sparse src)" "casync make" "rm -rf $O/pk" "$SNAPCTL pack $SRC oci:$O/pk:t"
  case_add "$T" "snapctl pack (dense src)" "casync make" "rm -rf $O/pk" "$SNAPCTL pack $DENSE oci:$O/pk:t"
  case_add "$T" "casync make" "casync make" "rm -rf $O/ca; mkdir -p $O/ca" "casync make --store=$O/ca/store $O/ca/img.caidx $SRC" "$CASYNC_RUNS" no
  case_add "$T" "cp -r (sparse src)" "snapctl pack (sparse src)" "rm -rf $O/cp" "cp -r $SRC $O/cp"
  case_add "$T" "cp -r (dense src)" "snapctl pack (dense src)" "rm -rf $O/cp" "cp -r $DENSE $O/cp"
  case_add "$T" "cp -r + fsync (sparse src)" "snapctl pack (sparse src)" "rm -rf $O/cp" "cp -r $SRC $O/cp && sync $O/cp/vm.mem $O/cp/vm.state"
  run_cases warm "$RUNS"
  CA_STORE=$(du -sb "$O/ca" | cut -f1)
  if [ "$COLD" = 1 ]; then run_cases cold "$COLD_RUNS"; fi
  rm -rf "$O/pk" "$O/ca" "$O/cp"
  echo "## pack"
  echo
  echo "$CASYNC_NOTE casync store + index after one run: $(mib "$CA_STORE") MiB. snapctl pack fsyncs every blob it writes; plain cp does not."
  echo
  for c in warm cold; do
    [ "$c" = warm ] || [ "$COLD" = 1 ] || continue
    p=$(median "$T" "$c" "snapctl pack (sparse src)"); d=$(median "$T" "$c" "snapctl pack (dense src)"); k=$(median "$T" "$c" "casync make")
    goal "pack ≥10× faster than casync ($c, sparse src): casync ÷ pack" "$(awk -v a="$k" -v b="$p" 'BEGIN { print a / b }')" ">=" 10 "×"
    goal "pack ≥10× faster than casync ($c, dense src): casync ÷ pack" "$(awk -v a="$k" -v b="$d" 'BEGIN { print a / b }')" ">=" 10 "×"
  done
fi

# The image every later section reads.
"$SNAPCTL" pack "$SRC" "oci:$O/img:t" >/dev/null 2>&1
IMG="oci:$O/img:t"
PACKS=$(find "$O/img/blobs/sha256" -type f -size +1M | tr '\n' ' ')

# ---------------------------------------------------------------- verify
if want verify; then
  say "verify vs b3sum"
  cases_reset
  T="verify $SIZE image"
  case_add "$T" "snapctl verify" "b3sum vm.mem (sparse)" ":" "$SNAPCTL verify $IMG"
  case_add "$T" "snapctl verify --blob-digests" "b3sum vm.mem (sparse)" ":" "$SNAPCTL verify $IMG --blob-digests"
  case_add "$T" "b3sum vm.mem (sparse)" "-" ":" "b3sum $SRC/vm.mem"
  case_add "$T" "b3sum vm.mem (dense)" "b3sum vm.mem (sparse)" ":" "b3sum $DENSE/vm.mem"
  case_add "$T" "b3sum pack blobs" "b3sum vm.mem (sparse)" ":" "b3sum $PACKS"
  case_add "$T" "sha256sum pack blobs" "b3sum vm.mem (sparse)" ":" "sha256sum $PACKS"
  run_cases warm "$RUNS"
  if [ "$COLD" = 1 ]; then run_cases cold "$COLD_RUNS"; fi
  for c in warm cold; do
    [ "$c" = warm ] || [ "$COLD" = 1 ] || continue
    v=$(median "$T" "$c" "snapctl verify"); b=$(median "$T" "$c" "b3sum vm.mem (sparse)")
    goal "verify within 1.3× of b3sum vm.mem ($c): verify ÷ b3sum" "$(awk -v a="$v" -v b="$b" 'BEGIN { print a / b }')" "<=" 1.3 "×"
  done
fi

# ---------------------------------------------------------------- unpack
if want unpack; then
  say "unpack vs cp"
  cases_reset
  T="unpack $SIZE image"
  case_add "$T" "snapctl unpack" "cp -r + fsync (sparse src)" "rm -rf $O/un" "$SNAPCTL unpack $IMG $O/un"
  case_add "$T" "cp -r (sparse src)" "-" "rm -rf $O/un" "cp -r $SRC $O/un"
  case_add "$T" "cp -r + fsync (sparse src)" "cp -r (sparse src)" "rm -rf $O/un" "cp -r $SRC $O/un && sync $O/un/vm.mem $O/un/vm.state"
  case_add "$T" "cp -r --sparse=always (dense src)" "cp -r (sparse src)" "rm -rf $O/un" "cp -r --sparse=always $DENSE $O/un"
  case_add "$T" "cp -r --sparse=always + fsync (dense src)" "cp -r (sparse src)" "rm -rf $O/un" "cp -r --sparse=always $DENSE $O/un && sync $O/un/vm.mem $O/un/vm.state"
  run_cases warm "$RUNS"
  if [ "$COLD" = 1 ]; then run_cases cold "$COLD_RUNS"; fi
  echo "## unpack: allocation of the result (du)"
  echo
  echo "| command | allocated MiB | apparent MiB |"
  echo "|---|---:|---:|"
  for i in "${!C_ROW[@]}"; do
    rm -rf "$O/un"; bash -c "${C_CMD[$i]}" >/dev/null 2>&1
    echo "| ${C_ROW[$i]} | $(mib "$(alloc "$O/un")") | $(mib "$(du -sb "$O/un" | cut -f1)") |"
  done
  echo
  "$SNAPCTL" verify "$IMG" --against "$O/un" >/dev/null 2>&1 && say "  (unpacked tree verified --against the image)"
  rm -rf "$O/un"; "$SNAPCTL" unpack "$IMG" "$O/un" >/dev/null 2>&1
  cmp "$SRC/vm.mem" "$O/un/vm.mem" && cmp "$SRC/vm.state" "$O/un/vm.state" || { echo "format.sh: unpack is not byte-identical" >&2; exit 1; }
  UN_ALLOC=$(alloc "$O/un"); rm -rf "$O/un"
  for c in warm cold; do
    [ "$c" = warm ] || [ "$COLD" = 1 ] || continue
    u=$(median "$T" "$c" "snapctl unpack"); p=$(median "$T" "$c" "cp -r + fsync (sparse src)"); q=$(median "$T" "$c" "cp -r (sparse src)")
    goal "unpack within 2× of cp + fsync ($c): unpack ÷ cp" "$(awk -v a="$u" -v b="$p" 'BEGIN { print a / b }')" "<=" 2 "×"
    goal "unpack within 2× of plain cp, no fsync ($c): unpack ÷ cp" "$(awk -v a="$u" -v b="$q" 'BEGIN { print a / b }')" "<=" 2 "×"
  done
  goal "unpack result sparse: allocated ÷ non-zero bytes" "$(awk -v a="$UN_ALLOC" -v b="$NONZERO" 'BEGIN { print a / b }')" "<=" 1.01 "×"
fi

# ---------------------------------------------------------------- stored bytes
if want stored; then
  say "stored bytes"
  read -r PB MB < <("$SNAPCTL" inspect "$IMG" --json | jq -r '"\(.own_pack_bytes) \(.metadata_bytes)"')
  LAYOUT=$(bytes_in_layout "$O/img")
  echo "## Stored bytes"
  echo
  echo "| quantity | bytes | MiB |"
  echo "|---|---:|---:|"
  echo "| logical size (vm.mem + vm.state) | $LOGICAL | $(mib "$LOGICAL") |"
  echo "| non-zero bytes (4 KiB pages with any non-zero byte) | $NONZERO | $(mib "$NONZERO") |"
  echo "| pack blobs | $PB | $(mib "$PB") |"
  echo "| manifest + config + index | $MB | $(mib "$MB") |"
  echo "| every file of the OCI layout (+ index.json, oci-layout) | $LAYOUT | $(mib "$LAYOUT") |"
  echo "| overhead: layout ÷ non-zero − 1 | $(awk -v a="$LAYOUT" -v b="$NONZERO" 'BEGIN { printf "%.4f%%", (a / b - 1) * 100 }') | |"
  echo
  goal "stored bytes ≤1% over non-zero: layout ÷ non-zero − 1" "$(awk -v a="$LAYOUT" -v b="$NONZERO" 'BEGIN { print (a / b - 1) * 100 }')" "<=" 1 "%"
fi

# ---------------------------------------------------------------- chunk size
SIZES=(64KiB 256KiB 1MiB 4MiB 16MiB)
sweep() { # NAME DIR PACK_FLAGS NONZERO_BYTES LOGICAL_BYTES
  local name=$1 dir=$2 flags=$3 cs
  cases_reset
  for cs in "${SIZES[@]}"; do
    case_add "$name: pack" "$cs" "1MiB" "rm -rf $O/sw-$cs" "$SNAPCTL pack $dir oci:$O/sw-$cs:t --chunk-size $cs $flags"
    case_add "$name: verify" "$cs" "1MiB" "rm -rf $O/un" "$SNAPCTL verify oci:$O/sw-$cs:t"
    case_add "$name: unpack" "$cs" "1MiB" "rm -rf $O/un" "$SNAPCTL unpack oci:$O/sw-$cs:t $O/un"
  done
  run_cases warm "$SWEEP_RUNS"
  echo "## Chunk size: $name — sizes (\`--chunk-size\`, flags: ${flags:-none})"
  echo
  echo "| chunk | chunks | zero | stored | index bytes | index B/chunk | manifest+config+index | pack bytes | layout ÷ non-zero | layout ÷ logical |"
  echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
  for cs in "${SIZES[@]}"; do
    local j ix lay
    j=$("$SNAPCTL" inspect "oci:$O/sw-$cs:t" --json)
    ix=$(index_bytes "$O/sw-$cs")
    lay=$(bytes_in_layout "$O/sw-$cs")
    echo "| $cs | $(jq '.totals.chunks' <<<"$j") | $(jq '.totals.zero_chunks' <<<"$j") | $(jq '.totals.stored_chunks' <<<"$j") | $ix | $(awk -v a="$ix" -v n="$(jq '.totals.chunks' <<<"$j")" 'BEGIN { printf "%.1f", a / n }') | $(jq '.metadata_bytes' <<<"$j") | $(jq '.own_pack_bytes' <<<"$j") | $(awk -v a="$lay" -v b="$4" 'BEGIN { printf "%.4f", a / b }') | $(awk -v a="$lay" -v b="$5" 'BEGIN { printf "%.4f", a / b }') |"
  done
  echo
  rm -rf "$O"/sw-* "$O/un"
}
SWEEP_RUNS=$((RUNS < 3 ? RUNS : 3))
if want chunks; then
  say "chunk-size sweep (random image)"
  sweep "random image, $SIZE" "$SRC" "" "$NONZERO" "$LOGICAL"
fi
if want text; then
  say "generating $TEXT_SIZE text-like sample"
  "$SNAPCTL" sample "$TEXT" --size "$TEXT_SIZE" --zero-fraction 0.5 --text-fraction 1 2>/dev/null
  TEXT_NONZERO=$("$HELPER" nonzero "$TEXT/vm.mem" "$TEXT/vm.state")
  say "chunk-size sweep (text image, zstd)"
  TEXT_LOGICAL=$(($(stat -c %s "$TEXT/vm.mem") + $(stat -c %s "$TEXT/vm.state")))
  sweep "text image, $TEXT_SIZE, zstd" "$TEXT" "--compress zstd" "$TEXT_NONZERO" "$TEXT_LOGICAL"
  cases_reset
  T="text image, $TEXT_SIZE, 1MiB chunks: compression"
  for z in none zstd zstd:1 zstd:9 flate; do
    case_add "$T: pack" "$z" "none" "rm -rf $O/tx-$z" "$SNAPCTL pack $TEXT oci:$O/tx-$z:t --compress $z"
    case_add "$T: unpack" "$z" "none" "rm -rf $O/un" "$SNAPCTL unpack oci:$O/tx-$z:t $O/un"
  done
  run_cases warm "$SWEEP_RUNS"
  echo "## Compression of the $TEXT_SIZE text-like image (1 MiB chunks, $(mib "$TEXT_NONZERO") MiB non-zero)"
  echo
  echo "| --compress | pack bytes | ratio non-zero ÷ packs |"
  echo "|---|---:|---:|"
  for z in none zstd zstd:1 zstd:9 flate; do
    pb=$("$SNAPCTL" inspect "oci:$O/tx-$z:t" --json | jq '.own_pack_bytes')
    echo "| $z | $pb | $(awk -v a="$TEXT_NONZERO" -v b="$pb" 'BEGIN { printf "%.2f", a / b }') |"
  done
  echo
  rm -rf "$O"/tx-* "$O/un" "$TEXT"
fi

# ---------------------------------------------------------------- layers
if want layers; then
  say "layers"
  L=$W/layers; LB=$L/base; LC=$L/child
  "$SNAPCTL" sample "$LB" --size "$LAYER_SIZE" --zero-fraction 0.5 --text-fraction 0 --seed 7 2>/dev/null
  base_j=$("$SNAPCTL" pack "$LB" "oci:$L/img:base" --json)
  clone_j=$("$SNAPCTL" pack "$LB" "oci:$L/img:clone" --parent "oci:$L/img:base" --json)
  cp -r "$LB" "$LC"
  "$SNAPCTL" sample "$LC" --mutate 10 --seed 7 2>/dev/null
  child_j=$("$SNAPCTL" pack "$LC" "oci:$L/img:child" --parent "oci:$L/img:base" --json)
  # diff exits 1 when the images differ, which they do.
  K=$({ "$SNAPCTL" diff "oci:$L/img:base" "oci:$L/img:child" --json || true; } | jq '[.files[].changed_chunks] | add')
  "$SNAPCTL" verify "oci:$L/img:child" >/dev/null 2>&1 || { echo "format.sh: layer does not verify" >&2; exit 1; }
  new() { jq '.pack_bytes + .metadata_bytes' <<<"$1"; }
  row() { echo "| $1 | $(jq .stored_chunks <<<"$2") | $(jq .inherited_chunks <<<"$2") | $(jq .pack_bytes <<<"$2") | $(jq .metadata_bytes <<<"$2") | $(new "$2") | $3 | $(jq '.seconds * 1000 | round / 1000' <<<"$2") |"; }
  CS=1048576
  echo "## Layers ($LAYER_SIZE image, $(mib "$("$HELPER" nonzero "$LB/vm.mem")") MiB non-zero, 1 MiB chunks)"
  echo
  echo "| image | stored chunks | inherited chunks | pack bytes | manifest+config+index | new bytes | limit | pack s |"
  echo "|---|---:|---:|---:|---:|---:|---:|---:|"
  row "base (full image)" "$base_j" "—"
  row "unchanged clone, --parent base" "$clone_j" "16384"
  row "k=$K changed chunks (\`sample --mutate 10\`), --parent base" "$child_j" "$((K * CS + 65536))"
  echo
  goal "unchanged clone ≤16 KiB new bytes" "$(new "$clone_j")" "<=" 16384 " B"
  goal "k=$K changed chunks ≤ k chunks + 64 KiB" "$(new "$child_j")" "<=" "$((K * CS + 65536))" " B"
  rm -rf "$L"
fi

# ---------------------------------------------------------------- summary
echo "## Timings (medians; ratio = this row's median ÷ the peer row's median)"
echo
"$HELPER" summary "$TSV"
if [ ${#GOALS[@]} -gt 0 ]; then
  echo "## Goals"
  echo
  echo "| goal | measured (median) | limit | |"
  echo "|---|---:|---:|---|"
  printf '%s\n' "${GOALS[@]}"
  echo
fi
echo "- load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
[ -n "$TSV_COPY" ] && cat "$TSV" >>"$TSV_COPY"
say "done"

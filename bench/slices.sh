#!/usr/bin/env bash
# What the outboard (issue 16 §2: slice CVs of raw chunks) costs `snapctl pack`: pack with
# 4 KiB slices (the default), 8 KiB slices and none, beside `b3sum` of the same memory
# file, in one run, on the format benchmark's image (a generated vm.mem, half its 1 MiB
# blocks zero, the rest random).
#
#   bash bench/slices.sh                 2 GiB image, 7 warm runs of each
#   bash bench/slices.sh --runs 3 --size 512MiB
#   bash bench/slices.sh --baseline PATH another snapctl binary packed as one more row
#                                        (e.g. a build of the commit before outboards)
#   bash bench/slices.sh --out DIR       write packs under DIR (default: the scratch dir;
#                                        /dev/shm takes the disk out of the wall time)
#
# Method, as bench/format.sh: runs interleaved (round 1 of every command, then round 2, …),
# outputs removed and `sync` before every timed run, one untimed run of each first (warm
# page cache). Wall time from `date +%s%N`, CPU time (user + sys) from /usr/bin/time;
# medians. On a machine shared with other work, wall times swing with its load; CPU time
# is what the outboard adds. Prints markdown on stdout, progress on stderr.
set -euo pipefail
trap 'echo "slices.sh: line $LINENO failed: $BASH_COMMAND" >&2' ERR

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
RUNS=7 SIZE=2GiB BASELINE="" OUT=""
while [ $# -gt 0 ]; do
  case "$1" in
    --runs) RUNS=$2; shift ;;
    --size) SIZE=$2; shift ;;
    --baseline) BASELINE=$2; shift ;;
    --out) OUT=$2; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "slices.sh: unknown option $1 (try --help)" >&2; exit 2 ;;
  esac
  shift
done
for t in b3sum jq /usr/bin/time; do
  command -v "$t" >/dev/null || { echo "slices.sh: $t missing: run 'bash scripts/setup.sh' first" >&2; exit 2; }
done
say() { echo "[$(date -u +%H:%M:%S)] $*" >&2; }

say "building snapctl (release)"
(cd "$ROOT" && cargo build --release -q -p snapctl --target-dir "$ROOT/target")
SNAPCTL=$ROOT/target/release/snapctl
W=$(mktemp -d "${TMPDIR:-/tmp}/snapctl-slices.XXXXXX")
O=${OUT:-$W}/out.$$
trap 'rm -rf "$W" "$O"' EXIT
trap 'exit 130' INT TERM
SRC=$W/src
say "generating $SIZE sample (half zero blocks, random data)"
"$SNAPCTL" sample "$SRC" --size "$SIZE" --zero-fraction 0.5 --text-fraction 0 2>/dev/null

NAMES=("snapctl pack (4 KiB slices, default)" "snapctl pack --slice-size 8KiB" "snapctl pack --slice-size none" "b3sum vm.mem")
CMDS=("$SNAPCTL pack $SRC oci:$O:t" "$SNAPCTL pack $SRC oci:$O:t --slice-size 8KiB" "$SNAPCTL pack $SRC oci:$O:t --slice-size none" "b3sum $SRC/vm.mem")
if [ -n "$BASELINE" ]; then
  NAMES+=("baseline pack ($(basename "$BASELINE"))")
  CMDS+=("$BASELINE pack $SRC oci:$O:t")
fi
TSV=$W/t.tsv
: >"$TSV"
for i in "${!CMDS[@]}"; do rm -rf "$O"; bash -c "${CMDS[$i]}" >/dev/null 2>&1; done
for r in $(seq 1 "$RUNS"); do
  say "round $r/$RUNS (load $(cut -d' ' -f1 /proc/loadavg))"
  for i in "${!CMDS[@]}"; do
    rm -rf "$O"; sync
    t0=$(date +%s%N)
    /usr/bin/time -f '%U %S' -o "$W/time.out" bash -c "${CMDS[$i]}" >/dev/null 2>"$W/err" || { cat "$W/err" >&2; exit 1; }
    t1=$(date +%s%N)
    printf '%s\t%s\t%s\n' "${NAMES[$i]}" "$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.4f", (b - a) / 1e9 }')" "$(awk '{ print $1 + $2 }' "$W/time.out")" >>"$TSV"
  done
done
median() { # NAME COLUMN
  awk -F'\t' -v n="$1" -v c="$2" '$1 == n { print $c }' "$TSV" | sort -g |
    awk '{ v[NR] = $1 } END { if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}
range() { awk -F'\t' -v n="$1" -v c="$2" '$1 == n { print $c }' "$TSV" | sort -g | sed -n '1p;$p' | paste -sd'–'; }
rm -rf "$O"
J=$("$SNAPCTL" pack "$SRC" "oci:$O:t" --json)
NONE_W=$(median "${NAMES[2]}" 2) NONE_C=$(median "${NAMES[2]}" 3) B3_W=$(median "${NAMES[3]}" 2)

echo "## pack with and without an outboard, $SIZE image"
echo
echo "- date: $(date -u +'%Y-%m-%d %H:%M UTC'), commit $(cd "$ROOT" && git rev-parse --short HEAD)$(cd "$ROOT" && git diff --quiet HEAD -- . 2>/dev/null || echo ' (+ uncommitted changes)'); $(nproc) cores; load average at end $(cut -d' ' -f1-3 /proc/loadavg)"
echo "- image: $(jq .logical_bytes <<<"$J") bytes, $(jq .pack_bytes <<<"$J") in packs; outboard at 4 KiB: $(jq .outboard_bytes <<<"$J") bytes for $(jq .outboard_entries <<<"$J") chunks ($(jq -n --argjson j "$J" '$j.outboard_bytes / $j.pack_bytes * 10000 | round / 100') % of the packs)"
echo "- packs written to ${OUT:-the scratch dir} ($(df --output=fstype "${OUT:-$W}" | tail -1)); $RUNS warm runs each, interleaved"
echo
echo "| command | wall median s (min–max) | CPU median s (min–max) | wall ÷ no outboard | CPU ÷ no outboard | wall ÷ b3sum |"
echo "| --- | ---: | ---: | ---: | ---: | ---: |"
for n in "${NAMES[@]}"; do
  w=$(median "$n" 2) c=$(median "$n" 3)
  echo "| $n | $w ($(range "$n" 2)) | $c ($(range "$n" 3)) | $(awk -v a="$w" -v b="$NONE_W" 'BEGIN { printf "%.2f", a / b }') | $(awk -v a="$c" -v b="$NONE_C" 'BEGIN { printf "%.2f", a / b }') | $(awk -v a="$w" -v b="$B3_W" 'BEGIN { printf "%.2f", a / b }') |"
done

#!/usr/bin/env bash
# A fleet of gVisor clones on one base (issue 22 §5): what each clone costs the store.
#
#   bash bench/fleet.sh [--clones 8] [--ticks 10] [--heap-mib 8] [--runsc /opt/snapctl-runsc/runsc]
#                       [--out DIR] [--flags "--base-delta off"]...
#
# One sandbox (tests/runtimes/counter.c: --heap-mib MiB of random heap, default 8 (a 9 MB
# checkpoint; 48 makes the 51 MB checkpoint of issue 22's table), a counter every 100 ms)
# runs under trixie's runsc 2024 (`--platform=ptrace --network=none`) and is checkpointed
# (`--compression=none --exclude-committed-zero-pages`: the split checkpoint.img +
# pages_meta.img + pages.img). That checkpoint is the base. Each clone is restored from
# it, runs --ticks more ticks (its own counter, its own runtime state: it diverges), and is
# checkpointed again. The base is packed into an OCI layout, then each clone with
# `--base` the base, first with snapctl's defaults and then with each --flags set.
# Reported per clone and file: bytes of the checkpoint, bytes the clone added to the
# layout's blobs (what a registry stores for it), and that as a share of the checkpoint.
# Output: a Markdown table on stdout, raw numbers in $OUT/fleet.tsv.
# Needs root (runsc) and gcc; uses target/release/snapctl if built, else target/debug.
set -euo pipefail
cd "$(dirname "$0")/.."
clones=8 ticks=10 heap=8 runsc=/opt/snapctl-runsc/runsc out="" flagsets=("")
while [ $# -gt 0 ]; do
  case "$1" in
    --clones) clones=$2; shift 2 ;;
    --ticks) ticks=$2; shift 2 ;;
    --heap-mib) heap=$2; shift 2 ;;
    --runsc) runsc=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --flags) flagsets+=("$2"); shift 2 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "fleet.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ -x "$runsc" ] || { echo "fleet.sh: no runsc at $runsc (bash scripts/install-trixie.sh runsc)" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "fleet.sh: runsc needs root" >&2; exit 2; }
snapctl=${SNAPCTL_BIN:-}
if [ -z "$snapctl" ]; then
  if [ -x target/release/snapctl ]; then snapctl=$PWD/target/release/snapctl; else snapctl=$PWD/target/debug/snapctl; fi
fi
[ -x "$snapctl" ] || { echo "fleet.sh: build snapctl first (cargo build -p snapctl)" >&2; exit 2; }
out=${out:-$(mktemp -d "${TMPDIR:-/tmp}/snapctl-fleet.XXXXXX")}
mkdir -p "$out"
root=$out/runsc-root
ids=()
cleanup() {
  for id in "${ids[@]}"; do
    "$runsc" --platform=ptrace --network=none --root "$root" kill "$id" KILL >/dev/null 2>&1 || true
    "$runsc" --platform=ptrace --network=none --root "$root" delete -force "$id" >/dev/null 2>&1 || true
  done
}
trap cleanup EXIT
rs() { "$runsc" --platform=ptrace --network=none --root "$root" "$@"; }

gcc -O2 -static -DHEAP_MIB="${heap}u" -o "$out/counter" tests/runtimes/counter.c

# An OCI bundle running /counter /out/progress with $2 bind-mounted at /out.
bundle() {
  local dir=$1 o=$2
  mkdir -p "$dir/rootfs" "$o"
  cp "$out/counter" "$dir/rootfs/counter"
  (cd "$dir" && "$runsc" spec -- /counter /out/progress)
  jq --arg o "$o" '.process.terminal = false | .root.readonly = true
    | .mounts += [{"destination": "/out", "type": "bind", "source": $o, "options": ["rbind", "rw"]}]' \
    "$dir/config.json" >"$dir/config.json.new"
  mv "$dir/config.json.new" "$dir/config.json"
}
count() { { tail -n1 "$1" 2>/dev/null || true; } | sed -n 's/^count=\([0-9]*\).*/\1/p'; }
wait_count() {
  local f=$1 want=$2 i
  for i in $(seq 1 600); do
    c=$(count "$f"); [ -n "$c" ] && [ "$c" -ge "$want" ] && return 0
    sleep 0.05
  done
  echo "fleet.sh: $f never reached count $want" >&2; exit 1
}
checkpoint() { rs checkpoint --compression=none --exclude-committed-zero-pages --image-path "$2" "$1" >/dev/null; }

echo "fleet.sh: base sandbox" >&2
bundle "$out/base-bundle" "$out/base-out"
ids+=(fleet-base-$$)
rs run -detach --bundle "$out/base-bundle" "fleet-base-$$" >"$out/base-run.log" 2>&1
wait_count "$out/base-out/progress" 5
mkdir -p "$out/base"
checkpoint "fleet-base-$$" "$out/base"
rs delete -force "fleet-base-$$" >/dev/null 2>&1 || true
base_count=$(count "$out/base-out/progress")

for i in $(seq 1 "$clones"); do
  echo "fleet.sh: clone $i of $clones" >&2
  # A clone restores into its own bundle and output: the base's progress file is copied
  # so each clone appends to its own.
  bundle "$out/clone$i-bundle" "$out/clone$i-out"
  cp "$out/base-out/progress" "$out/clone$i-out/progress"
  ids+=(fleet-clone$i-$$)
  rs restore -detach --image-path "$out/base" --bundle "$out/clone$i-bundle" "fleet-clone$i-$$" >"$out/clone$i-run.log" 2>&1
  wait_count "$out/clone$i-out/progress" $((base_count + ticks))
  mkdir -p "$out/clone$i"
  checkpoint "fleet-clone$i-$$" "$out/clone$i"
  rs delete -force "fleet-clone$i-$$" >/dev/null 2>&1 || true
done

blob_bytes() { find "$1/blobs" -type f -printf '%s\n' 2>/dev/null | awk '{s+=$1} END {print s+0}'; }
file_bytes() { stat -c %s "$1"; }
printf 'flags\tclone\tfile\tcheckpoint_bytes\n' >"$out/fleet-files.tsv"
printf 'flags\tclone\tcheckpoint_bytes\tstored_bytes\tshare_pct\n' >"$out/fleet.tsv"
echo "| flags | clones | checkpoint (each) | stored per clone, median (min-max) | share of a checkpoint |"
echo "|---|---:|---:|---:|---:|"
for flags in "${flagsets[@]}"; do
  layout=$out/layout-$(printf '%s' "${flags:-defaults}" | tr -c 'a-zA-Z0-9' '_')
  rm -rf "$layout"
  # shellcheck disable=SC2086 # flags are words
  "$snapctl" pack "$out/base" "oci:$layout:base" --kind gvisor $flags >/dev/null
  shares=() stored=()
  for i in $(seq 1 "$clones"); do
    before=$(blob_bytes "$layout")
    # shellcheck disable=SC2086
    "$snapctl" pack "$out/clone$i" "oci:$layout:clone$i" --kind gvisor --base "oci:$layout:base" $flags >/dev/null
    after=$(blob_bytes "$layout")
    ck=0
    for f in "$out/clone$i"/*; do
      b=$(file_bytes "$f"); ck=$((ck + b))
      printf '%s\t%s\t%s\t%s\n' "${flags:-defaults}" "$i" "$(basename "$f")" "$b" >>"$out/fleet-files.tsv"
    done
    s=$((after - before))
    share=$(awk -v s="$s" -v c="$ck" 'BEGIN {printf "%.3f", 100 * s / c}')
    printf '%s\t%s\t%s\t%s\t%s\n' "${flags:-defaults}" "$i" "$ck" "$s" "$share" >>"$out/fleet.tsv"
    stored+=("$s"); shares+=("$share")
  done
  med=$(printf '%s\n' "${stored[@]}" | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')
  lo=$(printf '%s\n' "${stored[@]}" | sort -n | head -n1); hi=$(printf '%s\n' "${stored[@]}" | sort -n | tail -n1)
  medshare=$(printf '%s\n' "${shares[@]}" | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')
  echo "| ${flags:-defaults} | $clones | $ck B | $med B ($lo-$hi) | $medshare % |"
done
echo "fleet.sh: raw numbers in $out/fleet.tsv, per file in $out/fleet-files.tsv" >&2

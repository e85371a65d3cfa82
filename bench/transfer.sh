#!/usr/bin/env bash
# The push/pull benchmark of issue 4: `snapctl push` and `snapctl pull` against
# `snapctl serve`, and `skopeo copy` of the same snapshot as a plain OCI layer against
# Debian's docker-registry, on loopback, same machine, same run.
#
#   bash bench/transfer.sh            2 GiB image (half zero), 3 interleaved runs, then
#                                     push/pull of a 4 GiB image, 3 runs
#   bash bench/transfer.sh --quick    256 MiB / 512 MiB, 1 run: a smoke test, not a result
#
# Options: --runs N  --size SIZE  --big-size SIZE  --no-big  --keep  --warm BYTES|auto
#
# Measures (seconds of wall time; medians of --runs runs; within a run the commands
# alternate, so load from other processes hits both sides alike):
#   snapctl push      `snapctl push DIR HOST/bench/vm:v1` of the checkpoint directory
#                     (packed on the fly: chunking, hashing, compression included) to a
#                     fresh `snapctl serve` with a fresh push cache
#   re-push           the same push again, unchanged, same cache and server
#   skopeo push       `skopeo copy --preserve-digests oci:LAYOUT docker://HOST/...` of a
#                     layout whose one layer is an uncompressed tar of the snapshot
#                     directory (holes written out, as in a container layer), to a fresh
#                     docker-registry. Building the tar is not timed (reported apart).
#   stored bytes      `du -sb` (apparent) and `du -sB1` (allocated) of each server's
#                     storage after the push
#   snapctl pull      `snapctl pull HOST/bench/vm:v1 DIR` into a fresh directory with a
#                     fresh chunk cache (files are fsynced by pull)
#   skopeo pull       `skopeo copy docker://... oci:DIR` (the layer is not unpacked:
#                     a lower bound for the skopeo wake path)
#   ... again         both pulls once more into fresh directories (fresh chunk cache):
#                     on this VM first pulls were often slower than second ones, for
#                     reasons then not found (since explained by bench/lib/memory.sh), so both
#                     are reported
#   cp                `cp vm.mem DST` and `cp vm.mem DST && sync DST` of the raw file
# Before each timed command: `sync`, so write-back of the last one is not billed to it,
# and WARM bytes of memory touched and freed (bench/lib/memory.sh: on this VM, memory
# idle for a few seconds goes back to the host and costs ~2-3 s/GiB to touch again; the
# command should not pay that). WARM defaults to twice the image's logical size: a pull
# with its server on this machine touches more fresh memory than the image's size, and
# with only 1x warmed, pulls of the 2 GiB image took 1.1-2.9 s, with 2x 0.9-1.5 s (both
# sides get the same; the 23:44 run in bench/results/BENCHMARKS-diary-*.md). --warm BYTES sets it, --warm 0 turns it
# off.
#
# Output: markdown on stdout, progress on stderr; every timed run is also appended to
# bench/results/transfer-<date>.tsv (not with --quick). Needs skopeo, docker-registry, curl, jq, python3,
# tar (scripts/setup.sh). SNAPCTL=path picks the binary (default:
# ${CARGO_TARGET_DIR:-target}/release/snapctl, built if missing).
set -euo pipefail
trap 'echo "transfer.sh: line $LINENO failed: $BASH_COMMAND" >&2' ERR

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
RUNS=3 SIZE=2GiB BIG_SIZE=4GiB BIG=1 KEEP=0 QUICK=0 WARM=auto
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) QUICK=1; RUNS=1; SIZE=256MiB; BIG_SIZE=512MiB ;;
    --runs) RUNS=$2; shift ;;
    --size) SIZE=$2; shift ;;
    --big-size) BIG_SIZE=$2; shift ;;
    --no-big) BIG=0 ;;
    --keep) KEEP=1 ;;
    --warm) WARM=$2; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "transfer.sh: unknown option $1 (try --help)" >&2; exit 2 ;;
  esac
  shift
done

for p in skopeo docker-registry curl jq python3 sha256sum tar; do
  command -v "$p" >/dev/null || { echo "transfer.sh: $p not found (run scripts/setup.sh)" >&2; exit 2; }
done

TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
SNAPCTL=${SNAPCTL:-$TARGET/release/snapctl}
if [ ! -x "$SNAPCTL" ]; then
  echo "building $SNAPCTL" >&2
  (cd "$ROOT" && cargo build --release -q -p snapctl --target-dir "$TARGET")
fi

W=$(mktemp -d "${TMPDIR:-/tmp}/snapctl-transfer.XXXXXX")
PIDS=()
cleanup() {
  for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill "$p" 2>/dev/null || true; done
  if [ "$KEEP" = 1 ]; then echo "kept $W" >&2; else rm -rf "$W"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM
log() { echo "[$(date -u +%H:%M:%S) transfer.sh] $*" >&2; }
mkdir -p "$ROOT/bench/results"
TSV=$ROOT/bench/results/transfer-$(date -u +%F).tsv
[ "$QUICK" = 1 ] && TSV=$W/timings.tsv  # a smoke test is not a result
[ -s "$TSV" ] || printf 'utc\tsize\trun\tmeasure\tseconds\textra\n' > "$TSV"

# time_it NAME SIZE RUN -- command...: sync, run (stdout to $W/out), record the wall
# seconds in $T and in the TSV, with the command's --json report if it printed one.
T=0
# shellcheck source=bench/lib/memory.sh
source "$ROOT/bench/lib/memory.sh"
time_it() {
  local name=$1 size=$2 run=$3; shift 4
  sync
  if [ "$WARM" = auto ]; then warm_memory "$((2 * $(to_bytes "$size")))"; elif [ "$WARM" != 0 ]; then warm_memory "$WARM"; fi
  local t0 t1 extra
  t0=$(date +%s%N)
  "$@" > "$W/out"
  t1=$(date +%s%N)
  T=$(echo "scale=3; ($t1 - $t0) / 1000000000" | bc)
  extra=$(jq -c . "$W/out" 2>/dev/null || true)
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$(date -u +%FT%TZ)" "$size" "$run" "$name" "$T" "$extra" >> "$TSV"
  log "$size run $run: $name ${T}s $extra"
}

SERVER_LOGS=$W
# shellcheck source=bench/lib/servers.sh
source "$ROOT/bench/lib/servers.sh"

# An OCI layout at $2 whose one layer is an uncompressed tar of directory $1.
tar_layout() {
  local src=$1 out=$2
  mkdir -p "$out/blobs/sha256"
  tar -C "$src" -cf "$out/layer.tar" .
  local d
  d=$(sha256sum "$out/layer.tar" | cut -d' ' -f1)
  mv "$out/layer.tar" "$out/blobs/sha256/$d"
  python3 - "$out" "sha256:$d" "$(stat -c %s "$out/blobs/sha256/$d")" <<'EOF'
import hashlib, json, os, sys
root, ld, ln = sys.argv[1], sys.argv[2], int(sys.argv[3])
def put(b):
    d = hashlib.sha256(b).hexdigest()
    open(os.path.join(root, "blobs/sha256", d), "wb").write(b)
    return "sha256:" + d, len(b)
cfg = {"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers", "diff_ids": [ld]}}
cd, cl = put(json.dumps(cfg).encode())
m = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
     "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cd, "size": cl},
     "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": ld, "size": ln}]}
md, ml = put(json.dumps(m).encode())
json.dump({"schemaVersion": 2, "manifests": [{"mediaType": m["mediaType"], "digest": md, "size": ml,
           "annotations": {"org.opencontainers.image.ref.name": "v1"}}]}, open(os.path.join(root, "index.json"), "w"))
open(os.path.join(root, "oci-layout"), "w").write('{"imageLayoutVersion":"1.0.0"}')
EOF
}

SKOPEO=(skopeo copy --quiet --preserve-digests --src-tls-verify=false --dest-tls-verify=false)
declare -A R  # R[size.measure] = "t1 t2 ..."
add() { R[$1]="${R[$1]:-} $2"; }
median() { tr ' ' '\n' <<<"$1" | grep . | sort -g | awk '{a[NR]=$1} END {if (NR==0) print "-"; else if (NR%2) print a[(NR+1)/2]; else printf "%.3f\n", (a[NR/2]+a[NR/2+1])/2}'; }
all() { tr -s ' ' <<<"${1# }" | sed 's/ /, /g'; }

# bench_size SIZE WITH_SKOPEO
bench_size() {
  local size=$1 skopeo=$2 snap=$W/snap-$1
  log "sample $size (half zero) in $snap"
  "$SNAPCTL" sample "$snap" --size "$size" --zero-fraction 0.5 >/dev/null
  if [ "$skopeo" = 1 ]; then
    log "tar layout for skopeo"
    local t0; t0=$(date +%s%N)
    tar_layout "$snap" "$W/layout-$size"
    add "$size.tar" "$(echo "scale=3; ($(date +%s%N) - $t0) / 1000000000" | bc)"
  fi
  for run in $(seq "$RUNS"); do
    # snapctl: fresh server and push cache.
    start_server snapctl "$W/s-store"
    local ref=127.0.0.1:$PORT/bench/vm:v1
    time_it snapctl_push "$size" "$run" -- "$SNAPCTL" push "$snap" "$ref" --cache "$W/pcache" --json
    add "$size.push" "$T"
    time_it snapctl_repush "$size" "$run" -- "$SNAPCTL" push "$snap" "$ref" --cache "$W/pcache" --json
    add "$size.repush" "$T"
    add "$size.s_apparent" "$(du -sb "$W/s-store" | cut -f1)"
    add "$size.s_alloc" "$(du -sB1 "$W/s-store" | cut -f1)"
    time_it snapctl_pull "$size" "$run" -- "$SNAPCTL" pull "$ref" "$W/pulled" --cache "$W/ccache" --json
    add "$size.pull" "$T"
    cmp "$snap/vm.mem" "$W/pulled/vm.mem" || { echo "transfer.sh: pulled vm.mem differs" >&2; exit 1; }
    # Again, fresh destination and cache: first pulls were often slower here than second
    # ones (cold memory: bench/lib/memory.sh), so both are reported.
    rm -rf "$W/pulled" "$W/ccache"
    time_it snapctl_pull_again "$size" "$run" -- "$SNAPCTL" pull "$ref" "$W/pulled" --cache "$W/ccache" --json
    add "$size.pull2" "$T"
    stop_server
    rm -rf "$W/s-store" "$W/pcache" "$W/pulled" "$W/ccache"

    time_it cp "$size" "$run" -- cp "$snap/vm.mem" "$W/cp.mem"
    add "$size.cp" "$T"; rm -f "$W/cp.mem"
    time_it cp_sync "$size" "$run" -- sh -c "cp '$snap/vm.mem' '$W/cp.mem' && sync '$W/cp.mem'"
    add "$size.cpsync" "$T"; rm -f "$W/cp.mem"

    if [ "$skopeo" = 1 ]; then
      start_server distribution "$W/d-store"
      time_it skopeo_push "$size" "$run" -- "${SKOPEO[@]}" "oci:$W/layout-$size:v1" "docker://127.0.0.1:$PORT/bench/vm:v1"
      add "$size.k_push" "$T"
      add "$size.d_apparent" "$(du -sb "$W/d-store" | cut -f1)"
      add "$size.d_alloc" "$(du -sB1 "$W/d-store" | cut -f1)"
      time_it skopeo_pull "$size" "$run" -- "${SKOPEO[@]}" "docker://127.0.0.1:$PORT/bench/vm:v1" "oci:$W/k-pulled:v1"
      add "$size.k_pull" "$T"
      rm -rf "$W/k-pulled"
      time_it skopeo_pull_again "$size" "$run" -- "${SKOPEO[@]}" "docker://127.0.0.1:$PORT/bench/vm:v1" "oci:$W/k-pulled:v1"
      add "$size.k_pull2" "$T"
      stop_server
      rm -rf "$W/d-store" "$W/k-pulled"
    fi
  done
  rm -rf "$snap" "$W/layout-$size"
}

gb() { printf '%.2f' "$(echo "scale=4; $1 / 1000000000" | bc)"; }
ratio() { printf '%.1f' "$(echo "scale=3; $1 / $2" | bc)"; }
pct() { printf '%.1f' "$(echo "scale=3; 100 * $1 / $2" | bc)"; }

bench_size "$SIZE" 1
[ "$BIG" = 1 ] && bench_size "$BIG_SIZE" 0

S=$SIZE
m() { median "${R[$S.$1]:-}"; }
echo "\`bash bench/transfer.sh\` on $(nproc) cores, $(date -u +%F), $(skopeo --version | head -1), docker-registry $(dpkg-query -W -f '${Version}' docker-registry 2>/dev/null || echo '?'), snapctl $(git -C "$ROOT" rev-parse --short HEAD); median of $RUNS run(s), seconds of wall time."
echo
echo "Image: \`snapctl sample --size $SIZE --zero-fraction 0.5\` (vm.mem, half holes, a quarter random, a quarter text-like)."
echo
echo "| measure | snapctl | skopeo + docker-registry | skopeo / snapctl | goal |"
echo "| --- | ---: | ---: | ---: | --- |"
echo "| push (hibernate), s | $(m push) | $(m k_push) | $(ratio "$(m k_push)" "$(m push)")x | >= 10x |"
echo "| pull (wake), s | $(m pull) | $(m k_pull) | $(ratio "$(m k_pull)" "$(m pull)")x | >= 10x |"
echo "| pull again (second pull of the same image, fresh cache), s | $(m pull2) | $(m k_pull2) | $(ratio "$(m k_pull2)" "$(m pull2)")x | >= 10x |"
echo "| stored, GB (du -sb) | $(gb "$(m s_apparent)") | $(gb "$(m d_apparent)") | $(pct "$(m s_apparent)" "$(m d_apparent)")% of skopeo's | <= 52% |"
echo "| stored, GB allocated (du -sB1) | $(gb "$(m s_alloc)") | $(gb "$(m d_alloc)") | $(pct "$(m s_alloc)" "$(m d_alloc)")% of skopeo's | |"
echo "| re-push unchanged, s | $(m repush) | | | < 0.3 s |"
echo "| pull vs cp of vm.mem | $(m pull) s | cp $(m cp) s, cp+sync $(m cpsync) s | pull / cp+sync $(ratio "$(m pull)" "$(m cpsync)")x, pull / cp $(ratio "$(m pull)" "$(m cp)")x | within 2x |"
echo "| pull again vs cp of vm.mem | $(m pull2) s | cp $(m cp) s, cp+sync $(m cpsync) s | pull / cp+sync $(ratio "$(m pull2)" "$(m cpsync)")x, pull / cp $(ratio "$(m pull2)" "$(m cp)")x | within 2x |"
echo
echo "Building the skopeo layout (tar of the directory + sha256) took $(m tar) s, not counted in skopeo push."
echo
echo "All runs ($SIZE): push [$(all "${R[$S.push]}")], re-push [$(all "${R[$S.repush]}")], pull [$(all "${R[$S.pull]}")], pull again [$(all "${R[$S.pull2]}")], skopeo push [$(all "${R[$S.k_push]}")], skopeo pull [$(all "${R[$S.k_pull]}")], skopeo pull again [$(all "${R[$S.k_pull2]}")], cp [$(all "${R[$S.cp]}")], cp+sync [$(all "${R[$S.cpsync]}")]."
if [ "$BIG" = 1 ]; then
  S=$BIG_SIZE
  echo
  echo "| $BIG_SIZE image | push (hibernate), s | pull (wake), s | re-push, s | cp+sync, s | stored GB |"
  echo "| --- | ---: | ---: | ---: | ---: | ---: |"
  echo "| snapctl | $(m push) | $(m pull) | $(m repush) | $(m cpsync) | $(gb "$(m s_apparent)") |"
  echo
  echo "All runs ($BIG_SIZE): push [$(all "${R[$S.push]}")], pull [$(all "${R[$S.pull]}")], re-push [$(all "${R[$S.repush]}")]."
fi

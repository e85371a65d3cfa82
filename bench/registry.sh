#!/usr/bin/env bash
# The registry benchmark of issue 3: the same clients against `snapctl serve` (release
# build) and Debian's docker-registry (distribution), each started here on a free
# 127.0.0.1 port with fresh storage.
#
#   bash bench/registry.sh            2 GiB skopeo layer, 1 GiB curl blob, 3 runs
#   bash bench/registry.sh --quick    256 MiB / 128 MiB, 1 run: a smoke test, not a result
#
# Options: --runs N  --layer-size SIZE  --blob-size SIZE  --keep
#
# Measures, per server:
#   skopeo push / pull   `skopeo copy --preserve-digests` of an OCI layout with one random
#                        layer (oci: -> docker:// and back), MB/s of the layer size
#   curl push / pull     monolithic POST+PUT of a random blob (`curl -T`), then GET to
#                        /dev/null, MB/s
#   64 concurrent pulls  64 curl GETs of one 64 MiB blob at once: errors, wall time, MB/s
#   peak RSS             VmHWM of a freshly restarted server after serving the layer
#                        once (curl GET), from /proc/PID/status
# Medians of --runs runs; runs alternate between the servers. Before each timed run:
# `sync`, so write-back of the previous run is not billed to the next. Storage is on the
# same filesystem as ${TMPDIR:-/tmp}. snapctl fsyncs every object before answering;
# docker-registry's filesystem driver does not (it is measured as it ships).
#
# Output: markdown on stdout (paste into BENCHMARKS.md), progress on stderr. Needs
# skopeo, docker-registry, curl, jq, python3 (scripts/setup.sh). SNAPCTL=path picks the
# binary (default: target/release/snapctl, built if missing).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
RUNS=3 LAYER_SIZE=2GiB BLOB_SIZE=1GiB KEEP=0 QUICK=0
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) QUICK=1; RUNS=1; LAYER_SIZE=256MiB; BLOB_SIZE=128MiB ;;
    --runs) RUNS=$2; shift ;;
    --layer-size) LAYER_SIZE=$2; shift ;;
    --blob-size) BLOB_SIZE=$2; shift ;;
    --keep) KEEP=1 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "registry.sh: unknown option $1 (try --help)" >&2; exit 2 ;;
  esac
  shift
done

for p in skopeo docker-registry curl jq python3 sha256sum; do
  command -v "$p" >/dev/null || { echo "registry.sh: $p not found (run scripts/setup.sh)" >&2; exit 2; }
done
bytes() { # 2GiB / 256MiB / 1000 -> bytes
  local v=$1
  case "$v" in
    *GiB) echo $(( ${v%GiB} * 1024 * 1024 * 1024 )) ;;
    *MiB) echo $(( ${v%MiB} * 1024 * 1024 )) ;;
    *) echo "$v" ;;
  esac
}
LAYER_BYTES=$(bytes "$LAYER_SIZE"); BLOB_BYTES=$(bytes "$BLOB_SIZE"); CONC_BYTES=$((64 * 1024 * 1024))

SNAPCTL=${SNAPCTL:-$ROOT/target/release/snapctl}
if [ ! -x "$SNAPCTL" ]; then
  echo "building $SNAPCTL" >&2
  (cd "$ROOT" && cargo build --release -q -p snapctl)
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/snapctl-regbench.XXXXXX")
PIDS=()
cleanup() {
  for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill "$p" 2>/dev/null || true; done
  if [ "$KEEP" = 1 ]; then echo "kept $WORK" >&2; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
log() { echo "[registry.sh] $*" >&2; }
now() { date +%s.%N; }

# --- inputs -------------------------------------------------------------------
log "generating inputs in $WORK (layer $LAYER_SIZE, blob $BLOB_SIZE)"
mkdir -p "$WORK/src/blobs/sha256"
head -c "$LAYER_BYTES" /dev/urandom > "$WORK/layer"
head -c "$BLOB_BYTES" /dev/urandom > "$WORK/blob"
head -c "$CONC_BYTES" /dev/urandom > "$WORK/conc"
LAYER_DIGEST=sha256:$(sha256sum "$WORK/layer" | cut -d' ' -f1)
BLOB_DIGEST=sha256:$(sha256sum "$WORK/blob" | cut -d' ' -f1)
CONC_DIGEST=sha256:$(sha256sum "$WORK/conc" | cut -d' ' -f1)
ln "$WORK/layer" "$WORK/src/blobs/sha256/${LAYER_DIGEST#sha256:}"
python3 - "$WORK/src" "$LAYER_DIGEST" "$LAYER_BYTES" >/dev/null <<'EOF'
import hashlib, json, os, sys
root, ld, ln = sys.argv[1], sys.argv[2], int(sys.argv[3])
def put(b):
    d = hashlib.sha256(b).hexdigest()
    open(os.path.join(root, "blobs/sha256", d), "wb").write(b)
    return "sha256:" + d, len(b)
cd, cl = put(b'{"bench":"snapctl registry"}')
m = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
     "artifactType": "application/vnd.snapctl.snapshot.v1",
     "config": {"mediaType": "application/vnd.snapctl.config.v1+json", "digest": cd, "size": cl},
     "layers": [{"mediaType": "application/vnd.snapctl.pack.v1", "digest": ld, "size": ln}]}
md, ml = put(json.dumps(m).encode())
json.dump({"schemaVersion": 2, "manifests": [{"mediaType": m["mediaType"], "digest": md, "size": ml,
           "annotations": {"org.opencontainers.image.ref.name": "v1"}}]}, open(os.path.join(root, "index.json"), "w"))
open(os.path.join(root, "oci-layout"), "w").write('{"imageLayoutVersion":"1.0.0"}')
print(md)
EOF

# --- servers ------------------------------------------------------------------
SERVER_LOGS=$WORK WAIT_PORT_TRIES=300
# shellcheck source=bench/lib/servers.sh
source "$ROOT/bench/lib/servers.sh"
rss_kib() { awk '/VmHWM/ {print $2}' "/proc/$SERVER_PID/status"; }

upload_url() { # repo digest -> absolute URL of a session with ?digest= appended
  local loc
  loc=$(curl -sf -D - -o /dev/null -X POST "http://127.0.0.1:$PORT/v2/$1/blobs/uploads/" | tr -d '\r' | awk 'tolower($1)=="location:" {print $2}')
  case "$loc" in http*) ;; *) loc="http://127.0.0.1:$PORT$loc" ;; esac
  case "$loc" in *\?*) echo "$loc&digest=$2" ;; *) echo "$loc?digest=$2" ;; esac
}
push_blob() { # repo digest file
  local url; url=$(upload_url "$1" "$2")
  curl -sf -o /dev/null -T "$3" -H 'Content-Type: application/octet-stream' "$url"
}

mbps() { python3 -c "import sys; print(f'{$1/1e6/float(sys.argv[1]):.0f}')" "$2"; }
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }

declare -A R   # R[kind.metric] = space-separated values
add() { R[$1]="${R[$1]:-} $2"; }

one_round() { # kind round
  local kind=$1 r=$2 dir="$WORK/store-$1-$2" t0 t1 fails
  start_server "$kind" "$dir"
  local reg="127.0.0.1:$PORT"
  sync; t0=$(now)
  skopeo copy -q --preserve-digests --dest-tls-verify=false "oci:$WORK/src:v1" "docker://$reg/bench/vm:v1"
  t1=$(now); add "$kind.skopeo_push" "$(mbps "$LAYER_BYTES" "$(echo "$t1 - $t0" | bc)")"
  rm -rf "$WORK/back"; sync; t0=$(now)
  skopeo copy -q --preserve-digests --src-tls-verify=false "docker://$reg/bench/vm:v1" "oci:$WORK/back:v1"
  t1=$(now); add "$kind.skopeo_pull" "$(mbps "$LAYER_BYTES" "$(echo "$t1 - $t0" | bc)")"
  got=$(jq -r '.manifests[0].digest' "$WORK/back/index.json")
  want=$(jq -r '.manifests[0].digest' "$WORK/src/index.json")
  [ "$got" = "$want" ] || { echo "manifest digest changed through $kind: $want -> $got" >&2; exit 1; }
  rm -rf "$WORK/back"

  sync; t0=$(now)
  push_blob bench/blob "$BLOB_DIGEST" "$WORK/blob"
  t1=$(now); add "$kind.curl_push" "$(mbps "$BLOB_BYTES" "$(echo "$t1 - $t0" | bc)")"
  sync; t0=$(now)
  curl -sf -o /dev/null "http://$reg/v2/bench/blob/blobs/$BLOB_DIGEST"
  t1=$(now); add "$kind.curl_pull" "$(mbps "$BLOB_BYTES" "$(echo "$t1 - $t0" | bc)")"

  push_blob bench/conc "$CONC_DIGEST" "$WORK/conc"
  t0=$(now); fails=0
  local pids=()
  for i in $(seq 64); do curl -sf -o /dev/null "http://$reg/v2/bench/conc/blobs/$CONC_DIGEST" & pids+=($!); done
  for p in "${pids[@]}"; do wait "$p" || fails=$((fails + 1)); done
  t1=$(now)
  add "$kind.conc_errors" "$fails"
  add "$kind.conc_mbps" "$(mbps $((64 * CONC_BYTES)) "$(echo "$t1 - $t0" | bc)")"
  stop_server

  # Peak RSS while serving the big layer, from a fresh process.
  start_server "$kind" "$dir"
  curl -sf -o /dev/null "http://127.0.0.1:$PORT/v2/bench/vm/blobs/$LAYER_DIGEST"
  add "$kind.rss_mib" "$(( $(rss_kib) / 1024 ))"
  stop_server
  rm -rf "$dir"
}

for r in $(seq "$RUNS"); do
  for kind in snapctl distribution; do
    log "round $r/$RUNS: $kind"
    one_round "$kind" "$r"
  done
done

m() { median ${R[$1]}; }
echo "## Registry"
echo
echo "\`bash bench/registry.sh$([ "$QUICK" = 1 ] && echo ' --quick')\` on $(nproc) cores, $(date -u +%Y-%m-%d): skopeo $(skopeo --version | awk '{print $3}'), docker-registry $(dpkg-query -W -f='${Version}' docker-registry 2>/dev/null || echo '?'), layer $LAYER_SIZE, blob $BLOB_SIZE, median of $RUNS run(s)."
echo "Throughput in MB/s (10^6 bytes per second of wall time, higher is better); RSS in MiB."
echo
echo "| measure | snapctl serve | docker-registry |"
echo "| --- | ---: | ---: |"
echo "| skopeo copy push ($LAYER_SIZE layer) | $(m snapctl.skopeo_push) | $(m distribution.skopeo_push) |"
echo "| skopeo copy pull ($LAYER_SIZE layer) | $(m snapctl.skopeo_pull) | $(m distribution.skopeo_pull) |"
echo "| curl push ($BLOB_SIZE blob, POST+PUT) | $(m snapctl.curl_push) | $(m distribution.curl_push) |"
echo "| curl pull ($BLOB_SIZE blob) | $(m snapctl.curl_pull) | $(m distribution.curl_pull) |"
echo "| 64 concurrent curl pulls of 64 MiB: aggregate | $(m snapctl.conc_mbps) | $(m distribution.conc_mbps) |"
echo "| 64 concurrent curl pulls: failed requests (all runs) | $(echo ${R[snapctl.conc_errors]} | tr ' ' '+' | bc) | $(echo ${R[distribution.conc_errors]} | tr ' ' '+' | bc) |"
echo "| peak RSS serving the $LAYER_SIZE layer (VmHWM) | $(m snapctl.rss_mib) | $(m distribution.rss_mib) |"
echo
echo "All runs: $(for k in "${!R[@]}"; do printf '%s=[%s] ' "$k" "$(echo ${R[$k]} | tr ' ' ',')"; done | tr ' ' '\n' | sort | tr '\n' ' ')"

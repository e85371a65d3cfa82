#!/usr/bin/env bash
# The main job on an embedded default, end to end on one machine playing two hosts:
#   host A: generate a sample Firecracker-style snapshot, start `snapctl serve` on a temporary
#           directory (127.0.0.1, a free port), push the snapshot (hibernate);
#   host B: its own cache and directories: pull the snapshot (wake), verify it byte for byte,
#           then a layer pushed by host A moves only its changed chunks;
#   lazy:   restore the snapshot's memory through a Firecracker-like test runtime whose page
#           faults `snapctl lazy` serves from verified chunks (root only: userfaultfd).
# Prints what moved: bytes, dedup, seconds, fault counts and latency.
# Usage: bash scripts/demo.sh [SIZE]   (default 256MiB)
set -euo pipefail
cd "$(dirname "$0")/.."
SIZE="${1:-256MiB}"
bash scripts/setup.sh
# SNAPCTL_DEMO_PROFILE=debug reuses a debug build (faster to build, slower to run).
PROFILE="${SNAPCTL_DEMO_PROFILE:-release}"
if [ "$PROFILE" = release ]; then cargo build --release -q -p snapctl -p snapctl-tests --bins; else cargo build -q -p snapctl -p snapctl-tests --bins; PROFILE=debug; fi
T="${CARGO_TARGET_DIR:-$PWD/target}/$PROFILE"
S="$T/snapctl"
VMM="$T/fake_vmm"
W="$(mktemp -d "${TMPDIR:-/tmp}/snapctl-demo.XXXXXX")"
SERVE_PID=""
LAZY_PID=""
cleanup() {
  for p in $LAZY_PID $SERVE_PID; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
  rm -rf "$W"
}
trap cleanup EXIT
if [ -t 2 ] && [ -z "${NO_COLOR:-}" ]; then B=$'\033[1m'; N=$'\033[0m'; else B=""; N=""; fi
step() { printf '\n%s== %s%s\n' "$B" "$*" "$N" >&2; }
# One line of a --json report, for people: say KIND FILE.
cat >"$W/say.py" <<'PY'
import json, sys
kind, path = sys.argv[1], sys.argv[2]
text = open(path).read()
try:
    r = json.loads(text)
except ValueError:  # several JSON lines (one per connection): the first
    r = json.loads(text.splitlines()[0])
M = 2 ** 20
if kind == "push":
    print(f"pushed: read {r['bytes_read']/M:.1f} MiB, sent {r['bytes_sent']/M:.1f} MiB in {r['uploaded_blobs']} blobs "
          f"({r['skipped_blobs']} already there, {r['mounted_blobs']} mounted), {r['seconds']:.2f} s")
elif kind == "vmm":
    print(f"runtime: {r['pages_checked']} pages checked against the original, {r['mismatches']} mismatches, "
          f"{r['seconds']:.2f} s")
elif kind == "lazy":
    f, l = r["faults"], r["latency_us"]
    print(f"faults: {f['total']} ({f['zero']} zero, {f['cache_hit']} cache hits, {f['fetched']} fetched), "
          f"{r['bytes_fetched']/M:.1f} MiB fetched, latency p50 {l['p50']} us p99 {l['p99']} us, "
          f"{r['verify_failures']} verification failures")
PY
say() { python3 "$W/say.py" "$1" "$2" >&2; }

step "sample snapshot ($SIZE vm.mem, half holes) in $W/a/snap"
"$S" sample "$W/a/snap" --size "$SIZE"
du -h --apparent-size "$W/a/snap/vm.mem" | sed 's/^/apparent /' >&2
du -h "$W/a/snap/vm.mem" | sed 's/^/allocated /' >&2

step "snapctl serve on a temporary directory (127.0.0.1, free port)"
PORT="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
REG="127.0.0.1:$PORT"
"$S" serve --storage "$W/registry" --listen "$REG" 2>"$W/serve.log" &
SERVE_PID=$!
for _ in $(seq 100); do curl -fsS "http://$REG/v2/" >/dev/null 2>&1 && break; sleep 0.1; done
echo "registry at http://$REG/v2/" >&2

step "host A: push (hibernate) -> $REG/sandboxes/vm:v1"
export SNAPCTL_CACHE="$W/a/cache"
"$S" push "$W/a/snap" "$REG/sandboxes/vm:v1" --json >"$W/push1.json"
say push "$W/push1.json"
"$S" push "$W/a/snap" "$REG/sandboxes/vm:v1" --json >"$W/push1b.json"
say push "$W/push1b.json"

step "host B (own cache, own dirs): pull (wake), then verify"
export SNAPCTL_CACHE="$W/b/cache"
"$S" pull "$REG/sandboxes/vm:v1" "$W/b/restore"
"$S" verify "$REG/sandboxes/vm:v1" --against "$W/b/restore"
cmp "$W/a/snap/vm.mem" "$W/b/restore/vm.mem" && echo "vm.mem byte-identical on host B; allocated: $(du -h "$W/b/restore/vm.mem" | cut -f1)" >&2

step "host A: the guest ran on (8 random blocks rewritten) -> push layer v2 over v1"
export SNAPCTL_CACHE="$W/a/cache"
"$S" sample "$W/a/snap" --size "$SIZE" --mutate 8
"$S" push "$W/a/snap" "$REG/sandboxes/vm:v2" --parent "$REG/sandboxes/vm:v1" --json >"$W/push2.json"
say push "$W/push2.json"

step "host B: pull v2: only the delta moves"
export SNAPCTL_CACHE="$W/b/cache"
"$S" pull "$REG/sandboxes/vm:v2" "$W/b/restore2"
"$S" verify "$REG/sandboxes/vm:v2" --against "$W/b/restore2"
"$S" diff "$REG/sandboxes/vm:v1" "$REG/sandboxes/vm:v2" || true

step "lazy restore: a Firecracker-like runtime faults vm.mem in through snapctl lazy"
if [ "$(id -u)" != 0 ]; then
  echo "skipped: userfaultfd for another process's memory needs root here" >&2
else
  export SNAPCTL_CACHE="$W/c/cache"   # a third host, cold cache
  SOCK="$W/uffd.sock"
  "$S" lazy "$REG/sandboxes/vm:v2" --socket "$SOCK" --once --json >"$W/lazy.json" 2>"$W/lazy.log" &
  LAZY_PID=$!
  for _ in $(seq 100); do [ -S "$SOCK" ] && break; sleep 0.1; done
  "$VMM" --socket "$SOCK" --mem-file "$W/a/snap/vm.mem" --threads 2 --json >"$W/vmm.json"
  wait "$LAZY_PID"; LAZY_PID=""
  say vmm "$W/vmm.json"
  say lazy "$W/lazy.json"
fi
echo "demo ok" >&2

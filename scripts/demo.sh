#!/usr/bin/env bash
# The main job on an embedded default: generate a sample Firecracker-style snapshot, pack
# it into a local OCI layout, verify, inspect, unpack it as a second host would, prove the
# result identical, then make an incremental layer and show what it cost.
# Usage: bash scripts/demo.sh [SIZE]   (default 256MiB)
set -euo pipefail
cd "$(dirname "$0")/.."
SIZE="${1:-256MiB}"
bash scripts/setup.sh
cargo build --release -q -p snapctl
S="$PWD/target/release/snapctl"
W="$(mktemp -d "${TMPDIR:-/tmp}/snapctl-demo.XXXXXX")"
trap 'rm -rf "$W"' EXIT
if [ -t 2 ] && [ -z "${NO_COLOR:-}" ]; then B=$'\033[1m'; N=$'\033[0m'; else B=""; N=""; fi
step() { printf '\n%s== %s%s\n' "$B" "$*" "$N" >&2; }

step "sample snapshot ($SIZE vm.mem, half holes) in $W/snap"
"$S" sample "$W/snap" --size "$SIZE"
du -h --apparent-size "$W/snap/vm.mem" | sed 's/^/apparent /' >&2
du -h "$W/snap/vm.mem" | sed 's/^/allocated /' >&2

step "pack -> oci:$W/images:v1"
"$S" pack "$W/snap" "oci:$W/images:v1"

step "verify (every chunk digest and Merkle root)"
"$S" verify "oci:$W/images:v1"

step "inspect"
"$S" inspect "oci:$W/images:v1"

step "unpack on a 'second host' and prove it identical"
"$S" unpack "oci:$W/images:v1" "$W/host2"
"$S" verify "oci:$W/images:v1" --against "$W/host2"
cmp "$W/snap/vm.mem" "$W/host2/vm.mem" && echo "vm.mem byte-identical; allocated: $(du -h "$W/host2/vm.mem" | cut -f1)" >&2

step "the guest ran on: 8 blocks changed -> incremental layer v2 over v1"
"$S" sample "$W/snap" --size "$SIZE" --mutate 8
"$S" pack "$W/snap" "oci:$W/images:v2" --parent "oci:$W/images:v1" --json | tee "$W/v2.json" >/dev/null
python3 - "$W/v2.json" <<'PY' >&2
import json, sys
r = json.load(open(sys.argv[1]))
print(f"layer v2: {r['stored_chunks']} new chunks, {r['inherited_chunks']} inherited, "
      f"{r['pack_bytes']/2**20:.1f} MiB of packs + {r['metadata_bytes']} B metadata")
PY
"$S" diff "oci:$W/images:v1" "oci:$W/images:v2" || true
"$S" verify "oci:$W/images:v2"
echo "demo ok" >&2

#!/usr/bin/env bash
# Fuzz smoke run: builds every fuzz target in fuzz/ and runs each for a short time,
# seeded from the spec test vectors (spec/vectors/). Exits non-zero if any target crashes
# (the crashing input is kept in fuzz/artifacts/<target>/).
#
#   scripts/fuzz-smoke.sh            # 20 s per target (CI)
#   scripts/fuzz-smoke.sh 600        # a longer run
#   FUZZ_TARGETS="chunk_index image_open" scripts/fuzz-smoke.sh 60
#   FUZZ_CORPUS=/var/tmp/snapctl-corpus scripts/fuzz-smoke.sh 600   # keep the corpora
#
# cargo-fuzz passes nightly-only flags (-Zsanitizer=address, -Cpasses=sancov-module, …) to
# rustc; RUSTC_BOOTSTRAP=1 makes the stable toolchain accept them, and the stable rust-std
# ships the ASan runtime, so no nightly is needed (see fuzz/README.md).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
secs=${1:-${FUZZ_SECONDS:-20}}
read -r -a targets <<<"${FUZZ_TARGETS:-chunk_index outboard image_config manifest decompress reference image_open criu_pagemap trace_json sign_policy sign_key sign_manifest serve_config pulled_json}"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target-fuzz}
export RUSTC_BOOTSTRAP=1

if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "fuzz-smoke: installing cargo-fuzz" >&2
  cargo install cargo-fuzz --locked --quiet
fi

# Seed corpora, generated from the committed vectors each run (corpora are not committed).
# FUZZ_CORPUS=DIR keeps the corpora (and what the run adds to them) in DIR.
if [ -n "${FUZZ_CORPUS:-}" ]; then
  corpus=$FUZZ_CORPUS
  mkdir -p "$corpus"
else
  corpus=$(mktemp -d)
  trap 'rm -rf "$corpus"' EXIT
fi
for t in "${targets[@]}"; do mkdir -p "$corpus/$t"; done
seed() { # TARGET NAME: stdin -> corpus file
  [ -d "$corpus/$1" ] && cat >"$corpus/$1/$2" || cat >/dev/null
}
shopt -s nullglob
for b in "$root"/spec/vectors/*/blobs/sha256/*; do
  name=$(basename "$b")
  if [ "$(head -c 8 "$b" | tr -d '\0')" = SNAPCIDX ]; then
    seed chunk_index "$name" <"$b"
  elif [ "$(head -c 8 "$b")" = SNAPCOBO ]; then
    seed outboard "$name" <"$b"
  elif grep -q '"format": "snapctl.image.v1"' "$b"; then
    seed image_config "$name" <"$b"
    # image_open input: config ‖ NUL ‖ the index it names.
    idx=$(grep -A1 '"index": {' "$b" | grep -o 'sha256:[0-9a-f]\{64\}' | head -1 || true)
    ixf=$(dirname "$b")/${idx#sha256:}
    if [ -n "$idx" ] && [ -f "$ixf" ]; then
      { cat "$b"; printf '\0'; cat "$ixf"; } | seed image_open "$name"
    fi
  elif grep -q '"schemaVersion"' "$b"; then
    seed manifest "$name" <"$b"
  else
    # A pack: its first chunk is a zstd or deflate stream or raw bytes; try each codec with
    # a 64 KiB bound, and as compression round-trip input.
    { printf '\001\000\000\001'; cat "$b"; } | seed decompress "zstd-$name"
    { printf '\002\000\000\001'; cat "$b"; } | seed decompress "flate-$name"
    { printf '\201\000\000\000'; head -c 4096 "$b"; } | seed decompress "rt-$name"
  fi
done
printf '\205\000\000\000snapctl snapctl snapctl snapctl snapctl snapctl snapctl snapctl snapctl' | seed decompress text-zstd
printf '\206\000\000\000snapctl snapctl snapctl snapctl snapctl snapctl snapctl snapctl snapctl' | seed decompress text-flate
i=0
for r in 'oci:/tmp/x:v1' 'oci:rel/dir' 'oci:a:b/c' "oci:/x@sha256:$(printf 'a%.0s' {1..64})" \
  'localhost:5000/vm/base:v2' '127.0.0.1:5000/a__b-c.d/e' "registry.example.com/a/b@sha256:$(printf '0%.0s' {1..64})"; do
  printf '%s' "$r" | seed reference "ref-$i"
  i=$((i + 1))
done
# A CRIU pagemap image: the two magics, pagemap_head {pages_id: 1}, then two entries
# {vaddr 0x7e0000000000, nr_pages 4, flags PRESENT|LAZY} and {vaddr +64 KiB, 1 page, 0}.
printf '\x19\x43\x56\x54\x25\x40\x08\x56\x02\x00\x00\x00\x08\x01\x0c\x00\x00\x00\x08\x80\x80\x80\x80\x80\xc0\x1f\x10\x04\x20\x06\x0a\x00\x00\x00\x08\x80\x80\x84\x80\x80\xc0\x1f\x10\x01' | seed criu_pagemap valid-2
# The worked example of spec/lazy.md "Prefetch and traces", and a trace naming a chunk twice.
printf '%s' '{"format":"snapctl.trace.v1","file":"vm.mem","chunkSize":65536,"chunks":[9,0,20],"workingSet":[643072,53248,1363968],"zeroChunks":[1]}' | seed trace_json spec-example
printf '%s' '{"format":"snapctl.trace.v1","file":"vm.mem","chunkSize":65536,"chunks":[3],"zeroChunks":[1,1,1]}' | seed trace_json twice
# Signatures (spec/sign.md): the worked example's key files, payload and manifests, and a
# policy of every requirement and signedIdentity type.
vec() { awk -v m="<!-- vector: $1 -->" '$0 == m {on = 1; next} on && /^```/ {if (inside) exit; inside = 1; next} inside {print}' "$root/spec/sign.md"; }
for v in cosign.key cosign.pub; do vec "$v" | seed sign_key "$v"; done
for v in tag-manifest referrer-manifest payload; do vec "$v" | tr -d '\n' | seed sign_manifest "$v"; done
printf '%s' '{"default":[{"type":"reject"}],"transports":{"docker":{"r.io:5000/vm":[{"type":"sigstoreSigned","keyData":"eA==","signedIdentity":{"type":"matchRepository"}}],"r.io/a":[{"type":"sigstoreSigned","keyPaths":["/k"],"signedIdentity":{"type":"remapIdentity","prefix":"r.io/a","signedPrefix":"q.io/b"}}],"*.io":[{"type":"insecureAcceptAnything"}],"":[{"type":"signedBy","keyType":"GPGKeys","keyPath":"/g"}]},"oci":{"/srv":[{"type":"sigstoreSigned","keyPath":"/k","signedIdentity":{"type":"exactRepository","dockerRepository":"r.io/a"}}]}}}' | seed sign_policy policy
# serve's configuration file: the example of spec/registry.md §4.1, and one key of every
# kind (sizes, durations as text and numbers, zot's camelCase spellings).
awk '/^```toml$/ {on = 1; next} on && /^```$/ {exit} on {print}' "$root/spec/registry.md" | seed serve_config spec-example
printf '%s\n' 'storage = "s3://b/p"' 'max_manifest_bytes = "4MiB"' 'chunk_min_length = 5242880' 'header_timeout = "1h30m"' 'idle_timeout = 120' \
  'log_format = "json"' '[gc]' 'interval = "0"' 'pull_flush = "5m"' '[retention]' 'dryRun = true' 'delay = "30d"' '[[retention.policies]]' \
  'repositories = ["team/*", "tmp/**", "a?c"]' 'deleteUntagged = false' \
  'keepTags = [{ patterns = ["v[0-9]+", "latest"], mostRecentlyPushedCount = 3, pulledWithin = "7d" }, { pushed_within = "720h" }]' | seed serve_config keys
# A repository's pull times (spec/registry.md §4.3).
printf '{"sha256:%s":1767225600,"sha256:%s":0,"not-a-digest":5}' "$(printf 'a%.0s' {1..64})" "$(printf '0%.0s' {1..64})" | seed pulled_json two
for t in "${targets[@]}"; do echo "fuzz-smoke: $t: $(find "$corpus/$t" -type f | wc -l) seeds" >&2; done

cd "$root/fuzz"
echo "fuzz-smoke: building ${#targets[@]} targets (target dir $CARGO_TARGET_DIR)" >&2
# One build for all targets (ASan + libFuzzer, optimised), then run the binaries directly:
# one cargo invocation per target would re-check the build each time.
cargo fuzz build -O
bin=$CARGO_TARGET_DIR/$(rustc -vV | sed -n 's/^host: //p')/release
failed=()
for t in "${targets[@]}"; do
  echo "fuzz-smoke: $t for ${secs}s" >&2
  mkdir -p "$root/fuzz/artifacts/$t"
  # -rss_limit_mb / -malloc_limit_mb: an allocation over 2 GiB is a finding (a decoder must
  # bound what it allocates by its input and the format's limits).
  if ! "$bin/$t" "$corpus/$t" -artifact_prefix="$root/fuzz/artifacts/$t/" \
      -max_total_time="$secs" -rss_limit_mb=2048 -malloc_limit_mb=2048 -timeout=10 -print_final_stats=1 \
      2>"$corpus/$t.log"; then
    failed+=("$t")
    echo "fuzz-smoke: $t FAILED; last lines of its log:" >&2
    tail -40 "$corpus/$t.log" >&2
  else
    grep -E '^stat::(number_of_executed_units|peak_rss_mb)' "$corpus/$t.log" | sed "s/^/fuzz-smoke: $t: /" >&2 || true
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz-smoke: crashes in: ${failed[*]} (inputs in fuzz/artifacts/)" >&2
  exit 1
fi
echo "fuzz-smoke: ${#targets[@]} targets ran ${secs}s each, no crash" >&2

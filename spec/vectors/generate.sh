#!/usr/bin/env bash
# Regenerates the spec test vectors in spec/vectors/ from their deterministic inputs.
#
#   spec/vectors/generate.sh                       # uses target/debug/snapctl
#   SNAPCTL=/path/to/snapctl spec/vectors/generate.sh
#
# Needs snapctl, jq, awk, od, dd, sha256sum. Writes, next to this script:
#   <vector>/          an OCI image layout per vector (one or more tagged images)
#   lies/              "consistent lies", one tag each: images whose every digest matches
#                      its blob, but whose content is wrong; `snapctl verify` must say no
#   vectors.json       inputs, expected roots and digests, corruption points, lies
#
# Inputs are generated, never stored: a file is a list of parts, each
#   {"text": TAG, "len": N}  the first N bytes of the lines "TAG 00000001\n", "TAG 00000002\n", …
#                            (awk: printf "%s %08d\n", TAG, i for i = 1, 2, …)
#   {"zero": N}              N zero bytes
# Every image is packed with SOURCE_DATE_EPOCH=0, files mode 0644, --kind dir, from the
# directory spec/vectors/ (so parent/base references read "oci:<vector>:<tag>").
#
# Each corruption flips the lowest bit of one byte (xor 0x01) of one blob of a pristine
# copy; `snapctl verify` must exit 1. The script checks that, and records what verify
# reported, before writing vectors.json.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
SNAPCTL=${SNAPCTL:-$root/target/debug/snapctl}
[ -x "$SNAPCTL" ] || { echo "generate.sh: $SNAPCTL not found (cargo build -p snapctl, or set SNAPCTL)" >&2; exit 2; }
export SOURCE_DATE_EPOCH=0 NO_COLOR=1
unset SNAPCTL_LOG
umask 022
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# ---------------------------------------------------------------------------------------
# The vectors. Chunk size 64 KiB everywhere: the smallest allowed, so boundaries are cheap.
files_boundaries='[
  {"name": "empty",            "parts": []},
  {"name": "sub/one-byte",     "parts": [{"text": "b", "len": 1}]},
  {"name": "one-chunk",        "parts": [{"text": "c", "len": 65536}]},
  {"name": "chunk-plus-one",   "parts": [{"text": "c", "len": 65537}]},
  {"name": "zeros",            "parts": [{"zero": 150000}]},
  {"name": "mixed",            "parts": [{"text": "m", "len": 65536}, {"zero": 65536}, {"text": "t", "len": 67}]}
]'
vectors=$(jq -n --argjson fb "$files_boundaries" '[
  {name: "boundaries-blake3", hash: "blake3", compress: "zstd", chunk_size: 65536,
   about: "boundary sizes (0, 1, one chunk, one chunk + 1 deduplicated against it, all-zero with a short zero tail, text|zero|tail), BLAKE3, zstd",
   images: [{tag: "v1", files: $fb}]},
  {name: "boundaries-sha256", hash: "sha256", compress: "flate", chunk_size: 65536,
   about: "the same inputs with SHA-256 and deflate",
   images: [{tag: "v1", files: $fb}]},
  {name: "raw-blake3", hash: "blake3", compress: "none", chunk_size: 65536,
   about: "no compression: every stored chunk is raw, so the pack is the chunk bytes; a zero chunk then a short tail",
   images: [{tag: "v1", files: [
     {name: "vm.state", parts: [{text: "s", len: 1000}]},
     {name: "vm.mem", parts: [{zero: 65536}, {text: "q", len: 700}]}]}]},
  {name: "chain", hash: "blake3", compress: "zstd", chunk_size: 65536,
   about: "a parent, a layer over it (one chunk changed, one chunk zeroed, one file unchanged, one file added), an image with the parent as its base, and the layer'"'"'s content rebased (--parent child --max-chain 0): a full index into the chain'"'"'s packs, no parent, the layer'"'"'s root",
   images: [
     {tag: "parent", files: [
       {name: "mem", parts: [{text: "p", len: 65536}, {text: "q", len: 65536}, {text: "r", len: 65536}, {text: "s", len: 65536}]},
       {name: "state", parts: [{text: "st", len: 3000}]}]},
     {tag: "child", parent: "parent", files: [
       {name: "mem", parts: [{text: "p", len: 65536}, {text: "q", len: 65536}, {text: "x", len: 65536}, {zero: 65536}]},
       {name: "new", parts: [{text: "n", len: 10}]},
       {name: "state", parts: [{text: "st", len: 3000}]}]},
     {tag: "based", base: "parent", files: [
       {name: "mem", parts: [{text: "p", len: 65536}, {text: "y", len: 100}]}]},
     {tag: "rebased", parent: "child", max_chain: 0, files: [
       {name: "mem", parts: [{text: "p", len: 65536}, {text: "q", len: 65536}, {text: "x", len: 65536}, {zero: 65536}]},
       {name: "new", parts: [{text: "n", len: 10}]},
       {name: "state", parts: [{text: "st", len: 3000}]}]}]},
  {name: "slices-blake3", hash: "blake3", compress: "none", chunk_size: 65536,
   about: "outboards: raw chunks of 16 slices, 3 slices (a 10 KiB tail), 2 slices (4097 bytes) and 1 slice (4096 bytes: no entry); a layer with one changed chunk, whose manifest lists its own outboard and the parent outboard",
   images: [
     {tag: "v1", files: [
       {name: "mem", parts: [{text: "a", len: 65536}, {zero: 65536}, {text: "b", len: 10240}]},
       {name: "edge", parts: [{text: "e", len: 4097}]},
       {name: "page", parts: [{text: "p", len: 4096}]}]},
     {tag: "layer", parent: "v1", files: [
       {name: "mem", parts: [{text: "c", len: 65536}, {zero: 65536}, {text: "b", len: 10240}]},
       {name: "edge", parts: [{text: "e", len: 4097}]},
       {name: "page", parts: [{text: "p", len: 4096}]}]}]}
]')

# ---------------------------------------------------------------------------------------
text() { # TAG LEN: the first LEN bytes of "TAG 00000001\n", "TAG 00000002\n", …
  awk -v t="$1" -v n="$2" 'BEGIN { s = 0; for (i = 1; s < n; i++) { l = sprintf("%s %08d\n", t, i); if (s + length(l) > n) l = substr(l, 1, n - s); printf "%s", l; s += length(l) } }'
}

make_files() { # FILES_JSON DIR
  local files=$1 dir=$2 n i name parts k p
  mkdir -p "$dir"
  n=$(jq length <<<"$files")
  for ((i = 0; i < n; i++)); do
    name=$(jq -r ".[$i].name" <<<"$files")
    parts=$(jq -c ".[$i].parts" <<<"$files")
    mkdir -p "$(dirname "$dir/$name")"
    : >"$dir/$name"
    for ((k = 0; k < $(jq length <<<"$parts"); k++)); do
      p=$(jq -c ".[$k]" <<<"$parts")
      if jq -e 'has("zero")' <<<"$p" >/dev/null; then
        head -c "$(jq .zero <<<"$p")" /dev/zero >>"$dir/$name"
      else
        text "$(jq -r .text <<<"$p")" "$(jq .len <<<"$p")" >>"$dir/$name"
      fi
    done
    chmod 0644 "$dir/$name"
  done
}

u32_at() { od -An -tu4 -j "$2" -N4 "$1" | tr -d ' '; }
u64_at() { od -An -tu8 -j "$2" -N8 "$1" | tr -d ' '; }
byte_at() { od -An -tu1 -j "$2" -N1 "$1" | tr -d ' '; }
poke() { # FILE OFFSET HEX...: overwrite bytes in place
  local f=$1 off=$2 hex=$3
  printf "$(sed 's/../\\x&/g' <<<"$hex")" | dd of="$f" bs=1 seek="$off" conv=notrunc status=none
}
flip() { # FILE OFFSET: xor the byte at OFFSET with 0x01
  local b
  b=$(byte_at "$1" "$2")
  poke "$1" "$2" "$(printf '%02x' $((b ^ 1)))"
}
blob() { echo "$1/blobs/sha256/${2#sha256:}"; }
manifest_of() { jq -r --arg t "$2" '.manifests[] | select(.annotations["org.opencontainers.image.ref.name"] == $t) | .digest' "$1/index.json"; }
config_of() { jq -r .config.digest "$(blob "$1" "$(manifest_of "$1" "$2")")"; }
index_of() { jq -r .index.digest "$(blob "$1" "$(config_of "$1" "$2")")"; }

# Rename every blob whose content no longer hashes to its name, rewriting the references
# to it (configs, manifests, index.json), until the layout is consistent again. Rewrites
# keep lengths (a hex digest for a hex digest), so descriptor sizes stay right.
fixup() {
  local dir=$1 changed=1 f old new
  while [ "$changed" = 1 ]; do
    changed=0
    for f in "$dir"/blobs/sha256/*; do
      old=$(basename "$f")
      new=$(sha256sum "$f" | cut -d' ' -f1)
      if [ "$old" != "$new" ]; then
        mv "$f" "$dir/blobs/sha256/$new"
        grep -l "$old" "$dir"/blobs/sha256/* "$dir/index.json" | xargs -r sed -i "s/$old/$new/g"
        changed=1
      fi
    done
  done
}

# Record byte offset of chunk CHUNK of file NAME in the index of image TAG of LAYOUT
# (fails if that chunk has no record).
record_offset() {
  local dir=$1 tag=$2 name=$3 chunk=$4 ix cfg fi F P first count r
  ix=$(blob "$dir" "$(index_of "$dir" "$tag")")
  cfg=$(blob "$dir" "$(config_of "$dir" "$tag")")
  fi=$(jq --arg n "$name" '.files | map(.name) | index($n)' "$cfg")
  F=$(u32_at "$ix" 16)
  P=$(u32_at "$ix" 20)
  first=$(u64_at "$ix" $((64 + 32 * fi + 8)))
  count=$(u64_at "$ix" $((64 + 32 * fi + 16)))
  for ((r = first; r < first + count; r++)); do
    local off=$((64 + 32 * F + 40 * P + 64 * r))
    if [ "$(u64_at "$ix" "$off")" = "$chunk" ]; then echo "$off"; return; fi
  done
  echo "no record for $name chunk $chunk" >&2
  return 1
}

# Replace the roots a lie made stale with the ones verify computes, so only the content
# check is left to catch it.
patch_roots() { # LAYOUT (absolute) TAG
  local dir=$1 tag=$2 out pair
  fixup "$dir"
  out=$("$SNAPCTL" verify --json "oci:$dir:$tag" 2>/dev/null || true)
  while read -r pair; do
    [ -n "$pair" ] || continue
    grep -l "${pair% *}" "$dir"/blobs/sha256/* "$dir/index.json" | xargs -r sed -i "s/${pair% *}/${pair#* }/g"
  done < <(jq -r '.report.failures[] | select(.kind == "file-root" or .kind == "image-root") | .message
                  | capture("(?:file|content) root is (?<want>\\S+), config says (?<have>\\S+)") | "\(.have) \(.want)"' <<<"$out")
  fixup "$dir"
}

# Pretty JSON, but every object that starts 12 or more columns deep (a corruption point,
# an input file, an expected file) on one line, so vectors.json stays small and greppable.
collapse() {
  awk '
    depth == 0 && match($0, /^ +/) && RLENGTH >= 12 && $0 ~ /\{$/ { buf = $0; depth = 1; next }
    depth > 0 {
      line = $0; sub(/^ +/, "", line)
      buf = buf (buf ~ /[\[{]$/ || line ~ /^[\]}]/ ? "" : " ") line
      if ($0 ~ /[{[]$/) depth++
      if (line ~ /^[\]}],?$/) depth--
      if (depth == 0) print buf
      next
    }
    { print }'
}

# ---------------------------------------------------------------------------------------
cd "$here"
names=$(jq -r '.[].name' <<<"$vectors")
for v in $names; do rm -rf "${here:?}/$v"; done
rm -rf "$here/lies"

out_vectors='[]'
nv=$(jq length <<<"$vectors")
for ((vi = 0; vi < nv; vi++)); do
  V=$(jq -c ".[$vi]" <<<"$vectors")
  name=$(jq -r .name <<<"$V")
  images_out='[]'
  ni=$(jq '.images | length' <<<"$V")
  for ((ii = 0; ii < ni; ii++)); do
    I=$(jq -c ".images[$ii]" <<<"$V")
    tag=$(jq -r .tag <<<"$I")
    src="$work/$name/$tag"
    make_files "$(jq -c .files <<<"$I")" "$src"
    args=(--kind dir --chunk-size "$(jq .chunk_size <<<"$V")" --hash "$(jq -r .hash <<<"$V")" --compress "$(jq -r .compress <<<"$V")")
    if jq -e .parent <<<"$I" >/dev/null; then args+=(--parent "oci:$name:$(jq -r .parent <<<"$I")"); fi
    if jq -e .base <<<"$I" >/dev/null; then args+=(--base "oci:$name:$(jq -r .base <<<"$I")"); fi
    if jq -e 'has("max_chain")' <<<"$I" >/dev/null; then args+=(--max-chain "$(jq .max_chain <<<"$I")"); fi
    manifest=$("$SNAPCTL" pack "$src" "oci:$name:$tag" "${args[@]}")
    cfg=$(blob "$name" "$(config_of "$name" "$tag")")
    (cd "$here" && "$SNAPCTL" verify "oci:$name:$tag" >/dev/null)

    # Corruption points: every structural region of every blob this image owns, and the
    # first and last byte of every pack it uses (own or inherited).
    m=$(blob "$name" "$manifest")
    idx_d=$(index_of "$name" "$tag")
    ix=$(blob "$name" "$idx_d")
    F=$(u32_at "$ix" 16)
    P=$(u32_at "$ix" 20)
    R=$(u64_at "$ix" 24)
    pt=$((64 + 32 * F))
    rt=$((pt + 40 * P))
    points=()
    add() { points+=("$1 $2 $3 $4"); } # blob-kind digest offset region
    msize=$(stat -c %s "$m")
    add manifest "$manifest" 0 "manifest: first byte"
    add manifest "$manifest" "$(grep -bo '"dev.snapctl.root":"' "$m" | head -1 | cut -d: -f1 | awk '{print $1 + 30}')" "manifest: dev.snapctl.root annotation value"
    add manifest "$manifest" $((msize - 1)) "manifest: last byte"
    cdig=$(config_of "$name" "$tag")
    add config "$cdig" 0 "config: first byte"
    add config "$cdig" "$(grep -bo '"chunkSize": ' "$cfg" | head -1 | cut -d: -f1 | awk '{print $1 + 13}')" "config: chunkSize value"
    add config "$cdig" "$(grep -bo '"root": "' "$cfg" | head -1 | cut -d: -f1 | awk '{print $1 + 20}')" "config: first file root"
    add index "$idx_d" 0 "index header: magic"
    add index "$idx_d" 8 "index header: major version"
    add index "$idx_d" 12 "index header: hash algorithm"
    add index "$idx_d" 13 "index header: chunk_shift"
    add index "$idx_d" 14 "index header: flags"
    add index "$idx_d" 16 "index header: file_count"
    add index "$idx_d" 20 "index header: pack_count"
    add index "$idx_d" 24 "index header: record_count"
    add index "$idx_d" 40 "index header: reserved"
    if [ "$F" -gt 0 ]; then
      add index "$idx_d" 64 "index file 0: size"
      add index "$idx_d" $((64 + 8)) "index file 0: first_record"
      add index "$idx_d" $((64 + 16)) "index file 0: record_count"
      add index "$idx_d" $((64 + 24)) "index file 0: reserved"
    fi
    if [ "$P" -gt 0 ]; then
      add index "$idx_d" "$pt" "index pack 0: sha256"
      add index "$idx_d" $((pt + 32)) "index pack 0: size"
    fi
    if [ "$R" -gt 0 ]; then
      last=$((rt + 64 * (R - 1)))
      add index "$idx_d" "$rt" "index record 0: chunk"
      add index "$idx_d" $((rt + 8)) "index record 0: pack"
      add index "$idx_d" $((rt + 12)) "index record 0: kind"
      add index "$idx_d" $((rt + 13)) "index record 0: codec"
      add index "$idx_d" $((rt + 16)) "index record 0: offset"
      add index "$idx_d" $((rt + 24)) "index record 0: stored_len"
      add index "$idx_d" $((rt + 32)) "index record 0: digest"
      add index "$idx_d" $((last + 16)) "index last record: offset"
      add index "$idx_d" $((last + 63)) "index last record: digest, last byte"
    fi
    for p in $(jq -r '.layers[] | select(.mediaType != "application/vnd.snapctl.snapshot.pack.v1" and .annotations["dev.snapctl.owner"] != "self")
                      | "\(.digest)=\(.mediaType | sub(".*snapshot[.]"; "") | sub("[.]v1.*"; ""))=\(.annotations["dev.snapctl.owner"])"' "$m"); do
      IFS== read -r pd what owner <<<"$p"
      add "$what" "$pd" 0 "$what ($owner): first byte"
    done
    for p in $(jq -r '.layers[] | select(.mediaType == "application/vnd.snapctl.snapshot.pack.v1") | "\(.digest)=\(.size)=\(.annotations["dev.snapctl.owner"])"' "$m"); do
      IFS== read -r pd psize owner <<<"$p"
      add pack "$pd" 0 "pack ($owner): first byte"
      add pack "$pd" $((psize - 1)) "pack ($owner): last byte"
    done
    # The image's own outboard: every header field, the first entry's fields, the first
    # and last CV; and a byte inside the second slice of the first pack (a slice reader
    # must refuse that slice alone).
    ob_d=$(jq -r '.layers[] | select(.mediaType == "application/vnd.snapctl.snapshot.outboard.v1" and .annotations["dev.snapctl.owner"] == "self") | .digest' "$m")
    if [ -n "$ob_d" ]; then
      obf=$(blob "$name" "$ob_d")
      E=$(u32_at "$obf" 16)
      add outboard "$ob_d" 0 "outboard header: magic"
      add outboard "$ob_d" 8 "outboard header: major version"
      add outboard "$ob_d" 12 "outboard header: hash algorithm"
      add outboard "$ob_d" 13 "outboard header: chunk_shift"
      add outboard "$ob_d" 14 "outboard header: slice_shift"
      add outboard "$ob_d" 16 "outboard header: entry_count"
      add outboard "$ob_d" 24 "outboard header: cv_count"
      add outboard "$ob_d" 32 "outboard entry 0: digest"
      add outboard "$ob_d" $((32 + 32)) "outboard entry 0: chunk_len"
      add outboard "$ob_d" $((32 + 40)) "outboard entry 0: first_cv"
      add outboard "$ob_d" $((32 + 48 * E)) "outboard: first CV"
      add outboard "$ob_d" $(($(stat -c %s "$obf") - 1)) "outboard: last CV, last byte"
      first_pack=$(jq -r '[.layers[] | select(.mediaType == "application/vnd.snapctl.snapshot.pack.v1" and .annotations["dev.snapctl.owner"] == "self")][0].digest' "$m")
      add pack "$first_pack" 5000 "pack (self): byte 5000, inside slice 1 of the first chunk"
    fi

    corr='[]'
    for pt_ in "${points[@]}"; do
      read -r kind dig off region <<<"$pt_"
      rm -rf "$work/c" && cp -r "$here/$name" "$work/c"
      flip "$(blob "$work/c" "$dig")" "$off"
      vcode=0
      vout=$("$SNAPCTL" verify --json "oci:$work/c:$tag" 2>/dev/null) || vcode=$?
      if [ "$vcode" != 1 ]; then
        echo "generate.sh: $name:$tag: flipping $kind $dig at $off ($region) was not caught (exit $vcode)" >&2
        exit 1
      fi
      if [ "$kind" = pack ]; then
        detected=$(jq -c '(.report.failures[0]) | {kind, file, chunk, offset, blob_offset}' <<<"$vout")
      else
        # Metadata that Image::open reads fails there (`.failures`); an outboard, read by
        # the audit, fails in the report.
        detected=$(jq -c '(.failures // .report.failures)[0] | {kind}' <<<"$vout")
        jq -e --arg d "$dig" '(.failures // .report.failures)[0].message | contains($d + ": content hashes to")' <<<"$vout" >/dev/null \
          || { echo "generate.sh: $name:$tag: $region: verify did not name blob $dig: $vout" >&2; exit 1; }
      fi
      corr=$(jq -c --arg k "$kind" --arg d "$dig" --argjson o "$off" --arg r "$region" --argjson det "$detected" \
        '. + [{blob: $k, digest: $d, offset: $o, region: $r, detected: $det}]' <<<"$corr")
    done

    files_out=$(jq -c '[.files[] | {name, size, mode, chunks, root}]' "$cfg")
    images_out=$(jq -c --arg tag "$tag" --arg m "$manifest" --arg c "$cdig" --arg i "$idx_d" \
      --argjson isz "$(stat -c %s "$ix")" --arg root "$(jq -r .root "$cfg")" --argjson files "$files_out" \
      --argjson inputs "$(jq -c .files <<<"$I")" --argjson corr "$corr" \
      --argjson img "$I" \
      '. + [{tag: $tag, parent: $img.parent, base: $img.base} + ($img | with_entries(select(.key == "max_chain"))) + {inputs: $inputs,
             expected: {manifest: $m, config: $c, index: $i, index_size: $isz, root: $root, files: $files},
             corruptions: $corr}]' <<<"$images_out")
  done
  rm -f "$here/$name/.snapctl.lock"
  out_vectors=$(jq -c --argjson V "$V" --argjson imgs "$images_out" \
    '. + [{name: $V.name, about: $V.about, layout: $V.name, hash: $V.hash, compression: $V.compress, chunk_size: $V.chunk_size, images: $imgs}]' <<<"$out_vectors")
done

# ---------------------------------------------------------------------------------------
# Consistent lies: edit, re-hash every blob and rewrite every reference so all digests
# match; verify must still exit 1, through chunk digests or Merkle roots.
lies='[]'
mkdir -p "$here/lies/blobs/sha256"
printf '{"imageLayoutVersion":"1.0.0"}' >"$here/lies/oci-layout"
echo '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[]}' >"$here/lies/index.json"
lie() { # NAME FROM TAG ABOUT: a scratch copy of layout FROM in $LIE; edits follow, then finish_lie
  LIE_NAME=$1; LIE="$work/lie"; LIE_TAG=$3; LIE_ABOUT=$4
  rm -rf "$LIE" && cp -r "$here/$2" "$LIE"
}
finish_lie() { # EXPECTED_KIND FILE CHUNK (file/chunk may be ""): check it, then add it to lies/ as tag NAME
  fixup "$LIE"
  local out vcode=0 desc
  out=$("$SNAPCTL" verify --json "oci:$LIE:$LIE_TAG" 2>/dev/null) || vcode=$?
  if [ "$vcode" != 1 ]; then echo "generate.sh: lie $LIE_NAME was not caught (exit $vcode)" >&2; exit 1; fi
  if ! jq -e --arg k "$1" '.report.failures | any(.kind == $k)' <<<"$out" >/dev/null; then
    echo "generate.sh: lie $LIE_NAME: expected a $1 failure, verify said: $out" >&2; exit 1
  fi
  cp -n "$LIE"/blobs/sha256/* "$here/lies/blobs/sha256/"
  desc=$(jq -c --arg t "$LIE_TAG" --arg n "$LIE_NAME" '.manifests[] | select(.annotations["org.opencontainers.image.ref.name"] == $t)
                                                      | .annotations["org.opencontainers.image.ref.name"] = $n' "$LIE/index.json")
  jq -c --argjson d "$desc" '.manifests += [$d]' "$here/lies/index.json" >"$work/index.json" && mv "$work/index.json" "$here/lies/index.json"
  lies=$(jq -c --arg n "$LIE_NAME" --arg a "$LIE_ABOUT" --arg k "$1" --arg f "$2" --arg c "$3" \
    --arg m "$(manifest_of "$LIE" "$LIE_TAG")" --argjson kinds "$(jq -c '[.report.failures[].kind] | unique' <<<"$out")" \
    '. + [{layout: "lies", tag: $n, about: $a, manifest: $m, expect: ({kind: $k} + (if $f == "" then {} else {file: $f, chunk: ($c | tonumber)} end)), reported_kinds: $kinds}]' <<<"$lies")
}

lie record-digest boundaries-blake3 v1 "a stored record's digest changed (roots left stale)"
off=$(record_offset "$LIE" v1 mixed 0); flip "$(blob "$LIE" "$(index_of "$LIE" v1)")" $((off + 32))
finish_lie chunk-digest mixed 0

lie consistent-roots boundaries-blake3 v1 "a stored record's digest changed, and every file root, the content root and the annotations recomputed to match it: only the chunk check can tell"
off=$(record_offset "$LIE" v1 mixed 0); flip "$(blob "$LIE" "$(index_of "$LIE" v1)")" $((off + 32))
patch_roots "$LIE" v1
finish_lie chunk-digest mixed 0

lie zero-record boundaries-blake3 v1 "a zero record's digest changed, roots recomputed to match"
off=$(record_offset "$LIE" v1 mixed 1); flip "$(blob "$LIE" "$(index_of "$LIE" v1)")" $((off + 63))
patch_roots "$LIE" v1
finish_lie zero-record mixed 1

lie record-location boundaries-blake3 v1 "mixed chunk 0's record points at one-chunk chunk 0's stored bytes (same length and codec; digests and roots untouched)"
ixf=$(blob "$LIE" "$(index_of "$LIE" v1)")
from=$(record_offset "$LIE" v1 one-chunk 0); to=$(record_offset "$LIE" v1 mixed 0)
poke "$ixf" $((to + 8)) "$(xxd -p -s $((from + 8)) -l 24 "$ixf" | tr -d '\n')"
finish_lie chunk-digest mixed 0

lie file-root boundaries-blake3 v1 "the config's root of one file changed"
cfgf=$(blob "$LIE" "$(config_of "$LIE" v1)")
old=$(jq -r '.files[] | select(.name == "one-chunk") | .root' "$cfgf")
new="${old%?}$(printf '%x' $(( (16#${old: -1} + 1) % 16 )))"
sed -i "s/$old/$new/" "$cfgf"
finish_lie file-root "" ""

lie annotation-root boundaries-blake3 v1 "the manifest's dev.snapctl.root annotation names another root"
mf=$(blob "$LIE" "$(manifest_of "$LIE" v1)")
old=$(jq -r '.annotations["dev.snapctl.root"]' "$mf")
new="${old%?}$(printf '%x' $(( (16#${old: -1} + 1) % 16 )))"
sed -i "s/$old/$new/" "$mf"
finish_lie image-root "" ""

lie parent-root chain child "the layer's config names its parent with another root"
cfgf=$(blob "$LIE" "$(config_of "$LIE" child)")
old=$(jq -r '.parent.root' "$cfgf")
new="${old%?}$(printf '%x' $(( (16#${old: -1} + 1) % 16 )))"
sed -i "s/\"root\": \"$old\"/\"root\": \"$new\"/" "$cfgf"
finish_lie chain-root "" ""

lie layer-record chain child "the layer's record of its changed chunk has another digest, roots recomputed to match"
off=$(record_offset "$LIE" child mem 2); flip "$(blob "$LIE" "$(index_of "$LIE" child)")" $((off + 40))
patch_roots "$LIE" child
finish_lie chunk-digest mem 2

lie outboard-cv slices-blake3 v1 "one CV of the outboard changed (the blob re-hashed, the manifest rewritten): the entry no longer merges to its chunk digest"
mf=$(blob "$LIE" "$(manifest_of "$LIE" v1)")
obf=$(blob "$LIE" "$(jq -r '.layers[] | select(.mediaType == "application/vnd.snapctl.snapshot.outboard.v1") | .digest' "$mf")")
flip "$obf" $((32 + 48 * $(u32_at "$obf" 16) + 32 * 5 + 7))
finish_lie outboard "" ""

lie parent-pack chain child "a chunk the layer inherits from its parent has other bytes in the parent's pack; the pack and every digest naming it (parent index, configs, manifests) rewritten to match"
pmf=$(blob "$LIE" "$(manifest_of "$LIE" parent)")
ppack=$(jq -r '.layers[] | select(.mediaType == "application/vnd.snapctl.snapshot.pack.v1") | .digest' "$pmf" | head -1)
old=${ppack#sha256:}
flip "$(blob "$LIE" "$ppack")" 0
new=$(sha256sum "$(blob "$LIE" "$ppack")" | cut -d' ' -f1)
mv "$(blob "$LIE" "$ppack")" "$LIE/blobs/sha256/$new"
# The index names packs by raw sha256 bytes, not hex: rewrite those too.
for f in "$LIE"/blobs/sha256/*; do
  if [ "$(head -c 8 "$f" | tr -d '\0')" = SNAPCIDX ]; then
    hexdump=$(xxd -p "$f" | tr -d '\n')
    if [[ $hexdump == *"$old"* ]]; then
      pos=$(( $(awk -v h="$hexdump" -v o="$old" 'BEGIN { print index(h, o) - 1 }') / 2 ))
      poke "$f" "$pos" "$new"
    fi
  fi
done
grep -l "$old" "$LIE"/blobs/sha256/* "$LIE/index.json" | xargs -r sed -i "s/$old/$new/g"
finish_lie chunk-corrupt mem 0


jq -n --argjson v "$out_vectors" --argjson l "$lies" '{
  about: "snapctl image format test vectors. See spec/format.md, \"Test vectors\". Regenerate with spec/vectors/generate.sh.",
  inputs: "a file is its parts concatenated: {text: T, len: N} = first N bytes of the lines \"T 00000001\\n\", \"T 00000002\\n\", … (printf \"%s %08d\\n\"); {zero: N} = N zero bytes. Mode 0644. Packed with SOURCE_DATE_EPOCH=0 --kind dir from spec/vectors/.",
  corruption: "flip the lowest bit (xor 0x01) of the byte at offset in the named blob of a copy of the layout: snapctl verify of that tag must exit 1. detected = what the reference implementation reported.",
  manifest_digests: "expected.manifest is reproducible only with the same compressor output; roots never depend on compression or packing.",
  vectors: $v,
  lies: $l
}' | collapse >"$here/vectors.json"
echo "wrote $(jq '.vectors | length' "$here/vectors.json") vectors, $(jq '[.vectors[].images[].corruptions[]] | length' "$here/vectors.json") corruptions, $(jq '.lies | length' "$here/vectors.json") lies; $(find "$here" -type f -printf '%s\n' | awk '{ s += $1 } END { printf "%d", s / 1024 }') KiB" >&2

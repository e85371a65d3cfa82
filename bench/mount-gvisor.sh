#!/usr/bin/env bash
# gVisor restored across a dialled network through `snapctl mount` (tests/src/netem.rs
# through netem_proxy): runsc 2024's restore from the mount against `snapctl pull` plus a
# restore from the pulled directory, and a reader that stands in for a restore that loads
# memory behind the application.
#
#   bash bench/mount-gvisor.sh               a 1 GiB sandbox, RTT 20 ms, 1 Gbit/s,
#                                            window link, 3 runs
#   Options: --size SIZE  the sandbox's heap (default 1GiB)  --rtt MS (default 20)
#            --rate 1gbit  --runs N (default 3)  --tag NAME
#            --links "window deep"  netem_proxy's --link, taking turns within each run
#            --first SIZE  how much of pages.img the stand-in reads: the first SIZE the
#                          recorded restore read, in its order (default 64MiB)
#            --runsc PATH  runsc 2024 (default /opt/snapctl-runsc/runsc,
#                          scripts/install-trixie.sh)
#            --mount-flags "--prefetch none"  more `snapctl mount` flags for (b) and (c)
#                          (default: none, the mount's defaults)
#
# Setup (untimed): tests/runtimes/heap_counter.c, built static, runs under runsc
# (--platform=ptrace --network=none) with SIZE of heap, every byte of it from a random
# stream (no zero page, no two pages alike), and a counter it appends to a file every
# 100 ms. It is checkpointed (--compression=none --exclude-committed-zero-pages:
# checkpoint.img, pages_meta.img and pages.img) and pushed (--kind gvisor) to a `snapctl
# serve` on 127.0.0.1. One restore from that local directory, its files first evicted from
# the page cache, is recorded with the kernel's filemap tracepoints (tracefs; every read of
# the three files, whatever system call made it, in order): what runsc reads first.
#
# Per run and link, each step through a fresh proxy and with a fresh, empty chunk cache:
#  (a) `snapctl pull REF DIR` (pull s), then `runsc restore --image-path DIR` timed until
#      the restored counter is seen to continue (local restore s);
#  (b) `snapctl mount REF DIR` (its defaults), then `runsc restore --image-path` the mount,
#      timed from the start of `snapctl mount` until the counter continues (mount restore
#      s); the bytes through the proxy. Goal: mount restore <= pull + 0.5 x local restore
#      (this runsc loads all of memory before the application runs again);
#  (c) the stand-in: `snapctl mount REF DIR` (its defaults) and from its start a reader
#      reads checkpoint.img and pages_meta.img whole, then the pages.img ranges of --first,
#      in the recorded order. Goal: those ranges read within their transfer (the stored
#      bytes of the chunks under them and of the two files, at --rate) + 2 RTT.
# A failed restore from the mount is reported with runsc's error and the mount's log (in
# the JSON lines), and the runs go on.
#
# Output: markdown on stdout and in bench/results/mount-gvisor-DATE[-TAG].md, every run as
# JSON lines beside it. Needs root, /dev/fuse, tracefs, runsc 2024, gcc (static libc), jq,
# python3, curl. Binaries: SNAPCTL, NETEM, FAKE_VMM as bench/lib/bins.sh takes them.
set -euo pipefail
trap 'echo "mount-gvisor.sh: line $LINENO failed: $BASH_COMMAND" >&2' ERR

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ARGV=("$@")
SIZE=1GiB RTT=20 RATE=1gbit RUNS=3 TAG="" LINKS=window FIRST=64MiB RUNSC=/opt/snapctl-runsc/runsc MOUNT_FLAGS=""
while [ $# -gt 0 ]; do
  case "$1" in
    --size) SIZE=$2; shift ;;
    --rtt) RTT=$2; shift ;;
    --rate) RATE=$2; shift ;;
    --runs) RUNS=$2; shift ;;
    --tag) TAG=$2; shift ;;
    --links) LINKS=$2; shift ;;
    --first) FIRST=$2; shift ;;
    --runsc) RUNSC=$2; shift ;;
    --mount-flags) MOUNT_FLAGS=$2; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "mount-gvisor.sh: unknown option $1 (try --help)" >&2; exit 2 ;;
  esac
  shift
done
# shellcheck source=bench/lib/bins.sh
source "$ROOT/bench/lib/bins.sh"
# shellcheck source=bench/lib/memory.sh
source "$ROOT/bench/lib/memory.sh"
need mount-gvisor.sh jq python3 curl gcc
[ "$(id -u)" = 0 ] || { echo "mount-gvisor.sh: runsc and the mount need root" >&2; exit 2; }
[ -x "$RUNSC" ] || { echo "mount-gvisor.sh: no runsc at $RUNSC (bash scripts/install-trixie.sh runsc)" >&2; exit 2; }
[ -e /dev/fuse ] || { echo "mount-gvisor.sh: no /dev/fuse" >&2; exit 2; }
BYTES=$(to_bytes "$SIZE")
MIB=$((BYTES >> 20))
FIRST_BYTES=$(to_bytes "$FIRST")
[ "$MIB" -ge 1 ] || { echo "mount-gvisor.sh: --size below 1 MiB" >&2; exit 2; }
release_bins
work_dir mount-gvisor.sh
SERVER_LOGS=$W
# shellcheck source=bench/lib/servers.sh
source "$ROOT/bench/lib/servers.sh"
export SNAPCTL_MOUNT_HOST=$W/host
TRACEFS=/sys/kernel/tracing TRACEFS_MOUNTED=0 TRACE_INSTANCE=snapctl-mount-gvisor-$$
cleanup() {
  mountpoint -q "$W/d" 2>/dev/null && "$SNAPCTL" umount --lazy "$W/d" >/dev/null 2>&1
  mountpoint -q "$W/host" 2>/dev/null && umount -l "$W/host"
  if [ -d "$W/runsc" ]; then
    for id in $("$RUNSC" --root "$W/runsc" list -quiet 2>/dev/null); do
      "$RUNSC" --platform=ptrace --network=none --root "$W/runsc" delete -force "$id" >/dev/null 2>&1 || true
    done
  fi
  [ -d "$TRACEFS/instances/$TRACE_INSTANCE" ] && rmdir "$TRACEFS/instances/$TRACE_INSTANCE"
  [ "$TRACEFS_MOUNTED" = 1 ] && umount "$TRACEFS"
  stop_and_clean
}
trap cleanup EXIT

NAME=mount-gvisor-$(date -u +%F)${TAG:+-$TAG}
mkdir -p "$ROOT/bench/results"
if [ -e "$ROOT/bench/results/$NAME.md" ] || [ -e "$ROOT/bench/results/$NAME.jsonl" ]; then NAME=$NAME-$(date -u +%H%M); fi
OUT=$ROOT/bench/results/$NAME.md
RUNLOG=$ROOT/bench/results/$NAME.jsonl
: > "$RUNLOG"

COMMON=$(jq -nc --arg runsc "$RUNSC" --arg root "$W/runsc" --arg heap "$W/heap_counter" --argjson mib "$MIB" \
  --arg snapctl "$SNAPCTL" --arg work "$W" --arg mf "$MOUNT_FLAGS" \
  '{runsc: $runsc, root: $root, heap: $heap, mib: $mib, snapctl: $snapctl, work: $work, mount_flags: ($mf | split(" ") | map(select(. != "")))}')
# g COMMAND JSON: a step of bench/lib/gvisor.py with COMMON and JSON as its arguments.
g() { python3 "$ROOT/bench/lib/gvisor.py" "$1" "$(jq -c --argjson e "$2" '. + $e' <<<"$COMMON")"; }

LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)
log "a $SIZE sandbox: build, run, checkpoint"
gcc -O2 -static -o "$W/heap_counter" "$ROOT/tests/runtimes/heap_counter.c"
CK=$(g checkpoint "$(jq -nc --arg b "$W/bundle-a" --arg i "$W/ckpt" '{bundle: $b, ticks: 5, image: $i}')")
log "checkpoint: $CK"
AT_SEED=$(jq -c '{at, seed}' <<<"$CK")
log "push to snapctl serve"
start_server snapctl "$W/storage"
"$SNAPCTL" push "$W/ckpt" "127.0.0.1:$PORT/bench/gvisor:v1" --kind gvisor --cache "$W/pushcache" >/dev/null
rm -rf "$W/pushcache"
g chunks "$(jq -nc --arg r "127.0.0.1:$PORT" '{registry: $r, repo: "bench/gvisor", tag: "v1"}')" > "$W/chunks.json"

log "record what a restore from the local checkpoint reads"
if [ ! -d "$TRACEFS/instances" ]; then mount -t tracefs nodev "$TRACEFS"; TRACEFS_MOUNTED=1; fi
g record "$(jq -c --arg i "$W/ckpt" --arg b "$W/bundle-rec" --arg t "$TRACE_INSTANCE" '. + {image: $i, bundle: $b, trace_instance: $t}' <<<"$AT_SEED")" > "$W/recorded.json"
if [ "$TRACEFS_MOUNTED" = 1 ]; then umount "$TRACEFS"; TRACEFS_MOUNTED=0; fi
g first "$(jq -nc --arg r "$W/recorded.json" --arg c "$W/chunks.json" --argjson f "$FIRST_BYTES" '{recorded: $r, chunks: $c, first: $f}')" > "$W/first.json"
log "recorded: $(jq -c 'del(.ranges) | .summary |= with_entries(.value |= (if type == "object" then del(.first_requests) else . end))' "$W/first.json")"

proxy_start() {
  : > "$W/net.out"
  "$NETEM" --upstream "127.0.0.1:$PORT" --rtt "${RTT}ms" --rate "$RATE" --link "$1" >"$W/net.out" 2>"$W/net.log" &
  NP=$!
  PIDS+=("$NP")
  for _ in $(seq 500); do [ -s "$W/net.out" ] && break; sleep 0.02; done
  REF=$(head -1 "$W/net.out")/bench/gvisor:v1
}
proxy_stop() { # sets NET: the proxy's summary
  kill "$NP"; wait "$NP" 2>/dev/null || true
  NET=$(tail -1 "$W/net.out")
  jq -e . <<<"$NET" >/dev/null || { echo "mount-gvisor.sh: no summary from netem_proxy: $(cat "$W/net.log")" >&2; exit 2; }
}

mkdir -p "$W/d"
for run in $(seq "$RUNS"); do
  for link in $LINKS; do
    proxy_start "$link"
    warm_memory $((2 * BYTES))
    A=$(g local "$(jq -c --arg r "$REF" --arg b "$W/b-local" '. + {ref: $r, bundle: $b}' <<<"$AT_SEED")")
    proxy_stop
    A=$(jq -c --argjson n "$NET" '. + {pull_bytes_down: $n.bytes_down}' <<<"$A")
    rm -rf "$W/pulled" "$W/cache-p" "$W/b-local"

    proxy_start "$link"
    warm_memory $((2 * BYTES))
    B=$(g mount "$(jq -c --arg r "$REF" --arg m "$W/d" --arg b "$W/b-mount" '. + {ref: $r, mnt: $m, bundle: $b}' <<<"$AT_SEED")")
    proxy_stop
    B=$(jq -c --argjson n "$NET" '. + {mount_bytes_down: $n.bytes_down, mount_connections: $n.connections}' <<<"$B")
    jq -e 'has("mount_error")' <<<"$B" >/dev/null && log "run $run: runsc restore from the mount FAILED: $(jq -r .mount_error <<<"$B")"
    rm -rf "$W/cache-m" "$W/b-mount"

    proxy_start "$link"
    warm_memory "$BYTES"
    C=$(g standin "$(jq -nc --arg r "$REF" --arg m "$W/d" --arg i "$W/ckpt" --arg f "$W/first.json" '{ref: $r, mnt: $m, image: $i, ranges_file: $f}')")
    proxy_stop
    C=$(jq -c --argjson n "$NET" '. + {standin_bytes_down: $n.bytes_down, rate_bps: $n.rate_bps}' <<<"$C")
    rm -rf "$W/cache-s"
    [ "$(jq .standin_right <<<"$C")" = true ] || { echo "mount-gvisor.sh: the stand-in read wrong bytes" >&2; exit 1; }

    jq -nc --argjson rtt "$RTT" --arg link "$link" --argjson run "$run" --argjson a "$A" --argjson b "$B" --argjson c "$C" \
      --argjson load "$(cut -d' ' -f1 /proc/loadavg)" '{rtt_ms: $rtt, link: $link, run: $run, load: $load} + $a + $b + $c' >> "$RUNLOG"
    log "run $run, link $link: $(tail -1 "$RUNLOG" | jq -c 'del(.mount_log)')"
  done
done
stop_server

exec > >(tee "$OUT")
SHOWN_ARGS=$(for a in "${ARGV[@]}"; do case $a in *" "*) printf ' "%s"' "$a" ;; *) printf ' %s' "$a" ;; esac; done)
echo "### $NAME: \`bash bench/mount-gvisor.sh$SHOWN_ARGS\`, $(date -u '+%Y-%m-%d %H:%M UTC')"
echo
echo "$(nproc) cores, load average at the start $LOAD_START and at the end $(cut -d' ' -f1-3 /proc/loadavg), snapctl $(git -C "$ROOT" rev-parse --short HEAD)$(git -C "$ROOT" diff --quiet HEAD -- . 2>/dev/null || echo '+changes') ($SNAPCTL), $($RUNSC --version | head -1); a $SIZE sandbox, RTT $RTT ms, cap $RATE, medians of $RUNS runs (min-max)."
echo
python3 - "$RUNLOG" "$W/first.json" "$W/chunks.json" "$CK" "$RTT" "$FIRST" <<'PY'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
first, chunks, ck = json.load(open(sys.argv[2])), json.load(open(sys.argv[3])), json.loads(sys.argv[4])
rtt, first_arg = float(sys.argv[5]), sys.argv[6]
# The cap as netem_proxy read it (bits per second).
rate = runs[0]["rate_bps"]
MiB = 1 << 20
def f(xs, d=2):
    return f"{statistics.median(xs):.{d}f} ({min(xs):.{d}f}-{max(xs):.{d}f})" if xs else "-"

print("| file | bytes | stored bytes (chunks fetched) |")
print("|---|---:|---:|")
for n, size in ck["sizes"].items():
    k = sum(1 for s in chunks["files"].get(n, []) if s)
    print(f"| {n} | {size} | {sum(chunks['files'].get(n, []))} ({k} chunk{'' if k == 1 else 's'} of {chunks['chunk_size'] // 1024} KiB) |")
print()
print("The image's metadata blobs, which a mount reads before it shows the files: " + ", ".join(f"{k} {v} bytes" for k, v in chunks["metadata_blobs"].items()) + ".")
print()
print("**Restore: pull then restore, against a restore from the mount.** Each from its command's start until the restored counter is seen to continue.")
print()
print("| link | pull s | local restore s | goal: pull + 0.5 x local s | mount restore s | mount / goal | within? | mount shown s | MiB through the proxy: pull, mount |")
print("|---|---:|---:|---:|---:|---:|---|---:|---:|")
for link in dict.fromkeys(r["link"] for r in runs):
    rs = [r for r in runs if r["link"] == link]
    ok = [r for r in rs if "mount_restore_s" in r]
    goal = [r["pull_s"] + 0.5 * r["local_restore_s"] for r in rs]
    ratio = [r["mount_restore_s"] / (r["pull_s"] + 0.5 * r["local_restore_s"]) for r in ok]
    if ratio:
        m = statistics.median(ratio)
        cells = f"{f([r['mount_restore_s'] for r in ok])} | {m:.2f} | {'yes' if m <= 1 else '**no**'}"
    else:
        cells = "- | - | **failed**"
    if len(ok) < len(rs):
        cells += f" ({len(rs) - len(ok)} of {len(rs)} failed)"
    mib = f"{statistics.median(r['pull_bytes_down'] for r in rs) / MiB:.0f}, {statistics.median(r['mount_bytes_down'] for r in rs) / MiB:.0f}"
    print(f"| {link} | {f([r['pull_s'] for r in rs])} | {f([r['local_restore_s'] for r in rs])} | {f(goal)} | {cells} | {f([r['mount_shown_s'] for r in rs])} | {mib} |")
for r in runs:
    if "mount_error" in r:
        print(f"\nRun {r['run']} ({r['link']}): runsc restore from the mount failed: `{r['mount_error'][:600]}`")
print()
stored = first["ranges_stored_bytes"] + first["meta_stored_bytes"]
transfer = stored * 8 / rate
budget = transfer + 2 * rtt / 1000
print(f"**The stand-in.** checkpoint.img and pages_meta.img whole, then {first['ranges_bytes'] / MiB:.0f} MiB of pages.img in {len(first['ranges'])} ranges (the first {first_arg} the recorded restore read, in its order; {first['chunks_under_ranges']} chunks under them), from the start of `snapctl mount`. Transfer: {stored} stored bytes (the chunks under the ranges {first['ranges_stored_bytes']}, the two files {first['meta_stored_bytes']}) at {rate / 1e9:g} Gbit/s = {transfer * 1e3:.0f} ms; budget = that + 2 RTT = {budget * 1e3:.0f} ms.")
print()
print("| link | mount shown ms | the two files read ms | ranges read ms | of which after shown ms | budget ms | read / budget | within? | MiB through the proxy |")
print("|---|---:|---:|---:|---:|---:|---:|---|---:|")
for link in dict.fromkeys(r["link"] for r in runs):
    rs = [r for r in runs if r["link"] == link]
    t = [r["standin_s"] for r in rs]
    ms = lambda k: f([r[k] * 1e3 for r in rs], 0)
    print(f"| {link} | {ms('standin_shown_s')} | {ms('standin_meta_s')} | {ms('standin_s')} | {f([(r['standin_s'] - r['standin_shown_s']) * 1e3 for r in rs], 0)} | {budget * 1e3:.0f} | {statistics.median(t) / budget:.2f} | {'yes' if statistics.median(t) <= budget else '**no**'} | {f([r['standin_bytes_down'] / MiB for r in rs], 0)} |")
print()
s = first["summary"]
print(f"**What the recorded restore read**: a restore from the local checkpoint, its files evicted from the page cache first; the counter continued {first['restore_s']:.2f} s after `runsc restore` started (filemap tracepoint events kept/written: {first['events_kept_written']}). Times from the start of `runsc restore`; a read is one read call as the reader made it, a piece one batch of pages it took from the page cache (its time is when it asked for them).")
print()
print("| file | reads | bytes read | first piece s | last piece s | largest read | mmap faults |")
print("|---|---:|---:|---:|---:|---:|---:|")
for n in ("checkpoint.img", "pages_meta.img", "pages.img"):
    if n in s:
        x = s[n]
        print(f"| {n} | {x['reads']} | {x['bytes']} | {x['first_s']:.3f} | {x['last_s']:.3f} | {x['largest']} | {x['faults']} |")
if "pages.img" in s:
    print()
    print("pages.img's first reads (offset, length): " + ", ".join(f"({o}, {l})" for o, l in s["pages.img"]["first_reads"]) + ".")
    print()
    print("pages.img's first pieces (s, offset, length): " + ", ".join(f"({t:.4f}, {o}, {l})" for t, o, l in s["pages.img"]["first_pieces"]) + ".")
PY
echo
echo "Every run: \`bench/results/$NAME.jsonl\`."

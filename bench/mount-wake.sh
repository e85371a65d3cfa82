#!/usr/bin/env bash
# A cold small read through `snapctl mount` across a dialled network (tests/src/netem.rs
# through netem_proxy): how long the first 4 KiB read of a chunk nobody fetched takes, and
# how long the mount takes to show the image.
#
#   bash bench/mount-wake.sh                 1 GiB image (half zero), RTT 2 20 50 ms,
#                                            1 Gbit/s, window link, 5 runs
#   Options: --size SIZE  --rtts "20 50" (ms)  --rate 1gbit  --runs N
#            --links "window deep"  (netem_proxy's --link)  --tag NAME
#            --read-all: each run also reads every file whole through a cold mount with
#            the defaults (a fresh chunk cache; from `snapctl mount` to `snapctl umount`
#            answered) against `snapctl pull` of the image through the same proxy (a
#            fresh cache), interleaved; goal: the mount within 1.1x the pull
#
# Per run, through a fresh proxy: first the peer, what one page costs on a connection
# already open (`curl` reading 4 KiB of the largest pack twice on one connection, the
# second read's time); then `snapctl mount REF DIR --no-cache --prefetch none` started
# (t0), the time until it says the image is shown ("shown"), and a `pread` of 4 KiB at a
# data page (never zero, a different one each run: a chunk nothing fetched) on a file
# opened with POSIX_FADV_RANDOM (no readahead: the read asks for its page). Goal: the read
# within one RTT plus the peer's one request on an open connection.
#
# Output: markdown on stdout and in bench/results/mount-wake-DATE[-TAG].md, every run as
# JSON lines beside it. Needs root and /dev/fuse, jq, python3, curl.
set -euo pipefail
trap 'echo "mount-wake.sh: line $LINENO failed: $BASH_COMMAND" >&2' ERR

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ARGV=("$@")
SIZE=1GiB RTTS="2 20 50" RATE=1gbit RUNS=5 TAG="" LINKS=window READ_ALL=0
while [ $# -gt 0 ]; do
  case "$1" in
    --size) SIZE=$2; shift ;;
    --rtts) RTTS=$2; shift ;;
    --rate) RATE=$2; shift ;;
    --runs) RUNS=$2; shift ;;
    --tag) TAG=$2; shift ;;
    --links) LINKS=$2; shift ;;
    --read-all) READ_ALL=1 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "mount-wake.sh: unknown option $1 (try --help)" >&2; exit 2 ;;
  esac
  shift
done
# shellcheck source=bench/lib/bins.sh
source "$ROOT/bench/lib/bins.sh"
need mount-wake.sh jq python3 curl
release_bins
work_dir mount-wake.sh
SERVER_LOGS=$W
# shellcheck source=bench/lib/servers.sh
source "$ROOT/bench/lib/servers.sh"
export SNAPCTL_MOUNT_HOST=$W/host
umount_all() { mountpoint -q "$W/d" 2>/dev/null && "$SNAPCTL" umount --lazy "$W/d" >/dev/null 2>&1; mountpoint -q "$W/host" 2>/dev/null && umount -l "$W/host"; true; }
trap 'umount_all; stop_and_clean' EXIT

NAME=mount-wake-$(date -u +%F)${TAG:+-$TAG}
mkdir -p "$ROOT/bench/results"
if [ -e "$ROOT/bench/results/$NAME.md" ] || [ -e "$ROOT/bench/results/$NAME.jsonl" ]; then NAME=$NAME-$(date -u +%H%M); fi
OUT=$ROOT/bench/results/$NAME.md
RUNLOG=$ROOT/bench/results/$NAME.jsonl
: > "$RUNLOG"

serve_sample "$SIZE"
ACCEPT="Accept: application/vnd.oci.image.manifest.v1+json"
MANIFEST=$(curl -sf -H "$ACCEPT" "http://127.0.0.1:$PORT/v2/bench/vm/manifests/v1")
BIGGEST=$(jq -r '.layers | max_by(.size) | .digest' <<<"$MANIFEST")
N=$(( RUNS * $(wc -w <<<"$RTTS") * $(wc -w <<<"$LINKS") ))
# Data pages in distinct chunks (1 MiB), one per run.
mapfile -t PAGES < <(python3 - "$MEM" "$N" <<'PY'
import os, random, sys
path, n = sys.argv[1], int(sys.argv[2])
pages = os.path.getsize(path) // 4096
rng, out = random.Random(9), []
with open(path, "rb") as f:
    while len(out) < n:
        p = rng.randrange(pages)
        f.seek(p * 4096)
        if any(f.read(4096)) and p // 256 not in {q // 256 for q in out}:
            out.append(p)
print("\n".join(map(str, out)))
PY
)

i=0
LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)
mkdir -p "$W/d"
for rtt in $RTTS; do
  for run in $(seq "$RUNS"); do
    for link in $LINKS; do
      : > "$W/net.out"
      "$NETEM" --upstream "127.0.0.1:$PORT" --rtt "${rtt}ms" --rate "$RATE" --link "$link" >"$W/net.out" 2>"$W/net.log" &
      np=$!
      PIDS+=("$np")
      for _ in $(seq 500); do [ -s "$W/net.out" ] && break; sleep 0.02; done
      addr=$(head -1 "$W/net.out")
      page=${PAGES[$i]}; i=$((i + 1))
      page_ms=$(curl -sf -r 0-4095 -w '%{time_total}\n' -o /dev/null "http://$addr/v2/bench/vm/blobs/$BIGGEST" -o /dev/null "http://$addr/v2/bench/vm/blobs/$BIGGEST" \
        | tail -1 | python3 -c "import sys; print(float(sys.stdin.read()) * 1e3)")
      rec=$(python3 - "$SNAPCTL" "$addr/bench/vm:v1" "$W/d" "$MEM" "$page" "$W/mount.log" <<'PY'
import json, os, subprocess, sys, time
sn, ref, d, mem, page, logp = sys.argv[1:7]
page = int(page)
t0 = time.time()
p = subprocess.Popen([sn, "mount", ref, d, "--no-cache", "--prefetch", "none"], stdout=subprocess.DEVNULL, stderr=open(logp, "w"))
while "shown in" not in open(logp).read():
    if p.poll() is not None or time.time() - t0 > 120:
        sys.exit(f"mount failed: {open(logp).read()}")
    time.sleep(0.002)
shown = time.time()
fd = os.open(f"{d}/vm.mem", os.O_RDONLY)
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
t1 = time.time()
got = os.pread(fd, 4096, page * 4096)
t2 = time.time()
os.close(fd)
with open(mem, "rb") as f:
    f.seek(page * 4096)
    right = f.read(4096) == got
subprocess.run([sn, "umount", "--wait", d], check=True, capture_output=True)
p.wait(timeout=60)
print(json.dumps({"shown_ms": (shown - t0) * 1e3, "first_read_ms": (t2 - t1) * 1e3, "right": right}))
PY
)
      if [ "$READ_ALL" = 1 ]; then
        all=$(python3 - "$SNAPCTL" "$addr/bench/vm:v1" "$W/d" "$W" <<'PY'
import json, os, shutil, subprocess, sys, time
sn, ref, d, w = sys.argv[1:5]
for x in ("cache-m", "cache-p", "pulled"):
    shutil.rmtree(f"{w}/{x}", ignore_errors=True)
subprocess.run(["sync"])
t0 = time.time()
subprocess.run([sn, "pull", ref, f"{w}/pulled", "--cache", f"{w}/cache-p"], check=True, capture_output=True)
pull = time.time() - t0
subprocess.run(["sync"])
logp = f"{w}/mount-all.log"
t0 = time.time()
p = subprocess.Popen([sn, "mount", ref, d, "--cache", f"{w}/cache-m"], stdout=subprocess.DEVNULL, stderr=open(logp, "w"))
while "shown in" not in open(logp).read():
    if p.poll() is not None or time.time() - t0 > 120:
        sys.exit(f"mount failed: {open(logp).read()}")
    time.sleep(0.002)
n = 0
for root, _, files in os.walk(d):
    for fn in files:
        with open(os.path.join(root, fn), "rb", buffering=0) as f:
            while b := f.read(1 << 20):
                n += len(b)
subprocess.run([sn, "umount", "--wait", d], check=True, capture_output=True)
mount = time.time() - t0
p.wait(timeout=120)
print(json.dumps({"pull_s": pull, "mount_read_all_s": mount, "bytes": n}))
PY
)
        rec=$(jq -c --argjson a "$all" '. + $a' <<<"$rec")
      fi
      kill "$np"; wait "$np" 2>/dev/null || true
      [ "$(jq .right <<<"$rec")" = true ] || { echo "mount-wake.sh: wrong bytes" >&2; exit 1; }
      jq -c --argjson rtt "$rtt" --arg link "$link" --argjson run "$run" --argjson page "$page" --argjson one "$page_ms" --argjson load "$(cut -d' ' -f1 /proc/loadavg)" \
        '{rtt_ms: $rtt, link: $link, run: $run, page: $page, warm_page_ms: $one, load: $load} + .' <<<"$rec" >> "$RUNLOG"
      log "RTT $rtt ms, link $link, run $run: $(tail -1 "$RUNLOG")"
    done
  done
done
stop_server

exec > >(tee "$OUT")
echo "### $NAME: \`bash bench/mount-wake.sh ${ARGV[*]}\`, $(date -u '+%Y-%m-%d %H:%M UTC')"
echo
echo "$(nproc) cores, load average at the start $LOAD_START and at the end $(cut -d' ' -f1-3 /proc/loadavg), snapctl $(git -C "$ROOT" rev-parse --short HEAD)$(git -C "$ROOT" diff --quiet HEAD -- . 2>/dev/null || echo '+changes'); $SIZE image, cap $RATE, medians of $RUNS runs (min-max)."
echo
python3 - "$RUNLOG" <<'PY'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print("| RTT ms | link | mount shown ms | first 4 KiB read of a cold chunk ms | a page on an open connection (curl) ms | goal: RTT + that ms | within? |")
print("|---:|---|---:|---:|---:|---:|---|")
for rtt, link in dict.fromkeys((r["rtt_ms"], r["link"]) for r in runs):
    rs = [r for r in runs if r["rtt_ms"] == rtt and r["link"] == link]
    def m(k):
        xs = [r[k] for r in rs]
        return f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})", statistics.median(xs)
    shown, _ = m("shown_ms")
    first, f = m("first_read_ms")
    one, o = m("warm_page_ms")
    print(f"| {rtt} | {link} | {shown} | {first} | {one} | {rtt + o:.1f} | {'yes' if f <= rtt + o else '**no**'} |")
if all("pull_s" in r for r in runs):
    print()
    print("| RTT ms | link | pull s | mount + read all + umount s | ratio (median of runs) | within 1.1x? |")
    print("|---:|---|---:|---:|---:|---|")
    for rtt, link in dict.fromkeys((r["rtt_ms"], r["link"]) for r in runs):
        rs = [r for r in runs if r["rtt_ms"] == rtt and r["link"] == link]
        p = [r["pull_s"] for r in rs]
        m = [r["mount_read_all_s"] for r in rs]
        ratio = statistics.median(b / a for a, b in zip(p, m))
        f = lambda xs: f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"
        print(f"| {rtt} | {link} | {f(p)} | {f(m)} | {ratio:.2f} | {'yes' if ratio <= 1.1 else '**no**'} |")
PY
echo
echo "Every run: \`bench/results/$NAME.jsonl\`."

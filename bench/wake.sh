#!/usr/bin/env bash
# Wake to the first page (issue 23 §3): how long a restored guest waits for its first data
# page, cold (a host with no chunk cache), with `snapctl lazy`'s defaults, across a dialled
# network (tests/src/netem.rs through netem_proxy; bench/wan.sh measures whole restores).
#
#   bash bench/wake.sh                       2 GiB image (half zero), RTT 0 2 20 50 ms,
#                                            1 Gbit/s, 7 runs
#   Options: --size SIZE  --rtts "0 20" (ms)  --rate 1gbit  --runs N  --tag NAME
#            --replay: first record a trace (a restore with --record-trace, the guest
#            touching 5% of its pages, no proxy), so every restore timed replays it: the
#            wake of a sandbox woken again, which reads its trace and whole outboards
#            after it listens (spec/lazy.md "Waking")
#            --links "window deep shallow": netem_proxy's --link, how the bottleneck queues
#            (window, the default; deep: one FIFO takes every byte at once; shallow: a small
#            buffer that drops), the models taking turns within each run; --queue-limit SIZE
#            (the shallow buffer's size; default netem_proxy's)
#
# Per run, through a fresh proxy: first the peer, the index transfer: `curl` fetching the
# manifest and then the index on one new connection (3 round trips and the bytes), and a
# second peer, what one page costs on a connection already open: `curl` reading 4 KiB of
# the largest pack twice on one connection, the second read's time (a fault's least: one
# request through the proxy, whatever the RTT; at RTT 0 the goal's 2 RTT is 0). Then
# `snapctl lazy REF --once --no-cache` started (t0), and fake_vmm (one vCPU) connects,
# sends the handshake and touches one data page (a different one each run, never zero: a
# zero page needs no fetch). fake_vmm reports, in wall-clock microseconds: its connect
# ("ready": the daemon binds its socket once the image's manifest, config and index are
# read and checked, its trace looked for, and, for a restore that records or replays a
# trace, its outboards read), the handshake sent, and the touch returned. Goals (issue 23
# §3): from the daemon's start to the first page within the index transfer plus 2 RTT, and
# from the handshake to the first page within 2 RTT.
#
# Output: markdown on stdout and in bench/results/wake-DATE[-TAG].md, every run as JSON
# lines in bench/results/wake-DATE[-TAG].jsonl. Needs root (userfaultfd), jq, python3, curl.
set -euo pipefail
trap 'echo "wake.sh: line $LINENO failed: $BASH_COMMAND" >&2' ERR

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ARGV=("$@")
SIZE=2GiB RTTS="0 2 20 50" RATE=1gbit RUNS=7 TAG="" REPLAY=0 LINKS=window QUEUE_LIMIT=""
while [ $# -gt 0 ]; do
  case "$1" in
    --size) SIZE=$2; shift ;;
    --rtts) RTTS=$2; shift ;;
    --rate) RATE=$2; shift ;;
    --runs) RUNS=$2; shift ;;
    --tag) TAG=$2; shift ;;
    --replay) REPLAY=1 ;;
    --links) LINKS=$2; shift
      for l in $LINKS; do case "$l" in window|deep|shallow) ;; *) echo "wake.sh: --links takes window, deep, shallow" >&2; exit 2 ;; esac; done ;;
    --queue-limit) QUEUE_LIMIT=$2; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "wake.sh: unknown option $1 (try --help)" >&2; exit 2 ;;
  esac
  shift
done
# shellcheck source=bench/lib/bins.sh
source "$ROOT/bench/lib/bins.sh"
need wake.sh jq python3 curl
release_bins
work_dir wake.sh
SERVER_LOGS=$W
# shellcheck source=bench/lib/servers.sh
source "$ROOT/bench/lib/servers.sh"

NAME=wake-$(date -u +%F)${TAG:+-$TAG}
mkdir -p "$ROOT/bench/results"
if [ -e "$ROOT/bench/results/$NAME.md" ] || [ -e "$ROOT/bench/results/$NAME.jsonl" ]; then NAME=$NAME-$(date -u +%H%M); fi
OUT=$ROOT/bench/results/$NAME.md
RUNLOG=$ROOT/bench/results/$NAME.jsonl
: > "$RUNLOG"

serve_sample "$SIZE"
ACCEPT="Accept: application/vnd.oci.image.manifest.v1+json"
MANIFEST=$(curl -sf -H "$ACCEPT" "http://127.0.0.1:$PORT/v2/bench/vm/manifests/v1")
INDEX=$(jq -r '.layers[] | select(.mediaType == "application/vnd.snapctl.snapshot.index.v1" and .annotations["dev.snapctl.owner"] == "self") | .digest' <<<"$MANIFEST")
[ -n "$INDEX" ] || { echo "wake.sh: no index in the manifest" >&2; exit 2; }
BIGGEST=$(jq -r '.layers | max_by(.size) | .digest' <<<"$MANIFEST")
# Data pages (not all zero) at random, one per run and setting.
N=$(( RUNS * $(wc -w <<<"$RTTS") * $(wc -w <<<"$LINKS") ))
mapfile -t PAGES < <(python3 - "$MEM" "$N" <<'PY'
import os, random, sys
path, n = sys.argv[1], int(sys.argv[2])
pages = os.path.getsize(path) // 4096
rng, out = random.Random(5), []
with open(path, "rb") as f:
    while len(out) < n:
        p = rng.randrange(pages)
        f.seek(p * 4096)
        if any(f.read(4096)) and p not in out:
            out.append(p)
print("\n".join(map(str, out)))
PY
)

if [ "$REPLAY" = 1 ]; then
  rm -f "$W/h.sock"
  "$SNAPCTL" lazy "127.0.0.1:$PORT/bench/vm:v1" --socket "$W/h.sock" --once --no-cache --record-trace >/dev/null 2>"$W/record.log" &
  rp=$!
  PIDS+=("$rp")
  "$FAKE_VMM" --socket "$W/h.sock" --mem-file "$MEM" --threads 2 --touch 5% --json --timeout 300 >"$W/vmm.json" 2>"$W/vmm.log" \
    || { echo "wake.sh: fake_vmm failed recording the trace: $(cat "$W/vmm.log")" >&2; exit 2; }
  wait "$rp" || { echo "wake.sh: the recording restore failed: $(tail -3 "$W/record.log")" >&2; exit 2; }
  grep -q "working set of" "$W/record.log" || { echo "wake.sh: no trace was stored: $(tail -3 "$W/record.log")" >&2; exit 2; }
  log "recorded: $(grep -o 'trace of .*stored' "$W/record.log")"
fi
i=0
LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)
for rtt in $RTTS; do
  for run in $(seq "$RUNS"); do
    for link in $LINKS; do
    r=$rtt; [ "$r" = 0 ] || r=${rtt}ms
    shallow=""; [ "$link" = shallow ] && shallow=$QUEUE_LIMIT
    : > "$W/net.out"
    "$NETEM" --upstream "127.0.0.1:$PORT" --rtt "$r" --rate "$RATE" --link "$link" ${shallow:+--queue-limit "$shallow"} >"$W/net.out" 2>"$W/net.log" &
    np=$!
    PIDS+=("$np")
    for _ in $(seq 500); do [ -s "$W/net.out" ] && break; sleep 0.02; done
    addr=$(head -1 "$W/net.out")
    rm -f "$W/h.sock"
    page=${PAGES[$i]}; i=$((i + 1))
    ti=$(now)
    curl -sf -H "$ACCEPT" -o /dev/null "http://$addr/v2/bench/vm/manifests/v1" -o /dev/null "http://$addr/v2/bench/vm/blobs/$INDEX" \
      || { echo "wake.sh: curl could not fetch the index through the proxy" >&2; exit 2; }
    index_ms=$(python3 -c "import sys; print((float(sys.argv[2]) - float(sys.argv[1])) * 1e3)" "$ti" "$(now)")
    page_ms=$(curl -sf -r 0-4095 -w '%{time_total}\n' -o /dev/null "http://$addr/v2/bench/vm/blobs/$BIGGEST" -o /dev/null "http://$addr/v2/bench/vm/blobs/$BIGGEST" \
      | tail -1 | python3 -c "import sys; print(float(sys.stdin.read()) * 1e3)") \
      || { echo "wake.sh: curl could not read a page of the largest pack through the proxy" >&2; exit 2; }
    t0=$(now)
    "$SNAPCTL" lazy "$addr/bench/vm:v1" --socket "$W/h.sock" --once --no-cache >/dev/null 2>"$W/lazy.log" &
    hp=$!
    PIDS+=("$hp")
    "$FAKE_VMM" --socket "$W/h.sock" --mem-file "$MEM" --threads 1 --touch "$page" --json --timeout 120 >"$W/vmm.json" 2>"$W/vmm.log" \
      || { echo "wake.sh: fake_vmm failed: $(cat "$W/vmm.log")" >&2; exit 2; }
    wait "$hp" || { echo "wake.sh: lazy failed: $(tail -3 "$W/lazy.log")" >&2; exit 2; }
    if [ "$REPLAY" = 1 ]; then grep -q "prefetch trace" "$W/lazy.log" || { echo "wake.sh: the restore found no trace to replay: $(tail -3 "$W/lazy.log")" >&2; exit 2; }; fi
    kill "$np"; wait "$np" 2>/dev/null || true
    [ "$(jq .mismatches "$W/vmm.json")" = 0 ] || { echo "wake.sh: wrong bytes" >&2; exit 1; }
    load=$(cut -d' ' -f1 /proc/loadavg)
    jq -c --arg t0 "$t0" --argjson rtt "$rtt" --argjson run "$run" --argjson page "$page" --argjson index "$index_ms" --argjson one "$page_ms" \
      --arg link "$link" --argjson load "$load" \
      '{rtt_ms: $rtt, link: $link, run: $run, page: $page, index_transfer_ms: $index, warm_page_ms: $one, load: $load,
        ready_ms: (.connected_unix_us / 1e3 - ($t0 | tonumber) * 1e3),
        handshake_ms: (.handshake_unix_us / 1e3 - ($t0 | tonumber) * 1e3),
        first_page_ms: (.first_touch_unix_us / 1e3 - ($t0 | tonumber) * 1e3)}' "$W/vmm.json" >> "$RUNLOG"
    log "RTT $rtt ms, link $link, run $run: $(tail -1 "$RUNLOG")"
    done
  done
done
stop_server

exec > >(tee "$OUT")
echo "### $NAME: \`bash bench/wake.sh ${ARGV[*]}\`, $(date -u '+%Y-%m-%d %H:%M UTC')"
echo
echo "$(nproc) cores, load average at the start $LOAD_START and at the end $(cut -d' ' -f1-3 /proc/loadavg) (each run's in the JSON lines), snapctl $(git -C "$ROOT" rev-parse --short HEAD)$(git -C "$ROOT" diff --quiet HEAD -- . 2>/dev/null || echo '+changes'); $SIZE image, cap $RATE, medians of $RUNS runs (min-max)$([ "$REPLAY" = 1 ] && echo "; every restore replays a recorded trace (--replay)")."
echo
python3 - "$RUNLOG" <<'PY'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print("| RTT ms | link | index transfer (curl) ms | ready (daemon start to socket) ms | first page after ready ms | after the handshake ms | a page on an open connection (curl) ms | start to first page ms | index transfer + 2 RTT ms | start within it? | after the handshake within 2 RTT? |")
print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---|")
for rtt, link in dict.fromkeys((r["rtt_ms"], r.get("link", "window")) for r in runs):
    rs = [r for r in runs if r["rtt_ms"] == rtt and r.get("link", "window") == link]
    def m(f):
        xs = [f(r) for r in rs]
        return f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})", statistics.median(xs)
    index, i = m(lambda r: r["index_transfer_ms"])
    ready, _ = m(lambda r: r["ready_ms"])
    after, _ = m(lambda r: r["first_page_ms"] - r["ready_ms"])
    hs, h = m(lambda r: r["first_page_ms"] - r["handshake_ms"])
    one = m(lambda r: r["warm_page_ms"])[0] if all("warm_page_ms" in r for r in rs) else ""
    start, st = m(lambda r: r["first_page_ms"])
    yes = lambda ok: "yes" if ok else "**no**"
    print(f"| {rtt} | {link} | {index} | {ready} | {after} | {hs} | {one} | {start} | {i + 2 * rtt:.1f} | {yes(st <= i + 2 * rtt)} | {yes(h <= 2 * rtt)} |")
PY
echo
echo "Every run: \`bench/results/$NAME.jsonl\`."

#!/usr/bin/env bash
# What checking signatures costs (issue 24, spec/sign.md §6): `snapctl pull` and a lazy
# restore's wake (daemon start to the guest's first page served) with a sigstoreSigned
# policy against the same commands with --insecure-policy, alternating, in the same run,
# from a `snapctl serve` reached through netem_proxy (tests/src/netem.rs) at each RTT.
#
#   bash bench/sign.sh                 64 MiB image, RTT 0 and 20 ms, 7 runs each
#   bash bench/sign.sh --runs 3 --rtts "0 20 50" --size 256MiB
#
# pull: `snapctl pull REF DIR --no-cache` (cold), wall time.
# wake: `snapctl lazy REF --once --no-cache` started, then fake_vmm touching one page (file
#       page 0, one vCPU): wall time from the daemon's start to fake_vmm's exit, which is
#       the time to the guest's first instruction (open the image, check the policy,
#       listen, handshake, first fault served).
# The image is signed by `snapctl sign` (tag scheme and referrer), so the check reads the
# tag-scheme manifest and its payload (the referrers listing goes out beside them and is
# not followed). Medians; the cost is median(policy) - median(none) and their ratio.
#
# Output: markdown on stdout and in bench/results/sign-DATE.md, runs as JSON lines in
# bench/results/sign-DATE.jsonl. Needs root (userfaultfd), jq, python3. SNAPCTL / FAKE_VMM
# / NETEM pick binaries (default: target/release/*, built if missing).
set -euo pipefail
trap 'echo "sign.sh: line $LINENO failed: $BASH_COMMAND" >&2' ERR

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
RUNS=7 SIZE=64MiB RTTS="0 20"
while [ $# -gt 0 ]; do
  case "$1" in
    --runs) RUNS=$2; shift ;;
    --size) SIZE=$2; shift ;;
    --rtts) RTTS=$2; shift ;;
    *) echo "sign.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done

# shellcheck source=bench/lib/bins.sh
source "$ROOT/bench/lib/bins.sh"
release_bins
work_dir sign.sh
since() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.3f}')" "$1" "$(now)"; }

SERVER_LOGS=$W
# shellcheck source=bench/lib/servers.sh
source "$ROOT/bench/lib/servers.sh"

DATE=$(date -u +%F)
NAME=sign-$DATE
mkdir -p "$ROOT/bench/results"
if [ -e "$ROOT/bench/results/$NAME.md" ] || [ -e "$ROOT/bench/results/$NAME.jsonl" ]; then NAME=$NAME-$(date -u +%H%M); fi
OUT=$ROOT/bench/results/$NAME.md
RUNLOG=$ROOT/bench/results/$NAME.jsonl
: > "$RUNLOG"

NET_PID="" NET_ADDR=""
start_net() {
  local rtt=$1
  [ "$rtt" = 0 ] || rtt=${rtt}ms
  : > "$W/net.out"
  "$NETEM" --upstream "127.0.0.1:$PORT" --rtt "$rtt" >"$W/net.out" 2>"$W/net.log" &
  NET_PID=$!
  PIDS+=("$NET_PID")
  for _ in $(seq 500); do [ -s "$W/net.out" ] && break; sleep 0.02; done
  NET_ADDR=$(head -1 "$W/net.out")
  case "$NET_ADDR" in 127.0.0.1:*) ;; *) echo "sign.sh: netem_proxy did not start: $(cat "$W/net.log")" >&2; exit 2 ;; esac
}
stop_net() { kill -TERM "$NET_PID"; wait "$NET_PID" || true; }
record() { python3 -c 'import json,sys
d={}
for a in sys.argv[1:]:
    k,v=a.split("=",1)
    try: d[k]=json.loads(v)
    except ValueError: d[k]=v
print(json.dumps(d))' "$@" >> "$RUNLOG"; }

log "sample $SIZE, push, key, sign"
"$SNAPCTL" sample "$W/snap" --size "$SIZE" --seed 2 >/dev/null
start_server snapctl "$W/storage"
"$SNAPCTL" push "$W/snap" "127.0.0.1:$PORT/bench/vm:v1" --cache "$W/pushcache" >/dev/null 2>&1
export COSIGN_PASSWORD=bench
"$SNAPCTL" key generate --output-key-prefix "$W/k" >/dev/null 2>&1
"$SNAPCTL" sign "127.0.0.1:$PORT/bench/vm:v1" --key "$W/k.key" >/dev/null 2>&1
MEM=$W/snap/vm.mem

# Each timed command reaches the server through a fresh proxy at RTT.
policy_for() { # ADDR -> policy file accepting only images signed by k.pub under ADDR/bench
  # Signed as the server's own name; read through the proxy's address: exactRepository.
  echo "{\"default\":[{\"type\":\"reject\"}],\"transports\":{\"docker\":{\"$1/bench\":[{\"type\":\"sigstoreSigned\",\"keyPath\":\"$W/k.pub\",\"signedIdentity\":{\"type\":\"exactRepository\",\"dockerRepository\":\"127.0.0.1:$PORT/bench/vm\"}}]}}}" >"$W/policy.json"
}
pol_args() { if [ "$1" = policy ]; then echo "--policy $W/policy.json"; else echo "--insecure-policy"; fi; }

pull_once() { # RTT MODE RUN
  start_net "$1"; policy_for "$NET_ADDR"
  rm -rf "$W/pulled"
  local t0; t0=$(now)
  # shellcheck disable=SC2046
  "$SNAPCTL" pull "$NET_ADDR/bench/vm:v1" "$W/pulled" --no-cache $(pol_args "$2") >/dev/null 2>"$W/pull.log" \
    || { echo "sign.sh: pull failed: $(tail -3 "$W/pull.log")" >&2; exit 2; }
  local s; s=$(since "$t0"); stop_net
  if [ "$2" = policy ]; then grep -q "signed by key" "$W/pull.log" || { echo "sign.sh: no signature was checked" >&2; exit 2; }; fi
  record what=pull rtt_ms="$1" mode="$2" run="$3" seconds="$s"
}

wake_once() { # RTT MODE RUN
  start_net "$1"; policy_for "$NET_ADDR"
  local sock=$W/h.sock
  rm -f "$sock"
  local t0; t0=$(now)
  # shellcheck disable=SC2046
  "$SNAPCTL" lazy "$NET_ADDR/bench/vm:v1" --socket "$sock" --once --no-cache $(pol_args "$2") >/dev/null 2>"$W/lazy.log" &
  local hp=$!
  PIDS+=("$hp")
  "$FAKE_VMM" --socket "$sock" --mem-file "$MEM" --threads 1 --touch 0 --json --timeout 120 >"$W/vmm.json" 2>"$W/vmm.log" \
    || { echo "sign.sh: fake_vmm failed: $(cat "$W/vmm.log")" >&2; exit 2; }
  local s; s=$(since "$t0")
  wait "$hp" || { echo "sign.sh: lazy failed: $(tail -3 "$W/lazy.log")" >&2; exit 2; }
  stop_net
  [ "$(jq .mismatches "$W/vmm.json")" = 0 ] || { echo "sign.sh: wrong bytes" >&2; exit 1; }
  if [ "$2" = policy ]; then grep -q "signed by key" "$W/lazy.log" || { echo "sign.sh: no signature was checked" >&2; exit 2; }; fi
  record what=wake rtt_ms="$1" mode="$2" run="$3" seconds="$s"
}

for rtt in $RTTS; do
  for run in $(seq "$RUNS"); do
    log "RTT $rtt ms, run $run"
    # Alternate which goes first, so neither always meets a warmer machine.
    if [ $((run % 2)) = 1 ]; then order="none policy"; else order="policy none"; fi
    for mode in $order; do pull_once "$rtt" "$mode" "$run"; done
    for mode in $order; do wake_once "$rtt" "$mode" "$run"; done
  done
done

python3 - "$RUNLOG" "$SIZE" "$RUNS" >"$OUT" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print(f"Signature checking: {sys.argv[2]} image, medians of {sys.argv[3]} runs, policy (sigstoreSigned, one signature) vs --insecure-policy in the same run.\n")
print("| command | RTT ms | none s | policy s | added ms | ratio |")
print("| --- | --- | --- | --- | --- | --- |")
for what in ("pull", "wake"):
    for rtt in sorted({r["rtt_ms"] for r in rows}):
        m = {mode: statistics.median(r["seconds"] for r in rows if r["what"] == what and r["rtt_ms"] == rtt and r["mode"] == mode) for mode in ("none", "policy")}
        print(f"| {what} | {rtt} | {m['none']:.3f} | {m['policy']:.3f} | {1000 * (m['policy'] - m['none']):.0f} | {m['policy'] / m['none']:.2f} |")
EOF
cat "$OUT"
log "results in $OUT and $RUNLOG"

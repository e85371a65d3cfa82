#!/usr/bin/env bash
# Issue 21 §2: how much slower an anonymous pull gets while another address floods the
# registry with wrong Basic passwords (13 requests/s, as the issue measured), per binary.
#
#   bench/auth-flood.sh [SNAPCTL_BIN ...]     (default: target/release/snapctl)
#
# For each binary: `snapctl serve --htpasswd` (bcrypt cost 10, one user) with
# --anonymous-read on 127.0.0.1, a 64 MiB sample pushed, then RUNS anonymous pulls with
# no flood and RUNS with the flood running from 127.0.0.2 (curl --interface); prints the
# median of each and their ratio, and the server's password-check counters. The machine
# is shared: compare ratios measured in the same run.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
RUNS=${RUNS:-3}
RATE=${RATE:-13}
BINS=("$@")
[ ${#BINS[@]} -gt 0 ] || BINS=("$ROOT/target/release/snapctl")
W=$(mktemp -d "${TMPDIR:-/tmp}/auth-flood.XXXXXX")
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$W"' EXIT
# A bcrypt hash (cost 10) of "right", made by the C library's crypt (libxcrypt).
HASH=$(perl -e 'print crypt("right", q($2b$10$snapctlbenchsaltsaltsa))')
echo "alice:$HASH" >"$W/htpasswd"
first=${BINS[0]}
"$first" sample "$W/snap" --size 64MiB >/dev/null
median() { sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
for bin in "${BINS[@]}"; do
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  rm -rf "$W/store"
  "$bin" serve --storage "$W/store" --listen "127.0.0.1:$port" 2>/dev/null &
  open=$!
  until curl -s "http://127.0.0.1:$port/v2/" >/dev/null; do sleep 0.1; done
  SNAPCTL_CACHE="$W/pc" "$bin" push "$W/snap" "127.0.0.1:$port/b/vm:v1" >/dev/null
  kill $open; wait $open 2>/dev/null || true
  "$bin" serve --storage "$W/store" --listen "127.0.0.1:$port" --htpasswd "$W/htpasswd" --anonymous-read 2>/dev/null &
  srv=$!
  until curl -s "http://127.0.0.1:$port/v2/" >/dev/null; do sleep 0.1; done
  pull() {
    rm -rf "$W/out" "$W/cache"
    local t0=$(date +%s.%N)
    SNAPCTL_CACHE="$W/cache" "$bin" pull "127.0.0.1:$port/b/vm:v1" "$W/out" >/dev/null
    echo "$(date +%s.%N) - $t0" | bc
  }
  quiet=$(for _ in $(seq "$RUNS"); do pull; done | median)
  (
    i=0
    while :; do
      i=$((i + 1))
      curl -s -o /dev/null --max-time 30 --interface 127.0.0.2 -u "alice:wrong$i" "http://127.0.0.1:$port/v2/b/vm/manifests/v1" &
      sleep "$(echo "scale=3; 1/$RATE" | bc)"
    done
  ) &
  flood=$!
  sleep 2
  loud=$(for _ in $(seq "$RUNS"); do pull; done | median)
  kill $flood; wait $flood 2>/dev/null || true
  checks=$(curl -s -u alice:right "http://127.0.0.1:$port/metrics" | grep -E '^snapctl_auth_(password_checks|refused)' | tr '\n' ' ' || true)
  kill $srv; wait $srv 2>/dev/null || true
  printf '%s\n  anonymous pull (64 MiB, median of %s): %.2f s quiet, %.2f s under %s wrong passwords/s: %.1fx\n  %s\n' \
    "$bin" "$RUNS" "$quiet" "$loud" "$RATE" "$(echo "$loud / $quiet" | bc -l)" "${checks:-(no auth counters)}"
done

#!/usr/bin/env bash
# Prove the README's two commands on a machine that never saw this project.
#
# A clean clone is not enough: what set-up installed before is still on this machine. So
# this script first removes everything set-up installs (the apt packages in its lists, the
# trixie prefixes, the pip packages, the cargo-installed tools, snapctl's and pip's caches,
# cargo's download cache), then clones HEAD into a temporary directory and runs the README's
# first two commands exactly as written there, one after the other, and reports each one's
# exit status and time. Between them it checks that the demo's set-up installed no test peer.
#
#   bash scripts/fresh-check.sh              # the whole check (tens of minutes)
#   bash scripts/fresh-check.sh --remove     # only remove what set-up installs
#   FRESH_KEEP=1 bash scripts/fresh-check.sh # keep the clone (its path is printed)
#
# Removal never reaches beyond set-up's own lists: a listed apt package whose removal would
# take a package outside those lists with it (say python3, which the base system needs) is
# kept, and the script says so. Needs root. Exit status: 0 when both commands succeed.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
say() { printf 'fresh-check: %s\n' "$*" >&2; }
[ "$(id -u)" = 0 ] || { say "needs root (it removes system packages)"; exit 2; }
mode=${1:-all}
case "$mode" in all|--remove) ;; *) say "usage: fresh-check.sh [--remove]"; exit 2 ;; esac

mapfile -t listed < <(bash "$here/setup.sh" --list)
of_kind() { local k=$1 l; for l in "${listed[@]}"; do [ "${l%% *}" = "$k" ] && echo "${l#* }"; done; return 0; }

remove_all() {
  local apt=() p keep=() gone
  for p in $(of_kind build-apt) $(of_kind test-apt); do
    dpkg -s "$p" >/dev/null 2>&1 && apt+=("$p")
  done
  # The packages apt would remove along with each listed one must all be listed ones or
  # packages installed only as dependencies; anything else means the base system needs it.
  local ours=" ${apt[*]} " autos
  autos=" $(apt-mark showauto | tr '\n' ' ') "
  local purge=()
  for p in "${apt[@]}"; do
    # apt refuses some outright (openssl: removing it would break what the system needs).
    if ! gone=$(apt-get -s purge "$p" 2>/dev/null | awk '$1 == "Purg" {print $2}'); then
      keep+=("$p (apt will not remove it)")
      continue
    fi
    local other="" g
    for g in $gone; do
      g=${g%%:*}
      [[ "$ours" == *" $g "* || "$autos" == *" $g "* || "$autos" == *" $g:"* ]] || other+="$g "
    done
    if [ -n "$other" ]; then keep+=("$p (needed by: $other)"); else purge+=("$p"); fi
  done
  removed_apt=" ${purge[*]} "
  if [ ${#purge[@]} -gt 0 ]; then
    say "apt purge: ${purge[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get purge -y -qq "${purge[@]}" >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get autoremove --purge -y -qq >/dev/null
  fi
  for p in "${keep[@]}"; do say "apt: kept $p"; done
  for p in $(of_kind prefix); do
    [ -e "$p" ] && { say "rm -rf $p"; rm -rf "$p"; }
  done
  local pips=()
  for p in $(of_kind pip); do pips+=("${p%%[*}"); done
  say "pip uninstall: ${pips[*]}"
  python3 -m pip uninstall -y -q "${pips[@]}" >/dev/null 2>&1 ||
    python3 -m pip uninstall -y -q --break-system-packages "${pips[@]}" >/dev/null 2>&1 || true
  for p in $(of_kind cargo-bin); do
    if [ -e "${CARGO_HOME:-$HOME/.cargo}/bin/$p" ]; then say "cargo uninstall $p"; cargo uninstall -q "$p" >/dev/null 2>&1 || rm -f "${CARGO_HOME:-$HOME/.cargo}/bin/$p"; fi
  done
  say "rm caches: ~/.cache/snapctl ~/.cache/pip cargo's registry and git caches"
  rm -rf "$HOME/.cache/snapctl" "$HOME/.cache/pip" "${CARGO_HOME:-$HOME/.cargo}/registry" "${CARGO_HOME:-$HOME/.cargo}/git"
  hash -r
}

remove_all
[ "$mode" = all ] || exit 0

# The README's first code block holds the two commands; run them as written.
mapfile -t cmds < <(awk '/^```/ {n++; next} n == 1' "$repo/README.md" | sed 's/[[:space:]]*#.*$//' | sed '/^[[:space:]]*$/d')
if [ ${#cmds[@]} -ne 2 ]; then
  say "the README's first code block should hold exactly two commands; it holds ${#cmds[@]}"
  exit 2
fi
clone=$(mktemp -d "${TMPDIR:-/tmp}/snapctl-fresh.XXXXXX")
status=0
trap '[ "${FRESH_KEEP:-0}" = 1 ] || [ "$status" != 0 ] || rm -rf "$clone"' EXIT
git clone -q "$repo" "$clone/snapctl"
say "clone of $(git -C "$repo" rev-parse --short HEAD) at $clone/snapctl"
cd "$clone/snapctl"
unset CARGO_TARGET_DIR SNAPCTL_BIN
results=()
for i in 0 1; do
  c=${cmds[$i]}
  say "running: $c"
  t0=$(date +%s)
  rc=0
  # No terminal and no stdin, as in CI.
  CI=true bash -c "$c" </dev/null >"$clone/cmd$i.log" 2>&1 || rc=$?
  secs=$(($(date +%s) - t0))
  tail -n 5 "$clone/cmd$i.log" | sed 's/^/    /' >&2
  results+=("$c: exit $rc in ${secs}s")
  [ "$rc" = 0 ] || status=1
  if [ "$i" = 0 ]; then
    # The demo's set-up installs build dependencies only.
    peers=""
    for p in $(of_kind test-apt); do
      [[ "$removed_apt" == *" $p "* ]] && dpkg -s "$p" >/dev/null 2>&1 && peers+="$p "
    done
    for p in $(of_kind prefix); do [ -e "$p" ] && peers+="$p "; done
    if [ -n "$peers" ]; then
      results+=("FAILED: the first command installed test peers: $peers")
      status=1
    fi
  fi
done
for r in "${results[@]}"; do say "$r"; done
[ "$status" = 0 ] && say "ok" || say "FAILED (logs: $clone/cmd0.log, $clone/cmd1.log; FRESH_KEEP=1 keeps them)"
exit "$status"

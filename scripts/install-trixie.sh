#!/usr/bin/env bash
# Install a test peer from Debian's next release (trixie) into a private prefix, with the
# dependencies it needs resolved from trixie's own package lists.
#
#   bash scripts/install-trixie.sh criu    # criu 4.x -> /opt/snapctl-criu/criu
#   bash scripts/install-trixie.sh runsc   # runsc 0.0~2024 (static) -> /opt/snapctl-runsc/runsc
#   bash scripts/install-trixie.sh cosign  # cosign 2.x (Go, static) -> /opt/snapctl-cosign/cosign
#   bash scripts/install-trixie.sh oras    # the Go oras CLI -> /opt/snapctl-oras/oras
#   bash scripts/install-trixie.sh skopeo  # skopeo with sigstore -> /opt/snapctl-skopeo/skopeo
#
# Why a private prefix: bookworm's criu 3.17 cannot dump on this kernel, and bookworm's runsc
# (2022) writes one `checkpoint.img` where the gVisor posts describe the split
# `checkpoint.img` + `pages_meta.img` + `pages.img`. Trixie has both, but trixie's criu needs
# trixie's glibc, and upgrading the system's libc for a test tool is not something a setup
# script should do. Nothing under /etc or /usr changes.
#
# How the dependencies are found (never a hand-kept list: the mirror moves):
#   1. a private apt state (sources, lists, archives in a temporary directory) for trixie on
#      the machine's own configured mirror;
#   2. the closure of the package's Depends and Pre-Depends, as apt's resolver computes it
#      from trixie's lists as if nothing were installed (no recommends);
#   3. minus every package the system already has at the same or a newer version (the system's
#      libraries come after the prefix's on the library path, so those still serve);
#   4. `apt-get download` of the rest, unpacked with dpkg-deb under $PREFIX/root;
#   5. a dynamically linked binary gets a wrapper that starts it through the prefix's dynamic
#      loader (when trixie's libc6 was needed) with the prefix's libraries first; a static
#      one is linked in place;
#   6. the loader's own `--list` names any library still missing, and the install fails with
#      that name rather than at first use.
# Idempotent: a prefix whose tool runs is left alone (SNAPCTL_TRIXIE_REINSTALL=1 forces).
# Needs root (criu and runsc need root to checkpoint and restore anyway).
set -euo pipefail

tool=${1:?usage: install-trixie.sh criu|runsc|cosign|oras|skopeo}
SUITE=${SNAPCTL_TRIXIE_SUITE:-trixie}
case "$tool" in
  criu)  PKG=criu;  BIN=usr/sbin/criu; PREFIX=${SNAPCTL_CRIU_PREFIX:-/opt/snapctl-criu} ;;
  runsc) PKG=runsc; BIN=usr/bin/runsc; PREFIX=${SNAPCTL_RUNSC_PREFIX:-/opt/snapctl-runsc} ;;
  # Bookworm has neither: cosign (signature interop, spec/sign.md) and the Go oras CLI
  # (PyPI's oras is a library; `oras repo ls` and `oras cp -r` are the Go tool's).
  cosign) PKG=cosign; BIN=usr/bin/cosign; PREFIX=${SNAPCTL_COSIGN_PREFIX:-/opt/snapctl-cosign} ;;
  oras)  PKG=oras;  BIN=usr/bin/oras;  PREFIX=${SNAPCTL_ORAS_PREFIX:-/opt/snapctl-oras} ;;
  # Bookworm's skopeo 1.9.3 is built with sigstore disabled ("Debian-local change: sigstore
  # disabled" for --sign-by-sigstore-private-key and sigstoreSigned policies); trixie's is not.
  skopeo) PKG=skopeo; BIN=usr/bin/skopeo; PREFIX=${SNAPCTL_SKOPEO_PREFIX:-/opt/snapctl-skopeo} ;;
  *) echo "install-trixie: unknown tool $tool (criu, runsc, cosign, oras or skopeo)" >&2; exit 2 ;;
esac
say() { echo "install-trixie($tool): $*" >&2; }
# How each tool prints its version (the Go CLIs take a subcommand, not a flag).
case "$tool" in cosign|oras) VERSION_ARG=version ;; *) VERSION_ARG=--version ;; esac

if [ -x "$PREFIX/$tool" ] && "$PREFIX/$tool" "$VERSION_ARG" >/dev/null 2>&1 && [ "${SNAPCTL_TRIXIE_REINSTALL:-0}" != 1 ]; then
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  say "needs root (skipping; the tests that need $tool will say so)"
  exit 0
fi

# The system's configured Debian mirror (deb822 sources first, then the one-line format):
# this script names no host of its own.
mirror=$(awk '/^URIs:/ && $2 ~ /debian/ && $2 !~ /security/ {print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
if [ -z "$mirror" ]; then
  mirror=$(awk '$1 == "deb" && $0 ~ /debian/ && $0 !~ /security/ {for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) {print $i; exit}}' \
    /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null || true)
fi
if [ -z "$mirror" ]; then
  say "no Debian mirror found in /etc/apt sources"
  exit 1
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial" "$work/archives/partial" "$work/debs"
keyring=/usr/share/keyrings/debian-archive-keyring.gpg
echo "deb [signed-by=$keyring] $mirror $SUITE main" >"$work/sources.list"
apt_opts=(
  -o "Dir::Etc::SourceList=$work/sources.list" -o Dir::Etc::SourceParts=/dev/null
  -o "Dir::State::Lists=$work/lists" -o "Dir::Cache::Archives=$work/archives"
  -o Dir::State::status=/dev/null -o APT::Sandbox::User=root -q
)
if ! apt-get "${apt_opts[@]}" update >"$work/update.log" 2>&1; then
  cat "$work/update.log" >&2
  say "could not read $SUITE's package lists from $mirror"
  exit 1
fi

# 2. The closure, from trixie's lists alone: what apt itself would install on a system
#    with nothing installed (status=/dev/null), without recommends. apt's resolver picks
#    one package per "A | B" alternative and per virtual package; `apt-cache depends
#    --recurse` follows every alternative (318 packages for skopeo against apt's 78).
closure=$(apt-get "${apt_opts[@]}" -s --no-install-recommends install "$PKG" 2>"$work/resolve.log" |
  awk '$1 == "Inst" {print $2}' | sort -u) || true
if [ -z "$closure" ]; then
  cat "$work/resolve.log" >&2
  say "$PKG is not in $SUITE's lists, or apt cannot resolve its dependencies there"
  exit 1
fi

# 3. Minus what the system already has, new enough.
fetch=()
for p in $closure; do
  cand=$(apt-cache "${apt_opts[@]}" show --no-all-versions "$p" 2>/dev/null | sed -n 's/^Version: //p' | head -n1)
  have=$({ dpkg-query -W -f='${db:Status-Abbrev} ${Version}' "$p" 2>/dev/null || true; } | awk '$1 == "ii" {print $2}')
  if [ "$p" != "$PKG" ] && [ -n "$have" ] && [ -n "$cand" ] && dpkg --compare-versions "$have" ge "$cand"; then
    continue
  fi
  fetch+=("$p")
done
say "from $SUITE: ${fetch[*]} (closure of $PKG: $(echo $closure | wc -w) packages)"

# 4. Download and unpack.
(cd "$work/debs" && apt-get "${apt_opts[@]}" download "${fetch[@]}" >"$work/download.log" 2>&1) || {
  cat "$work/download.log" >&2; say "download failed"; exit 1; }
rm -rf "$PREFIX.new"
mkdir -p "$PREFIX.new/root"
for deb in "$work"/debs/*.deb; do dpkg-deb -x "$deb" "$PREFIX.new/root"; done
if [ ! -x "$PREFIX.new/root/$BIN" ]; then
  say "the $PKG package has no $BIN"
  exit 1
fi

# 5. A wrapper (dynamic) or a link (static). Paths name $PREFIX, so the tree moves into
#    place first and is checked there.
multiarch=$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || gcc -print-multiarch)
rm -rf "$PREFIX"
mv "$PREFIX.new" "$PREFIX"
R="$PREFIX/root"
libpath="$R/usr/lib/$multiarch:$R/lib/$multiarch:/usr/lib/$multiarch:/lib/$multiarch"
interp=$(readelf -l "$R/$BIN" 2>/dev/null | sed -n 's/.*Requesting program interpreter: \(.*\)]/\1/p')
if [ -z "$interp" ]; then
  ln -sf "root/$BIN" "$PREFIX/$tool"
  loader=""
else
  # The prefix's loader when trixie's libc6 came along, else the system's.
  loader=$(cd "$R" && find usr/lib lib* -maxdepth 2 -name "$(basename "$interp")" 2>/dev/null | sort | head -n1 || true)
  if [ -n "$loader" ]; then loader="$R/$loader"; else loader="$interp"; fi
  cat >"$PREFIX/$tool" <<EOF
#!/bin/sh
# $PKG from Debian $SUITE with the libraries it needs from $SUITE first
# (written by snapctl's scripts/install-trixie.sh)
exec "$loader" --library-path "$libpath" "$R/$BIN" "\$@"
EOF
  chmod +x "$PREFIX/$tool"
  # 6. Name any library still missing.
  # (`--list` prints "X => not found", or stops at the first with "error while loading
  # shared libraries: X: ...".)
  missing=$({ "$loader" --library-path "$libpath" --list "$R/$BIN" 2>&1 || true; } |
    sed -n -e 's/^[[:space:]]*\([^ ]*\) => not found.*/\1/p' -e 's/.*error while loading shared libraries: \([^:]*\):.*/\1/p' |
    sort -u | tr '\n' ' ')
  if [ -n "$missing" ]; then
    say "$PREFIX/$tool cannot run: missing libraries: $missing(not in $SUITE's closure of $PKG, nor on this system)"
    exit 1
  fi
fi
if ! out=$("$PREFIX/$tool" "$VERSION_ARG" 2>&1); then
  echo "$out" >&2
  say "$PREFIX/$tool does not run"
  exit 1
fi
say "$(echo "$out" | head -n1) at $PREFIX/$tool"

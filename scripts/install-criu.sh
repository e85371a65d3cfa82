#!/usr/bin/env bash
# Install a CRIU that can dump on this kernel, for the CRIU round-trip and lazy-pages tests.
#
# Debian bookworm's criu 3.17 fails to dump here (vDSO bounds). Debian's next release
# (trixie) has criu 4.x, but it needs trixie's glibc, and upgrading the system's libc for one
# test tool is not something a setup script should do. So this script downloads criu,
# libcompel1 and trixie's libc6 (plus three small libraries bookworm's system lacks) with
# apt-get from the machine's own Debian mirror into a private directory, unpacks them under
# $PREFIX/root with dpkg-deb, and writes $PREFIX/criu: a wrapper that starts criu through
# trixie's dynamic loader with trixie's libraries first. Nothing under /etc or /usr changes.
#
# Tests find it as $SNAPCTL_CRIU, else /opt/snapctl-criu/criu. Idempotent: a working
# install is left alone. Needs root (criu itself needs root to dump and restore anyway).
set -euo pipefail

PREFIX=${SNAPCTL_CRIU_PREFIX:-/opt/snapctl-criu}
SUITE=${SNAPCTL_CRIU_SUITE:-trixie}
PKGS=(criu libcompel1 libc6 libprotobuf-c1 libnl-3-200 libnet1)

if [ -x "$PREFIX/criu" ] && "$PREFIX/criu" --version >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "install-criu: needs root (skipping; the CRIU tests will say so)" >&2
  exit 0
fi

# The system's configured Debian mirror (deb822 sources first, then the one-line format):
# this script names no host of its own.
mirror=$(awk '/^URIs:/ && $2 !~ /security/ {print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
if [ -z "$mirror" ]; then
  mirror=$(awk '$1 == "deb" && $0 !~ /security/ {for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) {print $i; exit}}' \
    /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null || true)
fi
if [ -z "$mirror" ]; then
  echo "install-criu: no Debian mirror found in /etc/apt sources" >&2
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
  -o APT::Sandbox::User=root -q
)
apt-get "${apt_opts[@]}" update >/dev/null
(cd "$work/debs" && apt-get "${apt_opts[@]}" download "${PKGS[@]}" >/dev/null)

rm -rf "$PREFIX.new"
mkdir -p "$PREFIX.new/root"
for deb in "$work"/debs/*.deb; do dpkg-deb -x "$deb" "$PREFIX.new/root"; done
loader=$(cd "$PREFIX.new/root" && find usr/lib lib* -maxdepth 2 -name 'ld-linux*.so.*' 2>/dev/null | sort | head -n1 || true)
multiarch=$(basename "$(dirname "$loader")")
if [ -z "$loader" ] || [ ! -x "$PREFIX.new/root/usr/sbin/criu" ]; then
  echo "install-criu: the downloaded packages have no loader or no criu" >&2
  exit 1
fi
cat >"$PREFIX.new/criu" <<EOF
#!/bin/sh
# criu from Debian $SUITE, run with its own glibc (written by snapctl's scripts/install-criu.sh)
R=$PREFIX/root
exec "\$R/$loader" --library-path "\$R/usr/lib/$multiarch:\$R/lib/$multiarch:/usr/lib/$multiarch:/lib/$multiarch" "\$R/usr/sbin/criu" "\$@"
EOF
chmod +x "$PREFIX.new/criu"
# The wrapper names $PREFIX, so it is checked after the move into place.
rm -rf "$PREFIX"
mv "$PREFIX.new" "$PREFIX"
if ! "$PREFIX/criu" --version >/dev/null; then
  echo "install-criu: $PREFIX/criu does not run" >&2
  exit 1
fi
echo "install-criu: $("$PREFIX/criu" --version | head -n1) at $PREFIX/criu" >&2

#!/usr/bin/env bash
# Installs what snapctl needs on a fresh Debian machine. Idempotent: safe to run again.
# Run as root (or with sudo available).
#
#   bash scripts/setup.sh           # build dependencies only: what `scripts/demo.sh` runs
#   bash scripts/setup.sh --tests   # also the real peers the tests and benchmarks talk to
#
# Everything it installs is listed here (BUILD_APT, TEST_APT, PIP_PKGS, the trixie prefixes,
# s3s-fs, cargo-machete, cargo-fuzz), so that scripts/fresh-check.sh can remove exactly that and prove these
# commands on a machine that never saw them.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here"
SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
tests=0
list=0
case "${1:-}" in
  "") ;;
  --tests) tests=1 ;;
  --list) list=1 ;;   # print what it installs, one "KIND NAME" a line (for fresh-check.sh)
  -h|--help) sed -n "2,10s/^# \\{0,1\\}//p" "$here/setup.sh"; exit 0 ;;
  *) echo "setup: unknown argument $1 (try --help)" >&2; exit 2 ;;
esac

if ! command -v cargo >/dev/null 2>&1; then
  echo "setup: cargo not found. snapctl needs Rust >= 1.89 (rustup's stable toolchain);" >&2
  echo "setup: Debian's packaged cargo is too old for its dependencies." >&2
  exit 2
fi

# Build: bindgen for userfaultfd-sys (libclang), a C toolchain, and what demo.sh calls.
BUILD_APT=(pkg-config libclang-dev clang gcc g++ libc6-dev curl python3)
# Tests and benchmarks: the real peers, and tools the test harness calls.
TEST_APT=(
  b3sum casync                       # format benchmark peers
  skopeo docker-registry             # registry peers
  openssl bc                         # registry TLS test (self-signed cert), bench arithmetic
  hyperfine jq python3-pip
  gnuplot-nox                        # bench/plots.sh: BENCHMARKS.md's plots (SVG)
  runsc                              # gVisor 2022 (one checkpoint.img), tests/tests/it/runsc.rs
  chromium                           # headless browser for the registry's web view test
  fuse3 util-linux                   # snapctl mount's tests: fusermount3, umount, unshare, setpriv
)
PIP_PKGS=(oras "moto[server]")       # OCI artifact client; S3 server
# Installed by tools, not here, listed for fresh-check: the trixie prefixes
# (install-trixie.sh), cargo binaries (s3s-fs and cargo-machete below, cargo-fuzz by
# fuzz-smoke.sh).
PREFIXES=("${SNAPCTL_CRIU_PREFIX:-/opt/snapctl-criu}" "${SNAPCTL_RUNSC_PREFIX:-/opt/snapctl-runsc}"
  "${SNAPCTL_COSIGN_PREFIX:-/opt/snapctl-cosign}" "${SNAPCTL_ORAS_PREFIX:-/opt/snapctl-oras}"
  "${SNAPCTL_SKOPEO_PREFIX:-/opt/snapctl-skopeo}")
CARGO_BINS=(s3s-fs cargo-machete cargo-fuzz)
if [ "$list" = 1 ]; then
  printf 'build-apt %s\n' "${BUILD_APT[@]}"
  printf 'test-apt %s\n' "${TEST_APT[@]}"
  printf 'pip %s\n' "${PIP_PKGS[@]}"
  printf 'prefix %s\n' "${PREFIXES[@]}"
  printf 'cargo-bin %s\n' "${CARGO_BINS[@]}"
  exit 0
fi

apt_install() {
  local missing=() p
  for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  [ ${#missing[@]} -gt 0 ] || return 0
  echo "setup: apt: ${missing[*]}" >&2
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

apt_install "${BUILD_APT[@]}"
[ "$tests" = 1 ] || exit 0

apt_install "${TEST_APT[@]}"
# docker-registry's package starts a system service on :5000; tests start their own on free ports.
if command -v systemctl >/dev/null 2>&1; then $SUDO systemctl disable --now docker-registry >/dev/null 2>&1 || true; fi
pkill -f '^/usr/bin/docker-registry serve /etc/docker/registry/config.yml' 2>/dev/null || true

# From Debian trixie, each in a private prefix with its dependency closure resolved from
# trixie's lists: criu 4.x (bookworm's 3.17 cannot dump on this kernel), runsc 2024 (the
# split checkpoint.img + pages_meta.img + pages.img format), cosign 2.x (signature interop)
# and the Go oras CLI (bookworm has neither), and skopeo with sigstore (bookworm's 1.9.3 is
# built with sigstore disabled; spec/sign.md §8).
for t in criu runsc cosign oras skopeo; do $SUDO bash ./install-trixie.sh "$t"; done

python3 -m pip install -q --disable-pip-version-check "${PIP_PKGS[@]}" >/dev/null 2>&1 || \
  python3 -m pip install -q --disable-pip-version-check --break-system-packages "${PIP_PKGS[@]}"

# s3s-fs: the other S3-compatible server the registry's S3 tests can use. Built (minutes of
# CPU) only when moto_server is unavailable; SNAPCTL_INSTALL_S3S=1 forces it.
if ! command -v s3s-fs >/dev/null 2>&1 && { ! command -v moto_server >/dev/null 2>&1 || [ "${SNAPCTL_INSTALL_S3S:-0}" = 1 ]; }; then
  cargo install -q s3s-fs@0.14.1 --locked --features binary
fi

# cargo-machete: scripts/test.sh fails on a dependency no crate uses.
if ! cargo machete --version >/dev/null 2>&1; then
  echo "setup: installing cargo-machete" >&2
  cargo install -q cargo-machete@0.9.2 --locked
fi

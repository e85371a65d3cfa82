#!/usr/bin/env bash
# Installs everything snapctl's build, tests and benchmarks need on a fresh Debian machine.
# Idempotent: safe to run again. Run as root (or with sudo available).
set -euo pipefail
SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"

if ! command -v cargo >/dev/null 2>&1; then
  echo "setup: cargo not found. snapctl needs Rust >= 1.89 (rustup's stable toolchain);" >&2
  echo "setup: Debian's packaged cargo is too old for its dependencies." >&2
  exit 2
fi

# Debian packages: build deps and the real peers the tests talk to.
APT_PKGS=(
  pkg-config libclang-dev clang g++  # bindgen (userfaultfd-sys); libFuzzer (fuzz smoke)
  b3sum casync                       # format benchmark peers
  skopeo docker-registry             # registry peers
  openssl bc                         # registry TLS test (self-signed cert), bench arithmetic
  hyperfine curl jq python3-pip
  runsc gcc libc6-dev                # gVisor round trip (tests/tests/it/runsc.rs), static counter
)
missing=()
for p in "${APT_PKGS[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
# docker-registry's package starts a system service on :5000; tests start their own on free ports.
if command -v systemctl >/dev/null 2>&1; then $SUDO systemctl disable --now docker-registry >/dev/null 2>&1 || true; fi
pkill -f '^/usr/bin/docker-registry serve /etc/docker/registry/config.yml' 2>/dev/null || true

# CRIU 4.x from Debian trixie in a private prefix (/opt/snapctl-criu): bookworm's 3.17
# cannot dump on this kernel. For tests/tests/it/criu.rs.
$SUDO bash "$(dirname "$0")/install-criu.sh"

# PyPI packages: oras (OCI artifact client) and moto (S3 server).
PIP_PKGS=(oras "moto[server]")
python3 -m pip install -q --disable-pip-version-check "${PIP_PKGS[@]}" >/dev/null 2>&1 || \
  python3 -m pip install -q --disable-pip-version-check --break-system-packages "${PIP_PKGS[@]}"

# s3s-fs: the other S3-compatible server the registry's S3 tests can use. Built (minutes of
# CPU) only when moto_server is unavailable; SNAPCTL_INSTALL_S3S=1 forces it.
if ! command -v s3s-fs >/dev/null 2>&1 && { ! command -v moto_server >/dev/null 2>&1 || [ "${SNAPCTL_INSTALL_S3S:-0}" = 1 ]; }; then
  cargo install -q s3s-fs@0.14.1 --locked --features binary
fi

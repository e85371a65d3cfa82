#!/usr/bin/env bash
# Sets up a fresh Debian machine and runs every test: unit, integration (with real peers:
# skopeo, docker-registry, oras, an S3 server), and a short fuzz run of every decoder.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export SNAPCTL_REQUIRE_PEERS="${SNAPCTL_REQUIRE_PEERS:-1}"
export CARGO_TERM_COLOR=never
cargo build --workspace --bins
# The integration tests run this binary; naming it saves each test binary a nested cargo.
export SNAPCTL_BIN="${SNAPCTL_BIN:-${CARGO_TARGET_DIR:-$PWD/target}/debug/snapctl}"
cargo test --workspace --no-fail-fast -- --test-threads="${SNAPCTL_TEST_THREADS:-2}"
if [ -x scripts/fuzz-smoke.sh ] || [ -f scripts/fuzz-smoke.sh ]; then
  bash scripts/fuzz-smoke.sh
fi

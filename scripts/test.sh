#!/usr/bin/env bash
# Sets up a fresh Debian machine and runs every test: unit, integration (with real peers:
# skopeo, docker-registry, oras, an S3 server, runsc, criu), format and clippy lints, a check
# for unused dependencies, and a short fuzz run of every decoder.
# Ends with one summary line, "total: N passed, M failed".
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --tests
export SNAPCTL_REQUIRE_PEERS="${SNAPCTL_REQUIRE_PEERS:-1}"
export CARGO_TERM_COLOR=never
# A CI disk is small: no incremental state, and line tables only in test builds (backtraces
# keep file:line).
export CARGO_INCREMENTAL=0
export CARGO_PROFILE_DEV_DEBUG="${CARGO_PROFILE_DEV_DEBUG:-line-tables-only}"
export CARGO_PROFILE_TEST_DEBUG="${CARGO_PROFILE_TEST_DEBUG:-line-tables-only}"
cargo build --workspace --bins
# The integration tests run this binary; naming it saves each test binary a nested cargo.
export SNAPCTL_BIN="${SNAPCTL_BIN:-${CARGO_TARGET_DIR:-$PWD/target}/debug/snapctl}"
log="$(mktemp "${TMPDIR:-/tmp}/snapctl-test.XXXXXX")"
trap 'rm -f "$log"' EXIT
status=0
cargo test --workspace --no-fail-fast -- --test-threads="${SNAPCTL_TEST_THREADS:-2}" 2>&1 | tee "$log" || status=$?
# Format and lints are part of the tests: a change that breaks either fails here, as in CI.
lint=0
cargo fmt --all --check >/dev/null 2>&1 || { echo "lint: cargo fmt --all --check: the code is not formatted (run cargo fmt --all)"; lint=1; status=1; }
cargo clippy --workspace --all-targets --quiet -- -D warnings || { echo "lint: cargo clippy found warnings (above)"; lint=1; status=1; }
# A dependency no crate uses fails too (cargo-machete, installed by setup.sh; a false
# positive goes in the crate's [package.metadata.cargo-machete] ignored list, with why).
cargo machete --skip-target-dir || { echo "lint: cargo machete found unused dependencies (above)"; lint=1; status=1; }
fuzz=0
if [ -f scripts/fuzz-smoke.sh ]; then
  bash scripts/fuzz-smoke.sh || { fuzz=1; status=1; }
fi
passed=$(sed -n 's/^test result: .* \([0-9][0-9]*\) passed; \([0-9][0-9]*\) failed.*/\1/p' "$log" | awk '{s+=$1} END {print s+0}')
failed=$(sed -n 's/^test result: .* \([0-9][0-9]*\) passed; \([0-9][0-9]*\) failed.*/\2/p' "$log" | awk '{s+=$1} END {print s+0}')
[ "$fuzz" = 0 ] || echo "fuzz smoke: a target crashed (see above)"
[ "$lint" = 0 ] || echo "lint: format, clippy or unused dependencies failed (see above)"
echo "total: $passed passed, $((failed + fuzz + lint)) failed"
exit "$status"

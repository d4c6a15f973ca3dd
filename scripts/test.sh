#!/usr/bin/env bash
# The full check: format, lints, then every test of the workspace against a real nats-server.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

scripts/setup.sh
# Headless Chromium and playwright-core for the bridge's browser test (idempotent, fast when there).
scripts/browser-test.sh --install-only

export KEDGE_NATS_SERVER="$ROOT/.tools/bin/nats-server"

cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
# Unit, integration and doc tests. Benches (harness = false binaries that print numbers) are
# compiled and linted by clippy above but not run here: `cargo bench -p kedge` runs them.
cargo test --workspace --lib --bins --tests
cargo test --workspace --doc

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
cargo test --workspace --all-targets

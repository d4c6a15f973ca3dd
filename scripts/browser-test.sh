#!/usr/bin/env bash
# The browser tests of the bridge (crates/kedge/tests/bridge_browser.rs, and the console's,
# console_browser.rs) drive Debian's headless
# Chromium with playwright-core. This script installs both, idempotently (fast when present):
#   - chromium from Debian (apt-get update + install, only when /usr/bin/chromium is missing);
#   - playwright-core from npm into .tools/browser (only when missing or another version).
# With no argument it then runs the test; with --install-only it stops after installing.
set -euo pipefail

PLAYWRIGHT_CORE_VERSION="1.65.1"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="$ROOT/.tools/browser"

if ! [ -x /usr/bin/chromium ]; then
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "browser-test: /usr/bin/chromium is missing and there is no apt-get to install it" >&2
        exit 1
    fi
    SUDO=""
    if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
    echo "browser-test: installing chromium (Debian package)" >&2
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
fi

installed=""
if [ -f "$DIR/node_modules/playwright-core/package.json" ]; then
    installed="$(node -p "require('$DIR/node_modules/playwright-core/package.json').version" 2>/dev/null || true)"
fi
if [ "$installed" != "$PLAYWRIGHT_CORE_VERSION" ]; then
    if ! command -v npm >/dev/null 2>&1; then
        echo "browser-test: installing nodejs and npm (Debian packages)" >&2
        SUDO=""
        if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
        $SUDO apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq nodejs npm >/dev/null
    fi
    echo "browser-test: installing playwright-core@$PLAYWRIGHT_CORE_VERSION into $DIR" >&2
    mkdir -p "$DIR"
    [ -f "$DIR/package.json" ] || echo '{"private": true}' > "$DIR/package.json"
    (cd "$DIR" && npm install --silent --no-audit --no-fund "playwright-core@$PLAYWRIGHT_CORE_VERSION" >/dev/null)
fi

if [ "${1:-}" = "--install-only" ]; then
    exit 0
fi
export KEDGE_NATS_SERVER="${KEDGE_NATS_SERVER:-$ROOT/.tools/bin/nats-server}"
cd "$ROOT"
exec cargo test -p kedge --test e2e -- bridge_browser:: console_browser:: --nocapture

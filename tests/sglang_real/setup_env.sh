#!/usr/bin/env bash
# Build the separate real-SGLang environment used by the `sglang`-marked suite (tests/sglang_real).
#
# The venv lives OUTSIDE the repository, at ${KVLEDGER_CACHE:-$HOME/.cache/kvledger}/sglang-venv,
# so every checkout and every CI run on the same machine reuses it (about 6 GB). A stamp file
# records the pins; when they match nothing is reinstalled, when they change the venv is rebuilt.
# A lock (flock) makes concurrent runs wait for one build instead of racing.
#
# SGLang 0.5.23's wheel requires CUDA-only packages (flashinfer, sglang-kernel, cuda-python,
# flash-attn-4, cutlass-dsl, ...) that cannot import on a CPU machine, so sglang is installed
# with --no-deps and its runtime dependencies are listed here minus the CUDA ones (facts:
# docs/engines/sglang.md, "The real-engine suite"). The one CPU kernel op a dense model calls
# comes from the test-only stand-in tests/sglang_real/stand_in/sgl_kernel/ that the harness puts
# first on PYTHONPATH (never installed here).
#
# When the pins change, the packages are reinstalled in place over the existing venv (pip moves
# each pinned package to its pin; a fresh venv takes ~3 GB of downloads on a machine without a
# package mirror). SGLANG_VENV_FRESH=1, or a venv whose interpreter no longer runs, starts from
# an empty venv.
#
# Also installed (re-installed whenever its files change, without rebuilding the venv):
#   - the test-only recount plugin tests/sglang_real/recount_plugin (entry point group
#     sglang.srt.plugins; it does nothing unless KVLEDGER_TEST_RECOUNT is set).
#
# Environment:
#   KVLEDGER_CACHE  cache root (default: $HOME/.cache/kvledger)
#   SGLANG_VENV     venv directory (default: $KVLEDGER_CACHE/sglang-venv)
#   PYTHON          interpreter that creates the venv (default: python3.11, else python3)
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
here="$repo_root/tests/sglang_real"
cache="${KVLEDGER_CACHE:-$HOME/.cache/kvledger}"
venv="${SGLANG_VENV:-$cache/sglang-venv}"
python_bin="${PYTHON:-$(command -v python3.11 || command -v python3)}"

# The pins are the stamp's content: change one and the next run rebuilds the venv.
sglang_pin="sglang==0.5.23"
deps=(
    "torch==2.14.1" "torchvision==0.29.1"
    "transformers==5.19.0" "tokenizers==0.23.2" "xgrammar==0.2.7" "openai==2.8.0"
    "openai-harmony==0.0.4" "compressed-tensors==0.18.0" "sentencepiece==0.2.1"
    "blobfile==3.0.0" "llguidance>=1.7.6,<2" "mistral_common>=1.11.5" "soundfile==0.13.1"
    "numba==0.65.1" "dill" IPython
    aiohttp "anthropic>=0.20.0" build distro easydict einops fastapi gguf interegular msgspec
    ninja numpy nvidia-ml-py orjson packaging partial_json_parser pillow "prometheus-client>=0.20.0"
    psutil pybase64 pydantic "python-dateutil<3" python-multipart "pyzmq>=25.1.2" regex requests
    scipy setproctitle tiktoken tqdm "uvicorn>=0.51" uvloop watchfiles xxhash zstandard
)
stamp="$venv/.kvledger-sglang-stamp"
wanted_stamp="$sglang_pin --no-deps | ${deps[*]}"

# pip, without the mirror's "Location ... is ignored" notes (one per package looked up)
pip_quiet() {
    "$venv/bin/python" -m pip "$@" --quiet 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

mkdir -p "$cache"
exec 9>"$cache/sglang-venv.lock"
flock 9

# The recount plugin: reinstalled when its sources change (a hash of them is its own stamp).
install_recount_plugin() {
    local plugin="$here/recount_plugin" plugin_stamp="$venv/.kvledger-recount-stamp" digest
    digest="$(cd "$plugin" && find . -type f \( -name '*.py' -o -name '*.toml' \) -not -path '*/build/*' -print0 \
        | sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1)"
    if [[ -f "$plugin_stamp" ]] && [[ "$(cat "$plugin_stamp")" == "$digest" ]]; then
        return 0
    fi
    echo "installing the test-only recount plugin into $venv"
    local tmp
    tmp="$(mktemp -d)"
    cp -r "$plugin/." "$tmp/"
    pip_quiet install --no-deps --no-build-isolation --force-reinstall "$tmp"
    rm -rf "$tmp"
    "$venv/bin/python" - <<'PY'
import importlib.metadata as m
names = [e.name for e in m.entry_points(group="sglang.srt.plugins")]
assert "kvledger_test_recount" in names, names
PY
    printf '%s' "$digest" > "$plugin_stamp"
}

if [[ -f "$stamp" ]] && [[ "$(cat "$stamp")" == "$wanted_stamp" ]] \
    && "$venv/bin/python" -c 'import importlib.metadata as m; m.version("sglang")' >/dev/null 2>&1; then
    install_recount_plugin
    echo "sglang venv ready: $venv"
    exit 0
fi

start=$(date +%s)
rm -f "$stamp"
if [[ "${SGLANG_VENV_FRESH:-0}" == 1 ]] || ! "$venv/bin/python" -c 'import sys' >/dev/null 2>&1; then
    echo "creating sglang venv at $venv with $python_bin"
    rm -rf "$venv"
    "$python_bin" -m venv "$venv"
else
    echo "updating sglang venv at $venv to the pins"
fi
pip_quiet install --upgrade pip setuptools wheel
pip_quiet install "${deps[@]}"
pip_quiet install --no-deps "$sglang_pin"
# The import check runs with the stand-in first on the path, as the harness runs the server.
SGLANG_USE_CPU_ENGINE=1 PYTHONPATH="$here/stand_in" "$venv/bin/python" -c '
import torch, transformers, sglang
import sglang.srt.managers.scheduler, sglang.launch_server  # they import the CPU ops at import time
print("sglang venv ok: sglang", sglang.__version__, "torch", torch.__version__)
'
install_recount_plugin
printf '%s' "$wanted_stamp" > "$stamp"
echo "sglang venv installed in $(( $(date +%s) - start )) s"

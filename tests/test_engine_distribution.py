"""The engine-side library (engine/: kvledger-engine) installs into a clean environment and
adds only itself: no dependency is fetched (``--no-index``), nothing of the daemon comes
along, every module imports with the standard library alone, and vLLM's entry point names
the plugin, which stays inert without ``KVLEDGER_VLLM_LEDGER``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENGINE = ROOT / "engine"

# Run in the clean venv: import every module of the library, then report what was imported
# beyond the standard library, the entry point, and what register() did without the variable.
PROBE = r"""
import importlib, importlib.metadata as m, json, pkgutil, sys
before = set(sys.modules)  # the interpreter's start (site, .pth hooks)
import kvledger_engine
names = [i.name for i in pkgutil.walk_packages(kvledger_engine.__path__, "kvledger_engine.")]
for name in names:
    importlib.import_module(name)
third_party = sorted({n.split(".")[0] for n in set(sys.modules) - before} - set(sys.stdlib_module_names) - {"kvledger_engine"})
eps = [(e.name, e.value) for e in m.entry_points(group="vllm.general_plugins")]
sglang_eps = [(e.name, e.value) for e in m.entry_points(group="sglang.srt.plugins")]
from kvledger_engine.vllm.plugin import register
register()
from kvledger_engine.sglang.plugin import register as register_sglang
register_sglang()  # without KVLEDGER_SGLANG_LEDGER: returns at once (no SGLang here either)
print(json.dumps({"modules": names, "third_party": third_party, "entry_points": eps, "sglang_entry_points": sglang_eps,
                  "requires": m.requires("kvledger-engine") or [], "daemon": "kvledger" in sys.modules}))
"""


def _pip_list(python: Path) -> set[str]:
    out = subprocess.run([str(python), "-m", "pip", "list", "--format", "json", "--disable-pip-version-check"],
                         capture_output=True, text=True, check=True).stdout
    return {p["name"].lower() for p in json.loads(out)}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(out), str(ENGINE)],
                   check=True, capture_output=True, text=True)
    (built,) = out.glob("kvledger_engine-*.whl")
    return built


def test_it_declares_no_dependency() -> None:
    project = tomllib.loads((ENGINE / "pyproject.toml").read_text())["project"]
    assert project["dependencies"] == []
    # the version is written once, in kvledger_engine/__init__.py; the daemon depends on it at that version
    assert project["dynamic"] == ["version"]
    import importlib.metadata

    import kvledger_engine
    assert f"kvledger-engine=={kvledger_engine.__version__}" in (importlib.metadata.requires("kvledger") or [])


def test_a_clean_venv_gets_only_the_library(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    before = _pip_list(python)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-index", "--disable-pip-version-check", str(wheel)],
                   check=True, env=env, capture_output=True, text=True)
    assert _pip_list(python) - before == {"kvledger-engine"}
    assert _pip_list(python) >= before  # nothing removed either
    check = subprocess.run([str(python), "-m", "pip", "check"], capture_output=True, text=True, env=env)
    assert check.returncode == 0, check.stdout + check.stderr

    env.pop("KVLEDGER_VLLM_LEDGER", None)
    run = subprocess.run([str(python), "-c", PROBE], capture_output=True, text=True, env=env, cwd=tmp_path, check=True)
    report = json.loads(run.stdout)
    assert report["third_party"] == [] and report["daemon"] is False and report["requires"] == []
    assert {"kvledger_engine.reference_ledger", "kvledger_engine.document_server", "kvledger_engine.vllm.plugin",
            "kvledger_engine.vllm.tenant_header"} <= set(report["modules"])
    assert report["entry_points"] == [["kvledger", "kvledger_engine.vllm.plugin:register"]]
    assert {"kvledger_engine.sglang.plugin", "kvledger_engine.sglang.ledger", "kvledger_engine.request_wire"} <= set(report["modules"])
    assert report["sglang_entry_points"] == [["kvledger", "kvledger_engine.sglang.plugin:register"]]


def test_the_reference_ledger_serves_a_document_in_the_clean_venv(wheel: Path, tmp_path: Path) -> None:
    """Not only imports: the reference ledger, embedded as docs/ledger.md shows, renders a
    kvledger/v1 document that the daemon's reader (here, outside that venv) accepts."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    import zipfile

    with zipfile.ZipFile(wheel) as zf:  # a wheel is a zip of the installed tree
        zf.extractall(site)
    script = (
        "import json; from kvledger_engine.reference_ledger import Ledger, PoolSpec\n"
        "led = Ledger([PoolSpec('kv', block_size=16, block_bytes=4096, num_blocks=64)], admission='reserve-cap', max_model_len=256)\n"
        "led.admit('r1', prompt_tokens=40, max_output_tokens=24)\n"
        "led.allocate('r1', 3)\n"
        "print(json.dumps(led.to_document()))\n"
    )
    run = subprocess.run([str(venv / "bin" / "python"), "-c", script], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    from kvledger.protocol.reader import facts_from_json

    facts = facts_from_json(run.stdout, "custom")
    (pool,) = facts.pools
    assert (pool.num_blocks, pool.block_size, pool.in_use) == (64, 16, 3)
    assert [r.id for r in facts.requests] == ["r1"]

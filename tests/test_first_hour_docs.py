"""The first hour read from the documentation (issue 32), each rough edge pinned by a test
that failed before: a missing file is named with the key or flag that pointed to it; a
`model.config` is checked at load, not once the engine answers; KV events' scheme is
checked at load (http:// refused, saying to use tcp://); `block_bytes` with `model:` is
refused; the demo's banner names /, /lab and /metrics; stale names and sentences are gone
from the pages."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from harness.kvledger_daemon import ROOT, _env
from kvledger.config.loader import load_config
from kvledger.config.types import ConfigError


def kvledger(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvledger.cli", *args], capture_output=True, text=True,
                          env=_env(None), cwd=ROOT, timeout=timeout)


def _config(tmp_path: Path, engine: str, top: str = "") -> Path:
    cfg = tmp_path / "kvledger.yml"
    cfg.write_text(f"nvml: {{enabled: false}}\n{top}engines:\n  - {engine}\n")
    return cfg


# ---------------------------------------------------------------- missing files name their key or flag

def test_a_missing_web_config_file_names_the_key(tmp_path: Path) -> None:
    cfg = _config(tmp_path, "{name: e, kind: ledger, url: 'http://127.0.0.1:9/'}", "web_config_file: web.yml\n")
    with pytest.raises(ConfigError) as err:
        load_config(cfg)
    assert str(err.value) == f"{cfg}: web_config_file: cannot read {tmp_path / 'web.yml'}: No such file or directory"


def test_a_missing_web_config_file_names_the_flag(tmp_path: Path) -> None:
    cfg = _config(tmp_path, "{name: e, kind: ledger, url: 'http://127.0.0.1:9/'}")
    missing = tmp_path / "nowhere.yml"
    res = kvledger("serve", "--config", str(cfg), "--web.config.file", str(missing), "--web.listen-address", "127.0.0.1:0")
    assert res.returncode == 2
    assert f"--web.config.file {missing}: cannot read: No such file or directory" in res.stderr, res.stderr


def test_a_missing_model_config_is_named_at_load(tmp_path: Path) -> None:
    cfg = _config(tmp_path, "{name: e, kind: vllm, url: 'http://127.0.0.1:9/metrics', model: {config: llama/config.json}}")
    with pytest.raises(ConfigError) as err:
        load_config(cfg)
    assert str(err.value) == (f"{cfg}: engines[0].model.config: cannot read {tmp_path / 'llama' / 'config.json'}: "
                              "No such file or directory")


def test_a_model_config_that_is_not_json_is_named_at_load(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    cfg = _config(tmp_path, "{name: e, kind: vllm, url: 'http://127.0.0.1:9/metrics', model: {config: config.json}}")
    with pytest.raises(ConfigError, match=r"engines\[0\]\.model\.config: .*config\.json: not a JSON file"):
        load_config(cfg)


def test_a_model_config_is_relative_to_the_configuration_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    cfg = _config(tmp_path, "{name: e, kind: vllm, url: 'http://127.0.0.1:9/metrics', model: {config: config.json}}")
    (engine,) = load_config(cfg).engines
    assert engine.model is not None and engine.model.config == str(tmp_path / "config.json")


# ---------------------------------------------------------------- contradictory or misdirected keys

def test_block_bytes_and_model_together_are_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    cfg = _config(tmp_path, "{name: e, kind: vllm, url: 'http://127.0.0.1:9/metrics', block_bytes: 2MiB, "
                            "model: {config: config.json}}")
    with pytest.raises(ConfigError) as err:
        load_config(cfg)
    assert str(err.value) == f"{cfg}: engines[0]: give block_bytes or model, not both (model derives block_bytes from config.json)"


@pytest.mark.parametrize("address", ["http://127.0.0.1:5557", "https://vllm:5557", "unix:///run/events.sock"])
def test_kv_events_over_http_is_refused_at_load_naming_tcp(tmp_path: Path, address: str) -> None:
    for key in ("kv_events", "kv_events_replay"):
        cfg = _config(tmp_path, f"{{name: e, kind: vllm, url: 'http://127.0.0.1:9/metrics', {key}: '{address}'}}")
        with pytest.raises(ConfigError) as err:
            load_config(cfg)
        message = str(err.value)
        assert message.startswith(f"{cfg}: engines[0].{key}: KV events are a ZMQ endpoint"), message
        assert "use tcp://HOST:PORT" in message


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:5557", "tcp://vllm-0.vllm:5557", "ipc:///tmp/kv-events"])
def test_kv_events_zmq_endpoints_load(tmp_path: Path, address: str) -> None:
    cfg = _config(tmp_path, f"{{name: e, kind: vllm, url: 'http://127.0.0.1:9/metrics', kv_events: '{address}'}}")
    (engine,) = load_config(cfg).engines
    assert engine.option("kv_events") == address


def test_kv_events_without_a_port_is_refused(tmp_path: Path) -> None:
    cfg = _config(tmp_path, "{name: e, kind: vllm, url: 'http://127.0.0.1:9/metrics', kv_events: 'tcp://127.0.0.1'}")
    with pytest.raises(ConfigError, match=r"engines\[0\]\.kv_events: expected a ZMQ endpoint tcp://HOST:PORT"):
        load_config(cfg)


# ---------------------------------------------------------------- the demo's banner

def test_the_demo_banner_names_the_pages_and_metrics(tmp_path: Path) -> None:
    log = tmp_path / "demo.log"
    env = {**_env(None), "PYTHONFAULTHANDLER": "1"}  # a hang below dumps every thread's stack to the log
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "kvledger.cli", "demo", "--listen", "127.0.0.1:0"],
                                stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=ROOT)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            proc.wait()
            raise AssertionError(f"the demo did not exit within 30 s of SIGTERM:\n{log.read_text()[-6000:]}") from None
    url = re.search(r"metrics on (http://127\.0\.0\.1:\d+)/metrics", line)
    assert url, line
    base = url.group(1)
    assert f"the live ledger on {base}/, the cache lab on {base}/lab, metrics on {base}/metrics (Ctrl-C stops)" in line, line


# ---------------------------------------------------------------- stale names and sentences

def test_the_ledger_address_is_written_one_way() -> None:
    """KVLEDGER_VLLM_LEDGER takes unix:///path (or http://...): no page shows a bare path."""
    bare = []
    for path in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "deploy").rglob("*.y*ml")]:
        for line in path.read_text().splitlines():
            if re.search(r"KVLEDGER_VLLM_LEDGER[=:]\s*['\"]?/", line) or re.search(r"KVLEDGER_VLLM_LEDGER,?\s*value:\s*['\"]?/", line):
                bare.append(f"{path.relative_to(ROOT)}: {line.strip()}")
    assert bare == []


def test_the_vllm_page_names_modules_that_exist() -> None:
    text = (ROOT / "docs" / "engines" / "vllm.md").read_text()
    for module in re.findall(r"kvledger_engine/vllm/(\w+\.py)", text) + re.findall(r"`(\w+\.py)`", text):
        found = list((ROOT / "engine").rglob(module)) + list((ROOT / "exporter").rglob(module))
        assert found, f"docs/engines/vllm.md names {module}, which does not exist"


def test_plan_page_has_no_cut_off_comment_and_calls_sim_tgi_what_it_is() -> None:
    text = (ROOT / "docs" / "plan.md").read_text()
    assert not re.search(r"sim-tgi[^.\n]*simulated vLLM|simulated vLLM[^.\n]*sim-tgi", text)
    # a shell comment that ends mid-sentence (no closing punctuation or word end) is cut off
    cut = [ln for ln in text.splitlines() if re.search(r"#\s.*\b(the|a|an|of|to|and|with|for|on|in)\s*$", ln)]
    assert cut == []

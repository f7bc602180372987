"""Every command the README shows is run by a test (issue 32): the cheap ones here, as
written (the configuration against engines that answer, promtool and amtool on the shipped
files, the scrape job inside a Prometheus configuration), the others by the test named for
them in RUN_BY. A command added to the README without a test fails
`test_every_readme_command_is_run_by_a_test`."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from harness.engine_fakes import FakeEngine
from harness.kvledger_daemon import ROOT, _env, start_daemon
from kvledger.sim.demo import demo_profiles
from kvledger.sim.engine import SimEngine
from kvledger.sim.vllm_frontend import VllmFrontend

README = (ROOT / "README.md").read_text()
HERE = "tests/test_readme.py"

#: each command of the README and the test that runs it (file::function)
RUN_BY: dict[str, str] = {
    "make demo": "tests/test_first_hour.py::test_make_demo_installs_only_the_runtime_dependencies",
    "python3 -m venv /opt/kvledger": "tests/test_release.py::test_a_clone_without_git_installs_with_pip_and_says_revision_unknown",
    "/opt/kvledger/bin/pip install ./engine .":
        "tests/test_release.py::test_a_clone_without_git_installs_with_pip_and_says_revision_unknown",
    "/opt/kvledger/bin/kvledger --version":
        "tests/test_release.py::test_a_clone_without_git_installs_with_pip_and_says_revision_unknown",
    "kvledger check --config kvledger.yml": f"{HERE}::test_the_readme_configuration_checks_against_its_engines",
    "kvledger serve --config kvledger.yml": f"{HERE}::test_the_readme_configuration_serves_its_engines",
    "promtool check rules alerts/kvledger.rules.yml": f"{HERE}::test_the_readme_checks_pass",
    "amtool check-config deploy/alertmanager/alertmanager.yml": f"{HERE}::test_the_readme_checks_pass",
    "make test": ".ci/run",  # the suite itself
}


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", README, re.MULTILINE | re.DOTALL)


def _commands() -> list[str]:
    out = []
    for block in _blocks("sh") + _blocks("console"):
        for line in block.splitlines():
            command = re.sub(r"\s+#.*$", "", line.removeprefix("$ ")).strip()
            if command and not line.lstrip().startswith("#"):
                out.append(command)
    return out


def test_every_readme_command_is_run_by_a_test() -> None:
    commands = _commands()
    assert {"make demo", "kvledger check --config kvledger.yml", "promtool check rules alerts/kvledger.rules.yml"} <= set(commands)
    assert sorted(set(commands) - set(RUN_BY)) == [], "a README command that no test runs: add it to RUN_BY and run it"
    for command, where in RUN_BY.items():
        assert command in commands, f"RUN_BY names a command the README no longer shows: {command}"
        if where == ".ci/run":
            assert command in (ROOT / ".ci" / "run").read_text()
            continue
        path, _, name = where.partition("::")
        assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.MULTILINE), where


def _the_configuration() -> str:
    (block,) = [b for b in _blocks("yaml") if b.startswith("# kvledger.yml\n")]
    return block


@pytest.fixture
def engines() -> Iterator[dict[str, str]]:
    """A stock vLLM (the demo's simulated one, its /metrics as vLLM renders them) and an
    SGLang (its fixture), on free ports: the README's addresses are replaced by theirs."""
    profile = next(p for p in demo_profiles() if p.name == "sim-stock-vllm")
    frontend = VllmFrontend(SimEngine(profile, seed=3, pid=4_200_000)).start()
    sglang = FakeEngine("sglang")
    try:
        yield {"http://127.0.0.1:8000/metrics": frontend.metrics_url, "http://127.0.0.1:30000/metrics": sglang.url}
    finally:
        sglang.stop()
        frontend.stop()


def _written(tmp_path: Path, addresses: dict[str, str]) -> Path:
    text = _the_configuration()
    for shown, real in addresses.items():
        assert shown in text, shown
        text = text.replace(shown, real)
    path = tmp_path / "kvledger.yml"
    path.write_text("nvml: {enabled: false}\n" + text)  # no GPU here: NVML's absence is not the README's point
    return path


def test_the_readme_configuration_checks_against_its_engines(tmp_path: Path, engines: dict[str, str]) -> None:
    cfg = _written(tmp_path, engines)
    res = subprocess.run([sys.executable, "-m", "kvledger.cli", "check", "--config", str(cfg)], capture_output=True,
                         text=True, env=_env(None), cwd=tmp_path, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"{cfg}: configuration is valid (2 engine(s), sharing=per-request)" in res.stdout
    assert "  ok    llama-8b/vllm" in res.stdout and "  ok    qwen-7b/sglang" in res.stdout, res.stdout


def test_the_readme_configuration_serves_its_engines(tmp_path: Path, engines: dict[str, str]) -> None:
    cfg = _written(tmp_path, engines)
    daemon = start_daemon(tmp_path, ["serve", "--config", str(cfg)], listen_flag="--web.listen-address")
    try:
        body = b""
        for _ in range(50):
            with urllib.request.urlopen(f"{daemon.url}/metrics", timeout=5) as r:
                body = r.read()
            if b'kvledger_kv_capacity_blocks{engine="qwen-7b"' in body and b'kvledger_kv_capacity_blocks{engine="llama-8b"' in body:
                break
            subprocess.run(["sleep", "0.2"], check=True)
        text = body.decode()
        assert 'kvledger_kv_capacity_blocks{engine="llama-8b",pool="0"}' in text
        assert re.search(r'kvledger_kv_capacity_blocks\{engine="qwen-7b",pool="[^"]*"\}', text)
        # max_model_len from the README's entry bounds the vLLM reservation
        assert 'kvledger_max_model_len_tokens{engine="llama-8b"} 8192' in text
    finally:
        daemon.stop()


def test_the_readme_checks_pass() -> None:
    promtool, amtool = shutil.which("promtool"), shutil.which("amtool")
    assert promtool and amtool, "make system-deps installs promtool and amtool"
    for command in ["promtool check rules alerts/kvledger.rules.yml", "amtool check-config deploy/alertmanager/alertmanager.yml"]:
        assert command in _commands()
        res = subprocess.run(command.split(), capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert res.returncode == 0, res.stdout + res.stderr


def test_the_readme_scrape_job_is_a_valid_prometheus_configuration(tmp_path: Path) -> None:
    (block,) = [b for b in _blocks("yaml") if b.startswith("scrape_configs:")]
    job = yaml.safe_load(block)["scrape_configs"][0]
    assert job["job_name"] == "kvledger"  # what the alerts and dashboards select
    config = tmp_path / "prometheus.yml"
    config.write_text("rule_files: [" + str(ROOT / "alerts" / "kvledger.rules.yml") + "]\n" + block)
    promtool = shutil.which("promtool")
    assert promtool
    res = subprocess.run([promtool, "check", "config", str(config)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


def test_the_readme_names_the_first_screen_of_tasks() -> None:
    """A newcomer finds the demo, the install, an engine, the scrape job, the dashboards and
    the alerts in the README's first sections, in that order."""
    headings = re.findall(r"^### (.+)$", README.split("\n## Engines", 1)[0], re.MULTILINE)
    assert headings == ["Run the demo", "Install", "Point it at an engine", "Scrape it with Prometheus",
                        "Import the dashboards", "Load the alerts"]
    assert len(README.splitlines()) < 200

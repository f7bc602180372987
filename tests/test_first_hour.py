"""What a new user meets in the first hour (issue 13), each friction pinned: exact numbers in
`snapshot`, each failure reported once, the demo's URL printed only once the port is its own,
a --fault typo named once, warnings for configurations that poll nothing, a missing vLLM log
told apart from one not read yet, `make system-deps` quiet on Debian's package names,
`make demo` without the test tools, and the README's word on `kvledger lab` and the
real-engine suite."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.kvledger_daemon import ROOT, _env
from kvledger.cli import format_value
from kvledger.collect.sources.vllm.source import VllmSource
from kvledger.config.types import EngineConfig
from kvledger.sim.demo import demo_profiles
from kvledger.sim.engine import SimEngine
from kvledger_engine.document_server import LedgerServer, serve_http


def kvledger(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvledger.cli", *args], capture_output=True, text=True,
                          env=_env(None), cwd=ROOT, timeout=timeout)


# ---------------------------------------------------------------- snapshot: exact numbers, failures once

@pytest.mark.parametrize(
    ("value", "text"),
    [
        (21474836480.0, "21474836480"),  # %g said 2.14748e+10
        (2**53 - 1, "9007199254740991"),
        (0.0, "0"),
        (-4096.0, "-4096"),
        (1764521234.123456, "1764521234.123456"),  # a timestamp keeps its digits
        (0.875, "0.875"),
        (1e-7, "1e-07"),  # not an integer: the shortest text that reads back the same float
    ],
)
def test_values_print_exactly(value: float, text: str) -> None:
    assert format_value(value) == text
    assert float(format_value(value)) == value


@pytest.fixture
def ledgers() -> Iterator[tuple[LedgerServer, LedgerServer]]:
    engines = [SimEngine(demo_profiles()[0], seed=1).start(), SimEngine(demo_profiles()[1], seed=2).start()]
    servers = [serve_http(e.document) for e in engines]
    try:
        yield servers[0], servers[1]
    finally:
        for x in (*servers, *engines):
            x.stop()


def test_snapshot_prints_exact_integers_and_each_failure_once(tmp_path: Path, ledgers: tuple[LedgerServer, LedgerServer]) -> None:
    good, bad = ledgers
    cfg = tmp_path / "kvledger.yml"
    cfg.write_text(f"""
nvml: {{enabled: false}}
engines:
  - {{name: good, kind: ledger, url: "{good.url}", timeout_seconds: 2}}
  - {{name: bad, kind: ledger, url: "{bad.url}", timeout_seconds: 2}}
""")
    ok = kvledger("snapshot", "--config", str(cfg))
    assert ok.returncode == 0, ok.stderr
    # 1024 blocks of 2 MiB: every digit, no exponent anywhere
    assert 'kvledger_kv_capacity_bytes{engine="good",pool="0"} 2147483648\n' in ok.stdout
    # (in the values: a label such as build_info's git revision may well read 0e9)
    assert not [line for line in ok.stdout.splitlines() if re.search(r"\d[eE][+-]?\d", line.rpartition(" ")[2])], ok.stdout
    stamp = re.search(r'kvledger_source_last_success_timestamp_seconds\{engine="good",source="ledger"\} (\S+)', ok.stdout)
    assert stamp and re.fullmatch(r"1[0-9]{9}(\.[0-9]+)?", stamp.group(1)), ok.stdout

    bad.fault = "status"
    failed = kvledger("snapshot", "--config", str(cfg))
    assert failed.returncode == 1
    both = failed.stdout + failed.stderr
    line = [ln for ln in failed.stdout.splitlines() if ln.split()[:2] == ["bad", "ledger"]]
    assert len(line) == 1 and "DOWN (http_status): " in line[0], failed.stdout
    message = line[0].split("DOWN (http_status): ", 1)[1]
    assert message and both.count(message) == 1, both  # not again on stderr, nor in a log line
    assert failed.stderr == "kvledger: 1 of 2 source(s) down (see above)\n"
    assert 'kvledger_kv_capacity_bytes{engine="good",pool="0"} 2147483648\n' in failed.stdout

    checked = kvledger("check", "--config", str(cfg))
    assert checked.returncode == 1
    assert (checked.stdout + checked.stderr).count(message) == 1, checked.stdout + checked.stderr


# ---------------------------------------------------------------- demo

def test_demo_reports_a_port_in_use_without_announcing_it() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = kvledger("demo", "--listen", f"127.0.0.1:{port}")
    assert res.returncode == 2
    assert "metrics on" not in res.stdout, res.stdout
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in res.stderr, res.stderr


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("leek", "kvledger demo: --fault leek: unknown mode 'leek' (modes: none, reserve-overcommit, per-request-used, "
                 "leak, overflow); did you mean 'leak'?\n"),
        ("sim-vllm=overflw", "kvledger demo: --fault sim-vllm=overflw: unknown mode 'overflw' (modes: none, "
                             "reserve-overcommit, per-request-used, leak, overflow); did you mean 'overflow'?\n"),
        ("nobody=leak", "kvledger demo: --fault: faults name unknown engine(s): nobody\n"),
    ],
)
def test_demo_fault_typo_is_named_once(fault: str, message: str) -> None:
    res = kvledger("demo", "--fault", fault, "--listen", "127.0.0.1:0")
    assert res.returncode == 2
    assert res.stderr == message
    assert res.stdout == ""


# ---------------------------------------------------------------- configurations that poll nothing

@pytest.mark.parametrize("text", ["", "engines: []\n"], ids=["empty-file", "no-engines"])
def test_check_warns_about_a_configuration_without_engines(tmp_path: Path, text: str) -> None:
    cfg = tmp_path / "kvledger.yml"
    cfg.write_text(text + "nvml: {enabled: false}\n" if text else "")
    res = kvledger("check", "--config", str(cfg))
    assert f"kvledger: warning: {cfg}: no engines configured (engines: is missing or empty)" in res.stderr, res.stderr


# ---------------------------------------------------------------- the vLLM log: missing vs not read yet

def _log_report(path: Path) -> str | None:
    source = VllmSource(EngineConfig(name="v", kind="vllm", url="http://127.0.0.1:9/metrics",
                                     options=(("log_file", str(path)),)))
    try:
        (report,) = source.subsource_health()  # before any poll: the engine has not answered
        assert report.name == "log" and not report.up
        return report.message
    finally:
        source.close()


def test_a_missing_log_file_is_not_reported_as_not_read_yet(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "server.log"
    assert _log_report(missing) == f"{missing}: No such file or directory"
    present = tmp_path / "server.log"
    present.write_text("INFO starting\n")
    assert _log_report(present) == f"{present}: not read yet (it is read after the engine's /metrics answers)"


# ---------------------------------------------------------------- the Makefile

MAKE = shutil.which("make")


def _fake_tools(bin_dir: Path, names: list[str]) -> None:
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name in names:
        tool = bin_dir / name
        tool.write_text("#!/bin/sh\nexit 0\n")
        tool.chmod(0o755)
    for name in ("apt-get", "sudo"):  # record every call instead of installing anything
        tool = bin_dir / name
        tool.write_text(f'#!/bin/sh\necho "{name} $*" >> "{bin_dir}/calls"\n')
        tool.chmod(0o755)
    os.symlink(shutil.which("id") or "/usr/bin/id", bin_dir / "id")


def _system_deps(bin_dir: Path) -> subprocess.CompletedProcess[str]:
    assert MAKE, "make is required"
    return subprocess.run([MAKE, "--no-print-directory", "-C", str(ROOT), "system-deps"], capture_output=True,
                          text=True, env={"PATH": str(bin_dir), "HOME": str(bin_dir)}, timeout=60)


DEBIAN = ["prometheus", "promtool", "prometheus-alertmanager", "amtool", "gcc", "g++", "openssl", "systemd-analyze",
          "chromium", "chromedriver"]


def test_system_deps_accepts_debians_alertmanager_name(tmp_path: Path) -> None:
    """Debian installs the Alertmanager as prometheus-alertmanager: with every tool present
    under Debian's names, `make system-deps` runs no apt-get."""
    _fake_tools(tmp_path / "bin", DEBIAN)
    res = _system_deps(tmp_path / "bin")
    assert res.returncode == 0, res.stdout + res.stderr
    assert not (tmp_path / "bin" / "calls").exists(), (tmp_path / "bin" / "calls").read_text()


@pytest.mark.parametrize(("absent", "package"), [("prometheus-alertmanager", "prometheus-alertmanager"),
                                                 ("systemd-analyze", "systemd"), ("gcc", "gcc"), ("g++", "g++"),
                                                 ("chromedriver", "chromium-driver")])
def test_system_deps_installs_what_is_missing(tmp_path: Path, absent: str, package: str) -> None:
    _fake_tools(tmp_path / "bin", [t for t in DEBIAN if t != absent])
    res = _system_deps(tmp_path / "bin")
    assert f"installing: {package}" in res.stdout, res.stdout + res.stderr
    calls = (tmp_path / "bin" / "calls").read_text()
    assert re.search(rf"apt-get install .* {re.escape(package)}\n", calls), calls


def test_make_demo_installs_only_the_runtime_dependencies(tmp_path: Path) -> None:
    """`make demo` in a fresh checkout: pip installs the package without its test extra."""
    assert MAKE, "make is required"
    res = subprocess.run([MAKE, "--no-print-directory", "-n", "-C", str(ROOT), "demo", f"VENV={tmp_path / 'venv'}"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    installs = [ln for ln in res.stdout.splitlines() if " install " in ln and "-e" in ln]
    assert installs and all("[test]" not in ln and ".[" not in ln for ln in installs), res.stdout
    assert re.search(r"kvledger demo --listen \S+\n", res.stdout), res.stdout
    faulty = subprocess.run([MAKE, "--no-print-directory", "-n", "-C", str(ROOT), "demo", f"VENV={tmp_path / 'venv'}",
                             "FAULT=reserve-overcommit"], capture_output=True, text=True, timeout=60)
    assert re.search(r"kvledger demo --listen \S+ --fault reserve-overcommit\n", faulty.stdout), faulty.stdout


# ---------------------------------------------------------------- the README

def test_docs_name_the_lab_and_the_real_engine_suites_cost() -> None:
    assert "kvledger lab" in (ROOT / "docs" / "getting-started.md").read_text()
    testing = (ROOT / "docs" / "testing.md").read_text()
    assert re.search(r"2\.5 GB", testing) and re.search(r"3\.5 min", testing)

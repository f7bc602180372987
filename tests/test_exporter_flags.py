"""An exporter user's habits (issue 22, point 1): the Prometheus exporters' flag names
(--web.listen-address, --web.config.file, --log.level, --log.format) with the older
spellings kept, logfmt and JSON logs from the real daemon, and --version and
kvledger_build_info naming the version, the git revision and the build date.

The wheel's side of the build identity (a baked revision, and "unknown" when the build had
no git) is proven by tests/test_release.py, which builds and installs the wheels."""

from __future__ import annotations

import json
import logging
import platform
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from harness.kvledger_daemon import ROOT, _env, start_daemon
from kvledger import __version__
from kvledger.cli import JsonFormatter, LogfmtFormatter, build_parser

#: one logfmt pair: a bare value (no space, quote, = or backslash) or a quoted one with escapes
_PAIR = r'([a-z_]+)=("(?:[^"\\]|\\["\\nrtu])*"|[^\s"=\\]+)'
_LOGFMT_LINE = re.compile(rf"{_PAIR}(?: {_PAIR})*")


def _git_head() -> str:
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()


def _kvledger(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvledger.cli", *args], capture_output=True, text=True, env=_env(None),
                          cwd=ROOT, timeout=60)


def _logfmt(line: str) -> dict[str, str]:
    assert _LOGFMT_LINE.fullmatch(line), f"not logfmt: {line!r}"
    out = {}
    for key, value in re.findall(_PAIR, line):
        out[key] = json.loads(value) if value.startswith('"') and "\\u" not in value else value.strip('"')
    return out


# ---------------------------------------------------------------- --version


def test_version_prints_version_revision_build_date_and_python() -> None:
    """From a source checkout (this one) nothing was baked: the revision is git's HEAD and
    the build date is honestly unknown."""
    res = _kvledger("--version")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == f"kvledger, version {__version__} (revision: {_git_head()})"
    assert lines[1] == "  build date:       unknown"
    assert lines[2] == f"  python version:   {platform.python_version()}"
    assert lines[3].startswith("  platform:         linux/")


# ---------------------------------------------------------------- the flags' spellings


@pytest.mark.parametrize("command", [["serve", "--config", "x.yml"], ["demo"], ["lab", "--serve"]])
def test_the_exporter_spellings_and_the_older_ones_set_the_same_options(command: list[str]) -> None:
    parser = build_parser()
    new = parser.parse_args([*command, "--web.listen-address", "0.0.0.0:9477", "--web.config.file", "web.yml"])
    old = parser.parse_args([*command, "--listen", "0.0.0.0:9477", "--web.config.file", "web.yml"])
    assert (new.listen, new.web_config_file) == (old.listen, old.web_config_file) == ("0.0.0.0:9477", "web.yml")


def test_log_flags_are_read_before_or_after_the_subcommand() -> None:
    parser = build_parser()
    default = parser.parse_args(["demo"])
    assert (default.log_level, default.log_format) == ("info", "logfmt")
    before = parser.parse_args(["--log.level", "debug", "--log.format", "json", "demo"])
    after = parser.parse_args(["demo", "--log.level=debug", "--log.format=json"])
    older = parser.parse_args(["--log-level", "debug", "demo", "--log.format", "json"])
    assert (before.log_level, before.log_format) == (after.log_level, after.log_format) == (older.log_level, older.log_format) \
        == ("debug", "json")
    # the subcommand's copy of a flag given only before it does not reset it
    assert parser.parse_args(["--log.format", "json", "demo", "--log.level", "warn"]).log_format == "json"


def test_a_log_level_or_format_it_does_not_know_is_refused_naming_the_choices() -> None:
    res = _kvledger("demo", "--log.format", "text")
    assert res.returncode == 2
    assert "--log.format: invalid choice: 'text' (choose from 'logfmt', 'json')" in res.stderr, res.stderr
    res = _kvledger("--log.level", "trace", "demo")
    assert res.returncode == 2 and "--log.level" in res.stderr and "'debug', 'info', 'warn'" in res.stderr, res.stderr


# ---------------------------------------------------------------- the formatters


def _record(msg: str, level: int = logging.INFO, exc: bool = False) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise ValueError('bad "value"\nsecond line')
        except ValueError:
            exc_info = sys.exc_info()
    return logging.LogRecord("kvledger.collect.collector", level, __file__, 1, msg, None, exc_info)


def test_logfmt_quotes_and_escapes_so_that_one_record_is_one_parseable_line() -> None:
    line = LogfmtFormatter().format(_record('engine "a"\nb=c\\d \x1b[31m', logging.WARNING, exc=True))
    assert "\n" not in line and "\x1b" not in line
    fields = _logfmt(line)
    assert list(fields) == ["time", "level", "logger", "msg", "err"]
    assert fields["level"] == "warn" and fields["logger"] == "kvledger.collect.collector"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", fields["time"])
    assert 'msg="engine \\"a\\"\\nb=c\\\\d \\u001b[31m"' in line
    assert fields["err"].startswith("Traceback") and 'ValueError: bad "value"\nsecond line' in fields["err"]
    assert LogfmtFormatter().format(_record("stopped")).endswith(" level=info logger=kvledger.collect.collector msg=stopped")


def test_json_logs_carry_the_same_fields() -> None:
    doc = json.loads(JsonFormatter().format(_record("source down", logging.ERROR, exc=True)))
    assert list(doc) == ["time", "level", "logger", "msg", "err"]
    assert (doc["level"], doc["msg"]) == ("error", "source down") and "ValueError" in doc["err"]


# ---------------------------------------------------------------- the real daemon


def _metrics(url: str) -> str:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        return str(resp.read().decode())


@pytest.mark.e2e
def test_the_daemon_logs_json_and_exports_its_build(tmp_path: Path) -> None:
    """`kvledger --log.format json demo --log.level debug --web.listen-address ...`: every
    line on stderr is a JSON object, debug included; /metrics names the build."""
    daemon = start_daemon(tmp_path, ["--log.format", "json", "demo", "--log.level", "debug"],
                          listen_flag="--web.listen-address")
    url, process = daemon.url, daemon.process
    try:
        text = _metrics(url)
    finally:
        process.stop()
    build = (f'kvledger_build_info{{version="{__version__}",revision="{_git_head()}",'
             f'python_version="{platform.python_version()}"}} 1.0')
    assert build in text.splitlines()
    logs = [line for line in process.log_path.read_text().splitlines() if line.startswith("{")]
    docs = [json.loads(line) for line in logs]
    assert {d["level"] for d in docs} >= {"debug", "info"}
    assert any(d["msg"] == f"kvledger {__version__} serving on {url}/metrics" and d["logger"] == "kvledger" for d in docs)
    assert docs[-1]["msg"] == "stopped"


@pytest.mark.e2e
def test_the_daemon_logs_logfmt_by_default_at_the_level_asked(tmp_path: Path) -> None:
    """The default is logfmt; --log.level warn (after the subcommand) keeps info lines out;
    the announcement on stdout is not a log line."""
    daemon = start_daemon(tmp_path / "info", ["demo"])
    daemon.stop()
    out = daemon.process.log_path.read_text().splitlines()
    logged = [_logfmt(line) for line in out if line.startswith("time=")]
    assert [line for line in out if not line.startswith("time=")] == [line for line in out if line.startswith("kvledger demo:")]
    assert {"msg": f"kvledger {__version__} serving on {daemon.url}/metrics", "level": "info"}.items() <= logged[0].items()

    quiet = start_daemon(tmp_path / "warn", ["demo", "--log.level", "warn"])
    quiet.stop()
    assert not [line for line in quiet.process.log_path.read_text().splitlines() if line.startswith("time=")]

"""Run the dashboards' queries against live data: the `kvledger demo`, a real Prometheus
scraping it every second with the fleet recording rules loaded, and helpers that
substitute template variables the way Grafana does.

Used by the live dashboard test (tests/test_dashboards.py, marked e2e) and by
dashboards/render_previews.py. The Prometheus binary is ``prometheus`` from PATH
(Debian package ``prometheus``); a missing binary raises ``LiveError``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dashboards.src.compat import iter_panels

ROOT = Path(__file__).resolve().parent.parent

# Stand-ins for the fleet recording rules that alerts/ defines, used only when the
# repository has no alerts rule file defining them. Same names, same meaning.
STAND_IN_RULES = """\
groups:
  - name: kvledger-fleet-stand-in
    rules:
      - record: kvledger:kv_capacity_bytes:sum
        expr: sum(kvledger_kv_capacity_bytes)
      - record: kvledger:kv_reserved_bytes:sum
        expr: sum by (basis) (kvledger_kv_reserved_bytes)
      - record: kvledger:kv_allocated_bytes:sum
        expr: sum by (basis) (kvledger_kv_allocated_bytes)
      - record: kvledger:kv_overcommit:ratio
        expr: >-
          sum by (engine, pool, basis) (kvledger_kv_reserved_bytes)
          / ignoring (basis) group_left ()
          (sum by (engine, pool) (kvledger_kv_capacity_bytes) > 0)
      - record: kvledger:gpu_memory_unaccounted_bytes:sum
        expr: sum by (basis) (kvledger_gpu_memory_unaccounted_bytes)
      - record: kvledger:gpu_memory_used_bytes:sum
        expr: sum(kvledger_gpu_memory_used_bytes)
      - record: kvledger:gpu_memory_total_bytes:sum
        expr: sum(kvledger_gpu_memory_total_bytes)
"""


class LiveError(RuntimeError):
    """A live component (demo, Prometheus) could not start or answered with an error."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str, params: dict[str, str] | list[tuple[str, str]] | None = None, timeout: float = 5.0) -> Any:
    if params:
        url = f"{url}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def _wait(probe: Any, timeout: float, what: str, interval: float = 0.25) -> Any:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            result = probe()
        except (OSError, LiveError, ValueError) as exc:
            last, result = exc, None
        if result:
            return result
        time.sleep(interval)
    raise LiveError(f"timed out after {timeout:.0f}s waiting for {what}" + (f" (last error: {last})" if last else ""))


@dataclass
class Process:
    proc: subprocess.Popen[bytes]
    log: Path

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _spawn(argv: list[str], log: Path, env: dict[str, str] | None = None) -> Process:
    handle = log.open("wb")
    try:
        proc = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    finally:
        handle.close()
    return Process(proc, log)


@contextmanager
def run_demo(workdir: Path) -> Iterator[str]:
    """`kvledger demo` on a free port; yields its "host:port"."""
    listen = f"127.0.0.1:{free_port()}"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "exporter"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    demo = _spawn([sys.executable, "-m", "kvledger.cli", "demo", "--listen", listen], workdir / "demo.log", env)
    try:
        def ready() -> bool:
            if demo.proc.poll() is not None:
                raise LiveError(f"kvledger demo exited ({demo.proc.returncode}):\n{demo.log_tail()}")
            with urllib.request.urlopen(f"http://{listen}/metrics", timeout=2) as resp:
                return b"kvledger_policy_info" in resp.read()

        _wait(ready, 30, "the demo's /metrics")
        yield listen
    finally:
        demo.stop()


def recording_rule_files(workdir: Path) -> list[Path]:
    """The alerts/ rule files when they define the fleet recording rules, else a stand-in file."""
    from dashboards.src.promql import RECORDING_RULES

    real = sorted((ROOT / "alerts").rglob("*.y*ml")) if (ROOT / "alerts").is_dir() else []
    real = [p for p in real if "record:" in p.read_text()]
    defined = set()
    for path in real:
        defined.update(re.findall(r"record:\s*(\S+)", path.read_text()))
    if real and RECORDING_RULES <= defined:
        return real
    path = workdir / "fleet-recording-rules.yml"
    path.write_text(STAND_IN_RULES)
    return [path]


@dataclass
class Prometheus:
    url: str
    process: Process

    def api(self, path: str, params: dict[str, str] | list[tuple[str, str]] | None = None) -> Any:
        try:
            body = _get(f"{self.url}/api/v1/{path}", params)
        except urllib.error.HTTPError as exc:
            body = json.loads(exc.read() or b"{}")
        if body.get("status") != "success":
            raise LiveError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("query", {"query": expr})
        if data["resultType"] not in ("vector", "matrix"):
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        data = self.api("query_range", {"query": expr, "start": str(start), "end": str(end), "step": str(step)})
        return list(data["result"])

    def label_values(self, selector: str, label: str) -> list[str]:
        """Grafana's ``label_values(selector, label)``: values of ``label`` on matching series."""
        series = self.api("series", [("match[]", selector), ("start", str(time.time() - 600))])
        return sorted({s[label] for s in series if label in s})


@contextmanager
def run_prometheus(workdir: Path, targets: list[str], rule_files: list[Path]) -> Iterator[Prometheus]:
    binary = shutil.which("prometheus")
    if binary is None:
        raise LiveError("prometheus not found on PATH (Debian: apt-get install prometheus)")
    port = free_port()
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(p.resolve()) for p in rule_files],
        "scrape_configs": [{"job_name": "kvledger", "static_configs": [{"targets": targets}]}],
    }
    cfg = workdir / "prometheus.yml"
    cfg.write_text(json.dumps(config))  # JSON is YAML
    proc = _spawn(
        [binary, f"--config.file={cfg}", f"--storage.tsdb.path={workdir / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        workdir / "prometheus.log",
    )
    prom = Prometheus(f"http://127.0.0.1:{port}", proc)
    try:
        def up() -> bool:
            if proc.proc.poll() is not None:
                raise LiveError(f"prometheus exited ({proc.proc.returncode}):\n{proc.log_tail()}")
            active = prom.api("targets")["activeTargets"]
            return bool(active) and all(t["health"] == "up" for t in active)

        _wait(up, 30, "Prometheus to scrape the demo")
        yield prom
    finally:
        proc.stop()


# ---------------------------------------------------------------- dashboards as queries


def load_dashboards() -> dict[str, dict[str, Any]]:
    return {p.stem: json.loads(p.read_text()) for p in sorted((ROOT / "dashboards" / "json").glob("*.json"))}


def panel_targets(dashboard: dict[str, Any]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(panel, target) for every query of every non-row panel."""
    for panel in iter_panels(dashboard.get("panels", [])):
        for target in panel.get("targets", []):
            yield panel, target


_VAR = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")


def substitute(expr: str, values: dict[str, str], rate_interval: str = "1m") -> str:
    """Replace Grafana variables: ``$__rate_interval`` and the dashboard's own variables."""
    def repl(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name == "__rate_interval":
            return rate_interval
        if name not in values:
            raise KeyError(f"variable ${name} has no value")
        return values[name]

    return _VAR.sub(repl, expr)


_LABEL_VALUES = re.compile(r"^label_values\((.*),\s*(\w+)\)$")


def query_variables(dashboard: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(name, selector, label) of every label_values query variable, in dashboard order."""
    out = []
    for var in dashboard["templating"]["list"]:
        if var["type"] != "query":
            continue
        match = _LABEL_VALUES.match(var["query"])
        if not match:
            raise ValueError(f"variable {var['name']}: not a label_values() query: {var['query']!r}")
        out.append((var["name"], match.group(1), match.group(2)))
    return out


def all_values(dashboard: dict[str, Any]) -> dict[str, str]:
    """Every variable set to "All" (its allValue regex), as a dashboard opens by default."""
    return {var["name"]: var.get("allValue") or ".*" for var in dashboard["templating"]["list"]
            if var["type"] == "query"}


def concrete_values(
    prom: Prometheus, dashboard: dict[str, Any], accept: Callable[[dict[str, str]], bool] | None = None
) -> dict[str, str]:
    """One real value per variable, from label_values in dashboard order, chosen so that every
    later variable still has values (e.g. an engine that has tenants) and, with ``accept``,
    the first such combination ``accept`` takes (e.g. one for which every panel has data:
    an engine may lack some figures by nature, as a stock vLLM lacks host buffers)."""
    variables = query_variables(dashboard)

    def choose(i: int, chosen: dict[str, str]) -> dict[str, str] | None:
        if i == len(variables):
            return chosen if accept is None or accept(chosen) else None
        name, selector, label = variables[i]
        for value in prom.label_values(substitute(selector, chosen), label):
            found = choose(i + 1, {**chosen, name: value})
            if found is not None:
                return found
        return None

    result = choose(0, {})
    if result is None:
        raise LiveError(f"{dashboard['title']}: no combination of real variable values")
    return result

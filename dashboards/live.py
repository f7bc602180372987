"""Run the dashboards' queries against live data: the `kvledger demo`, a real Prometheus
scraping it every second with the fleet recording rules loaded, and helpers that
substitute template variables the way Grafana does.

Used by the live dashboard test (tests/test_dashboards.py, marked e2e) and by
dashboards/render_previews.py. The processes come from the test harness (tests/harness/):
``prometheus`` from PATH (Debian package ``prometheus``), the daemon from this checkout.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "tests") not in sys.path:
    sys.path.insert(0, str(ROOT / "tests"))  # the process harness shared with the test suite

from dashboards.src.compat import iter_panels  # noqa: E402
from dashboards.src.panels import OPTIONAL_VARIABLES  # noqa: E402
from dashboards.src.promql import RECORDING_RULES  # noqa: E402
from harness.httpjson import wait_until  # noqa: E402
from harness.kvledger_daemon import run_demo  # noqa: E402
from harness.prometheus import PrometheusServer, start_prometheus  # noqa: E402


class LiveError(RuntimeError):
    """No usable combination of live values."""


@contextmanager
def run_live(workdir: Path) -> Iterator[PrometheusServer]:
    """`kvledger demo` and a real Prometheus scraping it every second with the project's
    rule files (the fleet recording rules among them), history for a few scrapes."""
    rules = sorted((ROOT / "alerts").glob("*.rules.yml"))
    with run_demo(workdir / "demo") as daemon, start_prometheus(workdir / "prometheus", [daemon.target], rules) as prom:
        prom.wait_for_target_up()
        wait_until(lambda: all(prom.query(r) for r in sorted(RECORDING_RULES)), 30, what="the recording rules")
        wait_until(lambda: prom.query("count_over_time(kvledger_build_info[1m]) >= 5"), 30, what="five scrapes")
        yield prom


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
    prom: PrometheusServer, dashboard: dict[str, Any], accept: Callable[[dict[str, str]], bool] | None = None
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
        found_values = prom.label_values(substitute(selector, chosen), label)
        if not found_values and name in OPTIONAL_VARIABLES:
            # no series has the label (the demo has no `cluster`): "All" is the only selection
            found_values = [".*"]
        for value in found_values:
            found = choose(i + 1, {**chosen, name: value})
            if found is not None:
                return found
        return None

    result = choose(0, {})
    if result is None:
        raise LiveError(f"{dashboard['title']}: no combination of real variable values")
    return result

"""monitoring/config.py is the one definition of the recording rules and join keys that
alerts/ and dashboards/ share: every `kvledger:` recorded series the generated rule file
or a generated dashboard names is defined there, the overcommit ratio is written once,
and every per-engine/pool/GPU/source join keeps the target labels."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from alerts_support import RULES

from monitoring import config as mon

RECORDED_NAME = re.compile(r"\bkvledger:[A-Za-z0-9_:]+")
CLAUSE = re.compile(r"\b(on|by) \(([^)]*)\)")
PER_TARGET = {"engine", "pool", "gpu", "source"}
DASHBOARD_JSON = sorted((ROOT / "dashboards" / "json").glob("*.json"))


def _strings(node: Any) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for value in node.values():
            yield from _strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from _strings(value)


def rule_exprs() -> list[tuple[str, str]]:
    doc = yaml.safe_load(RULES.read_text())
    return [(r.get("alert") or r["record"], r["expr"]) for g in doc["groups"] for r in g["rules"]]


def dashboard_queries() -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query template variable."""
    out = []
    for path in DASHBOARD_JSON:
        dash = json.loads(path.read_text())
        for panel in dash.get("panels", []):
            for sub in [panel, *panel.get("panels", [])]:
                for target in sub.get("targets", []):
                    out.append((f"{path.stem}: {sub.get('title')}", target["expr"]))
        for var in dash["templating"]["list"]:
            if var.get("type") == "query":
                query = var["query"] if isinstance(var["query"], str) else var["query"].get("query", "")
                out.append((f"{path.stem}: ${var['name']}", query))
    return out


def undefined_recorded_series(named: list[tuple[str, str]], defined: frozenset[str]) -> list[str]:
    """``where: name`` for every `kvledger:` series an expression names that ``defined`` lacks."""
    return [f"{where}: {name}" for where, expr in named for name in RECORDED_NAME.findall(expr)
            if name not in defined]


def test_the_rule_file_records_exactly_the_one_definition() -> None:
    doc = yaml.safe_load(RULES.read_text())
    for group, recordings in (("kvledger-recording", mon.RECORDINGS), ("kvledger-saturation", mon.SATURATION_RECORDINGS)):
        (recording,) = [g for g in doc["groups"] if g["name"] == group]
        records = [(r["record"], r["expr"]) for r in recording["rules"] if "record" in r]
        assert records == [(r.record, r.expr) for r in recordings]
    assert len(mon.RECORDED) == len(mon.RECORDINGS) + len(mon.SATURATION_RECORDINGS)


def test_alerts_and_dashboards_name_only_defined_recorded_series() -> None:
    named = rule_exprs() + dashboard_queries()
    used = {n for _, expr in named for n in RECORDED_NAME.findall(expr)}
    assert "kvledger:kv_overcommit:ratio" in used  # the scan sees the dashboards' recorded series
    assert undefined_recorded_series(named, mon.RECORDED) == []


def test_the_check_catches_a_recorded_series_missing_from_the_definition() -> None:
    named = dashboard_queries()
    assert undefined_recorded_series(named, mon.RECORDED - {"kvledger:kv_overcommit:ratio"})
    assert undefined_recorded_series([("x", "sum(kvledger:kv_typo_bytes:sum)")], mon.RECORDED) == [
        "x: kvledger:kv_typo_bytes:sum"]


def test_a_dashboard_query_cannot_name_an_undefined_recorded_series() -> None:
    from dashboards.src.panels import q

    q(mon.KV_OVERCOMMIT.record)
    with pytest.raises(KeyError, match="kvledger:kv_typo_bytes:sum"):
        q("sum(kvledger:kv_typo_bytes:sum)")


def test_the_overcommit_ratio_is_written_once() -> None:
    assert mon.KV_OVERCOMMIT.expr == mon.overcommit_ratio()
    alerts = dict(rule_exprs())
    # the quota alerts evaluate the one expression themselves (see alerts/generate.py)
    assert mon.indent(mon.overcommit_ratio('basis="exact"'), 4) in alerts["KVLedgerQuotaExceedsCapacity"]
    assert mon.indent(mon.overcommit_ratio('basis=~"exact|lower_bound"'), 2) in alerts["KVLedgerOvercommitHigh"]
    by_hand = [name for name, expr in [*rule_exprs(), *dashboard_queries()]
               if re.search(r"kvledger_kv_reserved_bytes[^/]*/[^/]*kvledger_kv_capacity_bytes", expr, re.DOTALL)
               and name not in {mon.KV_OVERCOMMIT.record, "KVLedgerQuotaExceedsCapacity", "KVLedgerOvercommitHigh"}]
    assert by_hand == [], "divide by kvledger:kv_overcommit:ratio's definition instead"


@pytest.mark.parametrize("source", ["rules", "dashboards"])
def test_per_engine_gpu_joins_keep_the_target_labels(source: str) -> None:
    named = rule_exprs() if source == "rules" else dashboard_queries()
    clauses = [(where, m.group(0)) for where, expr in named for m in CLAUSE.finditer(expr)]
    assert any(PER_TARGET & {x.strip() for x in c.split("(")[1].rstrip(")").split(",")} for _, c in clauses)
    bad = []
    for where, clause in clauses:
        listed = [x.strip() for x in clause.split("(", 1)[1].rstrip(")").split(",") if x.strip()]
        if tuple(listed) == mon.DEPLOYMENT_LABELS:
            continue  # the one aggregation over daemons on purpose: a deployment's replicas (autoscaling)
        if PER_TARGET & set(listed) and tuple(listed[: len(mon.TARGET_LABELS)]) != mon.TARGET_LABELS:
            bad.append(f"{where}: {clause}")
    assert bad == []

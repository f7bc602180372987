#!/usr/bin/env python3
"""Lint Prometheus rule files against kvledger's conventions (mixtool-like).

Checks, per rule:
- alerts: CamelCase name with the ``KVLedger`` prefix; ``severity`` label in
  {critical, warning, info}; ``summary`` annotation static (no ``{{``); ``description``
  templated (has ``{{``); ``runbook_url`` present and its ``#anchor`` resolving to a
  heading of docs/runbooks.md;
- recording rules: ``level:metric:operations`` names (two colons);
- every expression parses (promql_parser) and names only metrics of the catalogue
  (kvledger.output.catalog.BY_NAME), recording rules of the same files, or Prometheus'
  own ``up``;
- no counter of the catalogue is read except as the range argument of
  rate/increase/irate/resets/changes.

    python alerts/lint.py alerts/kvledger.rules.yml     # exit 1 and a list on problems
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import promql_parser as pp
import yaml

ROOT = Path(__file__).resolve().parent.parent
RUNBOOKS = ROOT / "docs" / "runbooks.md"
SEVERITIES = frozenset({"critical", "warning", "info"})
COUNTER_FUNCTIONS = frozenset({"rate", "increase", "irate", "resets", "changes"})
PROMETHEUS_SERIES = frozenset({"up"})  # synthesised by Prometheus for every scrape target
ALERT_NAME = re.compile(r"^KVLedger(?:[A-Z][a-z0-9]*|[A-Z]+(?=[A-Z][a-z]|$))+$")
RECORD_NAME = re.compile(r"^[a-z_][a-z0-9_]*:[a-z0-9_]+:[a-z0-9_:]+$")


@dataclass(frozen=True)
class Problem:
    rule: str  # alert or record name
    message: str

    def __str__(self) -> str:
        return f"{self.rule}: {self.message}"


def heading_anchors(markdown: str) -> set[str]:
    """GitHub-style anchors of the Markdown headings (lower case, punctuation dropped,
    spaces to hyphens)."""
    anchors = set()
    for line in markdown.splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            text = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower())
            anchors.add(text.replace(" ", "-"))
    return anchors


def _selector_name(vs: Any) -> str | None:
    if vs.name:
        return str(vs.name)
    for m in vs.matchers.matchers:
        if m.name == "__name__" and m.op == pp.MatchOp.Equal:
            return str(m.value)
    return None


def selectors(expr: Any, in_counter_fn: bool = False) -> Iterator[tuple[str | None, bool]]:
    """(metric name, read through a counter function) for every selector of ``expr``."""
    if isinstance(expr, pp.VectorSelector):
        yield _selector_name(expr), False
    elif isinstance(expr, pp.MatrixSelector):
        yield _selector_name(expr.vector_selector), in_counter_fn
    elif isinstance(expr, pp.Call):
        inside = expr.func.name in COUNTER_FUNCTIONS
        for arg in expr.args:
            yield from selectors(arg, inside)
    elif isinstance(expr, pp.BinaryExpr):
        yield from selectors(expr.lhs)
        yield from selectors(expr.rhs)
    elif isinstance(expr, pp.AggregateExpr):
        yield from selectors(expr.expr)
        if expr.param is not None:
            yield from selectors(expr.param)
    elif isinstance(expr, (pp.ParenExpr, pp.UnaryExpr, pp.SubqueryExpr)):
        yield from selectors(expr.expr)


def _rules(doc: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for group in doc.get("groups") or []:
        yield from group.get("rules") or []


def lint_rules(doc: dict[str, Any], catalog: dict[str, Any], runbook_anchors: set[str]) -> list[Problem]:
    """Problems of one rule-file document. ``catalog`` maps metric name to a spec with a
    ``type`` ("gauge"/"counter"); ``runbook_anchors`` are the anchors of docs/runbooks.md."""
    problems: list[Problem] = []
    rules = list(_rules(doc))
    recorded = {r["record"] for r in rules if "record" in r}
    for rule in rules:
        name = rule.get("alert") or rule.get("record") or "<unnamed>"

        def bad(msg: str, name: str = name) -> None:
            problems.append(Problem(name, msg))

        if "alert" in rule:
            if not ALERT_NAME.match(name):
                bad("alert name is not CamelCase with the KVLedger prefix")
            severity = (rule.get("labels") or {}).get("severity")
            if severity not in SEVERITIES:
                bad(f"severity {severity!r} not in {sorted(SEVERITIES)}")
            ann = rule.get("annotations") or {}
            summary, description, runbook = ann.get("summary"), ann.get("description"), ann.get("runbook_url")
            if not summary:
                bad("summary annotation missing")
            elif "{{" in summary:
                bad("summary annotation is templated; it must be a static sentence")
            if not description:
                bad("description annotation missing")
            elif "{{" not in description:
                bad("description annotation is not templated (no {{ ... }})")
            if not runbook:
                bad("runbook_url annotation missing")
            else:
                anchor = runbook.partition("#")[2]
                if not anchor:
                    bad(f"runbook_url {runbook} has no #anchor")
                elif anchor not in runbook_anchors:
                    bad(f"runbook_url anchor #{anchor} is not a heading of docs/runbooks.md")
        elif not RECORD_NAME.match(name):
            bad("recording rule name is not level:metric:operations")
        try:
            expr = pp.parse(str(rule.get("expr", "")))
        except ValueError as exc:
            bad(f"expression does not parse: {exc}")
            continue
        for metric, via_counter_fn in selectors(expr):
            if metric is None:
                bad("selector without a metric name")
            elif metric not in catalog and metric not in recorded and metric not in PROMETHEUS_SERIES:
                bad(f"metric {metric} is not in the catalogue nor a recording rule")
            elif metric in catalog and catalog[metric].type == "counter" and not via_counter_fn:
                bad(f"counter {metric} used without rate/increase/irate/resets/changes")
    return problems


def lint_files(paths: Iterable[Path], runbooks: Path = RUNBOOKS) -> list[Problem]:
    from kvledger.output.catalog import BY_NAME

    anchors = heading_anchors(runbooks.read_text()) if runbooks.exists() else set()
    problems: list[Problem] = []
    for path in paths:
        problems += lint_rules(yaml.safe_load(Path(path).read_text()) or {}, BY_NAME, anchors)
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    paths = [Path(p) for p in (argv if argv is not None else sys.argv[1:])] or [ROOT / "alerts" / "kvledger.rules.yml"]
    problems = lint_files(paths)
    for p in problems:
        print(p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

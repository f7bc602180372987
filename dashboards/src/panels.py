"""Panel, template-variable and layout helpers shared by every kvledger dashboard.

Everything a dashboard needs besides its own queries lives here once: the datasource
reference (a template variable, never a uid), units, thresholds, the template
variables, panel constructors that always set a unit and a description naming the
metrics shown, and a grid layout that places panels left to right.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from grafanalib import core as g

from dashboards.src import promql

# The datasource is always the `$datasource` template variable: no hard-coded uid.
DATASOURCE: dict[str, str] = {"type": "prometheus", "uid": "${datasource}"}

# Grafana units (https://grafana.com/docs/grafana/latest/panels-visualizations/configure-standard-options/).
BYTES = "bytes"
COUNT = "short"  # blocks, tokens, requests: plain counts, the axis label names the thing
RATIO = "percentunit"
SECONDS = "s"
PER_SECOND = "cps"  # counts per second
LABELS = "none"  # tables that show labels (info metrics)
UP = "none"  # 0/1 with value mappings

# Token marking the one panel allowed to put per-request and unique block counts side by side.
CONSISTENCY_TOKEN = "[consistency-check]"

_METRIC = re.compile(r"\bkvledger(?:_[a-z0-9_]+|:[a-z0-9_:]+)")


def metrics_in(expr: str) -> list[str]:
    """Metric names (catalogue names and recording rules) an expression mentions, in order."""
    seen: list[str] = []
    for name in _METRIC.findall(expr):
        if name not in seen:
            seen.append(name)
    return seen


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""
    instant: bool = False
    table: bool = False


def q(expr: str, legend: str = "", *, instant: bool = False, table: bool = False) -> Query:
    for name in metrics_in(expr):
        promql.known(name)
    return Query(expr, legend, instant or table, table)


def _targets(queries: Sequence[Query]) -> list[dict[str, Any]]:
    """Prometheus queries as Grafana 10/11 writes them (grafanalib's Target carries legacy keys)."""
    return [
        {
            "datasource": DATASOURCE,
            "editorMode": "code",
            "expr": item.expr,
            "format": "table" if item.table else "time_series",
            "hide": False,
            "instant": item.instant,
            "range": not item.instant,
            "legendFormat": item.legend,
            "refId": chr(ord("A") + i),
        }
        for i, item in enumerate(queries)
    ]


def _describe(text: str, queries: Sequence[Query]) -> str:
    names: list[str] = []
    for item in queries:
        for name in metrics_in(item.expr):
            if name not in names:
                names.append(name)
    return f"{text}\n\nMetrics: " + ", ".join(f"`{n}`" for n in names) + "."


def thresholds(*steps: tuple[str, float | None]) -> list[g.Threshold]:
    """Threshold steps, base step first: ``thresholds(("green", None), ("red", 0.9))``."""
    out = []
    for i, (color, value) in enumerate(steps):
        out.append(g.Threshold(color, i, 0.0 if value is None else float(value)))
    return out


NEUTRAL = (("green", None),)
UP_MAPPINGS: list[dict[str, Any]] = [
    {
        "type": "value",
        "options": {"0": {"text": "down", "color": "red", "index": 0}, "1": {"text": "up", "color": "green", "index": 1}},
    }
]



def _common(title: str, text: str, queries: Sequence[Query]) -> dict[str, Any]:
    """What every panel carries: title, a description naming its metrics, the datasource
    variable and its queries."""
    return {"title": title, "description": _describe(text, queries), "dataSource": DATASOURCE,
            "targets": _targets(queries)}


def timeseries(
    title: str,
    text: str,
    queries: Sequence[Query],
    unit: str,
    *,
    axis: str = "",
    stack: bool = False,
    steps: Sequence[tuple[str, float | None]] = NEUTRAL,
    threshold_line: bool = False,
    unstacked: Sequence[str] = (),
    soft_min: int | None = None,
    repeat: str | None = None,
) -> g.TimeSeries:
    """A time series panel. ``unstacked`` lists legend regexes drawn as lines over a stack;
    ``repeat`` names a variable to repeat the panel over (one panel per value).

    A panel whose legend names ``{{engine}}`` draws one set of series per engine: it is repeated
    by ``$engine`` (one panel per selected engine, stacked below each other, the engine in the
    title), unless it is already repeated by another variable (per GPU)."""
    if repeat is None and any("{{engine}}" in item.legend for item in queries):
        repeat = "engine"
    if repeat == "engine":
        title = f"{title} ($engine)"
    overrides = [
        {
            "matcher": {"id": "byRegexp", "options": pattern},
            "properties": [
                {"id": "custom.stacking", "value": {"mode": "none", "group": "A"}},
                {"id": "custom.fillOpacity", "value": 0},
                {"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}},
            ],
        }
        for pattern in unstacked
    ]
    return g.TimeSeries(
        **_common(title, text, queries),
        unit=unit,
        axisLabel=axis,
        fillOpacity=35 if stack else 10,
        stacking={"mode": "normal", "group": "A"} if stack else {},
        legendDisplayMode="table",
        legendPlacement="bottom",
        legendCalcs=["lastNotNull", "max"],
        tooltipMode="multi",
        tooltipSort="desc",
        thresholds=thresholds(*steps),
        thresholdsStyleMode="line" if threshold_line else "off",
        overrides=overrides,
        axisSoftMin=soft_min,
        repeat=_repeat(repeat),
    )


def _repeat(variable: str | None) -> g.Repeat:
    """Per engine: copies below each other, each as wide as the panel (the panels beside it
    keep their place); per GPU: side by side, two to a row."""
    if variable is None:
        return g.Repeat()
    if variable == "engine":
        return g.Repeat(direction="v", variable=variable)
    return g.Repeat(direction="h", variable=variable, maxPerRow=2)


def stat(
    title: str,
    text: str,
    queries: Sequence[Query],
    unit: str,
    *,
    steps: Sequence[tuple[str, float | None]] = NEUTRAL,
    mappings: list[dict[str, Any]] | None = None,
    color_mode: str = "value",
) -> g.Stat:
    return g.Stat(
        **_common(title, text, queries),
        format=unit,
        thresholds=thresholds(*steps),
        mappings=mappings or [],
        colorMode=color_mode,
        graphMode="area",
        textMode="value_and_name",
    )


def gauge(
    title: str,
    text: str,
    queries: Sequence[Query],
    unit: str,
    *,
    max_value: float = 1,
    steps: Sequence[tuple[str, float | None]] = NEUTRAL,
) -> g.GaugePanel:
    return g.GaugePanel(
        **_common(title, text, queries),
        format=unit,
        min=0,
        max=max_value,
        thresholds=thresholds(*steps),
        thresholdMarkers=True,
    )


def table(
    title: str,
    text: str,
    queries: Sequence[Query],
    unit: str = LABELS,
    *,
    hide: Sequence[str] = ("Time", "__name__", "job"),
    hide_value: bool = True,
) -> g.Table:
    """An instant table of label sets (and optionally the value)."""
    exclude = {name: True for name in hide}
    if hide_value:
        exclude["Value"] = True
    return g.Table(
        **_common(title, text, queries),
        unit=unit,
        transformations=[{"id": "organize", "options": {"excludeByName": exclude}}],
    )


# ---------------------------------------------------------------- template variables


#: A template variable, written as Grafana 10/11 does (grafanalib's Template carries removed keys).
Variable = dict[str, Any]


def datasource_variable() -> Variable:
    return {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
            "current": {}, "options": [], "hide": 0, "includeAll": False, "multi": False, "refresh": 1, "sort": 1}


def query_variable(name: str, label: str, metric_selector: str, label_name: str) -> Variable:
    """A multi-value variable from ``label_values(selector, label)`` with an All option (regex .*),
    refreshed when the time range changes, values sorted alphabetically."""
    for metric in metrics_in(metric_selector):
        promql.known(metric)
    return {"name": name, "label": label, "type": "query", "query": f"label_values({metric_selector}, {label_name})",
            "datasource": DATASOURCE, "current": {}, "options": [], "hide": 0, "includeAll": True, "multi": True,
            "allValue": ".*", "refresh": 2, "sort": 1}


#: Variables a fleet may leave without values: a fleet without a `cluster` label (one
#: Prometheus per cluster, or none set in external or target labels) gets only "All", whose
#: regex `.*` also matches series without the label.
OPTIONAL_VARIABLES = ("cluster",)


def cluster_variable() -> Variable:
    return query_variable("cluster", "Cluster", "kvledger_build_info", "cluster")


def job_variable() -> Variable:
    return query_variable("job", "Job", promql.sel("kvledger_build_info", promql.CLUSTER), "job")


def instance_variable() -> Variable:
    return query_variable("instance", "Node", promql.sel("kvledger_build_info", promql.CLUSTER, promql.JOB), "instance")


def engine_variable() -> Variable:
    return query_variable("engine", "Engine", promql.sel("kvledger_policy_info", promql.TARGET), "engine")


def pool_variable() -> Variable:
    return query_variable(
        "pool", "KV pool", promql.sel("kvledger_kv_capacity_bytes", promql.TARGET, promql.ENGINE), "pool"
    )


def gpu_variable() -> Variable:
    return query_variable("gpu", "GPU", promql.sel("kvledger_gpu_up", promql.TARGET), "gpu")


def tenant_variable() -> Variable:
    return query_variable(
        "tenant", "Tenant", promql.sel("kvledger_tenant_quota_bytes", promql.TARGET, promql.ENGINE), "tenant"
    )


# ---------------------------------------------------------------- layout


@dataclass
class Grid:
    """Places panels left to right on Grafana's 24-column grid, wrapping to a new line."""

    panels: list[g.Panel] = field(default_factory=list)
    x: int = 0
    y: int = 0
    line_height: int = 0

    def _newline(self) -> None:
        self.y += self.line_height
        self.x = 0
        self.line_height = 0

    def row(self, title: str) -> Grid:
        if self.x:
            self._newline()
        self.panels.append(g.RowPanel(title=title, gridPos=g.GridPos(h=1, w=24, x=0, y=self.y)))
        self.y += 1
        return self

    def add(self, panel: g.Panel, w: int = 12, h: int = 8) -> Grid:
        if self.x + w > 24:
            self._newline()
        self.panels.append(_with_pos(panel, g.GridPos(h=h, w=w, x=self.x, y=self.y)))
        self.x += w
        self.line_height = max(self.line_height, h)
        return self


def _with_pos(panel: g.Panel, pos: g.GridPos) -> g.Panel:
    panel.gridPos = pos
    return panel


#: The fleet variables every dashboard has, in this order (each narrows the next one's values).
FLEET_VARIABLES = ("cluster", "job", "instance", "engine", "pool")


def dashboard(title: str, uid: str, description: str, grid: Grid, variables: Sequence[Variable]) -> g.Dashboard:
    """A dashboard with the datasource and target variables (cluster, job, instance) first, then
    ``variables``: the engine and pool variables (every dashboard has them) and its own."""
    names = [v["name"] for v in variables]
    missing = [n for n in FLEET_VARIABLES[3:] if n not in names]
    if missing:
        raise ValueError(f"{title}: no {', '.join(missing)} variable")
    return g.Dashboard(
        title=title,
        uid=uid,
        description=description,
        tags=["kvledger"],
        panels=grid.panels,
        templating=g.Templating(
            list=[datasource_variable(), cluster_variable(), job_variable(), instance_variable(), *variables]
        ),
        time=g.Time("now-30m", "now"),
        refresh="30s",
        timezone="browser",
        graphTooltip=g.GRAPH_TOOLTIP_MODE_SHARED_CROSSHAIR,
        links=[
            g.DashboardLink(
                title="kvledger", tags=["kvledger"], asDropdown=True, includeVars=True, keepTime=True, type="dashboards"
            )
        ],
    ).auto_panel_ids()


def policy_table(*matchers: str) -> g.Table:
    """The declared accounting policy per engine (kvledger_policy_info labels): shown on every ledger dashboard."""
    return table(
        "Active accounting policy",
        "The policy every number on this dashboard obeys, per engine: `sharing` (per-request counts every "
        "request alone; reference-aware counts resident blocks once plus pending growth), the engine's "
        "`admission` behaviour (reserve-cap or dynamic), `overflow` handling when an estimate is exceeded, "
        "and `tenant_rule` (tenant figures always use the per-request rule).",
        [q(promql.sel("kvledger_policy_info", *matchers), table=True)],
        hide=("Time", "__name__", "job", "instance"),
    )

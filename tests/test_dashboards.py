"""The generated Grafana dashboards: up to date, importable into Grafana 10/11, every query
valid PromQL over catalogue metrics, and (e2e) every query answered by a live Prometheus
scraping `kvledger demo`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import promql_parser as pp
import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from dashboards import generate, live  # noqa: E402
from dashboards.src.compat import iter_panels  # noqa: E402
from dashboards.src.panels import CONSISTENCY_TOKEN, FLEET_VARIABLES, metrics_in  # noqa: E402
from dashboards.src.promql import RECORDING_RULES  # noqa: E402
from kvledger.output.catalog import BY_NAME  # noqa: E402

DASHBOARDS = live.load_dashboards()
QUERIES = [
    pytest.param(name, panel, target, id=f"{name}:{panel['title']}:{target['refId']}")
    for name, dash in DASHBOARDS.items()
    for panel, target in live.panel_targets(dash)
]
PANELS = [
    pytest.param(name, panel, id=f"{name}:{panel['title']}")
    for name, dash in DASHBOARDS.items()
    for panel in iter_panels(dash["panels"])
    if panel["type"] != "row"
]

# Per-request view vs unique-block metrics: never on one panel, except the consistency panel.
PER_REQUEST = {"kvledger_kv_block_references"}
UNIQUE = {
    "kvledger_kv_blocks", "kvledger_kv_shared_blocks", "kvledger_kv_in_use_bytes", "kvledger_kv_allocated_bytes",
    "kvledger_kv_reclaimable_bytes", "kvledger_kv_free_bytes", "kvledger_engine_reported_kv_used_blocks",
}
LEDGER_DASHBOARDS = ("kv-ledger", "fleet")

def parse(expr: str) -> Any:
    """Parse after substituting variables the way Grafana does (All -> .*, rate interval -> 1m)."""
    return pp.parse(live.substitute(expr, {v: ".*" for v in ("cluster", "job", "instance", "engine", "pool", "gpu", "tenant")}))


def selectors(node: Any) -> list[str]:
    names: list[str] = []

    def visit(n: Any) -> None:
        if isinstance(n, pp.VectorSelector):
            names.append(n.name)

    pp.walk(node, visit)
    return names


# ---------------------------------------------------------------- generation


def test_committed_json_equals_generation() -> None:
    expected = generate.render_all()
    assert sorted(expected) == sorted(f"{n}.json" for n in DASHBOARDS)
    for filename, text in expected.items():
        assert (ROOT / "dashboards" / "json" / filename).read_text() == text, (
            f"{filename} is stale: run `python -m dashboards.generate`"
        )


def test_check_mode_fails_with_a_diff_on_stale_json(tmp_path: Path) -> None:
    for filename, text in generate.render_all().items():
        (tmp_path / filename).write_text(text)
    ok = subprocess.run([sys.executable, str(ROOT / "dashboards" / "generate.py"), "--check", "--json-dir",
                         str(tmp_path)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    stale = tmp_path / "kv-ledger.json"
    stale.write_text(stale.read_text().replace("Quota headroom", "Headroom"))
    bad = subprocess.run([sys.executable, str(ROOT / "dashboards" / "generate.py"), "--check", "--json-dir",
                          str(tmp_path)], capture_output=True, text=True)
    assert bad.returncode == 1
    assert re.search(r'^-\s+"title": "Headroom \(capacity', bad.stdout, re.M), bad.stdout
    assert re.search(r'^\+\s+"title": "Quota headroom \(capacity', bad.stdout, re.M), bad.stdout


def test_unknown_metric_fails_generation() -> None:
    from dashboards.src.panels import q

    with pytest.raises(KeyError, match="kvledger_kv_used_bytes"):
        q("kvledger_kv_used_bytes")


# ---------------------------------------------------------------- Grafana 10/11 shape


def _values_of(key: str, node: Any) -> Any:
    """Every value stored under ``key`` anywhere in a JSON document."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k == key:
                yield v
            yield from _values_of(key, v)
    elif isinstance(node, list):
        for item in node:
            yield from _values_of(key, item)


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_dashboard_is_modern_and_uses_a_datasource_variable(name: str) -> None:
    dash = DASHBOARDS[name]
    assert dash["schemaVersion"] >= 36
    for legacy in ("rows", "style", "hideControls", "sharedCrosshair"):
        assert legacy not in dash
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    # No hard-coded datasource uid anywhere: every datasource reference is the variable.
    refs = list(_values_of("datasource", dash))
    assert refs, "no datasource references"
    for ref in refs:
        assert ref == {"type": "prometheus", "uid": "${datasource}"}, ref
    text = json.dumps(dash)
    for panel in iter_panels(dash["panels"]):
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    assert '"null"' not in text, "a threshold or value still carries the string \"null\""


def test_engine_gpu_tenant_variables_come_from_label_values() -> None:
    found = {}
    for dash in DASHBOARDS.values():
        for name, selector, label in live.query_variables(dash):
            found[name] = label
            for metric in metrics_in(selector):
                assert metric in BY_NAME
    assert {"engine", "gpu", "tenant"} <= set(found)
    assert found["engine"] == "engine" and found["gpu"] == "gpu" and found["tenant"] == "tenant"


@pytest.mark.parametrize("name,panel", PANELS)
def test_panel_has_unit_description_naming_its_metrics_and_thresholds(name: str, panel: dict[str, Any]) -> None:
    defaults = panel["fieldConfig"]["defaults"]
    assert defaults.get("unit"), "no unit"
    description = panel.get("description") or ""
    for target in panel["targets"]:
        for metric in metrics_in(target["expr"]):
            assert f"`{metric}`" in description, f"description does not name {metric}"
    steps = defaults["thresholds"]["steps"]
    assert steps[0]["value"] is None
    assert all(isinstance(s["value"], (int, float)) for s in steps[1:])


@pytest.mark.parametrize("name,panel", PANELS)
def test_reducing_panels_use_last_not_null_in_reduce_options(name: str, panel: dict[str, Any]) -> None:
    if panel["type"] not in ("stat", "gauge", "bargauge"):
        return
    assert panel["options"]["reduceOptions"]["calcs"] == ["lastNotNull"]
    assert "calcs" not in panel["fieldConfig"]["defaults"]
    if panel["type"] == "gauge":
        assert "showThresholdMarkers" in panel["options"]
        assert "showThresholdMarkers" not in panel["fieldConfig"]


def test_gauges_exist_so_the_gauge_fix_is_exercised() -> None:
    assert any(p["type"] == "gauge" for _, dash in DASHBOARDS.items() for p in iter_panels(dash["panels"]))


@pytest.mark.parametrize("name", LEDGER_DASHBOARDS)
def test_ledger_dashboards_state_the_active_policy(name: str) -> None:
    panels = [p for p in iter_panels(DASHBOARDS[name]["panels"]) if p["type"] != "row"]
    assert any("kvledger_policy_info" in t["expr"] for p in panels for t in p["targets"])


# ---------------------------------------------------------------- a fleet: variables, repeats, import


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_every_dashboard_has_the_fleet_variables_in_order(name: str) -> None:
    variables = {v["name"]: v for v in DASHBOARDS[name]["templating"]["list"]}
    order = [v["name"] for v in DASHBOARDS[name]["templating"]["list"]]
    assert [n for n in order if n in FLEET_VARIABLES] == list(FLEET_VARIABLES)
    for fleet_name in FLEET_VARIABLES:
        var = variables[fleet_name]
        assert var["type"] == "query" and var["includeAll"] and var["multi"] and var["allValue"] == ".*", var
    chain = {n: sel for n, sel, _ in live.query_variables(DASHBOARDS[name])}
    # each narrows the next: job by cluster, instance by cluster and job, engine and pool by the target
    assert "$cluster" in chain["job"]
    assert {"$cluster", "$job"} <= set(re.findall(r"\$\w+", chain["instance"]))
    for later in ("engine", "pool"):
        assert {"$cluster", "$job", "$instance"} <= set(re.findall(r"\$\w+", chain[later])), chain[later]


@pytest.mark.parametrize("name,panel,target", QUERIES)
def test_every_selector_is_narrowed_by_cluster_job_and_instance(
    name: str, panel: dict[str, Any], target: dict[str, Any]
) -> None:
    """Every series a panel reads is selected by the target variables, so a cluster, job or node
    choice narrows every panel (fleet-wide recording rules without those labels are not read)."""
    missing: list[str] = []

    def visit(n: Any) -> None:
        if isinstance(n, pp.VectorSelector):
            matched = {(m.name, m.value) for m in n.matchers.matchers}
            for label in ("cluster", "job", "instance"):
                if (label, f"${label}") not in matched:
                    missing.append(f"{n.name} lacks {label}=~\"${label}\"")

    # the variables stay literal `$name` text inside the matchers' strings (parseable as is)
    pp.walk(pp.parse(target["expr"].replace("$__rate_interval", "1m")), visit)
    assert not missing, missing


def _legend_engines(panel: dict[str, Any]) -> bool:
    return any("{{engine}}" in t.get("legendFormat", "") for t in panel["targets"])


@pytest.mark.parametrize("name,panel", PANELS)
def test_per_engine_time_series_are_repeated_by_engine(name: str, panel: dict[str, Any]) -> None:
    """A time series drawing a set of series per engine is one panel per engine ($engine repeat),
    not every engine's lines in one panel; a per-GPU repeat is the exception (the engines on a GPU)."""
    if panel["type"] != "timeseries":
        return
    if panel.get("repeat") == "engine":
        assert panel["repeatDirection"] == "v" and "$engine" in panel["title"]
        for target in panel["targets"]:
            # (`$engine|`: the node's own sources, without an engine, shown beside each engine's)
            assert re.search(r'engine=~"\$engine\|?"', target["expr"]), target["expr"]
    elif _legend_engines(panel):
        assert panel.get("repeat") == "gpu", f"{panel['title']}: one line set per engine, not repeated"


def test_some_panels_are_repeated_by_engine() -> None:
    repeated = [p["title"] for d in DASHBOARDS.values() for p in iter_panels(d["panels"]) if p.get("repeat") == "engine"]
    assert len(repeated) >= 20, repeated


def _sdk_round_trip(dash: dict[str, Any]) -> dict[str, Any]:
    """The dashboard loaded into the foundation SDK's model and serialized back."""
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.cog.plugins import register_default_plugins
    from grafana_foundation_sdk.models.dashboard import Dashboard

    register_default_plugins()
    back: dict[str, Any] = json.loads(json.dumps(Dashboard.from_json(json.loads(json.dumps(dash))), cls=JSONEncoder))
    return back


# The export envelope: Grafana's import form reads and removes them; no dashboard model has them.
IMPORT_ONLY = ("__inputs", "__requires")


def _lost(ours: Any, sdk: Any, path: str = "") -> list[str]:
    """What the SDK dropped or changed, field by field (what it adds are its defaults: allowed)."""
    if isinstance(ours, dict):
        if not isinstance(sdk, dict):
            return [f"{path}: {type(ours).__name__} became {type(sdk).__name__}"]
        out = []
        for key, value in ours.items():
            if not path and key in IMPORT_ONLY:
                continue
            out += [f"{path}/{key}: dropped"] if key not in sdk else _lost(value, sdk[key], f"{path}/{key}")
        return out
    if isinstance(ours, list):
        if not isinstance(sdk, list) or len(sdk) != len(ours):
            return [f"{path}: list of {len(ours)} became {sdk!r:.80}"]
        return [line for i, (a, b) in enumerate(zip(ours, sdk, strict=True)) for line in _lost(a, b, f"{path}/{i}")]
    return [] if ours == sdk and type(ours) is type(sdk) else [f"{path}: {ours!r:.60} became {sdk!r:.60}"]


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_dashboard_loads_in_the_grafana_foundation_sdk_without_loss(name: str) -> None:
    dash = DASHBOARDS[name]
    lost = _lost(dash, _sdk_round_trip(dash))
    assert not lost, "the foundation SDK drops or changes:\n" + "\n".join(lost)


def test_sdk_check_fails_on_a_dropped_or_renamed_field() -> None:
    """Fields the schema does not know, at every level, are reported: what grafanalib's raw
    output had (a query variable's `definition`), and misspellings of real fields. (The SDK
    checks names, not values: an unknown enum value passes through unchanged.)"""
    dash = json.loads(json.dumps(DASHBOARDS["kv-ledger"]))
    dash["templating"]["list"][1]["definition"] = "label_values(kvledger_build_info, cluster)"
    panel = next(p for p in dash["panels"] if p["type"] == "timeseries")
    panel["descripton"] = panel["description"]
    panel["targets"][0]["legend"] = panel["targets"][0].pop("legendFormat")
    panel["options"]["legend"]["displaymode"] = "table"
    panel["fieldConfig"]["defaults"]["custom"]["fillopacity"] = 10
    lost = _lost(dash, _sdk_round_trip(dash))
    for field in ("templating/list/1/definition", "descripton", "targets/0/legend", "legend/displaymode",
                  "custom/fillopacity"):
        assert any(line.endswith(f"/{field}: dropped") for line in lost), (field, lost)
    assert len(lost) == 5, lost


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_dashboard_imports_like_a_grafana_com_export(name: str) -> None:
    dash = DASHBOARDS[name]
    assert [(i["name"], i["type"], i["pluginId"]) for i in dash["__inputs"]] == [
        ("DS_PROMETHEUS", "datasource", "prometheus")]
    requires = {(r["type"], r["id"]) for r in dash["__requires"]}
    kinds = {p["type"] for p in iter_panels(dash["panels"]) if p["type"] != "row"}
    assert requires == {("grafana", "grafana"), ("datasource", "prometheus")} | {("panel", k) for k in kinds}
    assert "id" not in dash
    # The import form replaces ${DS_PROMETHEUS} with the chosen data source's uid: the datasource
    # variable opens on it, every panel keeps reading $datasource.
    text = json.dumps(dash)
    imported = json.loads(text.replace("${DS_PROMETHEUS}", "P1809F7CD0C75ACF3"))
    changed = [k for k in imported if k not in IMPORT_ONLY and imported[k] != dash[k]]
    assert changed == ["templating"], changed
    ds_var = imported["templating"]["list"][0]
    assert ds_var["type"] == "datasource" and ds_var["current"]["value"] == "P1809F7CD0C75ACF3"
    assert imported["templating"]["list"][1:] == dash["templating"]["list"][1:]


def test_previews_were_rendered_from_the_current_generator() -> None:
    """`make previews` records the SHA-256 of the JSON it rendered (docs/previews/dashboards.sha256)."""
    stamp = generate.PREVIEW_STAMP
    assert stamp.exists(), "no docs/previews/dashboards.sha256: run `make previews`"
    assert stamp.read_text() == generate.preview_stamp(), (
        "docs/previews are older than the dashboard generator: run `make dashboards previews`"
    )
    assert all((ROOT / "docs" / "previews" / f"{n}.png").exists() for n in DASHBOARDS)


def test_preview_stamp_changes_with_any_generated_dashboard(monkeypatch: pytest.MonkeyPatch) -> None:
    before = generate.preview_stamp()
    builder = generate.BUILDERS["host-network"]

    def retitled() -> Any:
        dash = builder()
        dash.title += " (changed)"
        return dash

    monkeypatch.setitem(generate.BUILDERS, "host-network", retitled)
    after = generate.preview_stamp()
    changed = [a for a, b in zip(before.splitlines(), after.splitlines(), strict=True) if a != b]
    assert len(changed) == 1 and changed[0].endswith("  dashboards/json/host-network.json"), changed


# ---------------------------------------------------------------- queries


@pytest.mark.parametrize("name,panel,target", QUERIES)
def test_query_parses_and_names_only_known_metrics(name: str, panel: dict[str, Any], target: dict[str, Any]) -> None:
    tree = parse(target["expr"])
    names = selectors(tree)
    assert names, "query selects no metric"
    for metric in names:
        assert metric in BY_NAME or metric in RECORDING_RULES, f"unknown metric {metric}"


@pytest.mark.parametrize("name,panel,target", QUERIES)
def test_rates_use_rate_interval(name: str, panel: dict[str, Any], target: dict[str, Any]) -> None:
    expr = target["expr"]
    for fn in re.findall(r"\b(\w+)\([^()]*\[", expr):
        assert fn in ("rate", "increase"), fn
    for window in re.findall(r"\[([^\]]*)\]", expr):
        assert window == "$__rate_interval", f"range window [{window}]"


def _safe_denominator(node: Any) -> bool:
    while isinstance(node, pp.ParenExpr):
        node = node.expr
    if isinstance(node, pp.BinaryExpr) and str(node.op) == ">":
        rhs = node.rhs
        while isinstance(rhs, pp.ParenExpr):
            rhs = rhs.expr
        return isinstance(rhs, pp.NumberLiteral) and rhs.val == 0
    if isinstance(node, pp.Call):
        return node.func.name == "clamp_min"
    return False


@pytest.mark.parametrize("name,panel,target", QUERIES)
def test_ratios_are_safe_when_the_denominator_is_zero(name: str, panel: dict[str, Any], target: dict[str, Any]) -> None:
    divisions: list[Any] = []

    def visit(n: Any) -> None:
        if isinstance(n, pp.BinaryExpr) and str(n.op) == "/":
            divisions.append(n)

    pp.walk(parse(target["expr"]), visit)
    for div in divisions:
        assert _safe_denominator(div.rhs), f"unsafe denominator: {div.rhs}"


def test_safe_denominator_check_rejects_a_bare_divisor() -> None:
    bare = pp.parse("a / b")
    guarded = pp.parse("a / ignoring (basis) group_left () (b > 0)")
    assert not _safe_denominator(bare.rhs)
    assert _safe_denominator(guarded.rhs)


@pytest.mark.parametrize("name,panel", PANELS)
def test_no_panel_mixes_per_request_and_unique_counts(name: str, panel: dict[str, Any]) -> None:
    names = {m for t in panel["targets"] for m in metrics_in(t["expr"])}
    mixes = bool(names & PER_REQUEST) and bool(names & UNIQUE)
    marked = CONSISTENCY_TOKEN in (panel.get("description") or "")
    assert mixes == marked, "mixes per-request and unique counts" if mixes else "marked but mixes nothing"


def test_exactly_one_consistency_panel() -> None:
    marked = [p["title"] for _, _, p in ((n, d, p) for n, d in DASHBOARDS.items() for p in iter_panels(d["panels"]))
              if CONSISTENCY_TOKEN in (p.get("description") or "")]
    assert len(marked) == 1, marked


# ---------------------------------------------------------------- live


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with live.run_live(tmp_path_factory.mktemp("dashboards-live")) as prom:
        yield prom


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["all", "concrete"])
@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_every_panel_query_returns_live_data(prometheus: Any, name: str, mode: str) -> None:
    """Every panel has data with All selected, and for one concrete selection (an engine
    may lack some figures by nature: a stock vLLM has no host buffer, so "concrete" takes
    the first selection under which every panel has data, when there is one, and otherwise
    requires each panel to have data under some concrete selection)."""
    dash = DASHBOARDS[name]

    def empty_panels(values: dict[str, str]) -> list[str]:
        empty = []
        for panel, target in live.panel_targets(dash):
            expr = live.substitute(target["expr"], values)
            if not prometheus.query(expr):  # raises on a query Prometheus rejects
                empty.append(f"{panel['title']}: {expr}")
        return empty

    def find_empty() -> list[str]:
        if mode == "all":
            empty = empty_panels(live.all_values(dash))
        else:
            try:
                empty = empty_panels(live.concrete_values(prometheus, dash, accept=lambda v: not empty_panels(v)))
            except live.LiveError:
                # no engine of the demo has every figure (the KV-cache groups panels need a pool
                # with stated groups, the tenant panels an engine with tenants): each panel has data
                # under some concrete selection of the variables
                # (the variables the panel's query uses: the tenant variable has no value for an
                # engine without tenants)
                empty = []
                for panel, target in live.panel_targets(dash):
                    expr = target["expr"]

                    def has_data(values: dict[str, str], expr: str = expr) -> bool:
                        return bool(prometheus.query(live.substitute(expr, values)))

                    used = [v for v in dash["templating"]["list"] if v["type"] != "query" or f"${v['name']}" in expr]
                    try:
                        live.concrete_values(prometheus, {**dash, "templating": {"list": used}}, accept=has_data)
                    except live.LiveError:
                        empty.append(f"{panel['title']}: {target['expr']}")
        return empty

    # every panel has data at one scrape: on a loaded machine a demo engine's poll may time out
    # (its series then absent, as for any source down), so the check waits (bounded) for a
    # scrape where they all answer
    deadline = time.monotonic() + 30
    while (empty := find_empty()) and time.monotonic() < deadline:
        time.sleep(1.0)  # the next scrape (every second)
    assert not empty, "panels without data:\n" + "\n".join(empty)


@pytest.mark.e2e
@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_no_time_series_panel_draws_several_engines_at_once(prometheus: Any, name: str) -> None:
    """With every variable on All (as a dashboard opens), each drawn time series panel shows one
    engine's series: a panel repeated by $engine is drawn once per engine (here: for each value
    the engine variable offers), any other reads at most one engine (the demo runs several)."""
    dash = DASHBOARDS[name]
    values = live.all_values(dash)
    engine_selector = next(sel for n, sel, _ in live.query_variables(dash) if n == "engine")
    engines = prometheus.label_values(live.substitute(engine_selector, values), "engine")
    assert len(engines) > 1, engines
    crowded = []
    for panel in iter_panels(dash["panels"]):
        if panel["type"] != "timeseries" or panel.get("repeat") == "gpu":
            continue
        for engine in engines if panel.get("repeat") == "engine" else [values["engine"]]:
            seen = {s["metric"].get("engine", "") for t in panel["targets"]
                    for s in prometheus.query(live.substitute(t["expr"], {**values, "engine": engine}))}
            if len(seen - {""}) > 1:
                crowded.append(f"{panel['title']} (engine={engine}): {sorted(seen)}")
    assert not crowded, "time series panels drawing several engines:\n" + "\n".join(crowded)


@pytest.mark.e2e
def test_recording_rules_carry_the_labels_the_fleet_dashboard_uses(prometheus: Any) -> None:
    assert {s["metric"].get("basis") for s in prometheus.query("kvledger:kv_reserved_bytes:sum")} >= {"exact"}
    overcommit = prometheus.query("kvledger:kv_overcommit:ratio")
    assert overcommit and all({"engine", "pool", "basis"} <= set(s["metric"]) for s in overcommit)
    capacity = float(prometheus.query("kvledger:kv_capacity_bytes:sum")[0]["value"][1])
    assert capacity == pytest.approx(float(prometheus.query("sum(kvledger_kv_capacity_bytes)")[0]["value"][1]))

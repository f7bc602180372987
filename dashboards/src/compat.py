"""Make grafanalib 0.7.1 output import cleanly into Grafana 10/11.

grafanalib 0.7.1 writes JSON shaped for old Grafana in several places. Queries and
template variables are not grafanalib objects (dashboards/src/panels.py writes them as
Grafana 10/11 does); every other fix is made here, once, on the final JSON of a dashboard,
never panel by panel:

- ``schemaVersion`` 12 (Grafana 4): Grafana would run every migration since on
  import. We emit ``SCHEMA_VERSION`` and drop the pre-schema-14 keys (``rows``,
  ``style``, ``hideControls``, ``sharedCrosshair``, ``gnetId``) and the null ``id`` (a
  dashboard to import has none).
- Threshold steps carry ``"value": "null"`` (a string) for the base step plus the old
  Graph-panel keys (``op``, ``yaxis``, ``line``, ``index``); Grafana expects
  ``{"color", "value": null}``. A panel without steps gets a neutral base step.
- GaugePanel puts ``calcs``, ``values`` and ``limit`` in ``fieldConfig.defaults`` and
  ``showThresholdLabels``/``Markers`` in ``fieldConfig``, where Grafana ignores them
  (and the editor fails on the missing ``options.reduceOptions``); they belong in
  ``options.reduceOptions`` and ``options``.
- Stat and Gauge reduce by ``mean`` by default: the mean over the dashboard's time
  range, not the current value. Grafana's own default is ``lastNotNull``.
- Stat's ``noValue`` defaults to the literal text ``"none"``, shown instead of
  "No data"; removed.
- Table panels carry pre-v8 top-level ``columns``, ``fontSize``, ``color`` and
  ``mappings`` (mappings belong in ``fieldConfig.defaults``).
- Panels carry row-era layout keys (``span``, ``height``, ``minSpan``, ``error``) and
  ``maxDataPoints: 100`` (coarse); removed so Grafana sizes queries by panel width.
- TimeSeries writes ``stacking: {}`` when not stacked (Grafana's editor expects a
  mode) and Gauge omits ``fieldConfig.overrides``.
- ``timepicker.time_options`` is gone since Grafana 7.
- Row panels carry ``links``, ``transparent`` and ``hideTimeOverride``, which a row has not
  (Grafana's dashboard schema, hence the foundation SDK, drops them).

And one addition for import by file or from grafana.com (Dashboards > New > Import): the
``__inputs`` (one Prometheus data source, ``DS_PROMETHEUS``, which the import form asks for and
the datasource variable opens on; every panel still reads the ``$datasource`` variable) and the
``__requires`` (Grafana, the Prometheus data source and every panel type used), as Grafana's
"Export for sharing externally" writes them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from grafanalib import core as g

SCHEMA_VERSION = 39

_LEGACY_DASHBOARD_KEYS = ("rows", "style", "hideControls", "sharedCrosshair", "gnetId")
_ROW_KEYS_NOT_IN_SCHEMA = ("links", "transparent", "hideTimeOverride")
_LEGACY_PANEL_KEYS = ("span", "height", "minSpan", "error", "editable", "maxDataPoints", "cacheTimeout")
_NONE_PANEL_KEYS = ("repeat", "repeatDirection", "maxPerRow", "timeFrom", "timeShift", "interval", "description")
_REDUCING_PANELS = ("stat", "gauge", "bargauge")
_NEUTRAL_STEP = {"color": "green", "value": None}

# What the import form asks for, and what the dashboard needs (Grafana's export format).
DS_INPUT = "DS_PROMETHEUS"
GRAFANA_VERSION = "10.4.0"  # the first release writing SCHEMA_VERSION 39
_PANEL_NAMES = {"timeseries": "Time series", "stat": "Stat", "gauge": "Gauge", "table": "Table",
                "bargauge": "Bar gauge", "text": "Text"}


def to_grafana_json(dashboard: g.Dashboard) -> dict[str, Any]:
    """The dashboard as a JSON-ready dict for Grafana 10/11."""
    data: dict[str, Any] = _plain(dashboard.to_json_data())
    return modernize(data)


def _plain(value: Any) -> Any:
    """Resolve grafanalib objects (anything with ``to_json_data``) into dicts and lists."""
    while hasattr(value, "to_json_data"):
        value = value.to_json_data()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def modernize(data: dict[str, Any]) -> dict[str, Any]:
    data["schemaVersion"] = SCHEMA_VERSION
    for key in _LEGACY_DASHBOARD_KEYS:
        data.pop(key, None)
    picker = data.get("timepicker", {})
    picker.pop("time_options", None)
    if picker.get("nowDelay") is None:
        picker.pop("nowDelay", None)
    for panel in iter_panels(data.get("panels", [])):
        _fix_panel(panel)
    if data.get("id") is None:
        data.pop("id", None)
    _add_import_sections(data)
    return data


def _add_import_sections(data: dict[str, Any]) -> None:
    """``__inputs`` and ``__requires`` (see the module docstring)."""
    data["__inputs"] = [{"name": DS_INPUT, "label": "Prometheus", "description": "The Prometheus scraping kvledger",
                         "type": "datasource", "pluginId": "prometheus", "pluginName": "Prometheus"}]
    kinds = sorted({panel["type"] for panel in iter_panels(data.get("panels", [])) if panel["type"] != "row"})
    data["__requires"] = [
        {"type": "grafana", "id": "grafana", "name": "Grafana", "version": GRAFANA_VERSION},
        {"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"},
        *({"type": "panel", "id": kind, "name": _PANEL_NAMES[kind], "version": ""} for kind in kinds),
    ]
    for variable in data.get("templating", {}).get("list", []):
        if variable.get("type") == "datasource":
            placeholder = "${" + DS_INPUT + "}"
            variable["current"] = {"selected": False, "text": placeholder, "value": placeholder}


def iter_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, including those nested in (collapsed) row panels."""
    for panel in panels:
        yield panel
        yield from iter_panels(panel.get("panels", []))


def _fix_panel(panel: dict[str, Any]) -> None:
    for key in _LEGACY_PANEL_KEYS:
        panel.pop(key, None)
    for key in _NONE_PANEL_KEYS:
        if panel.get(key) is None:
            panel.pop(key, None)
    kind = panel.get("type")
    field_config = panel.setdefault("fieldConfig", {})
    defaults = field_config.setdefault("defaults", {})
    options = panel.setdefault("options", {})
    if kind == "row":
        for key in ("fieldConfig", "options", "transformations", "targets", *_ROW_KEYS_NOT_IN_SCHEMA):
            panel.pop(key, None)
        if panel.get("datasource") is None:
            panel.pop("datasource", None)
        return
    field_config.setdefault("overrides", [])
    _fix_thresholds(defaults)
    for key in ("min", "max", "decimals", "color"):
        if key in defaults and defaults[key] is None:
            del defaults[key]
    custom = defaults.get("custom", {})
    for key in ("axisSoftMin", "axisSoftMax"):
        if key in custom and custom[key] is None:
            del custom[key]
    if kind == "timeseries" and not custom.get("stacking"):
        custom["stacking"] = {"mode": "none", "group": "A"}
    if kind == "gauge":
        _fix_gauge(panel, field_config, defaults, options)
    if kind == "stat":
        defaults.pop("noValue", None)
    if kind == "table":
        mappings = panel.pop("mappings", [])
        defaults.setdefault("mappings", mappings)
        for key in ("columns", "fontSize", "color"):
            panel.pop(key, None)
    if kind in _REDUCING_PANELS:
        reduce = options.setdefault("reduceOptions", {"values": False, "fields": ""})
        reduce["calcs"] = ["lastNotNull" if c == "mean" else c for c in reduce.get("calcs") or ["lastNotNull"]]


def _fix_thresholds(defaults: dict[str, Any]) -> None:
    spec = defaults.setdefault("thresholds", {"mode": "absolute", "steps": []})
    steps = []
    for i, step in enumerate(spec.get("steps") or []):
        value = step.get("value")
        if i == 0 or value == "null":
            value = None
        steps.append({"color": step["color"], "value": value})
    spec["steps"] = steps or [dict(_NEUTRAL_STEP)]


def _fix_gauge(
    panel: dict[str, Any], field_config: dict[str, Any], defaults: dict[str, Any], options: dict[str, Any]
) -> None:
    reduce = options.setdefault("reduceOptions", {})
    reduce["calcs"] = defaults.pop("calcs", None) or reduce.get("calcs") or ["lastNotNull"]
    reduce["values"] = bool(defaults.pop("values", False))
    reduce["fields"] = ""
    limit = defaults.pop("limit", None)
    if limit is not None:
        reduce["limit"] = limit
    for key in ("showThresholdLabels", "showThresholdMarkers"):
        if key in field_config:
            options[key] = field_config.pop(key)
    options.setdefault("orientation", "auto")
    defaults.pop("override", None)
    if defaults.get("title") is None:
        defaults.pop("title", None)

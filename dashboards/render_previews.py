"""Render a PNG preview of every dashboard from live data: `kvledger demo`, scraped every
second by a real Prometheus with the fleet recording rules, queried over the last minutes.

    python dashboards/render_previews.py [--seconds 90] [--out docs/previews]

Panels are laid out as in Grafana (24-column grid): time series as lines (stacked where the
panel stacks), stats and gauges as their latest values, tables as label rows. Every panel
shows its title and unit. Not a Grafana screenshot; a faithful sketch of what the queries
return. A dashboard with panels repeated per engine is drawn with one engine selected
(``preview_values``). Writes docs/previews/dashboards.sha256 last: the dashboards' JSON the
PNGs show (a test fails when the generator has changed since).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path[:0] = [str(ROOT), str(ROOT / "exporter")]

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402

from dashboards import generate, live  # noqa: E402
from dashboards.src.compat import iter_panels  # noqa: E402

ROW_UNIT_IN = 0.42  # inches per grid row unit
WIDTH_IN = 22.0
UNIT_NAMES = {"bytes": "bytes", "percentunit": "%", "s": "seconds", "cps": "per second", "short": "count",
              "none": ""}


def fmt(value: float, unit: str) -> str:
    if unit == "bytes":
        for suffix, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if abs(value) >= scale:
                return f"{value / scale:.2f} {suffix}"
        return f"{value:.0f} B"
    if unit == "percentunit":
        return f"{100 * value:.1f}%"
    if unit == "s":
        return f"{value:.3g} s"
    if unit == "cps":
        return f"{value:.3g}/s"
    for suffix, scale in (("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.4g}"


def legend(template: str, labels: dict[str, str]) -> str:
    out = template
    for key, value in labels.items():
        out = out.replace("{{" + key + "}}", value)
    return out or ",".join(f"{k}={v}" for k, v in labels.items() if k not in ("__name__", "job", "instance"))


def _style(ax: Axes, title: str, unit: str) -> None:
    label = UNIT_NAMES.get(unit, unit)
    ax.set_title(f"{title}" + (f"  [{label}]" if label else ""), fontsize=8.5, loc="left", fontweight="bold")
    ax.tick_params(labelsize=6.5)


def draw_timeseries(ax: Axes, panel: dict[str, Any], series: list[tuple[str, str, list[float], list[float]]]) -> None:
    unit = panel["fieldConfig"]["defaults"]["unit"]
    stacked = panel["fieldConfig"]["defaults"]["custom"].get("stacking", {}).get("mode") == "normal"
    unstacked_patterns = [o["matcher"]["options"] for o in panel["fieldConfig"].get("overrides", [])]
    import re

    bases: dict[str, list[float]] = {}  # one stack per value of the repeat variable (Grafana: one panel each)
    for name, group, ts, vs in series:
        t0 = [t - ts[-1] for t in ts]
        lone = any(re.match(p, name) for p in unstacked_patterns)
        if stacked and not lone:
            base = bases.get(group)
            if base is None or len(base) != len(vs):
                base = [0.0] * len(vs)
            top = [b + v for b, v in zip(base, vs, strict=True)]
            ax.fill_between(t0, base, top, alpha=0.5, label=name, linewidth=0.6)
            bases[group] = top
        else:
            ax.plot(t0, vs, label=name, linewidth=1.1, linestyle="--" if lone else "-")
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: fmt(v, unit)))
    ax.set_xlabel("seconds before now", fontsize=6.5)
    if series:
        ax.legend(fontsize=5.8, loc="upper left", ncol=2 if len(series) > 6 else 1, framealpha=0.6)
    ax.grid(alpha=0.25)


def draw_values(ax: Axes, panel: dict[str, Any], values: list[tuple[str, float]]) -> None:
    unit = panel["fieldConfig"]["defaults"]["unit"]
    mappings = panel["fieldConfig"]["defaults"].get("mappings") or []
    texts = {}
    for m in mappings:
        for key, opt in m.get("options", {}).items():
            texts[float(key)] = opt["text"]
    ax.axis("off")
    n = max(len(values), 1)
    cols = min(n, 4)
    rows = (n + cols - 1) // cols
    for i, (name, value) in enumerate(values):
        cx = (i % cols + 0.5) / cols
        cy = 1 - (i // cols + 0.55) / rows
        shown = texts.get(value, fmt(value, unit))
        color = "tab:green"
        for step in panel["fieldConfig"]["defaults"]["thresholds"]["steps"]:
            if step["value"] is None or value >= step["value"]:
                color = {"green": "tab:green", "orange": "tab:orange", "red": "tab:red"}.get(step["color"], "k")
        if panel["type"] == "gauge":
            top = panel["fieldConfig"]["defaults"].get("max", 1) or 1
            ax.barh(cy - 0.08 / rows, min(value / top, 1) * 0.8 / cols, height=0.1 / rows,
                    left=cx - 0.4 / cols, color=color, transform=ax.transAxes)
        ax.text(cx, cy + 0.05 / rows, shown, ha="center", va="center", fontsize=13 if n < 4 else 10,
                color=color, fontweight="bold", transform=ax.transAxes)
        ax.text(cx, cy - 0.22 / rows, name, ha="center", va="center", fontsize=6.5, transform=ax.transAxes)
    if not values:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", color="grey", transform=ax.transAxes)


def draw_table(ax: Axes, panel: dict[str, Any], rows: list[dict[str, str]]) -> None:
    ax.axis("off")
    hidden = {}
    for tr in panel.get("transformations", []):
        if tr["id"] == "organize":
            hidden = tr["options"].get("excludeByName", {})
    columns = [c for c in sorted({k for r in rows for k in r}) if not hidden.get(c)]
    if not rows or not columns:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", color="grey", transform=ax.transAxes)
        return
    cells = [[r.get(c, "") for c in columns] for r in rows[:8]]
    table = ax.table(cellText=cells, colLabels=columns, loc="upper center", cellLoc="left")
    table.auto_set_font_size(False)
    table.set_fontsize(6.5)
    table.scale(1, 1.1)


def preview_values(prom: live.PrometheusServer, dash: dict[str, Any]) -> dict[str, str]:
    """Every variable on All, except on a dashboard with panels repeated by $engine: there one
    engine is selected (the one for which most of the repeated panels' queries have data), so each
    repeated panel is drawn once, as Grafana draws it for that engine (under All Grafana draws one
    copy per engine)."""
    values = live.all_values(dash)
    repeated = [p for p in iter_panels(dash["panels"]) if p.get("repeat") == "engine"]
    if not repeated:
        return values
    selector = next(sel for name, sel, _ in live.query_variables(dash) if name == "engine")
    engines = prom.label_values(live.substitute(selector, values), "engine")
    if not engines:
        return values

    def answered(engine: str) -> int:
        chosen = {**values, "engine": engine}
        return sum(bool(prom.query(live.substitute(t["expr"], chosen))) for p in repeated for t in p["targets"])

    return {**values, "engine": max(engines, key=answered)}


def render(prom: live.PrometheusServer, dash: dict[str, Any], out: Path, window: float) -> None:
    values = preview_values(prom, dash)
    panels = list(iter_panels(dash["panels"]))
    height_units = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    fig = plt.figure(figsize=(WIDTH_IN, height_units * ROW_UNIT_IN + 0.8))
    total_h = height_units + 2
    selected = f"engine {values['engine']}" if values.get("engine", ".*") != ".*" else "all engines"
    fig.text(0.01, 1 - 0.6 / (total_h * ROW_UNIT_IN),
             dash["title"] + f"   (live: kvledger demo via Prometheus; {selected})",
             fontsize=13, fontweight="bold", va="center")
    end = time.time()
    start = end - window
    step = max(window / 120, 1.0)
    for panel in panels:
        pos = panel["gridPos"]
        left = pos["x"] / 24 + 0.006
        width = pos["w"] / 24 - 0.012
        top = 1 - (pos["y"] + 2) / total_h
        height = pos["h"] / total_h
        if panel["type"] == "row":
            fig.text(left, top - 0.5 / total_h, panel["title"], fontsize=10.5, fontweight="bold", color="#333",
                     va="center")
            continue
        pad = 1.3 / total_h  # room for the title and x labels
        ax = fig.add_axes((left + (0.03 if panel["type"] == "timeseries" else 0), top - height + pad * 0.7,
                           width - (0.03 if panel["type"] == "timeseries" else 0), height - pad))
        unit = panel["fieldConfig"]["defaults"]["unit"]
        _style(ax, live.substitute(panel["title"], values) if panel.get("repeat") == "engine" else panel["title"], unit)
        targets = panel["targets"]
        if panel["type"] == "timeseries":
            series = []
            for t in targets:
                expr = live.substitute(t["expr"], values, rate_interval="10s")
                for s in prom.query_range(expr, start, end, step):
                    ts = [float(p[0]) for p in s["values"]]
                    vs = [float(p[1]) for p in s["values"]]
                    group = s["metric"].get(panel.get("repeat") or "", "")
                    series.append((legend(t["legendFormat"], s["metric"]), group, ts, vs))
            draw_timeseries(ax, panel, series)
        elif panel["type"] in ("stat", "gauge"):
            vals = []
            for t in targets:
                for s in prom.query(live.substitute(t["expr"], values, rate_interval="10s")):
                    vals.append((legend(t["legendFormat"], s["metric"]), float(s["value"][1])))
            draw_values(ax, panel, vals)
        elif panel["type"] == "table":
            rows = []
            for t in targets:
                for s in prom.query(live.substitute(t["expr"], values, rate_interval="10s")):
                    row = dict(s["metric"])
                    row["Value"] = fmt(float(s["value"][1]), unit)
                    rows.append(row)
            draw_table(ax, panel, rows)
    fig.savefig(out, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=90.0, help="how long the demo runs before rendering")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "previews")
    args = parser.parse_args(argv)
    if generate.check(generate.JSON_DIR):  # the PNGs must show what the generator writes now
        print("dashboards/json is stale: run `make dashboards`, then `make previews`", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvledger-previews-") as tmp:
        workdir = Path(tmp)
        with live.run_live(workdir) as prom:
            print(f"collecting {args.seconds:.0f}s of demo data ...", flush=True)
            time.sleep(args.seconds)
            dashboards = live.load_dashboards()
            for name, dash in dashboards.items():
                path = args.out / f"{name}.png"
                render(prom, dash, path, args.seconds)
                print(f"wrote {path}")
    # which generator output the PNGs show (tests/test_dashboards.py fails when it is not the current one)
    (args.out / generate.PREVIEW_STAMP.name).write_text(generate.preview_stamp())
    print(f"wrote {args.out / generate.PREVIEW_STAMP.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

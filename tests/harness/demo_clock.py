"""The demo run faster than real time, and the production alert rules evaluated over it.

``replay_demo(minutes, faults)`` starts the demo as `kvledger demo` does (``start_demo``, the
same profiles, servers and daemon configuration: ``cli.demo_config`` and ``demo_collector``),
except that nothing steps on its own: the engines step on the demo's simulated clock
(``Demo.advance``) and the daemon's collector polls them, for real over HTTP and ZMQ, once per
simulated poll interval (1 s, `kvledger demo`'s default), with the simulated clock as its
wall clock. At each simulated scrape (15 s, deploy/prometheus/prometheus.yml) the daemon's
/metrics text (``render_text``, what the daemon serves) is parsed and kept as a scrape:
the target labels ``job="kvledger"`` and ``instance`` added and ``up`` 1, as Prometheus does.

``evaluate(scrapes)`` hands the scrapes to ``promtool test rules`` as input series, with the
production rule file alerts/kvledger.rules.yml and the evaluation interval of
deploy/prometheus/prometheus.yml: Prometheus' own rule manager evaluates every group at every
interval over the whole run, ``for`` durations and ALERTS included, and the test asks for the
alerts that were firing at any moment. A series that leaves a scrape gets a staleness marker
at the next one, as a scrape does.

Why promtool's rule unit tests rather than a TSDB backfilled with ``promtool tsdb
create-blocks-from openmetrics``: a backfilled TSDB has the samples, but nothing in Prometheus
evaluates alerting rules over the past (a server evaluates its rules at the current time;
``create-blocks-from rules`` evaluates recording rules only and says "Alerting rules are not
evaluated"), and OpenMetrics input cannot carry the staleness markers a scrape writes.
``promtool test rules`` runs the same rule groups with ``for``, pending and firing state over
simulated time.
"""

from __future__ import annotations

import math
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvledger.cli import demo_collector, demo_config
from kvledger.collect.sources.vllm.source import VllmSource
from kvledger.output.prometheus import render_text
from kvledger.sim.demo import Demo, start_demo
from kvledger.sim.engine import SimProfile
from kvledger.sim.llamacpp_server import SimLlamacppProfile

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "alerts" / "kvledger.rules.yml"
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
POLL_INTERVAL = 1.0  # `kvledger demo --interval`'s default
INSTANCE = "127.0.0.1:9477"  # `kvledger demo`'s default listen address


def _seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    for unit in ("ms", "s", "m", "h"):
        if duration.endswith(unit):
            return float(duration[: -len(unit)]) * units[unit]
    raise ValueError(f"unknown duration {duration!r}")


def prometheus_intervals() -> tuple[float, float]:
    """(scrape_interval, evaluation_interval) of deploy/prometheus/prometheus.yml."""
    glob = yaml.safe_load(PROMETHEUS_CONFIG.read_text())["global"]
    return _seconds(glob["scrape_interval"]), _seconds(glob["evaluation_interval"])


Series = tuple[str, tuple[tuple[str, str], ...]]


@dataclass
class Replay:
    """Every scrape of a simulated demo run: ``scrapes[i]`` at ``i * scrape_interval``."""

    scrape_interval: float
    scrapes: list[dict[Series, float]] = field(default_factory=list)
    wall_seconds: float = 0.0

    @property
    def minutes(self) -> float:
        return (len(self.scrapes) - 1) * self.scrape_interval / 60


def _parse(text: str) -> dict[Series, float]:
    samples: dict[Series, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = dict(s.labels)
            labels.update(job="kvledger", instance=INSTANCE)
            samples[(s.name, tuple(sorted(labels.items())))] = float(s.value)
    samples[("up", (("instance", INSTANCE), ("job", "kvledger")))] = 1.0
    return samples


def _vllm_caught_up(demo: Demo, sources: list[VllmSource], deadline: float) -> None:
    """Wait until each stock vLLM's KV-event subscriber holds every batch its frontend published
    (the events travel over ZMQ to another thread; in real time they arrive within the step)."""
    for frontend in demo.frontends:
        for source in sources:
            if source.engine != frontend.engine.profile.name:
                continue
            subscriber = source._events  # the harness reads the subscriber's progress
            if subscriber is None:
                continue
            while True:
                states = subscriber.ledger._ranks
                last = states[0].last if 0 in states else None
                if frontend.seq < 0 or (last is not None and last >= frontend.seq):
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{frontend.engine.profile.name}: KV events not received up to seq {frontend.seq}")
                time.sleep(0.001)


def replay_demo(
    minutes: float,
    faults: dict[str, str] | None = None,
    *,
    seed: int = 0,
    poll_interval: float | None = None,
    profiles: list[SimProfile] | None = None,
    llamacpp: list[SimLlamacppProfile] | None = None,
) -> Replay:
    """Run the demo for ``minutes`` of simulated time; its /metrics at every simulated scrape.

    ``poll_interval``: simulated seconds between two polls of the daemon (default: one poll
    per scrape, just before it; `kvledger demo` polls every second, which costs a tenth of a
    second of real time per poll here: the servers answer from the same process).
    ``profiles``, ``llamacpp``: a part of the demo (``start_demo``'s; default: all of it)."""
    scrape_interval, _ = prometheus_intervals()
    poll_interval = scrape_interval if poll_interval is None else poll_interval
    started = time.monotonic()
    replay = Replay(scrape_interval)
    demo = start_demo(faults=faults, seed=seed, stepping=False, profiles=profiles, llamacpp=llamacpp)
    try:
        config = demo_config(demo, INSTANCE, POLL_INTERVAL, "per-request")
        collector = demo_collector(demo, config)
        vllm_sources = [s for s in collector.sources if isinstance(s, VllmSource)]
        try:
            polls_per_scrape = round(scrape_interval / poll_interval)
            scrapes = round(minutes * 60 / scrape_interval)
            for i in range(scrapes + 1):
                for _ in range(polls_per_scrape if i else 1):
                    if i:
                        demo.advance(poll_interval)
                    _vllm_caught_up(demo, vllm_sources, time.monotonic() + 10)
                    collector.poll_once()
                replay.scrapes.append(_parse(render_text(collector.latest()).decode()))
        finally:
            collector.stop()
    finally:
        demo.stop()
    replay.wall_seconds = time.monotonic() - started
    return replay


def _selector(series: Series) -> str:
    name, labels = series
    pairs = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
    return f"{name}{{{pairs}}}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Inf" if value > 0 else "-Inf"
    return repr(value) if not value.is_integer() else str(int(value))


def input_series(replay: Replay) -> Iterator[dict[str, str]]:
    """promtool's input series: one value per scrape, ``_`` where the series was not there yet
    and ``stale`` at the first scrape it left (what a scrape writes), ``_`` after."""
    every = sorted({s for scrape in replay.scrapes for s in scrape})
    for series in every:
        values: list[str] = []
        present = False
        for scrape in replay.scrapes:
            value = scrape.get(series)
            if value is not None:
                values.append(_number(value))
                present = True
            else:
                values.append("stale" if present else "_")
                present = False
        yield {"series": _selector(series), "values": " ".join(values)}


@dataclass
class Evaluation:
    ok: bool
    output: str


def evaluate(replay: Replay, expected_firing: set[str], *, among: set[str] | None = None, rules: Path = RULES) -> Evaluation:
    """``promtool test rules`` with the production rules over the replay: passes when the alerts
    that were firing at any evaluation are exactly ``expected_firing`` (by alert name); with
    ``among``, only those alerts are looked at (the others may fire or not)."""
    _, evaluation_interval = prometheus_intervals()
    end = (len(replay.scrapes) - 1) * replay.scrape_interval
    window = f"{int(end + replay.scrape_interval)}s"
    names = "" if among is None else ', alertname=~"' + "|".join(sorted(among)) + '"'
    test = {
        "rule_files": [str(rules)],
        "evaluation_interval": f"{int(evaluation_interval)}s",
        "tests": [{
            "interval": f"{int(replay.scrape_interval)}s",
            "input_series": list(input_series(replay)),
            "promql_expr_test": [{
                # every alert that fired at some evaluation of the run (ALERTS is written by the rule manager)
                "expr": f'group by (alertname) (max_over_time(ALERTS{{alertstate="firing"{names}}}[{window}]))',
                "eval_time": f"{int(end)}s",
                "exp_samples": [{"labels": f'{{alertname="{name}"}}', "value": 1} for name in sorted(expected_firing)],
            }],
        }],
    }
    with tempfile.TemporaryDirectory(prefix="kvledger-demo-rules-") as tmp:
        path = Path(tmp) / "demo.test.yml"
        path.write_text(yaml.safe_dump(test, sort_keys=False, width=1 << 30))
        run = subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True, text=True, timeout=300)
    return Evaluation(run.returncode == 0, run.stdout + run.stderr)

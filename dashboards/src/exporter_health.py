"""Exporter health: sources up, poll errors and durations, staleness, KV event flow and
invariant violations."""

from __future__ import annotations

from grafanalib import core as g

from dashboards.src import panels as p
from dashboards.src.panels import q
from dashboards.src.promql import (
    ENGINE,
    INSTANCE,
    increase,
    labels,
    rate,
    sel,
    sum_by,
    zero_when_absent,
)

UID = "kvledger-exporter-health"
TITLE = "kvledger / Exporter health"

IE = (INSTANCE, ENGINE)
# Node-wide sources (nvml, host) carry engine="": the engine regex must also match "".
IE_OR_NODE = (INSTANCE, 'engine=~"$engine|"')


def dashboard() -> g.Dashboard:
    grid = p.Grid()
    grid.add(
        p.stat(
            "Sources up",
            "1 when the source's latest poll succeeded, per engine and source (engine is empty for node-wide "
            "sources such as nvml).",
            [q(sel("kvledger_source_up", *IE_OR_NODE), "{{engine}} {{source}}")],
            p.UP,
            steps=(("red", None), ("green", 1)),
            mappings=p.UP_MAPPINGS,
            color_mode="background",
        ),
        w=14,
        h=5,
    )
    grid.add(
        p.table(
            "Build",
            "The kvledger version on each node.",
            [q(sel("kvledger_build_info", INSTANCE), table=True)],
            hide=("Time", "__name__"),
        ),
        w=10,
        h=5,
    )
    grid.row("Polls")
    grid.add(
        p.timeseries(
            "Poll errors by reason",
            "Failed polls per second by source and reason; 0 for sources the exporter reports with no error "
            "counted.",
            [
                q(
                    zero_when_absent(
                        sum_by(labels("engine", "source", "reason"),
                               rate(sel("kvledger_source_errors_total", *IE_OR_NODE))),
                        sel("kvledger_source_up", *IE_OR_NODE),
                        labels("engine", "source"),
                    ),
                    "{{engine}} {{source}} {{reason}}",
                )
            ],
            p.PER_SECOND,
        ),
        w=8,
    )
    grid.add(
        p.timeseries(
            "Poll duration",
            "Duration of each source's latest completed poll.",
            [q(sel("kvledger_source_duration_seconds", *IE_OR_NODE), "{{engine}} {{source}}")],
            p.SECONDS,
        ),
        w=8,
    )
    grid.add(
        p.timeseries(
            "Time since last successful poll",
            "Now minus the source's latest successful poll (Unix time).",
            [q("time() - " + sel("kvledger_source_last_success_timestamp_seconds", *IE_OR_NODE),
               "{{engine}} {{source}}")],
            p.SECONDS,
            steps=(("green", None), ("orange", 30), ("red", 120)),
            threshold_line=True,
        ),
        w=8,
    )
    grid.row("KV events and invariants")
    grid.add(
        p.timeseries(
            "KV event rate by type",
            "KV cache events received per second, by type (engines with a KV event source only).",
            [q(sum_by(labels("engine", "type"), rate(sel("kvledger_kv_events_total", *IE))), "{{engine}} {{type}}")],
            p.PER_SECOND,
        ),
        w=8,
    )
    grid.add(
        p.timeseries(
            "KV event batches lost",
            "KV event batches lost (sequence gaps not replayed) per interval; a lost batch leaves the cached "
            "block set uncertain until the next resync.",
            [q(sum_by(labels("engine"), increase(sel("kvledger_kv_events_lost_total", *IE))), "{{engine}} lost")],
            p.COUNT,
            axis="batches",
        ),
        w=8,
    )
    grid.add(
        p.timeseries(
            "Invariant violations",
            "Polls whose facts violated an accounting invariant per interval, by check; 0 for engines with none "
            "counted.",
            [
                q(
                    zero_when_absent(
                        sum_by(labels("engine", "check"),
                               increase(sel("kvledger_ledger_invariant_violations_total", *IE))),
                        sel("kvledger_policy_info", *IE),
                        labels("engine"),
                    ),
                    "{{engine}} {{check}}",
                )
            ],
            p.COUNT,
            axis="polls",
            steps=(("green", None), ("red", 1)),
        ),
        w=8,
    )
    return p.dashboard(
        TITLE,
        UID,
        "Is kvledger itself healthy: sources up, poll errors, durations and staleness, KV event flow and "
        "loss, and accounting invariant violations.",
        grid,
        [p.engine_variable(), p.pool_variable()],
    )

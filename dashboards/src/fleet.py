"""Fleet overview across nodes, from the recording rules (monitoring/config.py defines them)."""

from __future__ import annotations

from grafanalib import core as g

from dashboards.src import panels as p
from dashboards.src.panels import q
from dashboards.src.promql import ratio, sel
from monitoring import config as mon

UID = "kvledger-fleet"
TITLE = "kvledger / Fleet overview"


def dashboard() -> g.Dashboard:
    grid = p.Grid()
    grid.add(
        p.stat(
            "Fleet KV capacity",
            "KV capacity summed over every pool of every engine on every node.",
            [q(sel(mon.KV_CAPACITY.record), "capacity")],
            p.BYTES,
        ),
        w=6,
        h=5,
    )
    grid.add(
        p.stat(
            "Fleet reserved / capacity",
            "Fleet-wide reserved bytes over fleet-wide capacity, per basis.",
            [
                q(
                    ratio(sel(mon.KV_RESERVED.record), sel(mon.KV_CAPACITY.record),
                          "on () group_left"),
                    "{{basis}}",
                )
            ],
            p.RATIO,
            steps=(("green", None), ("orange", 0.9), ("red", 1.0)),
        ),
        w=6,
        h=5,
    )
    grid.add(
        p.stat(
            "Fleet GPU memory used / total",
            "NVML used over NVML total, summed over every GPU of the fleet.",
            [q(ratio(sel(mon.GPU_USED.record), sel(mon.GPU_TOTAL.record)), "used")],
            p.RATIO,
            steps=(("green", None), ("orange", 0.9), ("red", 0.97)),
        ),
        w=6,
        h=5,
    )
    grid.add(
        p.stat(
            "Fleet unaccounted GPU memory",
            "GPU memory no engine declared, summed over the fleet, per basis.",
            [q(sel(mon.GPU_UNACCOUNTED.record), "{{basis}}")],
            p.BYTES,
        ),
        w=6,
        h=5,
    )
    grid.row("KV memory across the fleet")
    grid.add(
        p.timeseries(
            "Fleet capacity vs reserved vs allocated",
            "Fleet sums: capacity, reserved (what admitted requests may claim) and allocated (physically "
            "holding data), by basis.",
            [
                q(sel(mon.KV_CAPACITY.record), "capacity"),
                q(sel(mon.KV_RESERVED.record), "reserved ({{basis}})"),
                q(sel(mon.KV_ALLOCATED.record), "allocated ({{basis}})"),
            ],
            p.BYTES,
        ),
        w=12,
        h=9,
    )
    grid.add(
        p.table(
            "Most overcommitted pools",
            "The ten pools with the highest reserved / capacity ratio, by engine, pool and basis.",
            [q("topk(10, " + sel(mon.KV_OVERCOMMIT.record) + ")", table=True)],
            p.RATIO,
            hide=("Time", "__name__"),
            hide_value=False,
        ),
        w=12,
        h=9,
    )
    grid.row("GPU memory across the fleet")
    grid.add(
        p.timeseries(
            "Fleet GPU memory: used vs total",
            "NVML used and total memory summed over every GPU of the fleet.",
            [
                q(sel(mon.GPU_TOTAL.record), "total"),
                q(sel(mon.GPU_USED.record), "used"),
            ],
            p.BYTES,
        ),
        w=12,
    )
    grid.add(
        p.timeseries(
            "Fleet unaccounted GPU memory",
            "GPU memory no engine declared, summed over the fleet, per basis.",
            [q(sel(mon.GPU_UNACCOUNTED.record), "{{basis}}")],
            p.BYTES,
        ),
        w=12,
    )
    grid.row("Policies and nodes")
    grid.add(
        p.table(
            "Policies in the fleet",
            "How many engines run each declared accounting policy (sharing rule, admission, overflow, tenant "
            "rule).",
            [q("count by (sharing, admission, overflow, tenant_rule) (" + sel("kvledger_policy_info") + ")",
               table=True)],
            p.COUNT,
            hide=("Time",),
            hide_value=False,
        ),
        w=12,
    )
    grid.add(
        p.table(
            "Nodes",
            "Every node running kvledger with its version.",
            [q(sel("kvledger_build_info"), table=True)],
            hide=("Time", "__name__"),
        ),
        w=12,
    )
    return p.dashboard(
        TITLE,
        UID,
        "KV memory and GPU memory summed across every node, the most overcommitted pools and the policies "
        "in force, from the kvledger recording rules.",
        grid,
        [],
    )

"""Fleet overview across nodes: sums over the nodes, engines and pools the variables select.

The fleet-wide recording rules of monitoring/config.py sum everything one Prometheus holds (the
alerts read them); a dashboard narrowed to one cluster, job or engine sums the raw series under
its variables instead. The per-pool overcommit ratio keeps its labels, so its recording rule is
read here, filtered."""

from __future__ import annotations

from grafanalib import core as g

from dashboards.src import panels as p
from dashboards.src.panels import q
from dashboards.src.promql import ENGINE, POOL, TARGET, ratio, sel
from monitoring import config as mon

UID = "kvledger-fleet"
TITLE = "kvledger / Fleet overview"

# KV figures: the selected nodes' selected engines and pools; GPU figures: the selected nodes.
KV = (TARGET, ENGINE, POOL)


def _kv(name: str, by: str = "") -> str:
    return f"sum by ({by}) ({sel(name, *KV)})" if by else f"sum({sel(name, *KV)})"


def _gpu(name: str, by: str = "") -> str:
    return f"sum by ({by}) ({sel(name, TARGET)})" if by else f"sum({sel(name, TARGET)})"


def dashboard() -> g.Dashboard:
    grid = p.Grid()
    grid.add(
        p.stat(
            "Fleet KV capacity",
            "KV capacity summed over every pool of every engine on every node.",
            [q(_kv("kvledger_kv_capacity_bytes"), "capacity")],
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
                    ratio(_kv("kvledger_kv_reserved_bytes", "basis"), _kv("kvledger_kv_capacity_bytes"),
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
            [q(ratio(_gpu("kvledger_gpu_memory_used_bytes"), _gpu("kvledger_gpu_memory_total_bytes")), "used")],
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
            [q(_gpu("kvledger_gpu_memory_unaccounted_bytes", "basis"), "{{basis}}")],
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
                q(_kv("kvledger_kv_capacity_bytes"), "capacity"),
                q(_kv("kvledger_kv_reserved_bytes", "basis"), "reserved ({{basis}})"),
                q(_kv("kvledger_kv_allocated_bytes", "basis"), "allocated ({{basis}})"),
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
            [q("topk(10, " + sel(mon.KV_OVERCOMMIT.record, *KV) + ")", table=True)],
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
                q(_gpu("kvledger_gpu_memory_total_bytes"), "total"),
                q(_gpu("kvledger_gpu_memory_used_bytes"), "used"),
            ],
            p.BYTES,
        ),
        w=12,
    )
    grid.add(
        p.timeseries(
            "Fleet unaccounted GPU memory",
            "GPU memory no engine declared, summed over the fleet, per basis.",
            [q(_gpu("kvledger_gpu_memory_unaccounted_bytes", "basis"), "{{basis}}")],
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
            [q("count by (sharing, admission, overflow, tenant_rule) (" + sel("kvledger_policy_info", TARGET, ENGINE) + ")",
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
            [q(sel("kvledger_build_info", TARGET), table=True)],
            hide=("Time", "__name__"),
        ),
        w=12,
    )
    return p.dashboard(
        TITLE,
        UID,
        "KV memory and GPU memory summed across every node, the most overcommitted pools and the policies "
        "in force, over the nodes, engines and pools the variables select.",
        grid,
        [p.engine_variable(), p.pool_variable()],
    )

"""GPU memory budget: NVML's view of each device against the budget terms the engines
declare, and the memory nobody accounts for."""

from __future__ import annotations

from grafanalib import core as g

from dashboards.src import panels as p
from dashboards.src.panels import q
from dashboards.src.promql import ENGINE, GPU, INSTANCE, labels, on, ratio, sel, sum_by

UID = "kvledger-gpu-budget"
TITLE = "kvledger / GPU memory budget"

IG = (INSTANCE, GPU)


def dashboard() -> g.Dashboard:
    grid = p.Grid()
    grid.add(
        p.stat(
            "GPU answering NVML",
            "1 when the GPU answers NVML, 0 when it is lost or failing.",
            [q(sel("kvledger_gpu_up", *IG), "gpu {{gpu}}")],
            p.UP,
            steps=(("red", None), ("green", 1)),
            mappings=p.UP_MAPPINGS,
            color_mode="background",
        ),
        w=6,
        h=5,
    )
    grid.add(
        p.table(
            "GPUs",
            "GPU identity: uuid, name, driver version and whether it is a MIG instance.",
            [q(sel("kvledger_gpu_info", *IG), table=True)],
        ),
        w=18,
        h=5,
    )
    grid.row("Device memory (NVML) vs declared budget")
    grid.add(
        p.timeseries(
            "NVML: total, used, free, driver reserved",
            "Device memory as NVML reports it. With memory v2, used excludes the memory the driver and "
            "firmware reserve, reported separately.",
            [
                q(sel("kvledger_gpu_memory_total_bytes", *IG), "gpu {{gpu}} total"),
                q(sel("kvledger_gpu_memory_used_bytes", *IG), "gpu {{gpu}} used"),
                q(sel("kvledger_gpu_memory_free_bytes", *IG), "gpu {{gpu}} free"),
                q(sel("kvledger_gpu_memory_driver_reserved_bytes", *IG), "gpu {{gpu}} driver reserved"),
            ],
            p.BYTES,
        ),
        w=12,
        h=9,
    )
    grid.add(
        p.timeseries(
            "Budget terms by category (stacked) vs device total",
            "Declared budget terms stacked by category (weights, workspace, runtime_buffers, reserve, kv_pool) "
            "with where each figure comes from, summed over the engines on the GPU; the dashed line is the NVML device total. "
            "The reserve is headroom, not an allocation. Repeated per GPU so one device's terms never stack on another's.",
            [
                q(sum_by(labels("gpu", "category", "provenance"), sel("kvledger_gpu_budget_bytes", *IG)),
                  "gpu {{gpu}} {{category}} ({{provenance}})"),
                q(sel("kvledger_gpu_memory_total_bytes", *IG), "gpu {{gpu}} device total"),
            ],
            p.BYTES,
            stack=True,
            unstacked=(".*device total$",),
            repeat="gpu",
        ),
        w=12,
        h=9,
    )
    grid.add(
        p.timeseries(
            "Unaccounted GPU memory",
            "NVML used minus what the engines on the GPU declared (weights, workspace, runtime buffers, KV "
            "pool): CUDA graphs missed by profiling, another process, a leak. `basis` says exact or a bound.",
            [q(sel("kvledger_gpu_memory_unaccounted_bytes", *IG), "gpu {{gpu}} ({{basis}})")],
            p.BYTES,
        ),
        w=6,
    )
    grid.add(
        p.timeseries(
            "Budget slack (device total minus every term)",
            "The budget inequality weights + workspace + runtime_buffers + reserve + kv_pool <= total, "
            "evaluated by kvledger: device total minus every declared term including the reserve. Below zero "
            "the budget does not close.",
            [q(sel("kvledger_gpu_budget_slack_bytes", *IG), "gpu {{gpu}}")],
            p.BYTES,
        ),
        w=6,
    )
    grid.add(
        p.gauge(
            "Declared budget incl. reserve / device total",
            "All declared budget terms including the reserve over the NVML device total; above 100% the "
            "budget cannot close.",
            [
                q(
                    ratio(
                        sum_by(labels("gpu"), sel("kvledger_gpu_budget_bytes", *IG)),
                        sel("kvledger_gpu_memory_total_bytes", *IG),
                        on("gpu"),
                    ),
                    "gpu {{gpu}}",
                )
            ],
            p.RATIO,
            steps=(("green", None), ("orange", 0.95), ("red", 1.0)),
        ),
        w=6,
    )
    grid.add(
        p.timeseries(
            "Engine process memory (NVML)",
            "Device memory held by each engine's processes, from NVML's per-process figures.",
            [q(sel("kvledger_gpu_process_memory_bytes", *IG, ENGINE), "gpu {{gpu}} {{engine}}")],
            p.BYTES,
        ),
        w=6,
    )
    grid.row("Budget terms")
    grid.add(
        p.table(
            "Budget terms by engine",
            "Every declared term: engine, category and provenance (measured, configured or estimate), in bytes.",
            [q(sel("kvledger_gpu_budget_bytes", *IG, ENGINE), table=True)],
            p.BYTES,
            hide=("Time", "__name__", "job"),
            hide_value=False,
        ),
        w=24,
        h=8,
    )
    return p.dashboard(
        TITLE,
        UID,
        "Per GPU: NVML total/used/free/driver reserved against the budget terms the engines declare "
        "(weights, workspace, runtime buffers, reserve, KV pool) and the memory nobody accounts for.",
        grid,
        [p.instance_variable(), p.gpu_variable(), engine_on_gpu_variable()],
    )


def engine_on_gpu_variable() -> g.Template:
    """Engines with budget terms on the selected GPUs (an engine on another GPU has no data here)."""
    return p.query_variable("engine", "Engine", sel("kvledger_gpu_budget_bytes", INSTANCE, GPU), "engine")

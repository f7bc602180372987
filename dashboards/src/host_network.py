"""Host and network: output buffers and queues against their limits, with whether each limit is hard or an estimate (the label limit).

This is a separate memory domain: nothing here is ever added to GPU numbers."""

from __future__ import annotations

from grafanalib import core as g

from dashboards.src import panels as p
from dashboards.src.panels import q
from dashboards.src.promql import ENGINE, INSTANCE, on, ratio, sel

UID = "kvledger-host-network"
TITLE = "kvledger / Host and network"

IE = (INSTANCE, ENGINE)


def dashboard() -> g.Dashboard:
    grid = p.Grid()
    grid.row("Host output buffers")
    grid.add(
        p.timeseries(
            "Host output buffer vs limit",
            "Host output buffer bytes held by the engine against the buffer's limit; `limit` says whether the "
            "limit is a hard cap or an estimate.",
            [
                q(sel("kvledger_host_buffer_bytes", *IE), "{{engine}} buffered"),
                q(sel("kvledger_host_buffer_limit_bytes", *IE), "{{engine}} limit ({{limit}})"),
            ],
            p.BYTES,
        ),
        w=16,
    )
    grid.add(
        p.gauge(
            "Host buffer use",
            "Host output buffer bytes over the limit (the legend says whether the limit is hard or an estimate).",
            [
                q(
                    ratio(
                        sel("kvledger_host_buffer_bytes", *IE),
                        sel("kvledger_host_buffer_limit_bytes", *IE),
                        on("engine") + " group_right",
                    ),
                    "{{engine}} ({{limit}} limit)",
                )
            ],
            p.RATIO,
            steps=(("green", None), ("orange", 0.8), ("red", 0.95)),
        ),
        w=8,
    )
    grid.row("Network queues")
    grid.add(
        p.timeseries(
            "Application network queue depth vs limit",
            "Responses waiting to be sent in the engine's application queue against the queue's limit; "
            "`limit` says hard cap or estimate.",
            [
                q(sel("kvledger_network_queue_depth", *IE), "{{engine}} depth"),
                q(sel("kvledger_network_queue_limit", *IE), "{{engine}} limit ({{limit}})"),
            ],
            p.COUNT,
            axis="responses",
        ),
        w=16,
    )
    grid.add(
        p.gauge(
            "Network queue use",
            "Application network queue depth over its limit (the legend says whether the limit is hard or an estimate).",
            [
                q(
                    ratio(
                        sel("kvledger_network_queue_depth", *IE),
                        sel("kvledger_network_queue_limit", *IE),
                        on("engine") + " group_right",
                    ),
                    "{{engine}} ({{limit}} limit)",
                )
            ],
            p.RATIO,
            steps=(("green", None), ("orange", 0.8), ("red", 0.95)),
        ),
        w=8,
    )
    grid.add(
        p.timeseries(
            "Kernel socket queues of the serving port",
            "Bytes queued in the kernel for the engine's serving port (send and receive), from /proc/net/tcp "
            "and tcp6.",
            [q(sel("kvledger_network_socket_queue_bytes", *IE), "{{engine}} {{direction}}")],
            p.BYTES,
        ),
        w=24,
    )
    return p.dashboard(
        TITLE,
        UID,
        "Host output buffers, application network queues and kernel socket queues of each engine, against "
        "their limits (hard cap or estimate). A separate memory domain from the GPU.",
        grid,
        [p.instance_variable(), p.engine_variable()],
    )

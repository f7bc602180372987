"""KV ledger, per engine: reservations versus physical state, the two headrooms, overcommit,
prefix sharing, token budgets, output bounds and tenants — under the declared policy."""

from __future__ import annotations

from grafanalib import core as g

from dashboards.src import panels as p
from dashboards.src.panels import q
from dashboards.src.promql import (
    ENGINE,
    INSTANCE,
    POOL,
    TENANT,
    labels,
    on,
    rate,
    ratio,
    sel,
    sum_by,
)
from monitoring import config as mon

UID = "kvledger-kv-ledger"
TITLE = "kvledger / KV ledger"

EP = (INSTANCE, ENGINE, POOL)
EPL = "{{engine}}/{{pool}}"


def _capacity_row(grid: p.Grid) -> None:
    grid.row("Capacity, reservations and physical state (bytes)")
    grid.add(
        p.timeseries(
            "Capacity vs reserved vs allocated vs reclaimable vs free",
            "Reserved is what admitted requests (running and preempted) may claim under the declared sharing "
            "rule; allocated, reclaimable and free are the physical state of unique blocks (allocated = in use "
            "+ reclaimable, free = capacity - allocated). `basis` says exact or a hard bound.",
            [
                q(sel("kvledger_kv_capacity_bytes", *EP), f"{EPL} capacity"),
                q(sel("kvledger_kv_reserved_bytes", *EP), f"{EPL} reserved ({{{{basis}}}})"),
                q(sel("kvledger_kv_allocated_bytes", *EP), f"{EPL} allocated ({{{{basis}}}})"),
                q(sel("kvledger_kv_reclaimable_bytes", *EP), f"{EPL} reclaimable ({{{{basis}}}})"),
                q(sel("kvledger_kv_free_bytes", *EP), f"{EPL} free ({{{{basis}}}})"),
            ],
            p.BYTES,
        ),
        w=16,
        h=9,
    )
    grid.add(
        p.timeseries(
            "Unique blocks by state (partition of capacity)",
            "Unique KV blocks by state, stacked: in_use + reclaimable + free = capacity. A state is drawn "
            "only when known exactly.",
            [q(sel("kvledger_kv_blocks", *EP), f"{EPL} {{{{state}}}}")],
            p.COUNT,
            axis="blocks",
            stack=True,
        ),
        w=8,
        h=9,
    )


def _headroom_row(grid: p.Grid) -> None:
    grid.row("Headroom: quota and physical (two different numbers, never merged)")
    grid.add(
        p.timeseries(
            "Quota headroom (capacity - reserved)",
            "view=quota: capacity minus reserved. Below zero the pool is overcommitted: admitted requests may "
            "claim more than the pool holds.",
            [q(sel("kvledger_kv_headroom_bytes", *EP, 'view="quota"'), f"{EPL} quota ({{{{basis}}}})")],
            p.BYTES,
            steps=(("red", None), ("green", 0)),
            threshold_line=True,
        ),
        w=9,
    )
    grid.add(
        p.timeseries(
            "Physical headroom (free + reclaimable)",
            "view=physical: free plus reclaimable unique blocks, memory a new allocation can get now. Not the "
            "quota headroom: a pool can have physical headroom while its quota is exhausted.",
            [q(sel("kvledger_kv_headroom_bytes", *EP, 'view="physical"'), f"{EPL} physical ({{{{basis}}}})")],
            p.BYTES,
        ),
        w=9,
    )
    grid.add(
        p.stat(
            "Admission headroom",
            "More requests of the largest supported shape (max_model_len) that fit under the quota and under "
            "max_num_seqs.",
            [q(sel("kvledger_admission_headroom_requests", *EP), f"{EPL} ({{{{basis}}}})")],
            p.COUNT,
            steps=(("red", None), ("orange", 1), ("green", 4)),
        ),
        w=6,
    )


def _saturation_row(grid: p.Grid) -> None:
    grid.row("Saturation: which limit binds (docs/autoscaling.md)")
    # the engine's own constraints (sequences, token_budget) carry no pool: kept whatever $pool is
    pool_or_engine = 'pool=~"$pool|"'
    grid.add(
        p.timeseries(
            "Saturation by constraint",
            "Each limit that can stop the engine admitting work, as a share of the limit: kv_quota (reserved / "
            "capacity), kv_physical (in use / capacity, reclaimable counted as free), sequences (running / "
            "max_num_seqs), token_budget (scheduled tokens per iteration / max_num_batched_tokens). Only exact "
            "values and lower bounds (an upper bound does not show a limit is reached).",
            [
                q(
                    sel("kvledger_saturation_ratio", INSTANCE, ENGINE, pool_or_engine, mon.PROVEN_BASIS),
                    "{{engine}} {{constraint}} {{pool}} ({{basis}})",
                )
            ],
            p.RATIO,
            steps=(("green", None), ("orange", 0.8), ("red", 1.0)),
            threshold_line=True,
        ),
        w=10,
    )
    grid.add(
        p.timeseries(
            "Binding constraint",
            "Per engine, the saturation of the constraint that binds now (the largest ratio among those its "
            "admission enforces), named in the legend; the autoscaling examples scale on its mean over a "
            "deployment's replicas.",
            [q(sel(mon.SATURATION_BINDING.record, INSTANCE, ENGINE), "{{engine}} bound by {{constraint}}")],
            p.RATIO,
            steps=(("green", None), ("orange", 0.8), ("red", 1.0)),
            threshold_line=True,
        ),
        w=6,
    )
    grid.add(
        p.timeseries(
            "Waiting queue trend",
            "How fast the waiting queue grows (requests per second, deriv over 2m; below 0 it drains). A growing "
            "queue with one constraint at its limit is what KVLedgerBoundByOneConstraint reports.",
            [q(sel(mon.QUEUE_TREND.record, INSTANCE, ENGINE), "{{engine}}")],
            p.PER_SECOND,
        ),
        w=4,
    )
    grid.add(
        p.timeseries(
            "Recompute tax",
            "Computed tokens thrown away by preemption per second, to be recomputed (from in-engine ledgers).",
            [q(sum_by(labels("engine", "pool"), rate(sel("kvledger_preempted_tokens_total", *EP))), EPL)],
            p.PER_SECOND,
            axis="tokens/s",
        ),
        w=4,
    )


def _overcommit_row(grid: p.Grid) -> None:
    grid.row("Overcommit and preemptions")
    grid.add(
        p.timeseries(
            "Overcommit: reserved / capacity",
            "Reserved bytes over capacity. Above 100% under admission=reserve-cap is a broken promise; under "
            "admission=dynamic it predicts preemptions.",
            [
                # The recorded ratio (monitoring/config.py), not the division written again.
                q(sel(mon.KV_OVERCOMMIT.record, *EP), f"{EPL} ({{{{basis}}}})")
            ],
            p.RATIO,
            steps=(("green", None), ("orange", 0.9), ("red", 1.0)),
            threshold_line=True,
        ),
        w=9,
    )
    grid.add(
        p.timeseries(
            "Preemptions and admission re-checks",
            "Preemptions reported by the engine and admission re-checks after a request raised its bound, per "
            "second.",
            [
                q(sum_by(labels("engine"), rate(sel("kvledger_preemptions_total", INSTANCE, ENGINE))),
                  "{{engine}} preemptions"),
                q(sum_by(labels("engine", "result"), rate(sel("kvledger_admission_rechecks_total", INSTANCE, ENGINE))),
                  "{{engine}} re-check {{result}}"),
            ],
            p.PER_SECOND,
        ),
        w=9,
    )
    grid.add(
        p.timeseries(
            "Requests by state",
            "Running and preempted requests are admitted (they hold reservations); waiting ones are not.",
            [
                q(sel("kvledger_requests", INSTANCE, ENGINE), "{{engine}} {{state}}"),
                q(sel("kvledger_max_running_requests", INSTANCE, ENGINE), "{{engine}} max_num_seqs"),
            ],
            p.COUNT,
            axis="requests",
        ),
        w=6,
    )


def _sharing_row(grid: p.Grid) -> None:
    grid.row("Prefix sharing (sharing rule: see the policy table)")
    grid.add(
        p.table(
            "Sharing rule in force",
            "The sharing rule the reservations on this dashboard use (per-request or reference-aware).",
            [q(sel("kvledger_policy_info", INSTANCE, ENGINE), table=True)],
            hide=("Time", "__name__", "job", "instance", "admission", "overflow", "tenant_rule"),
        ),
        w=6,
    )
    grid.add(
        p.timeseries(
            "Prefix cache hit rate",
            "Share of prompt tokens found in the prefix cache at admission: rate of "
            "kvledger_prefix_cache_hit_tokens_total over rate of kvledger_prefix_cache_queried_tokens_total.",
            [
                q(
                    ratio(
                        rate(sel("kvledger_prefix_cache_hit_tokens_total", INSTANCE, ENGINE)),
                        rate(sel("kvledger_prefix_cache_queried_tokens_total", INSTANCE, ENGINE)),
                    ),
                    "{{engine}}",
                )
            ],
            p.RATIO,
        ),
        w=6,
    )
    grid.add(
        p.timeseries(
            "Unique blocks: in use and shared",
            "Physical view, every block counted once: unique blocks referenced by at least one request, and "
            "those referenced by more than one (shared prefixes).",
            [
                q(sel("kvledger_kv_blocks", *EP, 'state="in_use"'), f"{EPL} in use (unique)"),
                q(sel("kvledger_kv_shared_blocks", *EP), f"{EPL} shared (unique)"),
            ],
            p.COUNT,
            axis="blocks",
        ),
        w=9,
    )
    grid.add(
        p.timeseries(
            "Unique vs per-request block counts",
            f"{p.CONSISTENCY_TOKEN} The one panel that puts the per-request view (sum of reference counts) "
            "beside unique in-use blocks and the engine's own claim, to check them against each other: "
            "references >= unique in use >= shared must hold, and the engine's claim should match unique in "
            "use. Their difference is the sharing, not extra memory.",
            [
                q(sel("kvledger_kv_block_references", *EP), f"{EPL} references (per-request)"),
                q(sel("kvledger_kv_blocks", *EP, 'state="in_use"'), f"{EPL} in use (unique)"),
                q(sel("kvledger_engine_reported_kv_used_blocks", *EP), f"{EPL} engine-reported used"),
            ],
            p.COUNT,
            axis="blocks",
        ),
        w=9,
    )


def _groups_row(grid: p.Grid) -> None:
    grid.row("KV-cache groups within a pool (hybrid models)")
    grid.add(
        p.table(
            "Groups sharing each pool",
            "A hybrid model's layer types (full attention, sliding window, chunked local attention, Mamba) "
            "each keep a KV-cache group; the groups share one pool, a block belonging to one group at a time. "
            "window_tokens: the span a sliding window or local-attention chunk keeps. Empty for one-group pools.",
            [q(sel("kvledger_kv_group_info", *EP), table=True)],
            hide=("Time", "__name__", "job", "Value"),
        ),
        w=8,
    )
    grid.add(
        p.timeseries(
            "Blocks in use by group",
            "Unique blocks each group's requests reference, stacked: the groups' sum is at most the pool's "
            "in-use blocks (the engine's own usage gauge counts every group together). A sliding-window or "
            "Mamba group holds only its window or states, whatever the context length.",
            [q(sel("kvledger_kv_group_in_use_blocks", *EP), f"{EPL} group {{{{group}}}}")],
            p.COUNT,
            axis="blocks",
            stack=True,
        ),
        w=8,
    )
    grid.add(
        p.timeseries(
            "Reserved blocks by group",
            "Each group's share of the admitted requests' reservations (R_g summed, each request counted "
            "alone): a request at its cap needs blocks in every group. `basis` says exact or a bound.",
            [q(sel("kvledger_kv_group_reserved_blocks", *EP), f"{EPL} group {{{{group}}}} ({{{{basis}}}})")],
            p.COUNT,
            axis="blocks",
        ),
        w=8,
    )


def _tokens_row(grid: p.Grid) -> None:
    grid.row("Tokens: per-iteration budget vs resident cache")
    grid.add(
        p.timeseries(
            "Iteration token budget vs resident tokens",
            "The per-iteration budget (max_num_batched_tokens) bounds tokens computed per step, not the cache: "
            "a decode step adds one token per request while each keeps all its earlier tokens resident.",
            [
                q(sel("kvledger_iteration_budget_tokens", INSTANCE, ENGINE), "{{engine}} iteration budget"),
                q(sel("kvledger_iteration_tokens", INSTANCE, ENGINE), "{{engine}} scheduled this iteration"),
                q(sel("kvledger_kv_resident_tokens", *EP), f"{EPL} resident ({{{{basis}}}})"),
                q(sel("kvledger_kv_capacity_tokens", *EP), f"{EPL} token capacity"),
            ],
            p.COUNT,
            axis="tokens",
        ),
        w=16,
    )
    grid.add(
        p.gauge(
            "Resident tokens / token capacity",
            "Resident tokens of running requests over the tokens the pool can hold.",
            [
                q(
                    ratio(
                        sel("kvledger_kv_resident_tokens", *EP),
                        sel("kvledger_kv_capacity_tokens", *EP),
                        "ignoring (basis) group_left",
                    ),
                    f"{EPL} ({{{{basis}}}})",
                )
            ],
            p.RATIO,
            steps=(("green", None), ("orange", 0.8), ("red", 0.95)),
        ),
        w=8,
    )


def _bounds_row(grid: p.Grid) -> None:
    grid.row("Output bounds: caps vs estimates")
    grid.add(
        p.timeseries(
            "Pending growth by output bound",
            "Growth admitted requests may still create (reservation minus held), stacked by the kind of bound "
            "it rests on: cap (enforced max_tokens) or estimate (a prediction that can be exceeded).",
            [q(sel("kvledger_kv_pending_growth_bytes", *EP), f"{EPL} {{{{output_bound}}}}")],
            p.BYTES,
            stack=True,
        ),
        w=9,
    )
    grid.add(
        p.timeseries(
            "Estimate overflows and reservation leaks",
            "Requests whose output exceeded an estimated bound, and reservations found with no live request, "
            "per second.",
            [
                q(sum_by(labels("engine"), rate(sel("kvledger_reservation_overflows_total", INSTANCE, ENGINE))),
                  "{{engine}} overflows"),
                q(sum_by(labels("engine"), rate(sel("kvledger_reservation_leaks_total", INSTANCE, ENGINE))),
                  "{{engine}} leaks"),
            ],
            p.PER_SECOND,
        ),
        w=9,
    )
    grid.add(
        p.timeseries(
            "Extra context slots",
            "Extra contexts of running requests: speculative lookahead slots and extra branches (n - 1).",
            [q(sel("kvledger_extra_context_slots", INSTANCE, ENGINE), "{{engine}} {{purpose}}")],
            p.COUNT,
            axis="slots",
        ),
        w=6,
    )


def _tenants_row(grid: p.Grid) -> None:
    grid.row("Tenants vs quotas (per-request rule)")
    te = (INSTANCE, ENGINE, TENANT)
    grid.add(
        p.timeseries(
            "Tenant reserved vs quota",
            "Bytes a tenant's admitted requests may claim, counted with the per-request rule (what a quota "
            "must cover), against the tenant's configured quota.",
            [
                q(sel("kvledger_tenant_reserved_bytes", *te), "{{engine}} {{tenant}} reserved"),
                q(sel("kvledger_tenant_quota_bytes", *te), "{{engine}} {{tenant}} quota"),
            ],
            p.BYTES,
        ),
        w=9,
    )
    grid.add(
        p.gauge(
            "Tenant quota use",
            "Tenant reserved bytes over the tenant's quota (per-request rule).",
            [
                q(
                    ratio(sel("kvledger_tenant_reserved_bytes", *te), sel("kvledger_tenant_quota_bytes", *te)),
                    "{{engine}} {{tenant}}",
                )
            ],
            p.RATIO,
            steps=(("green", None), ("orange", 0.8), ("red", 1.0)),
        ),
        w=5,
    )
    grid.add(
        p.stat(
            "Sum of tenant quotas / capacity",
            "All tenant quotas of an engine over its KV capacity; above 100% the quotas are oversubscribed.",
            [
                q(
                    ratio(
                        sum_by(labels("engine"), sel("kvledger_tenant_quota_bytes", INSTANCE, ENGINE)),
                        sum_by(labels("engine"), sel("kvledger_kv_capacity_bytes", INSTANCE, ENGINE)),
                        on("engine"),
                    ),
                    "{{engine}}",
                )
            ],
            p.RATIO,
            steps=(("green", None), ("orange", 0.9), ("red", 1.0)),
        ),
        w=4,
    )
    grid.add(
        p.timeseries(
            "Tenant requests by state",
            "A tenant's requests by state.",
            [q(sel("kvledger_tenant_requests", *te), "{{engine}} {{tenant}} {{state}}")],
            p.COUNT,
            axis="requests",
        ),
        w=6,
    )


def dashboard() -> g.Dashboard:
    grid = p.Grid()
    grid.add(p.policy_table(INSTANCE, ENGINE), w=14, h=5)
    grid.add(
        p.table(
            "Engines",
            "Engine identity: kind, version and the primary source kvledger reads it from.",
            [q(sel("kvledger_engine_info", INSTANCE, ENGINE), table=True)],
            hide=("Time", "__name__", "job"),
        ),
        w=10,
        h=5,
    )
    _capacity_row(grid)
    _headroom_row(grid)
    _saturation_row(grid)
    _overcommit_row(grid)
    _sharing_row(grid)
    _groups_row(grid)
    _tokens_row(grid)
    _bounds_row(grid)
    _tenants_row(grid)
    return p.dashboard(
        TITLE,
        UID,
        "KV cache accounting per engine under one declared policy: reservations vs physical blocks, quota vs "
        "physical headroom, overcommit, prefix sharing, token budgets, output bounds and tenant quotas.",
        grid,
        [p.instance_variable(), p.engine_variable(), p.pool_variable(), p.tenant_variable()],
    )

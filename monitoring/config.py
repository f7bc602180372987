"""The one definition of what the alert rules and the dashboards share.

- ``TARGET_LABELS``: the labels that identify one kvledger daemon (one node). Every join
  and every per-engine or per-GPU aggregation keeps them, so two nodes with an engine or
  GPU of the same name never collide (many-to-many) or get summed together.
- ``on()`` / ``by()`` and ``JOIN_KEYS``: label lists built from them (the ``$E``, ``$EP``,
  ``$G``, ``$ES`` placeholders of the alert expressions).
- ``selector()``: a vector selector with matchers.
- ``RECORDINGS``: every recording rule, its record name and expression, once.
  alerts/generate.py writes them into the rule file; the dashboards read the record
  names (``RECORDED``) and never re-write an expression a recording rule holds.
- ``overcommit_ratio()``: reserved / capacity per pool, the expression of
  ``kvledger:kv_overcommit:ratio``; an alert that must not depend on the recording
  group evaluates the same expression from here.

Imported by alerts/generate.py (run as a script or loaded by file: it puts the repository
root on sys.path) and by dashboards/src (the repository root is on sys.path there).
"""

from __future__ import annotations

from dataclasses import dataclass

# ---------------------------------------------------------------- join keys

TARGET_LABELS: tuple[str, ...] = ("job", "instance")

# Selects the kvledger daemons' own scrape series (`up`) for KVLedgerDaemonDown.
DAEMON_SELECTOR = '{job=~"kvledger.*"}'


def labels(*extra: str) -> str:
    """``job, instance, <extra...>``: the target labels followed by ``extra``."""
    return ", ".join([*TARGET_LABELS, *extra])


def on(*extra: str) -> str:
    """``on (job, instance, <extra...>)``: vector matching per daemon."""
    return f"on ({labels(*extra)})"


def by(*extra: str) -> str:
    """``by (job, instance, <extra...>)``: aggregation per daemon."""
    return f"by ({labels(*extra)})"


# The alert expressions' placeholders: per engine, per pool, per GPU, per source.
JOIN_KEYS: dict[str, str] = {
    "E": labels("engine"),
    "EP": labels("engine", "pool"),
    "G": labels("gpu"),
    "ES": labels("engine", "source"),
}


# ---------------------------------------------------------------- selectors


def selector(name: str, *matchers: str) -> str:
    """A vector selector: ``name{m1, m2}`` (no braces when there is no matcher)."""
    parts = [m for m in matchers if m]
    return f"{name}{{{', '.join(parts)}}}" if parts else name


# ---------------------------------------------------------------- recording rules


def overcommit_ratio(*reserved_matchers: str) -> str:
    """Reserved bytes over capacity per pool (each basis of the reservations kept):
    ``kvledger_kv_reserved_bytes{...} / on (job, instance, engine, pool) group_left ()
    (kvledger_kv_capacity_bytes > 0)``. ``reserved_matchers`` narrow the reservations
    (e.g. ``basis="exact"``); the recording rule takes none."""
    return (
        f"{selector('kvledger_kv_reserved_bytes', *reserved_matchers)}\n"
        f"  / {on('engine', 'pool')} group_left ()\n"
        "(kvledger_kv_capacity_bytes > 0)"
    )


@dataclass(frozen=True)
class Recording:
    record: str
    expr: str


KV_CAPACITY = Recording("kvledger:kv_capacity_bytes:sum", "sum(kvledger_kv_capacity_bytes)")
KV_RESERVED = Recording("kvledger:kv_reserved_bytes:sum", "sum by (basis) (kvledger_kv_reserved_bytes)")
KV_ALLOCATED = Recording("kvledger:kv_allocated_bytes:sum", "sum by (basis) (kvledger_kv_allocated_bytes)")
KV_OVERCOMMIT = Recording("kvledger:kv_overcommit:ratio", overcommit_ratio())
GPU_UNACCOUNTED = Recording("kvledger:gpu_memory_unaccounted_bytes:sum",
                            "sum by (basis) (kvledger_gpu_memory_unaccounted_bytes)")
GPU_USED = Recording("kvledger:gpu_memory_used_bytes:sum", "sum(kvledger_gpu_memory_used_bytes)")
GPU_TOTAL = Recording("kvledger:gpu_memory_total_bytes:sum", "sum(kvledger_gpu_memory_total_bytes)")

# In the order the rule file lists them.
RECORDINGS: tuple[Recording, ...] = (
    KV_CAPACITY, KV_RESERVED, KV_ALLOCATED, KV_OVERCOMMIT, GPU_UNACCOUNTED, GPU_USED, GPU_TOTAL,
)

# ---------------------------------------------------------------- saturation and autoscaling

#: The labels that name one deployment of an engine for autoscalers: the replicas of a
#: Deployment share the kvledger configuration (one ConfigMap), hence the ``engine`` name,
#: and the prometheus-operator labels every target with its ``namespace``. ``job`` keeps
#: kvledger apart from other exporters. (docs/autoscaling.md, "Which labels")
DEPLOYMENT_LABELS: tuple[str, ...] = ("job", "namespace", "engine")

#: bases a saturation figure must have to show a limit is reached (an upper bound does not)
PROVEN_BASIS = 'basis=~"exact|lower_bound"'
#: the window of the waiting queue's trend (deriv): long enough for a few scrapes, short
#: enough to follow a burst
QUEUE_TREND_WINDOW = "2m"


def constraint_ratios() -> str:
    """Per engine and constraint taking part in its binding (the daemon lists them in
    ``kvledger_saturation_binding``, 0 or 1), the constraint's ratio on a proven basis, the
    fullest pool's. ``without`` keeps every target label (``namespace`` among them, which the
    deployment records group by). The one rule that reads the raw ratio family: at 10,000
    engines reading it is most of the cost (docs/autoscaling.md), so the others read this."""
    return (
        "max without (pool, basis) (\n"
        f"  {selector('kvledger_saturation_ratio', PROVEN_BASIS)}\n"
        f"    and {on('engine', 'constraint')}\n"
        "  kvledger_saturation_binding\n"
        ")"
    )


def queue_trend(window: str = QUEUE_TREND_WINDOW) -> str:
    """Per engine, how fast the waiting queue grows (requests per second; < 0: it drains)."""
    return f'deriv(kvledger_requests{{state="waiting"}}[{window}])'


DEPLOYMENT = ", ".join(DEPLOYMENT_LABELS)

SATURATION_CONSTRAINTS = Recording("kvledger:saturation_constraints:ratio", constraint_ratios())
# the constraint the daemon names as binding (the rule lives in its policy): its ratio
SATURATION_BINDING = Recording(
    "kvledger:saturation_binding:ratio",
    f"{SATURATION_CONSTRAINTS.record}\n  and {on('engine', 'constraint')}\n(kvledger_saturation_binding == 1)",
)
QUEUE_TREND = Recording(f"kvledger:requests_waiting:deriv{QUEUE_TREND_WINDOW}", queue_trend())
# what autoscalers read, per deployment (the replicas of one engine in a namespace)
DEPLOYMENT_SATURATION = Recording(
    "kvledger_deployment:saturation_binding:avg",
    f"avg by ({DEPLOYMENT}) ({SATURATION_BINDING.record})",
)
DEPLOYMENT_HEADROOM = Recording(
    "kvledger_deployment:admission_headroom_requests:sum",
    f"sum by ({DEPLOYMENT}) ({selector('kvledger_admission_headroom_requests', PROVEN_BASIS)})",
)
DEPLOYMENT_QUEUE_TREND = Recording(
    f"kvledger_deployment:requests_waiting:deriv{QUEUE_TREND_WINDOW}",
    f"sum by ({DEPLOYMENT}) ({QUEUE_TREND.record})",
)
# fleet rollups: over the per-engine records (one series per engine), never the raw families
FLEET_BINDING_COUNT = Recording(
    "kvledger_fleet:saturation_binding:count",
    f"count by (constraint) ({SATURATION_BINDING.record})",
)
FLEET_BINDING_AVG = Recording(
    "kvledger_fleet:saturation_binding:avg",
    f"avg by (constraint) ({SATURATION_BINDING.record})",
)

# In the order the rule file lists them: a rule reads only records listed before it (rules
# of one group run in order at the same evaluation time, each seeing the ones before).
SATURATION_RECORDINGS: tuple[Recording, ...] = (
    SATURATION_CONSTRAINTS, SATURATION_BINDING, QUEUE_TREND, DEPLOYMENT_SATURATION, DEPLOYMENT_HEADROOM, DEPLOYMENT_QUEUE_TREND,
    FLEET_BINDING_COUNT, FLEET_BINDING_AVG,
)

RECORDED: frozenset[str] = frozenset(r.record for r in (*RECORDINGS, *SATURATION_RECORDINGS))


def indent(expr: str, spaces: int) -> str:
    """``expr`` with every line indented (to nest a multi-line expression in another)."""
    pad = " " * spaces
    return "\n".join(pad + line for line in expr.splitlines())

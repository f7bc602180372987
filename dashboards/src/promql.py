"""PromQL building blocks shared by every dashboard.

Metric names are checked against the catalogue (kvledger.output.catalog) and the recording
rules of monitoring/config.py when a query is built, so a dashboard cannot name a metric
the exporter does not define nor a recorded series no rule records. The join keys
(``monitoring.config.TARGET_LABELS``) and the recording rules come from that one module,
shared with alerts/; rate windows, safe ratios and the template-variable matchers are
written once here.
"""

from __future__ import annotations

from kvledger.output.catalog import BY_NAME
from monitoring import config as mon

# Recording rules (monitoring/config.py defines them, alerts/ writes them; dashboards only read them).
RECORDING_RULES: frozenset[str] = mon.RECORDED

# Per-daemon label lists and vector matching (the target labels, then these).
labels = mon.labels
on = mon.on

RATE_INTERVAL = "$__rate_interval"

# Label matchers bound to the dashboard template variables.
# The target: every query of every dashboard selects by cluster (optional: `.*` also matches a
# series without the label), job and instance, the labels Prometheus attaches at scrape.
CLUSTER = 'cluster=~"$cluster"'
JOB = 'job=~"$job"'
TARGET = f'{CLUSTER}, {JOB}, instance=~"$instance"'
INSTANCE = TARGET  # the node: its cluster, job and instance
ENGINE = 'engine=~"$engine"'
POOL = 'pool=~"$pool"'
GPU = 'gpu=~"$gpu"'
TENANT = 'tenant=~"$tenant"'


def known(name: str) -> str:
    """Return ``name`` if the catalogue or the recording rules define it, else raise."""
    if name not in BY_NAME and name not in RECORDING_RULES:
        raise KeyError(f"metric {name!r} is neither in kvledger.output.catalog nor a recording rule")
    return name


def sel(name: str, *matchers: str) -> str:
    """A vector selector: ``name{m1, m2}`` (no braces when there is no matcher)."""
    return mon.selector(known(name), *matchers)


def rate(selector: str) -> str:
    return f"rate({selector}[{RATE_INTERVAL}])"


def increase(selector: str) -> str:
    return f"increase({selector}[{RATE_INTERVAL}])"


def sum_by(labels: str, expr: str) -> str:
    return f"sum by ({labels}) ({expr})"


def positive(expr: str) -> str:
    """A denominator that drops zero (and negative) samples: the ratio is absent, not infinite."""
    return f"({expr} > 0)"


def ratio(numerator: str, denominator: str, matching: str = "") -> str:
    """``numerator / (denominator > 0)`` with an optional vector-matching clause."""
    if matching.endswith(("group_left", "group_right")):
        # A parenthesis right after group_left would be read as its label list.
        matching += " ()"
    join = f" {matching} " if matching else " "
    return f"{numerator} /{join}{positive(denominator)}"


def zero_when_absent(expr: str, reference: str, labels: str) -> str:
    """``expr``, or 0 for every ``labels`` set the exporter reports in ``reference``.

    Counters the exporter has never incremented have no series; while the exporter is
    up and reports the engine/source, "none counted" is a true zero.
    """
    return f"({expr}) or on ({labels}) (0 * group by ({labels}) ({reference}))"

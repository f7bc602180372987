"""Saturation: how close an engine is to each limit that can stop it admitting work, and
which of them binds now (docs/design.md §2, "Saturation").

Four constraints, each a ratio of a quantity to its limit:

- ``kv_quota``     reserved / C per pool (what admitted requests may claim);
- ``kv_physical``  in_use / C per pool (reclaimable blocks count as free: an engine evicts
                   them before it refuses or preempts anything);
- ``sequences``    running / max_num_seqs (the engine);
- ``token_budget`` scheduled tokens per iteration / max_num_batched_tokens (the engine): the
                   engine's recent iterations where it states them (``Budgets.window_*``),
                   else its latest iteration.

A ratio keeps the basis of its numerator and is absent when an input is unknown.

The binding constraint is the largest ratio among those the engine's admission enforces:
``reserve-cap`` admits against the quota (``kv_quota``), ``dynamic`` against physical
memory (``kv_physical``; its quota ratio is the overcommit that predicts preemption, not a
limit it stops at), an unknown admission against both. A ratio takes part with a value it
is known to reach (exact, or a lower bound); one known only as an upper bound does not
(it cannot show the limit binds). Ties go to the first in ``CONSTRAINTS`` order.
"""

from __future__ import annotations

from kvledger.domain.facts import Admission, Budgets
from kvledger.domain.measure import Measure

#: every constraint, in the order that breaks ties of the binding one
CONSTRAINTS: tuple[str, ...] = ("kv_quota", "kv_physical", "sequences", "token_budget")

#: the constraints each admission behaviour enforces (None: unknown, every one)
_ENFORCED: dict[Admission | None, frozenset[str]] = {
    "reserve-cap": frozenset(("kv_quota", "sequences", "token_budget")),
    "dynamic": frozenset(("kv_physical", "sequences", "token_budget")),
    None: frozenset(CONSTRAINTS),
}


def sequences_ratio(running: int | None, max_num_seqs: int | None) -> Measure | None:
    """running / max_num_seqs, exact (both are counts the engine states); absent without either."""
    if running is None or not max_num_seqs:
        return None
    return Measure(exact=running / max_num_seqs)


def token_budget_ratio(budgets: Budgets) -> Measure | None:
    """Scheduled tokens per iteration / max_num_batched_tokens, exact.

    Over the engine's recent window when it states one (``window_scheduled_tokens`` over
    ``window_iterations`` iterations; no iteration in the window: 0, the budget unused),
    else its latest iteration (``iteration_tokens``); absent without the budget."""
    limit = budgets.max_num_batched_tokens
    if not limit:
        return None
    if budgets.window_scheduled_tokens is not None and budgets.window_iterations is not None:
        if budgets.window_iterations == 0:
            return Measure(exact=0.0)
        return Measure(exact=budgets.window_scheduled_tokens / (budgets.window_iterations * limit))
    if budgets.iteration_tokens is None:
        return None
    return Measure(exact=budgets.iteration_tokens / limit)


def known_value(m: Measure) -> float | None:
    """The value a ratio is known to reach: exact, else its lower bound (None: upper bound only)."""
    return m.exact if m.exact is not None else m.lower


def binding_constraint(ratios: list[tuple[str, Measure]], admission: Admission | None) -> tuple[str | None, frozenset[str]]:
    """(the binding constraint, the constraints that took part) over ``ratios`` as
    (constraint, ratio) pairs, several per constraint allowed (one per pool): the largest
    known value among the constraints ``admission`` enforces, ties in ``CONSTRAINTS``
    order. (None, empty) when no ratio takes part."""
    enforced = _ENFORCED[admission]
    best: dict[str, float] = {}
    for constraint, m in ratios:
        v = known_value(m)
        if constraint in enforced and v is not None:
            best[constraint] = max(v, best.get(constraint, v))
    if not best:
        return None, frozenset()
    order = {c: i for i, c in enumerate(CONSTRAINTS)}
    binding = min(best, key=lambda c: (-best[c], order[c]))
    return binding, frozenset(best)

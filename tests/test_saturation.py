"""Saturation (policy/saturation.py): each constraint's ratio from an engine's state, the
binding constraint, and the recompute tax of preemption, checked against quantities the
tests count themselves from a reference ledger (never against the formulas under test)."""

from __future__ import annotations

import pytest
from accounting_support import accounts_of

from kvledger.domain.facts import Budgets, EngineFacts, PoolFacts, Snapshot
from kvledger.domain.measure import Measure
from kvledger.output.catalog import BY_NAME
from kvledger.policy.saturation import CONSTRAINTS, binding_constraint, token_budget_ratio
from kvledger.protocol.reader import facts_from_document
from kvledger_engine.iteration_window import IterationWindow
from kvledger_engine.reference_ledger import Ledger, PoolSpec

B = 16


Series = frozenset[tuple[str, str]]


def series(**labels: str) -> Series:
    """A series by its labels' names and values."""
    return frozenset(labels.items())


def samples(snapshot: Snapshot, name: str) -> dict[Series, float]:
    return {series(**labels): value for labels, value in BY_NAME[name].samples(accounts_of(snapshot))}


def ledger_engine(ledger: Ledger, name: str = "e") -> EngineFacts:
    return facts_from_document(ledger.to_document(), name)


# ---------------------------------------------------------------- the binding rule


def test_ties_go_to_the_documented_order() -> None:
    ones = [(c, Measure(exact=0.5)) for c in reversed(CONSTRAINTS)]
    assert binding_constraint(ones, None) == ("kv_quota", frozenset(CONSTRAINTS))
    assert binding_constraint(ones, "dynamic")[0] == "kv_physical"
    rest = [(c, m) for c, m in ones if not c.startswith("kv_")]
    assert binding_constraint(rest, "dynamic")[0] == "sequences"


@pytest.mark.parametrize(
    ("admission", "expected", "taking_part"),
    [
        ("reserve-cap", "kv_quota", {"kv_quota", "sequences", "token_budget"}),
        ("dynamic", "sequences", {"kv_physical", "sequences", "token_budget"}),
        (None, "kv_quota", set(CONSTRAINTS)),
    ],
)
def test_admission_decides_which_memory_constraint_can_bind(admission: str | None, expected: str, taking_part: set[str]) -> None:
    # a dynamic engine's quota ratio above 1 is overcommit, not a limit it stops at
    ratios = [("kv_quota", Measure(exact=1.4)), ("kv_physical", Measure(exact=0.3)),
              ("sequences", Measure(exact=1.0)), ("token_budget", Measure(exact=0.2))]
    binding, candidates = binding_constraint(ratios, admission)  # type: ignore[arg-type]
    assert (binding, set(candidates)) == (expected, taking_part)


def test_an_upper_bound_alone_never_binds_and_the_fullest_pool_counts() -> None:
    ratios = [("kv_quota", Measure(upper=3.0)), ("kv_physical", Measure(lower=0.2, upper=0.9)),
              ("kv_physical", Measure(exact=0.6)), ("sequences", Measure(exact=0.5))]
    assert binding_constraint(ratios, None) == ("kv_physical", frozenset({"kv_physical", "sequences"}))
    assert binding_constraint([("kv_quota", Measure(upper=3.0))], None) == (None, frozenset())


def test_token_budget_reads_the_window_then_the_latest_iteration() -> None:
    assert token_budget_ratio(Budgets(max_num_batched_tokens=1000, iteration_tokens=900,
                                      window_scheduled_tokens=1500, window_iterations=5)) == Measure(exact=0.3)
    assert token_budget_ratio(Budgets(max_num_batched_tokens=1000, iteration_tokens=900,
                                      window_scheduled_tokens=0, window_iterations=0)) == Measure(exact=0.0)
    assert token_budget_ratio(Budgets(max_num_batched_tokens=1000, iteration_tokens=250)) == Measure(exact=0.25)
    assert token_budget_ratio(Budgets(iteration_tokens=250)) is None
    assert token_budget_ratio(Budgets(max_num_batched_tokens=1000)) is None


def test_the_window_forgets_old_iterations_and_is_unknown_until_one_ran() -> None:
    now = [0.0]
    window = IterationWindow(seconds=5.0, clock=lambda: now[0])
    assert window.budgets() == {}  # never recorded: unknown, not idle
    for t, tokens in ((0.0, 100), (1.0, 300), (4.0, 50)):
        now[0] = t
        window.record(tokens)
    assert window.totals() == (450, 3)
    now[0] = 5.5  # the first iteration is older than 5 s
    assert window.budgets() == {"window_scheduled_tokens": 350, "window_iterations": 2}
    now[0] = 100.0
    assert window.totals() == (0, 0)


# ---------------------------------------------------------------- from an engine's ledger


def test_an_engine_at_max_num_seqs_is_bound_by_sequences_with_kv_at_thirty_percent() -> None:
    seqs = 4
    ledger = Ledger([PoolSpec("0", B, 1024, 100)], admission="dynamic", max_model_len=2048, max_num_seqs=seqs,
                    max_num_batched_tokens=2048)
    for i in range(seqs):
        ledger.admit(f"r{i}", 120, 100)
        ledger.advance(f"r{i}", 120)  # ceil(120 / 16) = 8 blocks each
    for i in range(3):
        ledger.submit(f"w{i}", 120, 100)  # waiting: no room in the running set
    for _ in range(3):
        ledger.set_iteration_tokens(seqs)  # decode steps: one token per running request
    in_use = sum(len(ledger.request_blocks(f"r{i}")) for i in range(seqs))
    assert in_use == 32
    got = samples(Snapshot(engines=[ledger_engine(ledger)]), "kvledger_saturation_ratio")
    assert got[series(engine="e", pool="", constraint="sequences", basis="exact")] == 1.0
    assert got[series(engine="e", pool="0", constraint="kv_physical", basis="exact")] == in_use / 100
    assert got[series(engine="e", pool="", constraint="token_budget", basis="exact")] == seqs / 2048
    binding = samples(Snapshot(engines=[ledger_engine(ledger)]), "kvledger_saturation_binding")
    assert binding == {series(engine="e", constraint="kv_physical"): 0.0, series(engine="e", constraint="sequences"): 1.0,
                       series(engine="e", constraint="token_budget"): 0.0}


def test_a_reserve_cap_engine_full_of_reservations_is_bound_by_its_quota() -> None:
    ledger = Ledger([PoolSpec("0", B, 1024, 100)], admission="reserve-cap", max_model_len=2048, max_num_seqs=64)
    admitted = 0
    while ledger.admit(f"r{admitted}", 16, 300):  # ceil(316 / 16) = 20 blocks reserved each, 1 in use
        ledger.advance(f"r{admitted}", 16)
        admitted += 1
    assert admitted == 5  # 5 x 20 = 100 blocks: the quota is full while 5 blocks hold data
    got = samples(Snapshot(engines=[ledger_engine(ledger)]), "kvledger_saturation_ratio")
    assert got[series(engine="e", pool="0", constraint="kv_quota", basis="exact")] == 1.0
    assert got[series(engine="e", pool="0", constraint="kv_physical", basis="exact")] == 0.05
    assert got[series(engine="e", pool="", constraint="sequences", basis="exact")] == admitted / 64
    assert series(engine="e", pool="", constraint="token_budget", basis="exact") not in got  # no budget stated: absent, never 0
    binding = samples(Snapshot(engines=[ledger_engine(ledger)]), "kvledger_saturation_binding")
    assert binding == {series(engine="e", constraint="kv_quota"): 1.0, series(engine="e", constraint="sequences"): 0.0}


def test_unknown_inputs_leave_the_ratios_and_the_binding_absent() -> None:
    bare = EngineFacts(name="x", kind="vllm", source="vllm", pools=[PoolFacts("0", 16, 100)])
    snap = Snapshot(engines=[bare])
    assert samples(snap, "kvledger_saturation_ratio") == {}
    assert samples(snap, "kvledger_saturation_binding") == {}


def test_preempted_tokens_count_what_each_preemption_threw_away() -> None:
    ledger = Ledger([PoolSpec("0", B, 1024, 100), PoolSpec("1", B, 1024, 100)], admission="dynamic", max_model_len=2048)
    thrown = {"0": 0, "1": 0}
    for rid, pool, computed in (("a", "0", 50), ("b", "0", 7), ("c", "1", 33)):
        ledger.admit(rid, 40, 100, pool=pool)
        ledger.advance(rid, computed)
        ledger.preempt(rid)
        thrown[pool] += computed
    ledger.resume("a")
    ledger.advance("a", 60)
    ledger.preempt("a")  # its recomputed tokens are thrown away again
    thrown["0"] += 60
    got = samples(Snapshot(engines=[ledger_engine(ledger)]), "kvledger_preempted_tokens_total")
    assert got == {series(engine="e", pool="0"): thrown["0"], series(engine="e", pool="1"): thrown["1"]}
    bare = EngineFacts(name="x", kind="vllm", source="vllm", pools=[PoolFacts("0", 16, 100)])
    assert samples(Snapshot(engines=[bare]), "kvledger_preempted_tokens_total") == {}

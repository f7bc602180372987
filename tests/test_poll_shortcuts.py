"""The shortcuts a busy poll takes (issue 31, point 7) against the general way they skip.

Each shortcut reads or accounts the common case with fewer passes over the requests; each
must give exactly what the general way gives, and leave everything else to it: tenants and
in-range integers read without building the paths their errors would name, an integer column
holding one value for every request, one pool given for every request, request states as
codes counted in one pass, tenants counted by code.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest

from kvledger.domain.facts import Budgets, EngineFacts, PoolFacts, RequestFacts, TenantQuota
from kvledger.domain.limits import MAX_SAFE_INT
from kvledger.domain.request_table import RequestTable
from kvledger.policy.engine_accounts import engine_account
from kvledger.policy.reservations import STATE_CODES, request_columns
from kvledger.protocol import fast_decoder, reader
from kvledger.protocol.reader import ProtocolError

# ---------------------------------------------------------------- the reader


def tenants_entry_by_entry(raw: object) -> list[TenantQuota] | str:
    """``tenants`` checked entry by entry, as the reader always did: the reference."""
    try:
        out = []
        for i, item in enumerate(reader._arr(raw, "tenants")):
            path = f"tenants[{i}]"
            q = reader._obj(item, path)
            out.append(TenantQuota(reader._req(q, "name", path, reader._str), reader._req(q, "quota_bytes", path, reader._int)))
        return out
    except ProtocolError as exc:
        return str(exc)


def tenants_read(raw: object) -> list[TenantQuota] | str:
    try:
        return reader._tenants(raw)
    except ProtocolError as exc:
        return str(exc)


GOOD = {"name": "a", "quota_bytes": 10}
TENANT_LISTS: list[Any] = [
    [],
    [GOOD, {"name": "b", "quota_bytes": 0}],
    [GOOD, {"name": "b", "quota_bytes": MAX_SAFE_INT}],
    [GOOD, {"name": "b", "quota_bytes": MAX_SAFE_INT + 1}],
    [GOOD, {"name": "b", "quota_bytes": -1}],
    [GOOD, {"name": "b", "quota_bytes": 2.0}],  # an integral float counts as an integer
    [GOOD, {"name": "b", "quota_bytes": 2.5}],
    [GOOD, {"name": "b", "quota_bytes": True}],
    [GOOD, {"name": "b", "quota_bytes": "10"}],
    [GOOD, {"name": "b"}],
    [GOOD, {"quota_bytes": 1}],
    [GOOD, {"name": "", "quota_bytes": 1}],
    [GOOD, {"name": None, "quota_bytes": 1}],
    [GOOD, {"name": 7, "quota_bytes": 1}],
    [GOOD, {"name": "b", "quota_bytes": 1, "note": "a key the reader does not read"}],
    [GOOD, "b"],
    [GOOD, None],
    [GOOD, [1, 2]],
    {"name": "a"},
    "tenants",
]


@pytest.mark.parametrize("raw", TENANT_LISTS)
def test_tenants_in_one_pass_read_as_entry_by_entry(raw: Any) -> None:
    assert tenants_read(raw) == tenants_entry_by_entry(raw)


def test_a_bad_tenant_is_named_by_its_path() -> None:
    assert tenants_read([GOOD, {"name": "b", "quota_bytes": -1}]) == "tenants[1].quota_bytes: must be >= 0, got -1"
    assert tenants_read([GOOD, {"name": ""}]) == "tenants[1].name: must not be empty"
    assert tenants_read([GOOD, {"name": "b", "quota_bytes": 2.0}]) == [TenantQuota("a", 10), TenantQuota("b", 2)]


@pytest.mark.parametrize("value", [0, 5, 9, 10, -1, 11, 2.0, 2.5, True, "3", MAX_SAFE_INT, MAX_SAFE_INT + 1, 1 << 70])
@pytest.mark.parametrize("args", [(), (0, 10), (5, 9), (1,)])
def test_integers_in_range_read_as_the_check_reads_them(value: Any, args: tuple[int, ...]) -> None:
    def through(get: Any) -> object:
        try:
            return get({"k": value}, "k", "p", reader._int, *args)
        except ProtocolError as exc:
            return str(exc)

    try:
        expected: object = reader._int(value, "p.k", *args)
    except ProtocolError as exc:
        expected = str(exc)
    assert through(reader._opt) == expected
    assert through(reader._req) == expected
    if isinstance(expected, int):
        assert type(through(reader._opt)) is int


# ---------------------------------------------------------------- the typed decoder


@pytest.mark.parametrize("values, default", [
    ([1] * 5, 0),
    ([0] * 5, 0),
    ([int("4096") for _ in range(5)], 0),  # equal values that are distinct objects
    ([None] * 5, 7),
    ([None] * 5, -1),
    ([3, 3, 3, 3, 4], 0),
    ([4, 3, 3, 3, 3], 0),
    ([None, 3, 3, 3, None], 9),
    ([3, None, None, None, 3], 9),
    ([], 0),
    ([2], 0),
])
def test_an_integer_column_of_one_value_is_the_column_of_its_values(values: list[int | None], default: int) -> None:
    for column in (values, tuple(values)):
        got = fast_decoder._int_array(column, len(values), default)
        assert got.dtype == np.int64
        assert got.tolist() == [default if v is None else v for v in values]


def columns_of(n: int, pool: Any) -> Any:
    return fast_decoder.Columns(id=[f"r{i}" for i in range(n)], state=["running"] * n, prompt_tokens=[10] * n,
                                max_output_tokens=[5] * n, pool=pool)


@pytest.mark.parametrize("pool, expected", [(None, "a"), ("", "a"), ("a", "a"), ("b", "b")])
def test_one_pool_for_every_request(pool: str | None, expected: str) -> None:
    table = fast_decoder.table_from_columns(columns_of(3, pool), "a", {"a": 100, "b": 100})
    assert table is not None
    assert table.pools == [expected] * 3
    assert table.pool_names() == {expected}


def test_one_unknown_pool_is_left_to_the_checked_reader() -> None:
    assert fast_decoder.table_from_columns(columns_of(3, "x"), "a", {"a": 100}) is None
    empty = fast_decoder.table_from_columns(columns_of(0, "x"), "a", {"a": 100})  # no request names it
    assert empty is not None and empty.pools == [] and empty.pool_names() == set()


def test_the_pools_of_a_table_are_its_requests_pools() -> None:
    table = fast_decoder.table_from_columns(columns_of(3, ["a", "b", ""]), "a", {"a": 100, "b": 100})
    assert table is not None
    assert table.pool_names() == {"a", "b"}
    assert table.select(np.array([True, False, True])).pool_names() == {"a"}
    built = RequestTable.from_requests([RequestFacts("x", "running", 1, 1, pool="p")])
    assert built.pool_names() == {"p"}


# ---------------------------------------------------------------- the policy


STATES = ("running", "waiting", "preempted")


def requests() -> list[RequestFacts]:
    rng = np.random.default_rng(3)
    tenants = ["t0", "t1", "t2", "other", None]
    return [
        RequestFacts(f"r{i}", STATES[int(rng.integers(3))], 100, 50, "estimate" if i % 3 else "cap",  # type: ignore[arg-type]
                     tenant=tenants[int(rng.integers(len(tenants)))], blocks_held=int(rng.integers(0, 12)))
        for i in range(200)
    ]


def test_states_as_codes_count_as_the_states_do() -> None:
    reqs = requests()
    cols = request_columns(reqs, PoolFacts(id="0", block_size=16, num_blocks=10_000, block_bytes=1), 4096)
    counts = Counter(r.state for r in reqs)
    assert cols.state_counts() == (counts["running"], counts["waiting"], counts["preempted"])
    assert cols.states.tolist() == [STATE_CODES[r.state] for r in reqs]
    for name, mask in (("running", cols.running), ("waiting", cols.waiting), ("preempted", cols.preempted)):
        assert mask.tolist() == [r.state == name for r in reqs]
    assert cols.admitted.tolist() == [r.state != "waiting" for r in reqs]
    assert cols.estimate.tolist() == [r.output_bound == "estimate" for r in reqs]


def test_tenants_count_their_requests_by_state() -> None:
    reqs = requests()
    quotas = [TenantQuota("t0", 1 << 30), TenantQuota("t1", 1 << 30), TenantQuota("t2", 1 << 30), TenantQuota("idle", 1)]
    facts = EngineFacts(name="e", kind="ledger", source="ledger", requests=reqs, tenants=quotas,
                        pools=[PoolFacts(id="0", block_size=16, num_blocks=10_000, block_bytes=2)],
                        budgets=Budgets(max_model_len=4096, max_num_seqs=512))
    account = engine_account(facts, "per-request")
    for t in account.tenants:
        mine = [r for r in reqs if r.tenant == t.tenant]
        assert t.requests == {state: sum(r.state == state for r in mine) for state in STATES}
        claimed = sum(max(-(-150 // 16), r.blocks_held) for r in mine if r.state != "waiting")
        assert (t.reserved_blocks, t.reserved_bytes) == (claimed, 2 * claimed)
    assert account.requests == {state: sum(r.state == state for r in reqs) for state in STATES}

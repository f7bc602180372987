"""A pool shared by several KV-cache groups (hybrid models), by hand computation
(docs/design.md, "Hybrid models: a pool shared by KV-cache groups")."""

from __future__ import annotations

import pytest

from kvledger.domain.facts import Budgets, EngineFacts, KvGroupFacts, PoolFacts, RequestFacts
from kvledger.domain.limits import MAX_RESERVATION
from kvledger.output.prometheus import render_text
from kvledger.policy.engine_accounts import engine_account, engine_violations
from kvledger.protocol.reader import ProtocolError, facts_from_document, schema_errors

# the tiny Gemma 3 of the real suite: layers [sliding, sliding, full] x 2, window 64, B = 32
GEMMA = (
    KvGroupFacts("0", "sliding_window", window=64, in_use=6),
    KvGroupFacts("1", "sliding_window", window=64, in_use=6),
    KvGroupFacts("2", "full_attention", in_use=58),
)
# the tiny Qwen3-Next: [linear, full] x 2, B = 544, Mamba state in align mode (2 blocks)
QWEN_NEXT = (KvGroupFacts("0", "mamba", state_blocks=2, in_use=2), KvGroupFacts("1", "full_attention", in_use=2))


def req(rid: str, p: int, o: int, state: str = "running", held: int = 0) -> RequestFacts:
    return RequestFacts(id=rid, state=state, prompt_tokens=p, max_output_tokens=o, blocks_held=held)  # type: ignore[arg-type]


def pool(groups: tuple[KvGroupFacts, ...], block_size: int = 32, num_blocks: int = 255, in_use: int = 70) -> PoolFacts:
    return PoolFacts(id="0", block_size=block_size, num_blocks=num_blocks, block_bytes=4096, in_use=in_use, reclaimable=0,
                     free=num_blocks - in_use, groups=groups, layer_groups=len(groups))  # fmt: skip


def account(p: PoolFacts, requests: list[RequestFacts], sharing: str = "per-request", max_model_len: int = 2048) -> object:
    e = EngineFacts(name="e", kind="ledger", source="ledger", pools=[p], requests=requests,
                    budgets=Budgets(max_model_len=max_model_len, max_num_seqs=8))  # fmt: skip
    acc = engine_account(e, sharing)
    assert engine_violations(e) == acc.invariant_violations  # what a cycle that makes no Accounts counts
    return acc


def test_a_request_reserves_every_groups_share() -> None:
    # P = 922, O = 100 (1022 tokens, B = 32): full attention ceil(1022 / 32) = 32 blocks; each
    # window group of W = 64 at most ceil(64 / 32) + 1 = 3; R = 3 + 3 + 32 = 38
    acc = account(pool(GEMMA), [req("a", 922, 100, held=35), req("b", 922, 100, held=35)])
    (p,) = acc.pools  # type: ignore[attr-defined]
    assert p.reserved_blocks.exact == 2 * 38
    assert [(g.group, g.kind, g.window, g.reserved.exact, g.in_use.exact) for g in p.groups] == [
        ("0", "sliding_window", 64, 6, 6), ("1", "sliding_window", 64, 6, 6), ("2", "full_attention", None, 64, 58)]
    # capacity in tokens: one block of every group per B tokens of a full context
    assert p.token_capacity == 255 // 3 * 32
    # admission at L = 2048: 3 + 3 + 64 = 70 blocks per request; (255 - 76) // 70 = 2
    assert p.admission_headroom_requests.exact == 2


def test_a_state_group_reserves_its_state_blocks_whatever_the_length() -> None:
    # B = 544: full attention ceil(600 / 544) = 2, Mamba align 2 state blocks: R = 4
    acc = account(pool(QWEN_NEXT, block_size=544, num_blocks=14, in_use=4), [req("a", 500, 100, held=3)])
    (p,) = acc.pools  # type: ignore[attr-defined]
    assert p.reserved_blocks.exact == 4
    assert [g.reserved.exact for g in p.groups] == [2, 2]


def test_chunked_local_attention_holds_at_most_its_chunk() -> None:
    groups = (KvGroupFacts("0", "chunked_local_attention", window=64), KvGroupFacts("1", "full_attention"))
    # chunk 64, B = 16: ceil(64 / 16) + 1 = 5 of a 63-block request; full 63
    acc = account(pool(groups, block_size=16, num_blocks=400, in_use=0), [req("a", 1000, 8)])
    (p,) = acc.pools  # type: ignore[attr-defined]
    assert [g.reserved.exact for g in p.groups] == [5, 63]
    assert p.reserved_blocks.exact == 68
    assert [g.in_use for g in p.groups] == [None, None]  # not stated: unknown, never 0


def test_waiting_requests_reserve_in_no_group() -> None:
    acc = account(pool(GEMMA), [req("a", 922, 100, held=35), req("w", 922, 100, state="waiting")])
    (p,) = acc.pools  # type: ignore[attr-defined]
    assert [g.reserved.exact for g in p.groups] == [3, 3, 32]


def test_groups_stating_more_in_use_than_the_pool_are_unknown() -> None:
    acc = account(pool(GEMMA, in_use=60), [req("a", 922, 100, held=35)])
    (p,) = acc.pools  # type: ignore[attr-defined]
    assert "groups_in_use_le_in_use" in acc.invariant_violations  # type: ignore[attr-defined]
    assert [g.in_use for g in p.groups] == [None, None, None]
    assert p.reserved_blocks.exact == 38  # the rest stands


def test_a_reservation_past_the_range_is_unknown_not_wrapped() -> None:
    groups = tuple(KvGroupFacts(str(i), "mamba", state_blocks=1024) for i in range(64))
    many = [RequestFacts(id="a", state="running", prompt_tokens=1, max_output_tokens=1, contexts=1024)]
    acc = account(pool(groups, num_blocks=2**32, in_use=0), many)
    assert 64 * 1024 * 1024 < MAX_RESERVATION  # this shape stays in range
    (p,) = acc.pools  # type: ignore[attr-defined]
    assert p.reserved_blocks.exact == 64 * 1024 * 1024
    huge = (KvGroupFacts("0", "full_attention"),) * 1 + tuple(KvGroupFacts(str(i), "full_attention") for i in range(1, 64))
    # P = 1: no prompt block shared, each of 1024 contexts owns 2**30 blocks in each of 64 groups
    big = [RequestFacts(id="b", state="running", prompt_tokens=1, max_output_tokens=2**30, contexts=1024)]
    acc = account(pool(huge, block_size=1, num_blocks=2**32, in_use=0), big, max_model_len=2**30)
    (p,) = acc.pools  # type: ignore[attr-defined]
    assert "reservation_in_range" in acc.invariant_violations  # type: ignore[attr-defined]
    assert p.reserved_blocks is None and p.quota_headroom_blocks is None


def test_the_stock_bound_counts_every_group_at_the_cap() -> None:
    # running 3 known only as a count: each request at L = 2048 takes 3 + 3 + 64 = 70 blocks
    p = PoolFacts(id="0", block_size=32, num_blocks=255, in_use=100, groups=(*GEMMA[:2], KvGroupFacts("2", "full_attention")),
                  running_requests=3, layer_groups=3)  # fmt: skip
    e = EngineFacts(name="e", kind="vllm", source="vllm", pools=[p], requests=None, budgets=Budgets(max_model_len=2048))
    (acc,) = engine_account(e, "per-request").pools
    assert acc.reserved_blocks.upper == 210
    assert [g.reserved.upper for g in acc.groups] == [9, 9, 192]


def document(groups: object) -> dict[str, object]:
    return {"schema": "kvledger/v1", "engine": {"kind": "vllm"},
            "pools": [{"id": "0", "block_size": 32, "block_bytes": 4096, "num_blocks": 255, "groups": groups}],
            "requests": []}  # fmt: skip


def test_the_document_states_groups_and_the_metrics_carry_them() -> None:
    groups = [{"id": "0", "kind": "sliding_window", "window": 64, "in_use": 3}, {"id": "1", "kind": "full_attention", "in_use": 9}]
    doc = document(groups)
    doc["pools"][0]["blocks"] = {"in_use": 12, "reclaimable": 0, "free": 243}  # type: ignore[index]
    assert schema_errors(doc) == []
    facts = facts_from_document(doc, "e")
    (p,) = facts.pools
    assert p.groups == (KvGroupFacts("0", "sliding_window", 64, None, 3), KvGroupFacts("1", "full_attention", None, None, 9))
    assert p.layer_groups == 2


@pytest.mark.parametrize(
    ("groups", "path", "says"),
    [
        ([{"id": "0", "kind": "sliding_window"}], "pools[0].groups[0].window", "is required for a sliding_window group"),
        ([{"id": "0", "kind": "full_attention"}, {"id": "0", "kind": "mamba"}], "pools[0].groups[1].id", "listed twice"),
        ([{"id": "0", "kind": "cross_attention"}], "pools[0].groups[0].kind", "expected one of full_attention"),
        ([{"id": "0", "kind": "full_attention", "in_use": 256}], "pools[0].groups[0].in_use", "more than num_blocks"),
        ([{"id": str(i), "kind": "full_attention"} for i in range(65)], "pools[0].groups", "more than 64"),
    ],
)
def test_bad_groups_are_named(groups: object, path: str, says: str) -> None:
    with pytest.raises(ProtocolError) as err:
        facts_from_document(document(groups), "e")
    assert err.value.path == path and says in str(err.value)
    # the schema says so too, but for what JSON Schema cannot say (unique ids, a count against the pool's)
    assert bool(schema_errors(document(groups))) == (says not in ("listed twice", "more than num_blocks"))


def test_render_has_one_series_per_group() -> None:
    from accounting_support import accounts_of

    from kvledger.domain.facts import Snapshot

    e = EngineFacts(name="e", kind="ledger", source="ledger", pools=[pool(GEMMA)], requests=[req("a", 922, 100, held=35)],
                    budgets=Budgets(max_model_len=2048))  # fmt: skip
    text = render_text(accounts_of(Snapshot(engines=[e]))).decode()
    assert 'kvledger_kv_group_in_use_blocks{engine="e",pool="0",group="2"} 58.0' in text
    assert 'kvledger_kv_group_reserved_blocks{engine="e",pool="0",group="0",basis="exact"} 3.0' in text
    assert 'kvledger_kv_group_info{engine="e",pool="0",group="0",layer_type="sliding_window",window_tokens="64"} 1.0' in text


def test_a_stock_hybrid_vllm_is_bounded_by_its_own_sizing_before_its_events() -> None:
    """cache_config_info of the tiny Gemma 3 as vLLM 0.32 exports it (sliding_window "None"):
    kv_cache_max_concurrency 3.657 of 256 blocks is 70 blocks a request at max_model_len, so
    two running requests are bounded by 140 blocks, not the 64 of one full-attention group."""
    from kvledger.collect.sources.vllm.metrics import vllm_facts_from_metrics
    from kvledger.config.types import EngineConfig

    text = (
        'vllm:cache_config_info{block_size="32",engine="0",kv_cache_max_concurrency="3.657142857142857",'
        'kv_cache_memory_bytes="4194304",kv_cache_size_tokens="3744",num_gpu_blocks="256",sliding_window="None"} 1.0\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.2\n'
        'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
        'vllm:num_requests_waiting{engine="0",model_name="m"} 0.0\n'
    )
    facts = vllm_facts_from_metrics(text, EngineConfig(name="g", kind="vllm", url="http://x/metrics"))
    (pool,) = facts.pools
    assert pool.engine_request_blocks == 70 and pool.groups == ()
    facts.budgets = Budgets(max_model_len=1024)
    (acc,) = engine_account(facts, "per-request").pools
    assert acc.reserved_blocks is not None and acc.reserved_blocks.upper == 140

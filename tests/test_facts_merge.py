"""The one precedence between configured and engine-reported facts (docs/design.md §7b),
pinned for every field that can come from both."""

from __future__ import annotations

import pytest

from kvledger.collect.merge import configured_facts, merge
from kvledger.config.types import EngineConfig, HostConfig, LimitConfig, MemoryConfig, ProcessMatch, SizeWithSource, TenantConfig
from kvledger.domain.facts import Budgets, EngineFacts, HostFacts, Limit, MemoryTerm, TenantQuota


def cfg(**kw: object) -> EngineConfig:
    base: dict[str, object] = dict(name="e", kind="ledger", url="http://127.0.0.1:1/")
    base.update(kw)
    return EngineConfig(**base)  # type: ignore[arg-type]


def engine(**kw: object) -> EngineFacts:
    base: dict[str, object] = dict(name="e", kind="ledger", source="ledger")
    base.update(kw)
    return EngineFacts(**base)  # type: ignore[arg-type]


def merged(c: EngineConfig, e: EngineFacts) -> EngineFacts:
    return merge(e, configured_facts(c))


# ------------------------------------------------ operator decisions: the configuration wins


@pytest.mark.parametrize("field", ["admission", "overflow"])
def test_admission_and_overflow_configured_wins_then_engine_then_kind_default(field: str) -> None:
    configured = {"admission": "dynamic", "overflow": "swap"}[field]
    reported = {"admission": "reserve-cap", "overflow": "reject"}[field]
    assert getattr(merged(cfg(**{field: configured}), engine(**{field: reported})), field) == configured
    assert getattr(merged(cfg(), engine(**{field: reported})), field) == reported
    # neither says: the kind's default (vLLM admits dynamically and preempts)
    default = {"admission": "dynamic", "overflow": "preempt-recompute"}[field]
    assert getattr(merged(cfg(kind="vllm"), engine(kind="vllm", source="vllm")), field) == default
    assert getattr(merged(cfg(), engine()), field) is None  # a ledger document that is silent: unknown


def test_tenants_configured_list_replaces_the_engines() -> None:
    mine = (TenantConfig("a", 10),)
    theirs = [TenantQuota("b", 20), TenantQuota("a", 99)]
    assert merged(cfg(tenants=mine), engine(tenants=theirs)).tenants == [TenantQuota("a", 10)]
    assert merged(cfg(), engine(tenants=theirs)).tenants == theirs


def test_gpus_configured_wins_then_engine_then_its_memory_terms() -> None:
    terms = [MemoryTerm(3, "weights", 1, "measured")]
    assert merged(cfg(gpus=(0, 1)), engine(gpus=[5], memory=terms)).gpus == [0, 1]
    assert merged(cfg(), engine(gpus=[5], memory=terms)).gpus == [5]
    assert merged(cfg(), engine(memory=terms)).gpus == [3]
    assert merged(cfg(), engine()).gpus == []


def test_pids_configured_wins() -> None:
    assert merged(cfg(processes=ProcessMatch(pids=(7,))), engine(pids=[9])).pids == [7]
    assert merged(cfg(), engine(pids=[9])).pids == [9]


# ------------------------------------------------ measurements: the engine wins, config fills


@pytest.mark.parametrize("field", ["max_num_batched_tokens", "max_num_seqs", "max_model_len"])
def test_budgets_engine_wins_field_by_field(field: str) -> None:
    c = cfg(**{field: 100})
    assert getattr(merged(c, engine(budgets=Budgets(**{field: 50}))).budgets, field) == 50
    assert getattr(merged(c, engine(budgets=Budgets())).budgets, field) == 100
    assert getattr(merged(cfg(), engine(budgets=Budgets())).budgets, field) is None


def test_iteration_tokens_is_the_engines_only() -> None:
    assert merged(cfg(), engine(budgets=Budgets(iteration_tokens=5))).budgets.iteration_tokens == 5


def test_memory_terms_engine_wins_per_gpu_and_category_config_on_every_gpu() -> None:
    c = cfg(memory=MemoryConfig({"weights": SizeWithSource(7), "reserve": SizeWithSource(9)}))
    e = engine(gpus=[0, 1], memory=[MemoryTerm(0, "weights", 1000, "measured")])
    m = merged(c, e).memory
    assert sorted((t.gpu, t.category, t.bytes, t.source) for t in m) == [
        (0, "reserve", 9, "configured"), (0, "weights", 1000, "measured"),
        (1, "reserve", 9, "configured"), (1, "weights", 7, "configured"),
    ]
    # configured GPUs place the configured terms
    m2 = merged(cfg(gpus=(2,), memory=MemoryConfig({"reserve": SizeWithSource(9)})), engine()).memory
    assert [(t.gpu, t.category) for t in m2] == [(2, "reserve")]
    # nothing known about the GPUs: GPU 0
    m3 = merged(cfg(memory=MemoryConfig({"reserve": SizeWithSource(9)})), engine()).memory
    assert [(t.gpu, t.category) for t in m3] == [(0, "reserve")]


def test_host_engine_wins_field_by_field() -> None:
    c = cfg(host=HostConfig(output_buffer_limit_bytes=LimitConfig(100.0, "hard"),
                            network_queue_limit=LimitConfig(5.0, "estimate")))
    e = engine(host=HostFacts(network_queue_limit=Limit(99.0, "hard"), output_buffer_bytes=3))
    h = merged(c, e).host
    assert h.output_buffer_limit == Limit(100.0, "hard")  # configured fills
    assert h.network_queue_limit == Limit(99.0, "hard")  # reported wins
    assert h.output_buffer_bytes == 3


# ------------------------------------------------ identity


def test_identity() -> None:
    m = merged(cfg(name="mine", kind="ledger"), engine(name="mine", kind="vllm", version="0.10.2"))
    assert (m.name, m.kind, m.source, m.version) == ("mine", "vllm", "ledger", "0.10.2")
    silent = merged(cfg(name="mine"), engine(name="mine", kind=""))
    assert silent.kind == "ledger"


def test_merge_does_not_modify_its_inputs() -> None:
    c = configured_facts(cfg(memory=MemoryConfig({"reserve": SizeWithSource(9)}), gpus=(0,)))
    e = engine(memory=[MemoryTerm(0, "weights", 1, "measured")])
    merge(e, c)
    assert [t.category for t in e.memory] == ["weights"] and e.gpus == []
    assert [t.category for t in c.memory] == ["reserve"]

"""What the configuration says of an engine, merged into what the engine reports: the
one place this is decided, with one precedence for every field that can come from both.

``configured`` is ``configured_facts(cfg)``: the EngineFacts the configuration alone
gives (also what is exported while the engine's source is down). ``merge`` is applied by
the collector to every engine's primary facts before accounting.

Precedence (docs/design.md, "Configuration and engine facts"):

- **Operator decisions: the configuration wins**, the engine's value applies where the
  configuration is silent, and the kind's default last:
  ``admission``, ``overflow`` (then ``engine_kinds``' default for the kind),
  ``tenants`` (names and quotas: a configured list replaces the engine's),
  ``gpus`` (then the GPUs of the engine's memory terms), ``pids``.
- **Measurements: the engine wins**, the configuration fills what the engine does not
  report, field by field: ``budgets`` (each of max_num_batched_tokens, max_num_seqs,
  max_model_len; iteration_tokens is the engine's only), ``memory`` terms (per GPU and
  category; a configured term applies to every GPU of the engine), ``host`` (each field).
- **Identity**: ``name`` is the configuration's; ``kind`` (what engine it is: a
  kvledger/v1 document may say ``vllm``) and ``version`` are the engine's, the configured
  kind where it does not say; ``source`` is the kind of source that read it.
- Everything else (pools, requests, counters, events) is the engine's alone.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import kvledger.collect.sources.kinds  # noqa: F401  (every kind's registration: fills KINDS)
from kvledger.collect.sources.base import Contribution, EngineContribution, engine_position
from kvledger.config.engine_kinds import KINDS
from kvledger.config.types import EngineConfig
from kvledger.domain.facts import Budgets, EngineFacts, HostFacts, Limit, MemoryTerm, Snapshot, TenantQuota

T = TypeVar("T", Budgets, HostFacts)
D = TypeVar("D")  # a dataclass


def configured_facts(cfg: EngineConfig) -> EngineFacts:
    """What the configuration alone says about an engine (memory terms on its GPUs, or on
    GPU 0 when it names none: ``merge`` spreads them over the engine's own GPUs)."""
    gpus = list(cfg.gpus)
    memory = [
        MemoryTerm(gpu, category, term.value, term.source)
        for category, term in cfg.memory.terms.items()
        for gpu in (gpus or [0])
    ]
    limits = cfg.host
    host = HostFacts(
        output_buffer_limit=Limit(limits.output_buffer_limit_bytes.value, limits.output_buffer_limit_bytes.kind)
        if limits.output_buffer_limit_bytes
        else None,
        network_queue_limit=Limit(limits.network_queue_limit.value, limits.network_queue_limit.kind)
        if limits.network_queue_limit
        else None,
    )
    return EngineFacts(
        name=cfg.name,
        kind=cfg.kind,
        source=cfg.kind,
        admission=cfg.admission,
        overflow=cfg.overflow,
        budgets=Budgets(
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_num_seqs=cfg.max_num_seqs,
            max_model_len=cfg.max_model_len,
        ),
        memory=memory,
        host=host,
        tenants=[TenantQuota(t.name, t.quota_bytes) for t in cfg.tenants],
        gpus=gpus,
        pids=list(cfg.processes.pids) if cfg.processes else [],
    )


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    """The fields of dataclass ``cls`` its ``__init__`` takes, read once per class."""
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls) if f.init)
    return names


def replace(obj: D, **changes: Any) -> D:
    """``dataclasses.replace`` (a new object, ``changes`` over the old one's fields)
    without its introspection at every call: the collector merges every busy engine's
    facts at every poll, and copies every configured engine at every cycle."""
    for name in _field_names(type(obj)):
        if name not in changes:
            changes[name] = getattr(obj, name)
    return type(obj)(**changes)


def _fill(engine: T, configured: T) -> T:
    """``engine`` with each of its None fields taken from ``configured``."""
    changes = {
        name: getattr(configured, name)
        for name in _field_names(type(engine))
        if getattr(engine, name) is None and getattr(configured, name) is not None
    }
    return replace(engine, **changes) if changes else engine


def merge(engine: EngineFacts, configured: EngineFacts) -> EngineFacts:
    """``engine``'s facts with the configuration merged in by the precedence above."""
    kind = KINDS.get(configured.source)  # the configured kind
    gpus = list(configured.gpus or engine.gpus or sorted({t.gpu for t in engine.memory}))
    reported = {(t.gpu, t.category) for t in engine.memory}
    # a configured term applies to every GPU of the engine (configured_facts put it on
    # the configured GPUs, or on GPU 0 when none are configured)
    per_category = {t.category: t for t in configured.memory}
    memory = list(engine.memory) + [
        replace(t, gpu=gpu)
        for t in per_category.values()
        for gpu in (gpus or [0])
        if (gpu, t.category) not in reported
    ]
    budgets = _fill(replace(engine.budgets), configured.budgets)
    return replace(
        engine,
        name=configured.name,
        kind=engine.kind or configured.kind,
        source=engine.source or configured.source,
        admission=configured.admission or engine.admission or (kind.admission if kind else None),
        overflow=configured.overflow or engine.overflow or (kind.overflow if kind else None),
        tenants=list(configured.tenants or engine.tenants),
        gpus=gpus,
        pids=list(configured.pids or engine.pids),
        budgets=budgets,
        memory=memory,
        host=_fill(engine.host, configured.host),
    )


def apply_contribution(snapshot: Snapshot, contribution: Contribution) -> None:
    """Apply one source's contribution to the Snapshot being assembled: an engine's primary
    facts merged over its configured facts (``merge``); any other (a patch, the GPUs) applies itself."""
    if isinstance(contribution, EngineContribution):
        i = engine_position(snapshot, contribution.facts.name)
        if i is not None:
            snapshot.engines[i] = merge(contribution.facts, snapshot.engines[i])
        else:
            snapshot.engines.append(replace(contribution.facts))
    else:
        contribution.apply(snapshot)

"""Builds the sources and the config-derived base facts of each configured engine.

Each kind's source class is named, by reference, in its registration
(``collect/sources/<kind>/kind.py``: ``EngineKind.source``), which
``kvledger.collect.sources.kinds`` imports: a reader and an IDE follow ``kind: sglang`` to
``SglangSource``."""

from __future__ import annotations

from collections.abc import Sequence

import kvledger.collect.sources.kinds  # noqa: F401  (every kind's registration: fills KINDS)
from kvledger.collect.merge import configured_facts
from kvledger.collect.sources.base import Source, SourceError
from kvledger.config.engine_kinds import KINDS
from kvledger.config.types import Config, ConfigError, EngineConfig
from kvledger.domain.facts import EngineFacts


def kind_source(cfg: EngineConfig) -> Source:
    """The source of ``cfg``'s kind (its registration's class), built with ``cfg``."""
    if cfg.kind not in KINDS:
        raise ConfigError(f"engine {cfg.name!r}: kind {cfg.kind!r} is not registered (kvledger.collect.sources.kinds); "
                          f"kinds: {', '.join(KINDS)}")
    source = KINDS[cfg.kind].source(cfg)
    if not isinstance(source, Source):
        raise TypeError(f"kind {cfg.kind!r}: its registration's source built {type(source).__name__}, not a Source")
    return source


def base_engine_facts(cfg: EngineConfig) -> EngineFacts:
    """What the configuration alone says about an engine (the sources add the rest)."""
    return configured_facts(cfg)


def engine_sources(cfg: EngineConfig) -> list[Source]:
    try:
        return _engine_sources(cfg)
    except SourceError as exc:  # e.g. a URL the HTTP client cannot use
        raise ConfigError(f"engine {cfg.name!r}: {exc.message}") from None


def _engine_sources(cfg: EngineConfig) -> list[Source]:
    sources: list[Source] = [kind_source(cfg)]
    if cfg.host.port is not None:
        from kvledger.collect.sources.host_sockets import HostSocketSource

        sources.append(HostSocketSource(cfg.name, cfg.host.port))
    if cfg.processes is not None and cfg.processes.match is not None:
        from kvledger.collect.sources.processes import ProcessSource

        sources.append(ProcessSource(cfg.name, cfg.processes))
    return sources


def build_sources(
    config: Config, previous: tuple[Config, Sequence[Source]] | None = None
) -> tuple[list[Source], dict[int, float], list[EngineFacts]]:
    """Sources, their timeouts (by id), and the base facts of every engine. With
    ``previous`` (a reload), an engine whose configuration is unchanged keeps its source
    objects, and so its state; NVML too when its setting is unchanged."""
    kept: dict[str, list[Source]] = {}
    if previous is not None:
        old_config, old_sources = previous
        unchanged = {c.name for c in old_config.engines if c in config.engines}
        for s in old_sources:
            if s.engine in unchanged:
                kept.setdefault(s.engine, []).append(s)
            elif s.engine == "" and old_config.nvml == config.nvml:
                kept.setdefault("", []).append(s)
    sources: list[Source] = []
    timeouts: dict[int, float] = {}
    kept_ids = {id(s) for group in kept.values() for s in group}
    try:
        for cfg in config.engines:
            for s in kept.get(cfg.name) or engine_sources(cfg):
                sources.append(s)
                timeouts[id(s)] = cfg.timeout_seconds
        if config.nvml.enabled != "false":
            if kept.get(""):
                sources.extend(kept[""])
            else:
                from kvledger.collect.sources.nvml import NvmlSource

                nvml = NvmlSource(config.nvml.enabled)
                if nvml.available():  # auto without a library: no GPU figures, and no alarm
                    sources.append(nvml)
                else:
                    nvml.close()
    except BaseException:
        # a configuration that fails half way (a bad URL in the third engine) leaves nothing
        # running: the sources built for it so far are closed, the kept ones untouched
        for s in sources:
            if id(s) not in kept_ids:
                s.close()
        raise
    return sources, timeouts, [base_engine_facts(c) for c in config.engines]

"""The source interface: a source knows one thing and turns it into Snapshot facts.

A source's ``poll()`` does its I/O (bounded by its own timeout) and returns a
Contribution; the collector applies the latest contribution of every *up* source to
a fresh Snapshot before the policy runs. A source never computes policy numbers.

Failures are raised as ``SourceError(reason, message)``: ``reason`` is a short,
bounded token used as a label value (``timeout``, ``connect``, ``http_status``,
``parse``, ``schema``, ``driver``, ...); ``message`` is the human sentence that names
what was wrong (shown by ``kvledger check``/``snapshot`` and logged).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from kvledger.model import EngineFacts, GpuFacts, Snapshot


T = TypeVar("T")


class SourceError(Exception):
    """A source failed; ``reason`` is a bounded label value, the message says what was wrong."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message

    def __str__(self) -> str:
        return self.message


class Contribution(ABC):
    """What one successful poll adds to a Snapshot. Must not mutate shared objects."""

    #: primaries (the engine's main facts) are applied before patches
    order: int = 1

    @abstractmethod
    def apply(self, snapshot: Snapshot) -> None: ...


def find_engine(snapshot: Snapshot, name: str) -> EngineFacts | None:
    for engine in snapshot.engines:
        if engine.name == name:
            return engine
    return None


@dataclass
class EngineContribution(Contribution):
    """The primary facts of one engine; merged over the config-derived base facts."""

    facts: EngineFacts
    order: int = 0

    def apply(self, snapshot: Snapshot) -> None:
        base = find_engine(snapshot, self.facts.name)
        merged = dataclasses.replace(self.facts)
        if base is not None:
            # Config-only knowledge fills what the engine does not report.
            if not merged.tenants:
                merged.tenants = base.tenants
            if not merged.gpus:
                merged.gpus = base.gpus
            if not merged.pids:
                merged.pids = base.pids
            merged.memory = list(merged.memory) + [
                t for t in base.memory if (t.gpu, t.category) not in {(m.gpu, m.category) for m in merged.memory}
            ]
            if merged.admission is None:
                merged.admission = base.admission
            if merged.overflow is None:
                merged.overflow = base.overflow
            merged.budgets = _fill(merged.budgets, base.budgets)
            merged.host = _fill(merged.host, base.host)
            snapshot.engines[snapshot.engines.index(base)] = merged
        else:
            snapshot.engines.append(merged)


def _fill(primary: T, fallback: T) -> T:
    """A copy of dataclass ``primary`` whose None fields take ``fallback``'s values."""
    changes = {
        f.name: getattr(fallback, f.name)
        for f in dataclasses.fields(primary)  # type: ignore[arg-type]
        if getattr(primary, f.name) is None and getattr(fallback, f.name) is not None
    }
    return dataclasses.replace(primary, **changes) if changes else primary  # type: ignore[type-var]


@dataclass
class EnginePatch(Contribution):
    """A secondary fact for an engine (events, log, host sockets): fn returns a new EngineFacts."""

    engine: str
    fn: Callable[[EngineFacts], EngineFacts]
    order: int = 1

    def apply(self, snapshot: Snapshot) -> None:
        base = find_engine(snapshot, self.engine)
        if base is None:
            return
        snapshot.engines[snapshot.engines.index(base)] = self.fn(base)


@dataclass
class GpuContribution(Contribution):
    gpus: list[GpuFacts]
    driver_version: str | None = None
    order: int = 0

    def apply(self, snapshot: Snapshot) -> None:
        snapshot.gpus = list(self.gpus)
        snapshot.driver_version = self.driver_version


@dataclass(frozen=True)
class SubsourceReport:
    """The health of a part a source runs itself (vLLM's KV-event subscriber, its log reader)."""

    name: str  # the ``source`` label value, e.g. "kv_events"
    up: bool
    message: str | None = None  # why it is not up


class Source(ABC):
    """One source of facts. ``engine`` is the engine name ("" for node-wide sources)."""

    kind: str = ""
    engine: str = ""

    @abstractmethod
    def poll(self) -> Contribution:
        """Fetch and parse once; raise SourceError on failure. Runs off the scrape path."""

    def subsource_health(self) -> list[SubsourceReport]:
        """The parts this source runs itself, each with its health (none by default)."""
        return []

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release sockets and threads."""

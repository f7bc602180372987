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

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from kvledger.domain.facts import EngineFacts, GpuFacts, Snapshot


class SourceError(Exception):
    """A source failed; ``reason`` is a bounded label value, the message says what was wrong."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message

    def __str__(self) -> str:
        return self.message


class Contribution:
    """What one successful poll adds to a Snapshot (facts only); the collector applies it
    (``collect.merge.apply_contribution``). Must not mutate shared objects."""

    #: primaries (the engine's main facts) are applied before patches
    order: int = 1

    def apply(self, snapshot: Snapshot) -> None:
        """Add this contribution's facts to the Snapshot (a patch, the GPUs). An engine's
        primary facts (``EngineContribution``) are merged by the collector instead."""
        raise NotImplementedError(f"{type(self).__name__} does not apply itself")


_positions = threading.local()  # the engines list last indexed on this thread, and its index


def engine_position(snapshot: Snapshot, name: str) -> int | None:
    """The position of the first engine named ``name`` in ``snapshot.engines``, or None.
    Constant time as a Snapshot is assembled (one index of names per engines list, made
    again when the list changed in a way that moved a name): a lookup per contribution by
    scanning, and replacing by ``list.index`` (which compares whole EngineFacts), cost time
    quadratic in the engines (0.5 s a cycle at 1,000 engines)."""
    engines = snapshot.engines
    cached = getattr(_positions, "cached", None)
    if cached is None or cached[0] is not engines or cached[1] != len(engines):
        index: dict[str, int] = {}
        for i, e in enumerate(engines):
            index.setdefault(e.name, i)
        cached = _positions.cached = (engines, len(engines), index)
    found: int | None = cached[2].get(name)
    if found is not None and engines[found].name == name:
        return found
    for j, e in enumerate(engines):  # the list was changed in place: look, then index it again
        if e.name == name:
            _positions.cached = None
            return j
    return None


def find_engine(snapshot: Snapshot, name: str) -> EngineFacts | None:
    i = engine_position(snapshot, name)
    return None if i is None else snapshot.engines[i]


@dataclass
class EngineContribution(Contribution):
    """The primary facts of one engine, as the engine reports them; the configured facts
    are merged in by the collector (``collect.merge``: one precedence for every field)."""

    facts: EngineFacts
    order: int = 0


@dataclass
class EnginePatch(Contribution):
    """A secondary fact for an engine (events, log, host sockets): fn returns a new EngineFacts."""

    engine: str
    fn: Callable[[EngineFacts], EngineFacts]
    order: int = 1

    def apply(self, snapshot: Snapshot) -> None:
        i = engine_position(snapshot, self.engine)
        if i is None:
            return
        snapshot.engines[i] = self.fn(snapshot.engines[i])


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
    document_age_seconds: float | None = None  # a kvledger/v1 document's age at its latest read


class Source(ABC):
    """One source of facts. ``engine`` is the engine name ("" for node-wide sources)."""

    kind: str = ""
    engine: str = ""

    @abstractmethod
    def poll(self) -> Contribution:
        """Fetch and parse once; raise SourceError on failure. Runs off the scrape path."""

    def document_age(self) -> float | None:
        """The age of the kvledger/v1 document this source read last (None: it reads none)."""
        return None

    def refresh_interval_steps(self) -> int | None:
        """Engine steps between the engine's own refreshes of what this source reads (None:
        each read is current, or the interval is unknown)."""
        return None

    def subsource_health(self) -> list[SubsourceReport]:
        """The parts this source runs itself, each with its health (none by default)."""
        return []

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release sockets and threads."""

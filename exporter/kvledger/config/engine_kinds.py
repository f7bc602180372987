"""The table of engine kinds: what a kind's registration says, and the table the
configuration reads.

A registration (``register(EngineKind(...))``) names the kind's source class (by
reference), the configuration keys that only this kind accepts, the admission and overflow
rules of the engine when neither the engine nor the configuration says, and the kind's
documentation page. It lives in the kind's own folder (``collect/sources/<kind>/kind.py``),
beside the source it names; ``kvledger.collect.sources.kinds`` imports every kind's
registration, one line each, and the entry points (the CLI, the docs generator, the
simulator, the tests' conftest) import it before they read a configuration. The
configuration loader, the merge of configured facts, the registry that builds the sources and
the generated docs derive everything from ``KINDS``. A new engine kind is its folder and
one line in ``collect/sources/kinds.py`` (docs/adding-an-engine.md).

This module imports nothing of ``collect/`` (the sources read the configuration): the
table is filled from there, never looked up from here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from kvledger.domain.facts import Admission, Overflow

if TYPE_CHECKING:
    from kvledger.config.types import EngineConfig


@dataclass(frozen=True)
class Option:
    """A configuration key only this kind accepts; the loader checks it by ``value``:
    ``address`` (tcp://, ipc://, http(s):// or unix:///absolute/path), ``zmq`` (a ZMQ endpoint:
    tcp://HOST:PORT or ipc:///path), ``path`` (a file),
    ``boolean`` (true or false, kept as the text "true" or "false"), ``tokens`` (a whole
    number of tokens, 1 .. 2**30, kept as its decimal text) or ``steps`` (a whole number of
    engine steps, 1 .. 2**30, kept as its decimal text)."""

    name: str
    value: Literal["address", "zmq", "path", "boolean", "tokens", "steps"]
    help: str


@dataclass(frozen=True)
class EngineKind:
    name: str  # the ``kind:`` value in the configuration
    #: the kind's source class (a ``kvledger.collect.sources.base.Source``), built with the
    #: engine's configuration: named by reference, so that a reader follows ``kind: sglang``
    #: to ``SglangSource``
    source: Callable[[EngineConfig], object]
    options: tuple[Option, ...]  # configuration keys that only this kind accepts (cfg.option(name))
    admission: Admission | None  # the engine's rule, when neither it nor the config says
    overflow: Overflow | None
    docs: str  # the kind's page, relative to the repository root
    summary: str  # one line for error messages and the table of kinds (docs/engines/index.md)


#: every registered kind by name, in the order of kvledger.collect.sources.kinds
KINDS: dict[str, EngineKind] = {}

#: kinds on the roadmap: named in the error for an unknown kind, never accepted
PLANNED: tuple[str, ...] = ()


def register(kind: EngineKind) -> None:
    if kind.name in KINDS:
        raise ValueError(f"engine kind {kind.name!r} is registered twice")
    KINDS[kind.name] = kind


def kind_specific_keys() -> dict[str, tuple[str, ...]]:
    """Each kind-specific configuration key and the kinds that accept it (``ledger``: the
    kinds with an in-engine plugin)."""
    owners: dict[str, tuple[str, ...]] = {}
    for kind in KINDS.values():
        for o in kind.options:
            owners[o.name] = (*owners.get(o.name, ()), kind.name)
    return owners

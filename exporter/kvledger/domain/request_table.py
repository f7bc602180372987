"""The requests of one engine as columns, read-only, behaving as a sequence of RequestFacts.

A busy engine's ledger lists every request, and every request's tokens move at every
step, so a poll cannot skip unchanged requests: it must read them all. Building one
``RequestFacts`` object per request per poll cost more than decoding the document, so
``protocol.py`` converts the requests of a document into a ``RequestTable``: one column
per field (Python lists as the document gave them, checked in bulk), and the policy reads
the numeric columns as numpy arrays (``column``), built once per table. Indexing or
iterating builds ``RequestFacts`` on demand (tests, tools, the rare consumer that needs
one request), like ``BlockRefArray`` does for block references.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from itertools import compress
from typing import Any, overload

import numpy as np

from kvledger.domain.facts import RequestFacts

#: the numeric columns, in RequestFacts' order, with their defaults
INT_COLUMNS: tuple[tuple[str, int], ...] = (
    ("prompt_tokens", 0),
    ("max_output_tokens", 0),
    ("generated_tokens", 0),
    ("computed_tokens", 0),
    ("contexts", 1),
    ("speculative_slots", 0),
    ("blocks_held", 0),
)
INT_NAMES = tuple(name for name, _ in INT_COLUMNS)


class RequestTable(Sequence[RequestFacts]):
    """Requests as columns. ``ints`` maps each name of ``INT_COLUMNS`` to a list of ints;
    ``block_ids`` is None when no request lists its blocks."""

    __slots__ = ("_arrays", "_ints", "_names", "_pool_names", "block_ids", "ids", "output_bounds", "pools", "states", "tenants")

    def __init__(
        self,
        ids: list[str],
        states: list[str],
        pools: list[str],
        tenants: list[str | None],
        output_bounds: list[str],
        ints: dict[str, list[int]],
        block_ids: list[list[int] | None] | None = None,
        arrays: dict[str, np.ndarray] | None = None,
        pool_names: set[str] | None = None,
    ) -> None:
        """``pool_names``: the set of ``pools``, where the maker has it already."""
        n = len(ids)
        arrays = dict(arrays or {})
        columns: tuple[Any, ...] = (states, pools, tenants, output_bounds, *ints.values(), *arrays.values())
        if not all(len(c) == n for c in columns) or not set(INT_NAMES) <= set(ints) | set(arrays):
            raise ValueError("request columns differ in length or lack a column")
        if block_ids is not None and len(block_ids) != n:
            raise ValueError("request columns differ in length")
        self.ids = ids
        self.states = states
        self.pools = pools
        self.tenants = tenants
        self.output_bounds = output_bounds
        self._ints = dict(ints)  # a column given only as an array is listed when first asked for
        self.block_ids = block_ids
        self._arrays: dict[str, np.ndarray] = arrays
        # the numeric columns: INT_COLUMNS', then any other integer field the wire defines
        # (a field the policy does not read yet rides along, readable by ``column``)
        self._names = (*INT_NAMES, *(name for name in (*ints, *arrays) if name not in INT_NAMES))
        self._pool_names = pool_names

    @classmethod
    def of_columns(
        cls, ids: list[str], states: list[str], pools: list[str], tenants: list[str | None], output_bounds: list[str],
        block_ids: list[list[int] | None] | None, arrays: dict[str, np.ndarray], pool_names: set[str],
    ) -> RequestTable:
        """A table of columns its maker has checked (``protocol.fast_decoder``): every column
        ``len(ids)`` long, ``arrays`` holding every name of ``INT_COLUMNS`` (and perhaps other
        integer fields), ``pool_names`` the set of ``pools``; built without checking them again."""
        table = cls.__new__(cls)
        table.ids, table.states, table.pools, table.tenants, table.output_bounds = ids, states, pools, tenants, output_bounds
        table._ints = {}
        table.block_ids = block_ids
        table._arrays = arrays
        table._names = (*INT_NAMES, *(name for name in arrays if name not in INT_NAMES))
        table._pool_names = pool_names
        return table

    def pool_names(self) -> set[str]:
        """The distinct pools of the requests (built once)."""
        if self._pool_names is None:
            self._pool_names = set(self.pools)
        return self._pool_names

    @property
    def ints(self) -> dict[str, list[int]]:
        """Every numeric column as a list of ints."""
        if len(self._ints) < len(self._names):
            for name in self._names:
                if name not in self._ints:
                    self._ints[name] = [int(v) for v in self._arrays[name].tolist()]
        return self._ints

    @classmethod
    def from_requests(cls, requests: Iterable[RequestFacts]) -> RequestTable:
        if isinstance(requests, RequestTable):
            return requests
        reqs = list(requests)
        block_ids: list[list[int] | None] | None = [r.block_ids for r in reqs]
        if block_ids is not None and all(b is None for b in block_ids):
            block_ids = None
        return cls(
            [r.id for r in reqs],
            [r.state for r in reqs],
            [r.pool for r in reqs],
            [r.tenant for r in reqs],
            [r.output_bound for r in reqs],
            {name: [getattr(r, name) for r in reqs] for name in INT_NAMES},
            block_ids,
        )

    @classmethod
    def concat(cls, tables: Sequence[RequestTable]) -> RequestTable:
        def cat(lists: Iterable[list[Any]]) -> list[Any]:
            out: list[Any] = []
            for part in lists:
                out.extend(part)
            return out

        block_ids = None
        if any(t.block_ids is not None for t in tables):
            block_ids = cat(t.block_ids if t.block_ids is not None else [None] * len(t) for t in tables)
        return cls(
            cat(t.ids for t in tables),
            cat(t.states for t in tables),
            cat(t.pools for t in tables),
            cat(t.tenants for t in tables),
            cat(t.output_bounds for t in tables),
            {name: cat(t.ints[name] for t in tables) for name in INT_NAMES},
            block_ids,
        )

    # ------------------------------------------------------------ columns for the policy

    def column(self, name: str) -> np.ndarray:
        """A numeric column as an int64 array (built once)."""
        arr = self._arrays.get(name)
        if arr is None:
            arr = self._arrays[name] = np.array(self._ints[name], dtype=np.int64) if self.ids else np.zeros(0, np.int64)
        return arr

    def held(self) -> np.ndarray:
        """held(r): ``len(block_ids)`` where a request lists them, else ``blocks_held``."""
        if self.block_ids is None:
            return self.column("blocks_held")
        return np.array(
            [h if b is None else len(b) for h, b in zip(self.ints["blocks_held"], self.block_ids, strict=True)],
            dtype=np.int64,
        )

    def select(self, mask: np.ndarray) -> RequestTable:
        """The requests where ``mask`` is True."""
        keep = mask.tolist()
        ints = {name: list(compress(values, keep)) for name, values in self.ints.items()}
        arrays = {name: arr[mask] for name, arr in self._arrays.items()}
        return RequestTable(
            list(compress(self.ids, keep)),
            list(compress(self.states, keep)),
            list(compress(self.pools, keep)),
            list(compress(self.tenants, keep)),
            list(compress(self.output_bounds, keep)),
            ints,
            None if self.block_ids is None else list(compress(self.block_ids, keep)),
            arrays,
        )

    def with_labels(self, pools: list[str], tenants: list[str | None]) -> RequestTable:
        """The same requests with other pool and tenant names (label limits)."""
        return RequestTable(self.ids, self.states, pools, tenants, self.output_bounds, self._ints, self.block_ids, self._arrays)

    # ------------------------------------------------------------ Sequence[RequestFacts]

    def __len__(self) -> int:
        return len(self.ids)

    def _row(self, i: int) -> RequestFacts:
        ints = self.ints
        return RequestFacts(
            self.ids[i],
            self.states[i],  # type: ignore[arg-type]  # checked against REQUEST_STATES where the table was built
            ints["prompt_tokens"][i],
            ints["max_output_tokens"][i],
            self.output_bounds[i],  # type: ignore[arg-type]  # checked against OUTPUT_BOUNDS where the table was built
            self.pools[i],
            self.tenants[i],
            ints["generated_tokens"][i],
            ints["computed_tokens"][i],
            ints["contexts"][i],
            ints["speculative_slots"][i],
            ints["blocks_held"][i],
            None if self.block_ids is None else self.block_ids[i],
        )

    @overload
    def __getitem__(self, index: int) -> RequestFacts: ...

    @overload
    def __getitem__(self, index: slice) -> RequestTable: ...

    def __getitem__(self, index: int | slice) -> RequestFacts | RequestTable:
        if isinstance(index, slice):
            mask = np.zeros(len(self), dtype=bool)
            mask[index] = True
            return self.select(mask)
        n = len(self.ids)
        if not -n <= index < n:
            raise IndexError("request index out of range")
        return self._row(index % n if n else index)

    def __iter__(self) -> Iterator[RequestFacts]:
        return map(self._row, range(len(self.ids)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    def __hash__(self) -> int:  # a container compared by value: not hashable
        raise TypeError("RequestTable is not hashable")

    def __repr__(self) -> str:
        return f"RequestTable({len(self)} requests)"

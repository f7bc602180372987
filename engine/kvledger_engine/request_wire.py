"""The request of kvledger/v1, defined once, and its one writer.

``REQUEST_FIELDS`` lists every field of a request: its JSON type, range, enumeration,
default and whether it is required. Everything that writes or reads a request is built
from it:

- the writer here (``RequestWriter``): the row form (``requests[]``, one JSON object per
  request) and the columnar form (``request_columns``, one column per field), used by every
  producer in this distribution (the vLLM plugin, the SGLang plugin, the reference ledger);
- the daemon's two readers (``kvledger.protocol.fast_decoder``: typed structs;
  ``kvledger.protocol.reader``: field by field, naming the path of the first problem);
- the published JSON Schema's request properties, which tests/test_protocol.py holds to
  this definition both ways.

A new request field is one entry here (and its property in the schema, its attribute in
the daemon's ``RequestFacts``/``RequestTable`` where the policy reads it):
tests/test_wire_once.py adds one and shows the writer writes it in both forms and both
readers read it and name it when it is wrong.

Standard library only: this module runs inside inference engines' processes.
"""

from __future__ import annotations

import base64
import json
import sys
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

from kvledger_engine.wire_terms import MAX_SAFE_INT, OUTPUT_BOUNDS, REQUEST_INT_RANGES, REQUEST_STATES

#: a field's JSON type: a string, one of ``options``, an integer in [minimum, maximum], or
#: an array of such integers (``block_ids``)
JsonType = Literal["string", "enum", "integer", "integers"]


@dataclass(frozen=True, slots=True)
class Field:
    """One field of a request: ``requests[i].<name>`` in the row form, ``request_columns.<name>``
    (an array with one entry per request) in the columnar form.

    An optional field may be absent or null (read alike: absent); a required one must be
    there and not null. ``default`` is the value an absent field reads as (None: unknown,
    or, for ``pool`` and ``blocks_held``, a value derived as noted in ``REQUEST_FIELDS``).
    ``one_value``: the columnar form may give the field as one value standing for every
    request."""

    name: str
    json_type: JsonType
    required: bool = False
    minimum: int = 0  # integers, and the items of integer arrays
    maximum: int = MAX_SAFE_INT
    options: tuple[str, ...] = ()  # enumerations
    min_length: int = 0  # strings
    default: str | int | None = None
    one_value: bool = True

    @property
    def allow_empty(self) -> bool:
        return self.min_length == 0


def count_field(name: str, *, required: bool = False, default: int | None = 0,
                ranges: Mapping[str, tuple[int, int]] = REQUEST_INT_RANGES) -> Field:
    """An integer field, its range ``ranges[name]`` (``wire_terms.REQUEST_INT_RANGES``)."""
    lo, hi = ranges[name]
    return Field(name, "integer", required, lo, hi, default=None if required else default)


#: the fields of a request, in the order writers put them: msgspec matches keys in the
#: expected order first
REQUEST_FIELDS: tuple[Field, ...] = (
    Field("id", "string", required=True, min_length=1, one_value=False),
    Field("pool", "string"),  # absent, null or empty: the document's first pool
    Field("state", "enum", required=True, options=REQUEST_STATES),
    Field("tenant", "string"),
    count_field("prompt_tokens", required=True),
    count_field("max_output_tokens", required=True),
    Field("output_bound", "enum", options=OUTPUT_BOUNDS, default="cap"),
    count_field("generated_tokens"),
    count_field("computed_tokens"),
    count_field("contexts", default=1),
    count_field("speculative_slots"),
    count_field("blocks_held", default=None),  # absent or null: len(block_ids) where listed, else 0
    Field("block_ids", "integers", maximum=MAX_SAFE_INT, one_value=False),
)


def _dumps(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))


def int64le(values: Sequence[int]) -> dict[str, str]:
    """An integer column of the columnar form as machine integers (docs/ledger.md):
    ``{"int64le": base64 of little-endian signed 64-bit integers}``: written and read
    without one number's text per request."""
    packed = array("q", values)
    if sys.byteorder == "big":
        packed.byteswap()
    return {"int64le": base64.b64encode(packed.tobytes()).decode("ascii")}


def _encoder(f: Field) -> Callable[[Any], str]:
    """The JSON text of one value of ``f``."""
    if f.json_type == "integer":
        return int.__repr__
    if f.json_type == "enum":
        return lambda v: f'"{v}"'  # the options are plain words
    return _dumps


class RequestWriter:
    """Writes the requests of a kvledger/v1 document, rows or columns, field for field as
    ``fields`` (``REQUEST_FIELDS``) define them and in their order.

    A request is a mapping from field names to values; an absent or None value is left out
    (an optional field's reader then takes its default). ``shared``: values that every
    request this writer writes has (a single-pool engine's ``pool``, ``output_bound``,
    ``contexts``, ``speculative_slots``): written into every row, and as the one value of
    their column. A name that is not a field, or a shared value for a field that cannot be
    one value, raises ``ValueError``, as does a request without a required field."""

    def __init__(self, shared: Mapping[str, object] | None = None, fields: Sequence[Field] = REQUEST_FIELDS) -> None:
        self.fields = tuple(fields)
        by_name = {f.name: f for f in self.fields}
        self.shared = dict(shared or {})
        for name in self.shared:
            if name not in by_name:
                raise ValueError(f"shared value for {name!r}: not a field of a request")
            if not by_name[name].one_value:
                raise ValueError(f"shared value for {name!r}: the field has one value per request")
        # each field: (name, its key's text, its encoder, its shared text or None)
        self._plan = tuple(
            (f.name, f'"{f.name}":', _encoder(f),
             None if f.name not in self.shared or self.shared[f.name] is None else _encoder(f)(self.shared[f.name]))
            for f in self.fields
        )
        self._required = tuple(f.name for f in self.fields if f.required and f.name not in self.shared)
        self.per_request = tuple(f.name for f in self.fields if f.name not in self.shared)

    def _check(self, request: Mapping[str, Any]) -> None:
        for name in self._required:
            if request.get(name) is None:
                raise ValueError(f"request {request.get('id')!r}: the required field {name!r} has no value")
        unknown = request.keys() - self.per_request
        if unknown:
            raise ValueError(f"request {request.get('id')!r}: {sorted(unknown)} not per-request fields of this writer")

    def row(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """One ``requests[]`` entry as a dict (for a writer that builds the document as data)."""
        self._check(request)
        out: dict[str, Any] = {}
        shared = self.shared
        for name, _key, _enc, _text in self._plan:
            value = shared[name] if name in shared else request.get(name)
            if value is not None:
                out[name] = list(value) if isinstance(value, (list, tuple)) else value
        return out

    def row_json(self, request: Mapping[str, Any]) -> str:
        """One ``requests[]`` entry as compact JSON text."""
        self._check(request)
        parts = []
        for name, key, enc, text in self._plan:
            if text is None:
                value = request.get(name)
                if value is None:
                    continue
                text = enc(value)
            parts.append(key + text)
        return "{" + ",".join(parts) + "}"

    def columns(self, requests: Sequence[Mapping[str, Any]], *, machine_integers: bool = True,
                collapse: bool = False, check: bool = True) -> dict[str, Any]:
        """``request_columns`` of ``requests``: one array per field with one entry per
        request; a shared value as the column's one value; an optional field no request has
        left out. ``machine_integers``: integer columns as ``int64le`` (a column with a
        missing entry stays an array); ``collapse``: a column whose entries are all equal as
        its one value, where the field allows one. ``check=False``: the requests come from a
        typed record that always has the required fields and no others (the plugins'
        ``RequestRow``), so the per-request check is skipped."""
        if check:
            for request in requests:
                self._check(request)
        out: dict[str, Any] = {}
        for f in self.fields:
            if f.name in self.shared:
                if self.shared[f.name] is not None:
                    out[f.name] = self.shared[f.name]
                continue
            values = [r.get(f.name) for r in requests]
            if not f.required and all(v is None for v in values):
                continue
            if f.json_type == "integers":
                out[f.name] = [None if v is None else list(v) for v in values]
            elif collapse and f.one_value and values and values.count(values[0]) == len(values):
                out[f.name] = values[0]
            elif f.json_type == "integer" and machine_integers and None not in values:
                out[f.name] = int64le(cast(list[int], values))  # no None: checked above
            else:
                out[f.name] = values
        return out


FIELDS = {f.name: f for f in REQUEST_FIELDS}

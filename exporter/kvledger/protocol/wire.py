"""The request of kvledger/v1, defined once: every field, its JSON type, range, enumeration,
default and whether it is required.

Both readers of a body are built from ``REQUEST_FIELDS``: the typed decoder
(``fast_decoder``: msgspec structs for ``requests[]`` rows and for ``request_columns``,
which check type, range and enumeration while they parse) and the checked reader
(``reader``: field by field, naming the path of the first problem, e.g.
``requests[3].prompt_tokens: expected integer, got "abc"``). The ranges are
``model.limits.REQUEST_INT_RANGES``, the enumerations the wire terms' own tuples.
tests/test_protocol.py holds this definition to the published JSON Schema
(``schema/kvledger-v1.json``), property by property, both ways. A new request field is one
entry here (and its attribute in ``RequestFacts``/``RequestTable`` and its property in the
schema, which that test asks for).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvledger.model.facts import OUTPUT_BOUNDS, REQUEST_STATES
from kvledger.model.limits import MAX_SAFE_INT, REQUEST_INT_RANGES

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


def _count(name: str, *, required: bool = False, default: int | None = 0) -> Field:
    """An integer field, its range ``limits.REQUEST_INT_RANGES[name]``."""
    lo, hi = REQUEST_INT_RANGES[name]
    return Field(name, "integer", required, lo, hi, default=None if required else default)


#: the fields of a request, in the order writers put them (the vLLM integration, the
#: reference ledger): msgspec matches keys in the expected order first
REQUEST_FIELDS: tuple[Field, ...] = (
    Field("id", "string", required=True, min_length=1, one_value=False),
    Field("pool", "string"),  # absent, null or empty: the document's first pool
    Field("state", "enum", required=True, options=REQUEST_STATES),
    Field("tenant", "string"),
    _count("prompt_tokens", required=True),
    _count("max_output_tokens", required=True),
    Field("output_bound", "enum", options=OUTPUT_BOUNDS, default="cap"),
    _count("generated_tokens"),
    _count("computed_tokens"),
    _count("contexts", default=1),
    _count("speculative_slots"),
    _count("blocks_held", default=None),  # absent or null: len(block_ids) where listed, else 0
    Field("block_ids", "integers", maximum=MAX_SAFE_INT, one_value=False),
)

FIELDS = {f.name: f for f in REQUEST_FIELDS}
REQUIRED = tuple(f.name for f in REQUEST_FIELDS if f.required)
#: the order the checked reader checks a request's fields in (the first problem of a
#: request is named by it): the required ones first
CHECK_ORDER: tuple[Field, ...] = tuple(f for f in REQUEST_FIELDS if f.required) + tuple(
    f for f in REQUEST_FIELDS if not f.required
)
INTEGER_FIELDS = tuple(f.name for f in REQUEST_FIELDS if f.json_type == "integer")

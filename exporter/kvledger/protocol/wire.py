"""The request of kvledger/v1 as the daemon reads it: the engine-side library's one
definition (``kvledger_engine.request_wire.REQUEST_FIELDS``: every field, its JSON type,
range, enumeration, default and whether it is required), from which its writer writes.

Both readers of a body are built from ``REQUEST_FIELDS``: the typed decoder
(``fast_decoder``: msgspec structs for ``requests[]`` rows and for ``request_columns``,
which check type, range and enumeration while they parse) and the checked reader
(``reader``: field by field, naming the path of the first problem, e.g.
``requests[3].prompt_tokens: expected integer, got "abc"``). The ranges are
``wire_terms.REQUEST_INT_RANGES`` (``domain.limits`` re-exports them), the enumerations the
wire terms' own tuples. tests/test_protocol.py holds this definition to the published JSON
Schema (``schema/kvledger-v1.json``), property by property, both ways. A new request field
is one entry in the engine-side definition (tests/test_wire_once.py adds one).
"""

from __future__ import annotations

from kvledger_engine.request_wire import FIELDS as FIELDS
from kvledger_engine.request_wire import REQUEST_FIELDS as REQUEST_FIELDS
from kvledger_engine.request_wire import Field as Field
from kvledger_engine.request_wire import JsonType as JsonType

REQUIRED = tuple(f.name for f in REQUEST_FIELDS if f.required)
#: the order the checked reader checks a request's fields in (the first problem of a
#: request is named by it): the required ones first
CHECK_ORDER: tuple[Field, ...] = tuple(f for f in REQUEST_FIELDS if f.required) + tuple(
    f for f in REQUEST_FIELDS if not f.required
)
INTEGER_FIELDS = tuple(f.name for f in REQUEST_FIELDS if f.json_type == "integer")

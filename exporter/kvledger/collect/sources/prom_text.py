"""A small, tolerant reader of the Prometheus text exposition format.

Engine adapters (vLLM, SGLang, TGI, ...) read an engine's /metrics with it. It wraps
``prometheus_client.parser.text_string_to_metric_families`` and flattens the result to
``{sample name: [Sample(labels, value), ...]}``:

- sample names are kept exactly as exposed (``vllm:num_preemptions_total``,
  ``..._bucket``, ``..._created``), colons included;
- families the caller does not know are simply never looked up;
- a malformed or truncated body raises ``SourceError("parse", ...)`` whose message names
  the first offending line (number and text). Every exception the parser can raise on
  engine text (``PARSER_ERRORS``, named here once) is such a parse error: a sample whose
  timestamp has 312 digits overflows prometheus_client's ``int / 1000`` (OverflowError)
  and fails its engine's poll as ``parse`` like any other bad line, never as ``internal``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from kvledger.collect.sources.base import SourceError

#: longest excerpt of an offending line quoted in an error message
_QUOTE = 120
#: what prometheus_client's text parser raises on text it cannot read: ValueError (and
#: UnicodeError) for a malformed line, ArithmeticError (OverflowError) for a number beyond
#: a double (``a 1 999...9``: the timestamp divided by 1000), the others for shapes its
#: splitting does not expect. Each is a parse error of the engine that sent the text.
PARSER_ERRORS: tuple[type[Exception], ...] = (ValueError, ArithmeticError, TypeError, IndexError, KeyError)


@dataclass(frozen=True, slots=True)
class Sample:
    labels: Mapping[str, str]
    value: float


Exposition = dict[str, list[Sample]]


def parse_exposition(text: str) -> Exposition:
    """Samples by name. Raises SourceError("parse") naming the first bad line."""
    out: Exposition = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out.setdefault(s.name, []).append(Sample(dict(s.labels), _float(s.value)))
    except PARSER_ERRORS as exc:
        raise SourceError("parse", _locate_error(text, exc)) from None
    return out


def _float(value: float) -> float:
    """The sample value as a float; an integer literal beyond a double's range is +-inf
    (as a float literal of that size would be), never an OverflowError."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def _locate_error(text: str, exc: Exception) -> str:
    """Re-parse line by line (error path only) to name the first line the parser rejects."""
    lines = text.split("\n")
    for number, line in enumerate(lines, start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        try:
            for _ in text_string_to_metric_families(stripped + "\n"):
                pass
        except PARSER_ERRORS as line_exc:
            quoted = stripped if len(stripped) <= _QUOTE else stripped[:_QUOTE] + "..."
            hint = "; the body looks truncated" if number == len(lines) and not text.endswith("\n") else ""
            detail = str(line_exc) or type(line_exc).__name__
            return f"invalid exposition line {number}: {quoted!r} ({detail}){hint}"
    detail = str(exc) or type(exc).__name__
    return f"invalid Prometheus text exposition: {detail}"


def samples(exp: Exposition, *names: str) -> list[Sample]:
    """Samples of the first of ``names`` present (newest name first, deprecated after)."""
    for name in names:
        if name in exp:
            return exp[name]
    return []


def first_present(exp: Exposition, *names: str) -> str | None:
    for name in names:
        if name in exp:
            return name
    return None


def group_by(items: Iterable[Sample], label: str, default: str | None = None) -> dict[str | None, list[Sample]]:
    """Samples grouped by the value of ``label`` (``default`` where the label is absent)."""
    out: dict[str | None, list[Sample]] = {}
    for s in items:
        out.setdefault(s.labels.get(label, default), []).append(s)
    return out


def finite(value: float) -> float | None:
    """The value, or None for NaN/inf (an unknown, never a number)."""
    return value if math.isfinite(value) else None

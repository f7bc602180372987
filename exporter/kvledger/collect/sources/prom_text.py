"""A small, strict reader of the Prometheus text exposition format, in linear time.

Engine adapters (vLLM, SGLang, TGI, ...) read an engine's /metrics with it; the result is
``{sample name: [Sample(labels, value), ...]}``:

- sample names are kept exactly as exposed (``vllm:num_preemptions_total``,
  ``..._bucket``, ``..._created``), colons included; as prometheus_client's parser did, a
  sample of a ``counter`` family whose TYPE line names it without ``_total`` is read as
  ``<name>_total`` (an OpenMetrics-style counter);
- families the caller does not know are simply never looked up;
- a malformed or truncated body raises ``SourceError("parse", ...)`` whose message names
  the first offending line (number and text) and what is wrong with it.

Every line is read with a fixed set of regular expressions whose alternatives never
overlap, and every label value is unescaped in one pass, so the cost is linear in the
size of the text whatever it holds: a label value of a million ``\\"`` costs what a million
plain characters cost (prometheus_client's parser, used before, copied the rest of a value
at each escaped quote: 1 MiB of ``\\"`` took 5 s, 4 MiB of mixed escapes 36 s;
bench/bench_parse_worst.py measures ours). A parse also stops at its ``deadline`` (a
``time.monotonic()`` instant, checked every ``CHECK_EVERY`` lines) and when the daemon
stops (``abandon_parses()``), raising ``SourceError("timeout")``: no parse outlives its
poll's deadline by more than the time of ``CHECK_EVERY`` lines, nor holds up shutdown.

What it accepts is the text format as Prometheus reads it: ``name{label="value",...}
value [timestamp]`` with optional blanks around the braces, commas and ``=``, a trailing
comma, quoted (UTF-8) metric and label names, ``# HELP`` / ``# TYPE`` lines and other
comments; a value is a float (``NaN``, ``+Inf``, exponents; no ``_``, ASCII only) and a
timestamp an int64 count of milliseconds. Anything else is a parse error of the engine
that sent it.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from kvledger.collect.sources.base import SourceError

#: longest excerpt of an offending line quoted in an error message
_QUOTE = 120
#: lines between two looks at the clock (and at ``abandon_parses``)
CHECK_EVERY = 256

_STOPPING = threading.Event()


def abandon_parses() -> None:
    """Make every parse in progress (and every later one) stop at its next check with
    SourceError("timeout"): the daemon calls it when it shuts down."""
    _STOPPING.set()


def allow_parses() -> None:
    """Undo ``abandon_parses`` (a process that starts a daemon again: tests)."""
    _STOPPING.clear()


class Sample(NamedTuple):
    labels: Mapping[str, str]
    value: float


Exposition = dict[str, list[Sample]]

# ---------------------------------------------------------------- the grammar
#
# Each line is read twice over at most: once as ``masked``, the line with every escape
# (``\\``, ``\"``) replaced by two placeholder characters of the same length, so that
# every ``"`` left in it opens or closes a quoted string, and once for the values, cut
# from the line itself at the positions found in ``masked``. Both the masking (two
# str.replace) and the patterns (possessive, no alternative overlapping another) cost one
# pass over the line whatever it holds.

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*+"
_PAIR_TEXT = rf'{_NAME}="[^"]*+"'
_BLANK = re.compile(r"[ \t]*+")
#: the common shape, in one match: a legacy name, canonical labels, a value, a timestamp
_CANONICAL = re.compile(
    rf"({_NAME})(?:\{{((?:{_PAIR_TEXT}(?:,{_PAIR_TEXT})*+,?)?)\}})?[ \t]++([^ \t]++)(?:[ \t]++([^ \t]++))?"
)
_NAME_RE = re.compile(_NAME)
_STRING_RE = re.compile(r'"([^"]*+)"')
_META = re.compile(r"#[ \t]+(HELP|TYPE)(?=[ \t]|$)[ \t]*+")
_TIMESTAMP = re.compile(r"-?[0-9]{1,19}")
_PLACEHOLDERS = "\x00\x00"
#: characters that stand for an escaped backslash while a value is unescaped (the first one
#: the value does not hold)
_SPARES = ("\x00", "\x01", "\ufffe", "\uffff")
#: the sample names a family of each type holds (prometheus_client's rule)
_SUFFIXES = {"counter": ("",), "gauge": ("",), "summary": ("_count", "_sum", ""), "histogram": ("_count", "_sum", "_bucket")}


class _LineError(Exception):
    """What is wrong with one line (the caller adds the line's number and text)."""


def _mask(line: str) -> str:
    """The line with each ``\\\\`` and ``\\"`` escape replaced by two placeholders. Escapes
    pair from the left (``\\\\\\"`` is ``\\\\`` then ``\\"``): the pairs of backslashes first,
    then a backslash left before a quote."""
    if "\\" not in line:
        return line
    return line.replace("\\\\", _PLACEHOLDERS).replace('\\"', _PLACEHOLDERS)


def _unescape(text: str) -> str:
    """``\\\\``, ``\\n`` and ``\\"`` resolved in one pass; any other escape kept as written."""
    if "\\" not in text:
        return text
    if "\\\\" not in text:
        return text.replace("\\n", "\n").replace('\\"', '"')
    for spare in _SPARES:  # a character the text lacks stands for each escaped backslash meanwhile
        if spare not in text:
            return text.replace("\\\\", spare).replace("\\n", "\n").replace('\\"', '"').replace(spare, "\\")
    return "\\".join(part.replace("\\n", "\n").replace('\\"', '"') for part in text.split("\\\\"))


def _value(token: str) -> float:
    if "_" in token or not token.isascii():
        raise _LineError(f"value {_brief(token)} is not a number")
    try:
        return float(token)
    except ValueError:
        raise _LineError(f"value {_brief(token)} is not a number") from None


def _timestamp(token: str) -> None:
    if _TIMESTAMP.fullmatch(token) is None or not -(2**63) <= int(token) < 2**63:
        raise _LineError(f"timestamp {_brief(token)} is not a count of milliseconds (an int64)")


def _brief(text: str) -> str:
    return repr(text) if len(text) <= 40 else repr(text[:37]) + "..."


def _skip(masked: str, pos: int) -> int:
    return _BLANK.match(masked, pos).end()  # type: ignore[union-attr]  # [ \t]*+ always matches


def _labels(line: str, masked: str, pos: int) -> tuple[dict[str, str], int]:
    """The labels of ``{...}`` opening at ``pos``, and the position after the ``}``. A
    quoted name without ``=`` is the metric name (``{"my.metric", a="b"}``): key ``__name__``."""
    labels: dict[str, str] = {}
    n = len(masked)
    pos = _skip(masked, pos + 1)
    if pos < n and masked[pos] == ",":  # one leading comma, as prometheus_client allowed
        pos += 1
    while True:
        pos = _skip(masked, pos)
        if pos >= n:
            raise _LineError("labels not closed: no '}'")
        if masked[pos] == "}":
            return labels, pos + 1
        if masked[pos] == '"':
            m = _STRING_RE.match(masked, pos)
            if m is None:
                raise _LineError(f"quoted name at column {pos + 1} not closed")
            key, quoted = _unescape(line[m.start(1):m.end(1)]), True
        else:
            m = _NAME_RE.match(masked, pos)
            if m is None:
                raise _LineError(f"expected a label name at column {pos + 1}, got {_brief(line[pos:pos + 20])}")
            key, quoted = m.group(), False
        pos = _skip(masked, m.end())
        if pos < n and masked[pos] == "=":
            pos = _skip(masked, pos + 1)
            v = _STRING_RE.match(masked, pos)
            if v is None:
                raise _LineError(f"label {_brief(key)}: the value is not a closed quoted string")
            value = _unescape(line[v.start(1):v.end(1)])
            pos = v.end()
        elif quoted:
            key, value = "__name__", key
        else:
            raise _LineError(f"label {_brief(key)} has no '=' and value")
        if key in labels:
            raise _LineError(f"label {_brief(key)} given twice")
        labels[key] = value
        pos = _skip(masked, pos)
        if pos < n and masked[pos] == ",":
            pos += 1
        elif pos >= n or masked[pos] != "}":
            raise _LineError(f"expected ',' or '}}' after label {_brief(key)} at column {pos + 1}")


def _sample(line: str) -> tuple[str, dict[str, str], float]:
    """One sample line (stripped, not a comment): its name, labels and value."""
    masked = _mask(line)
    m = _CANONICAL.fullmatch(masked)
    if m is not None:
        name = m.group(1)
        labels: dict[str, str] = {}
        start, end = m.span(2)
        if start < end:
            # name="value",name="value"[,]: split at the quotes (every one left in masked is real)
            parts = masked[start:end].split('"')
            names = [p[1:-1] for p in parts[2:-1:2]]
            names.insert(0, parts[0][:-1])
            if "\\" not in line:  # no escapes (str.replace may return the line itself even with \n)
                values = parts[1::2]
            else:
                values, pos = [], start
                for i, part in enumerate(parts):
                    if i % 2:
                        values.append(_unescape(line[pos:pos + len(part)]))
                    pos += len(part) + 1
            labels = dict(zip(names, values, strict=True))
            if len(labels) != len(names):
                seen: set[str] = set()
                for twice in names:
                    if twice in seen:
                        raise _LineError(f"label {_brief(twice)} given twice")
                    seen.add(twice)
            if "__name__" in labels:
                raise _LineError("the metric name given twice (before the braces and as __name__)")
        value = line[m.start(3):m.end(3)]
        stamp = None if m.start(4) < 0 else line[m.start(4):m.end(4)]
    else:
        name, labels, value, stamp = _general(line, masked)
    number = _value(value)
    if stamp is not None:
        _timestamp(stamp)
    return name, labels, number


def _general(line: str, masked: str) -> tuple[str, dict[str, str], str, str | None]:
    """Any other shape the format allows: blanks around the braces and commas, quoted names."""
    m = _NAME_RE.match(masked)
    name = m.group() if m else None
    pos = m.end() if m else 0
    braces = _skip(masked, pos)
    labels: dict[str, str] = {}
    if braces < len(masked) and masked[braces] == "{":
        labels, pos = _labels(line, masked, braces)
        given = labels.pop("__name__", None)
        if name is None:
            if given is None:
                raise _LineError("no metric name (before the braces or quoted within them)")
            name = given
        elif given is not None:
            raise _LineError("the metric name given twice (before the braces and within them)")
    elif name is None:
        raise _LineError("expected a metric name")
    elif pos < len(masked) and masked[pos] not in " \t":
        raise _LineError(f"invalid character {line[pos]!r} in the metric name at column {pos + 1}")
    fields = line[pos:].split()
    if not fields:
        raise _LineError("no value")
    if len(fields) > 2:
        raise _LineError(f"expected a value and an optional timestamp, got {len(fields)} fields")
    return name, labels, fields[0], fields[1] if len(fields) == 2 else None


def _family_name(line: str, pos: int) -> tuple[str, int]:
    """The metric name a HELP or TYPE line names at ``pos`` (legacy or quoted), and the end."""
    masked = _mask(line)
    if pos < len(masked) and masked[pos] == '"':
        m = _STRING_RE.match(masked, pos)
        name = _unescape(line[m.start(1):m.end(1)]) if m else None
    else:
        m = _NAME_RE.match(masked, pos)
        name = m.group() if m else None
    if m is None or name is None or (m.end() < len(masked) and masked[m.end()] not in " \t"):
        raise _LineError("invalid metric name")
    return name, m.end()


def parse_exposition(text: str, deadline: float | None = None) -> Exposition:
    """Samples by name. Raises SourceError("parse") naming the first bad line, and
    SourceError("timeout") when ``deadline`` (time.monotonic()) passes first."""
    out: Exposition = {}
    family, kind, allowed = "", "untyped", frozenset[str]()
    lines = text.split("\n")
    for index, raw in enumerate(lines):
        if index % CHECK_EVERY == 0 and index:
            _check_clock(deadline, index, len(lines))
        line = raw.strip()
        if not line:
            continue
        try:
            if line[0] == "#":
                meta = _META.match(line)
                if meta is None:
                    continue  # a comment
                pos = meta.end()
                if meta.group(1) == "HELP":
                    name = _family_name(line, pos)[0] if pos < len(line) else ""
                    if name != family:
                        family, kind, allowed = name, "untyped", frozenset((name,))
                    continue
                if pos >= len(line):
                    raise _LineError("TYPE line without a metric name")
                name, end = _family_name(line, pos)
                kind = line[end:].strip()
                if not kind:
                    raise _LineError("TYPE line without a type")
                family = name
                allowed = frozenset(name + s for s in _SUFFIXES.get(kind, ("",)))
                continue
            name, labels, value = _sample(line)
        except _LineError as exc:
            raise SourceError("parse", _located(text, lines, index, line, str(exc))) from None
        if name in allowed:
            if kind == "counter" and not family.endswith("_total"):
                name += "_total"
        else:  # a sample outside the family announced last: a family of its own
            family, kind, allowed = "", "untyped", frozenset()
        out.setdefault(name, []).append(Sample(labels, value))
    return out


def _check_clock(deadline: float | None, index: int, total: int) -> None:
    if _STOPPING.is_set():
        raise SourceError("timeout", f"parsing stopped at line {index} of {total}: kvledger is shutting down")
    if deadline is not None and time.monotonic() > deadline:
        raise SourceError("timeout", f"parsing the exposition passed the poll's deadline at line {index} of {total}")


def _located(text: str, lines: list[str], index: int, line: str, problem: str) -> str:
    quoted = line if len(line) <= _QUOTE else line[:_QUOTE] + "..."
    hint = "; the body looks truncated" if index == len(lines) - 1 and not text.endswith("\n") else ""
    return f"invalid exposition line {index + 1}: {quoted!r} ({problem}){hint}"


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

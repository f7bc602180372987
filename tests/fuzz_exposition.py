"""Mutations of an engine's Prometheus exposition, for the fuzz suites of the adapters that
read one (tests/test_fuzz_{sglang,trtllm,triton_trtllm,tgi}_text.py): sample values replaced
by nan/inf/negative/huge/fractional text, label values mangled, timestamps appended (312
digits overflow prometheus_client's ``int / 1000``), lines dropped, duplicated or swapped,
the body truncated. ``check_adapter`` runs one adapter over one mutation: it must
raise its documented SourceError or return facts within the protocol's ranges that account
and render cleanly (fuzz_support)."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

from fuzz_support import assert_exports_cleanly, assert_facts_in_range
from hypothesis import event as _hypothesis_event
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from kvledger.collect.sources.base import SourceError
from kvledger.domain.facts import EngineFacts

VALUES = ("nan", "NaN", "+Inf", "-Inf", "-1", "-0.5", "0", "1", "1.5", "2.5", "16", "1e308", "-1e308",
          "9007199254740993", "1e20", "9" * 400, "0x10", "", "abc", "4294967297", "1073741825")
#: sample timestamps (milliseconds): far beyond a double, a float past its range, garbage
TIMESTAMPS = ("9" * 312, "-" + "9" * 312, "9" * 5000, "1e400", "1700000000000", "0", "-1", "1.5", "abc")
LABEL_VALUES = ("0", "1", "01", "-1", "1024", "9" * 5000, "\u00b2", "", "x", "None", "1.5", " 3 ", "é")
_SAMPLE = re.compile(r"^(?P<series>[a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?) (?P<value>\S+)(?P<rest>.*)$")
_LABEL = re.compile(r'(?P<name>[a-zA-Z_][a-zA-Z0-9_]*)="(?P<value>[^"]*)"')


@st.composite
def mutated(draw: st.DrawFn, captures: Mapping[str, str], prefix: str) -> str:
    """A capture with 1..4 mutations; samples whose name starts with ``prefix`` are favoured."""
    lines = captures[draw(st.sampled_from(sorted(captures)))].split("\n")
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.integers(0, 7))
        samples = [i for i, line in enumerate(lines) if not line.startswith("#") and _SAMPLE.match(line)]
        if kind <= 2 and samples:
            ours = [i for i in samples if lines[i].startswith(prefix)] or samples
            i = draw(st.sampled_from(ours))
            m = _SAMPLE.match(lines[i])
            assert m is not None
            lines[i] = f"{m['series']} {draw(st.sampled_from(VALUES))}{m['rest']}"
        elif kind == 3 and samples:
            i = draw(st.sampled_from(samples))
            labels = list(_LABEL.finditer(lines[i]))
            if labels:
                m = draw(st.sampled_from(labels))
                lines[i] = lines[i][: m.start("value")] + draw(st.sampled_from(LABEL_VALUES)) + lines[i][m.end("value"):]
        elif kind == 4 and lines:
            del lines[draw(st.integers(0, len(lines) - 1))]
        elif kind == 5 and lines:
            i = draw(st.integers(0, len(lines) - 1))
            lines.insert(draw(st.integers(0, len(lines))), lines[i])
        elif kind == 6 and samples:
            i = draw(st.sampled_from(samples))
            m = _SAMPLE.match(lines[i])
            assert m is not None
            lines[i] = f"{m['series']} {m['value']} {draw(st.sampled_from(TIMESTAMPS))}"
        else:
            text = "\n".join(lines)
            lines = text[: draw(st.integers(0, len(text)))].split("\n")
    return "\n".join(lines)


def event(value: str) -> None:
    if currently_in_test_context():
        _hypothesis_event(value)


def check_adapter(parse: Callable[[str], EngineFacts], text: str, reasons: tuple[str, ...]) -> EngineFacts | None:
    """The adapter's error (one of ``reasons``) or facts in range that account and render."""
    try:
        facts = parse(text)
    except SourceError as exc:
        assert exc.reason in reasons, exc
        event(f"rejected: {exc.reason}")
        return None
    event("accepted" if not any(p.source_violations for p in facts.pools) else "accepted with a violation")
    assert_facts_in_range(facts)
    accounts = assert_exports_cleanly(facts)
    for pool in accounts.engines[0].pools:
        for m in (pool.physical.in_use, pool.physical.free, pool.physical.reclaimable):
            assert m is None or m.exact is None or 0 <= m.exact <= pool.capacity_blocks, pool
        used = pool.engine_reported_used_blocks
        assert used is None or 0 <= used <= pool.capacity_blocks
    return facts

"""Fuzzing llama.cpp's three answers: mutations of the captures in tests/fixtures/llamacpp/
(/slots and /props JSON: values replaced by extremes and wrong types, keys dropped, slots
duplicated, bytes truncated; /metrics text: values replaced, lines dropped, duplicated or
truncated).

Each case: the parser raises SourceError (``parse``, ``schema``; the mapping ``config``)
or the facts lie within the protocol's ranges and account and render cleanly.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

from fuzz_support import EXTREMES, FUZZ, assert_exports_cleanly, assert_facts_in_range
from hypothesis import event, given
from hypothesis import strategies as st

from kvledger.collect.sources.base import SourceError
from kvledger.collect.sources.llamacpp.documents import parse_props, parse_slots
from kvledger.collect.sources.llamacpp.mapping import llamacpp_facts
from kvledger.collect.sources.llamacpp.metrics import parse_metrics
from kvledger.config.types import EngineConfig

FIXTURES = Path(__file__).parent / "fixtures" / "llamacpp"
SLOTS = {p.name: p.read_bytes() for p in sorted(FIXTURES.glob("*-slots.json"))}
PROPS = {p.name: p.read_bytes() for p in sorted(FIXTURES.glob("*-props.json"))}
METRICS = {p.name: p.read_text() for p in sorted(FIXTURES.glob("*-metrics.txt"))}
CFGS = [
    EngineConfig(name="fuzz", kind="llamacpp", url="http://127.0.0.1:8080/metrics", block_bytes=2 << 10),
    EngineConfig(name="fuzz", kind="llamacpp", url="http://127.0.0.1:8080", options=(("kv_unified", "true"),)),
]
VALUES = ("nan", "NaN", "+Inf", "-Inf", "-1", "-0.5", "0", "1", "1.5", "2.5", "1e308", "-1e308", "9007199254740993",
          "1e20", "9" * 400, "0x10", "", "abc")
_SAMPLE = re.compile(r"^(?P<series>[a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?) (?P<value>\S+)(?P<rest>.*)$")
SLOT_KEYS = ("id", "n_ctx", "is_processing", "id_task", "n_prompt_tokens", "n_prompt_tokens_processed",
             "n_prompt_tokens_cache", "next_token")


def _paths(node: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [path]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*path, i))
    return out


def _set(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    node = doc
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    return doc


def _drop(doc: Any, path: tuple[Any, ...]) -> Any:
    if not path:
        return doc
    node = doc
    for p in path[:-1]:
        node = node[p]
    del node[path[-1]]
    return doc


@st.composite
def mutated_json(draw: st.DrawFn, captures: dict[str, bytes], slots: bool) -> bytes:
    doc = json.loads(captures[draw(st.sampled_from(sorted(captures)))])
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(doc)
        kind = draw(st.integers(0, 4))
        if slots and isinstance(doc, list) and doc and kind == 0:  # a slot's known field gets an extreme
            i = draw(st.integers(0, len(doc) - 1))
            if isinstance(doc[i], dict):
                doc[i][draw(st.sampled_from(SLOT_KEYS))] = copy.deepcopy(draw(st.sampled_from(EXTREMES)))
        elif kind <= 1:  # any value replaced
            doc = _set(doc, draw(st.sampled_from(paths)), copy.deepcopy(draw(st.sampled_from(EXTREMES))))
        elif kind == 2 and len(paths) > 1:  # a key or item dropped
            doc = _drop(doc, draw(st.sampled_from(paths[1:])))
        elif kind == 3 and slots and isinstance(doc, list) and doc:  # a slot duplicated or renumbered
            item = json.loads(json.dumps(doc[draw(st.integers(0, len(doc) - 1))]))
            if isinstance(item, dict) and draw(st.booleans()):
                item["id"] = len(doc) + draw(st.integers(0, 3))
            doc.append(item)
        else:
            text = json.dumps(doc).encode()
            return text[: draw(st.integers(0, len(text)))]
    return json.dumps(doc).encode()


@st.composite
def mutated_metrics(draw: st.DrawFn) -> str:
    lines = METRICS[draw(st.sampled_from(sorted(METRICS)))].split("\n")
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.integers(0, 4))
        samples = [i for i, line in enumerate(lines) if _SAMPLE.match(line) and not line.startswith("#")]
        if kind <= 1 and samples:
            i = draw(st.sampled_from(samples))
            m = _SAMPLE.match(lines[i])
            assert m is not None
            lines[i] = f"{m['series']} {draw(st.sampled_from(VALUES))}{m['rest']}"
        elif kind == 2 and lines:
            del lines[draw(st.integers(0, len(lines) - 1))]
        elif kind == 3 and lines:
            i = draw(st.integers(0, len(lines) - 1))
            lines.insert(draw(st.integers(0, len(lines))), lines[i])
        else:
            text = "\n".join(lines)
            lines = text[: draw(st.integers(0, len(text)))].split("\n")
    return "\n".join(lines)


def _check(slots_body: bytes, props_body: bytes, metrics_text: str | None, cfg: EngineConfig) -> None:
    try:
        slots = parse_slots(slots_body)
        props = parse_props(props_body)
        metrics = None if metrics_text is None else parse_metrics(metrics_text)
        facts = llamacpp_facts(None if props.sleeping else slots, props, metrics, cfg)
    except SourceError as exc:
        assert exc.reason in ("parse", "schema", "config"), exc
        event(f"rejected: {exc.reason}")
        return
    event("accepted" if not any(p.source_violations for p in facts.pools) else "accepted with a violation")
    assert_facts_in_range(facts)
    accounts = assert_exports_cleanly(facts)
    for pool in accounts.engines[0].pools:
        used = pool.engine_reported_used_blocks
        assert used is None or 0 <= used <= pool.capacity_blocks
        for m in (pool.physical.in_use, pool.physical.reclaimable, pool.physical.free):
            assert m is None or m.exact is None or 0 <= m.exact <= pool.capacity_blocks


@FUZZ
@given(mutated_json(SLOTS, slots=True), st.sampled_from(sorted(PROPS)), st.sampled_from(sorted(METRICS)),
       st.sampled_from(CFGS))
def test_fuzz_llamacpp_slots(slots_body: bytes, props: str, metrics: str, cfg: EngineConfig) -> None:
    _check(slots_body, PROPS[props], METRICS[metrics], cfg)


@FUZZ
@given(st.sampled_from(sorted(SLOTS)), mutated_json(PROPS, slots=False), st.sampled_from(CFGS))
def test_fuzz_llamacpp_props(slots: str, props_body: bytes, cfg: EngineConfig) -> None:
    _check(SLOTS[slots], props_body, None, cfg)


@FUZZ
@given(st.sampled_from(sorted(SLOTS)), st.sampled_from(sorted(PROPS)), mutated_metrics(), st.sampled_from(CFGS))
def test_fuzz_llamacpp_metrics(slots: str, props: str, metrics_text: str, cfg: EngineConfig) -> None:
    _check(SLOTS[slots], PROPS[props], metrics_text, cfg)

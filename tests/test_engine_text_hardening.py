"""Hardening round two (issue 25), across the engine kinds and the collector:

- every exception a parser raises on engine text is a parse error of that engine, for
  every kind that reads Prometheus text (a timestamp of 312 digits overflowed
  prometheus_client's ``int / 1000``: the engine went down as ``internal``);
- a failure that repeats is logged once per change, never once per poll, and counted at
  every poll; a source that recovers says so once;
- every exported number, sums and counters included, is within 2**53 - 1: the exposition
  check refuses an engine with a larger one (``invalid``), the others stay fresh;
- the reason table (docs/metrics.md's list) holds every reason ``kvledger_source_errors_total`` can carry.
"""

from __future__ import annotations

import ast
import dataclasses
import logging
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from accounting_support import accounts_of, no_render_check
from import_graph import parse_python

from kvledger.collect.collector import Collector
from kvledger.collect.sources.base import Contribution, EngineContribution, Source, SourceError
from kvledger.collect.sources.llamacpp.metrics import parse_metrics
from kvledger.collect.sources.sglang.metrics import sglang_facts
from kvledger.collect.sources.tgi.metrics import tgi_facts
from kvledger.collect.sources.triton_trtllm.metrics import triton_trtllm_facts
from kvledger.collect.sources.trtllm.metrics import trtllm_facts
from kvledger.collect.sources.vllm.metrics import vllm_facts_from_metrics
from kvledger.config.engine_kinds import KINDS as REGISTERED
from kvledger.config.types import EngineConfig
from kvledger.domain.facts import EngineFacts, PoolFacts, Snapshot
from kvledger.domain.limits import MAX_SAFE_INT
from kvledger.output.prometheus import check_renderable, render_text

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
LOGGER = "kvledger.collect.collector"


def _cfg(kind: str, **kw: object) -> EngineConfig:
    return EngineConfig(name="e", kind=kind, url="http://127.0.0.1:1/metrics", block_bytes=1 << 20, max_model_len=8192,
                        gpus=(0,), **kw)  # type: ignore[arg-type]


#: kind -> (a capture, the adapter)
KINDS: dict[str, tuple[str, Callable[[str], object]]] = {
    "vllm": ("vllm/vllm-0.32-like.txt", lambda t: vllm_facts_from_metrics(t, _cfg("vllm"))),
    "sglang": ("sglang/sglang-kv-gauges-metrics.txt", lambda t: sglang_facts(t, _cfg("sglang"))),
    "trtllm": ("trtllm/trtllm-serve-block-gauges-metrics.txt", lambda t: trtllm_facts(t, _cfg("trtllm"))),
    "triton-trtllm": ("triton-trtllm/triton-trtllm-metrics-names-metrics.txt",
                      lambda t: triton_trtllm_facts(t, _cfg("triton-trtllm"))),
    "tgi": ("tgi/tgi-2-paged-metrics.txt", lambda t: tgi_facts(t, _cfg("tgi", options=(("block_size", "16"),)))),
    "llamacpp": ("llamacpp/llamacpp-b11434-split-busy-metrics.txt", parse_metrics),
}


def test_every_registered_kind_that_reads_an_exposition_is_here() -> None:
    """The registered kinds (config/engine_kinds.py), less ``ledger`` (kvledger/v1 JSON documents)."""
    assert sorted(KINDS) == sorted(set(REGISTERED) - {"ledger"})


# ---------------------------------------------------------------- 1. every parser error is a parse error


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_capture_parses(kind: str) -> None:
    capture, adapter = KINDS[kind]
    adapter((FIXTURES / capture).read_text())


@pytest.mark.parametrize("stamp", ["9" * 312, "-" + "9" * 312])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_timestamp_of_312_digits_is_a_parse_error_of_every_kind(kind: str, stamp: str) -> None:
    capture, adapter = KINDS[kind]
    text = (FIXTURES / capture).read_text() + f"a 1 {stamp}\n"
    with pytest.raises(SourceError) as err:
        adapter(text)
    assert err.value.reason == "parse"
    assert err.value.message.startswith(f"invalid exposition line {text.count(chr(10))}: 'a 1 {stamp[:4]}")


# ---------------------------------------------------------------- 1. logged once per change, counted each time


def _pool(in_use: int = 3) -> PoolFacts:
    return PoolFacts(id="0", block_size=16, num_blocks=10, block_bytes=100, in_use=in_use, reclaimable=0, free=10 - in_use)


class Scripted(Source):
    """A source whose next poll does what ``self.next`` says: facts, a SourceError or any exception."""

    kind = "ledger"

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self.next: BaseException | EngineFacts = self.facts()

    def facts(self, **kw: object) -> EngineFacts:
        return EngineFacts(name=self.engine, kind="ledger", source="ledger", pools=[_pool()], **kw)  # type: ignore[arg-type]

    def poll(self) -> Contribution:
        if isinstance(self.next, BaseException):
            raise self.next
        return EngineContribution(self.next)


def _records(caplog: pytest.LogCaptureFixture, engine: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER and f"source {engine}/" in r.getMessage()]


def _errors(c: Collector, engine: str) -> dict[str, int]:
    return next(h.errors for h, _ in c.health() if h.engine == engine and h.source == "ledger")


def test_a_repeated_failure_is_logged_once_and_counted_every_poll(caplog: pytest.LogCaptureFixture) -> None:
    src, good = Scripted("bad"), Scripted("good")
    c = Collector([src, good], base_engines=[EngineFacts(name=n, kind="ledger", source="ledger") for n in ("bad", "good")])
    caplog.set_level(logging.INFO, LOGGER)
    try:
        src.next = SourceError("parse", "invalid exposition line 3: 'a 1 999...' (integer division result too large)")
        for _ in range(20):
            c.poll_once()
        (down,) = _records(caplog, "bad")
        assert down.levelno == logging.WARNING and "down (parse)" in down.getMessage()
        assert _errors(c, "bad") == {"parse": 20}
        src.next = SourceError("parse", "another line")  # the message changes: one more line
        c.poll_once()
        c.poll_once()
        assert len(_records(caplog, "bad")) == 2 and _errors(c, "bad") == {"parse": 22}
        src.next = src.facts()  # recovers: one line
        c.poll_once()
        c.poll_once()
        assert [r.levelno for r in _records(caplog, "bad")] == [logging.WARNING] * 2 + [logging.INFO]
        assert "up again (was down: parse)" in _records(caplog, "bad")[-1].getMessage()
        src.next = SourceError("parse", "another line")  # down again, with the message of before: a change
        c.poll_once()
        assert len(_records(caplog, "bad")) == 4 and _errors(c, "bad") == {"parse": 23}
        assert _records(caplog, "good") == []
    finally:
        c.stop()


def test_an_unexpected_exception_logs_its_traceback_once(caplog: pytest.LogCaptureFixture) -> None:
    src = Scripted("buggy")
    c = Collector([src], base_engines=[EngineFacts(name="buggy", kind="ledger", source="ledger")])
    caplog.set_level(logging.INFO, LOGGER)
    try:
        src.next = OverflowError("integer division result too large for a float")
        for _ in range(30):  # the probe: 7,044 log lines in 2.5 minutes from two such engines
            c.poll_once()
        (down,) = _records(caplog, "buggy")
        assert down.exc_info is not None and "down (internal): OverflowError" in down.getMessage()
        assert _errors(c, "buggy") == {"internal": 30}
    finally:
        c.stop()


def test_facts_invalid_at_every_poll_are_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    src = Scripted("sum")
    c = Collector([src], base_engines=[EngineFacts(name="sum", kind="ledger", source="ledger")])
    caplog.set_level(logging.INFO, LOGGER)
    try:
        src.next = src.facts(counters={"prefix_cache_hit_tokens": 1.1e16})
        for _ in range(10):
            c.poll_once()
        (down,) = _records(caplog, "sum")
        assert "down (invalid)" in down.getMessage() and "beyond 2**53 - 1" in down.getMessage()
        assert _errors(c, "sum") == {"invalid": 10}
        src.next = src.facts()
        c.poll_once()
        assert "up again (was down: invalid)" in _records(caplog, "sum")[-1].getMessage()
    finally:
        c.stop()


# ---------------------------------------------------------------- 2. every exported number within 2**53 - 1


@pytest.mark.parametrize(
    ("what", "change"),
    [
        ("prefix-cache tokens summed over ranks", {"counters": {"prefix_cache_hit_tokens": 1.1e16}}),
        ("KV events lost after a jump to 2**63 - 1", {"kv_events_lost": 2**63 - 1}),
        ("a counter of 2**53", {"counters": {"preemptions": float(2**53)}}),
        ("KV events by type", {"kv_events": {"BlockStored": 2**53 + 1}}),
    ],
)
def test_a_number_beyond_2_53_makes_its_engine_invalid_alone(what: str, change: dict[str, object]) -> None:
    bad, good = Scripted("bad"), Scripted("good")
    bad.next = bad.facts(**change)
    c = Collector([bad, good], base_engines=[EngineFacts(name=n, kind="ledger", source="ledger") for n in ("bad", "good")])
    try:
        accounts = c.poll_once()
        health = {h.engine: h for h, _ in c.health() if h.source == "ledger"}
        assert health["bad"].reason == "invalid" and health["good"].up, what
        body = render_text(accounts).decode()
        assert 'kvledger_kv_capacity_blocks{engine="good",pool="0"} 10.0' in body
        assert 'engine="bad",pool=' not in body
        for line in body.splitlines():
            if line and not line.startswith("#"):
                assert abs(float(line.rsplit(" ", 1)[1])) <= MAX_SAFE_INT, line
    finally:
        c.stop()


def test_the_exposition_check_is_the_one_place_for_the_range() -> None:
    facts = EngineFacts(name="e", kind="ledger", source="ledger", pools=[_pool()], counters={"preemptions": float(MAX_SAFE_INT)})
    check_renderable(accounts_of(Snapshot(engines=[facts])))  # 2**53 - 1 itself is exported
    over = dataclasses.replace(facts, counters={"preemptions": float(MAX_SAFE_INT + 1)})
    with pytest.raises(ValueError, match=r"kvledger_preemptions_total\{engine=\"e\"\}: value 9007199254740992.0 is beyond"):
        check_renderable(accounts_of(Snapshot(engines=[over]), render_check=no_render_check))


# ---------------------------------------------------------------- the README lists every reason


def _reasons_in_code() -> set[str]:
    """Every reason a failure counted in kvledger_source_errors_total can carry: the first
    argument of every SourceError(...), a name resolved through the constants assigned to
    it in the same function; the collector's _mark_down(..., reason, ...) and errors[...]
    keys; the HTTP client's (reason, message) pairs."""
    found: set[str] = set()

    def constants(node: ast.AST) -> set[str]:  # "x", or "x" if ... else "y"
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return {node.value}
        if isinstance(node, ast.IfExp):
            return constants(node.body) | constants(node.orelse)
        return set()

    for path in sorted((ROOT / "exporter" / "kvledger").rglob("*.py")):
        tree = parse_python(path.read_text())
        for func in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
            assigned: dict[str, set[str]] = {}
            for n in ast.walk(func):
                if isinstance(n, ast.Assign):
                    for t in n.targets:
                        if isinstance(t, ast.Name):
                            assigned.setdefault(t.id, set()).update(constants(n.value))
            for n in ast.walk(func):
                if isinstance(n, ast.Call):
                    name = n.func.id if isinstance(n.func, ast.Name) else n.func.attr if isinstance(n.func, ast.Attribute) else ""
                    index = {"SourceError": 0, "_mark_down": 1}.get(name)
                    if index is None or len(n.args) <= index:
                        continue
                    arg = n.args[index]
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                        found.add(arg.value)
                    elif isinstance(arg, ast.Name) and arg.id in assigned:
                        found.update(assigned[arg.id])
                elif (isinstance(n, ast.Subscript) and isinstance(n.value, ast.Attribute) and n.value.attr == "errors"
                      and isinstance(n.slice, ast.Constant) and isinstance(n.slice.value, str)):
                    found.add(n.slice.value)
                elif (path.name == "http_client.py" and isinstance(n, ast.Tuple) and len(n.elts) == 2
                      and isinstance(n.elts[0], ast.Constant) and isinstance(n.elts[0].value, str)
                      and isinstance(n.elts[1], ast.JoinedStr)):
                    found.add(n.elts[0].value)
    return {r for r in found if re.fullmatch(r"[a-z_]+", r)}


def test_the_reason_table_holds_every_reason_the_code_can_give() -> None:
    """kvledger.output.catalog.REASONS (docs/metrics.md is generated from it) holds every reason
    the code gives, and no reason the code no longer gives."""
    from kvledger.output.catalog import REASONS

    reasons = _reasons_in_code()
    assert {"connect", "timeout", "too_large", "parse", "missing", "invalid", "internal", "unavailable"} <= reasons
    assert sorted(reasons - set(REASONS)) == [], "reasons missing from kvledger.output.catalog.REASONS"
    assert sorted(set(REASONS) - reasons) == [], "REASONS lists a reason the code no longer gives"

"""Fuzzing the sglang adapter: mutations of the fixtures in tests/fixtures/sglang/ (SGLang's /metrics)
through tests/fuzz_exposition.py. Each case raises SourceError ("parse", "missing") or gives facts in
range that account and render cleanly beside a healthy engine."""

from __future__ import annotations

from pathlib import Path

from fuzz_exposition import check_adapter, mutated
from fuzz_support import FUZZ
from hypothesis import given

from kvledger.collect.sources.sglang.metrics import sglang_facts
from kvledger.config.types import EngineConfig

CAPTURES = {p.name: p.read_text() for p in sorted((Path(__file__).parent / "fixtures" / "sglang").glob("*.txt"))}
CFG = EngineConfig(name="fuzz", kind="sglang", url="http://127.0.0.1:30000/metrics", block_bytes=2 << 20, max_model_len=8192, gpus=(0,))


@FUZZ
@given(mutated(CAPTURES, "sglang:"))
def test_fuzz_sglang_metrics(text: str) -> None:
    check_adapter(lambda text: sglang_facts(text, CFG), text, ("parse", "missing"))


def test_every_capture_is_accepted_or_refused_as_documented() -> None:
    for text in CAPTURES.values():
        check_adapter(lambda text: sglang_facts(text, CFG), text, ("parse", "missing"))

"""Fuzzing the trtllm adapter: mutations of the fixtures in tests/fixtures/trtllm/ (trtllm-serve's /prometheus/metrics)
through tests/fuzz_exposition.py. Each case raises SourceError ("parse", "missing") or gives facts in
range that account and render cleanly beside a healthy engine."""

from __future__ import annotations

from pathlib import Path

from fuzz_exposition import check_adapter, mutated
from fuzz_support import FUZZ
from hypothesis import given

from kvledger.collect.sources.trtllm.metrics import trtllm_facts
from kvledger.config.types import EngineConfig

CAPTURES = {p.name: p.read_text() for p in sorted((Path(__file__).parent / "fixtures" / "trtllm").glob("*.txt"))}
CFG = EngineConfig(name="fuzz", kind="trtllm", url="http://127.0.0.1:8000/prometheus/metrics", block_bytes=1 << 20, max_model_len=8192, gpus=(0,))


@FUZZ
@given(mutated(CAPTURES, "trtllm_kv_cache"))
def test_fuzz_trtllm_metrics(text: str) -> None:
    check_adapter(lambda text: trtllm_facts(text, CFG), text, ("parse", "missing"))


def test_every_capture_is_accepted_or_refused_as_documented() -> None:
    for text in CAPTURES.values():
        check_adapter(lambda text: trtllm_facts(text, CFG), text, ("parse", "missing"))

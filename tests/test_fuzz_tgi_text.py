"""Fuzzing the tgi adapter: mutations of the fixtures in tests/fixtures/tgi/ (TGI's /metrics)
through tests/fuzz_exposition.py. Each case raises SourceError ("parse", "missing", "config") or gives facts in
range that account and render cleanly beside a healthy engine."""

from __future__ import annotations

from pathlib import Path

from fuzz_exposition import check_adapter, mutated
from fuzz_support import FUZZ
from hypothesis import given

from kvledger.collect.sources.tgi.metrics import tgi_facts
from kvledger.config.types import EngineConfig

CAPTURES = {p.name: p.read_text() for p in sorted((Path(__file__).parent / "fixtures" / "tgi").glob("*.txt"))}
CFG = EngineConfig(name="fuzz", kind="tgi", url="http://127.0.0.1:3000/metrics", options=(("block_size", "16"),), block_bytes=1 << 20, max_model_len=8192, gpus=(0,))


@FUZZ
@given(mutated(CAPTURES, "tgi_batch"))
def test_fuzz_tgi_metrics(text: str) -> None:
    check_adapter(lambda text: tgi_facts(text, CFG), text, ("parse", "missing", "config"))


def test_every_capture_is_accepted_or_refused_as_documented() -> None:
    for text in CAPTURES.values():
        check_adapter(lambda text: tgi_facts(text, CFG), text, ("parse", "missing", "config"))

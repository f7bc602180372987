"""The golden files of the engine adapters (tests/fixtures/<kind>/golden/<capture>.json):
the facts parsed from each fixture, written under ``KVLEDGER_REGEN=1`` and otherwise
compared exactly. Regenerate every adapter's goldens with one command (read the diff):

    KVLEDGER_REGEN=1 .venv/bin/python -m pytest -q tests/test_sglang_metrics.py \\
        tests/test_trtllm_metrics.py tests/test_triton_trtllm_metrics.py tests/test_tgi_metrics.py
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from kvledger.domain.facts import EngineFacts

REGEN = os.environ.get("KVLEDGER_REGEN") == "1"
FIXTURES = Path(__file__).parent / "fixtures"


def check_golden(facts: EngineFacts, path: Path) -> None:
    got = json.loads(json.dumps(dataclasses.asdict(facts), sort_keys=True))
    if REGEN:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(got, indent=2, sort_keys=True) + "\n")
    assert path.exists(), f"{path} is missing: regenerate with KVLEDGER_REGEN=1 (see tests/engine_golden.py)"
    assert got == json.loads(path.read_text())

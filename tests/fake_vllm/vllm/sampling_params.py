from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class SamplingParams:
    max_tokens: int | None = 16
    n: int = 1
    extra_args: dict[str, Any] | None = None

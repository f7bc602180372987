"""Validated reads of sample values from an engine's Prometheus exposition, shared by the
adapters that read one (SGLang, TensorRT-LLM, Triton, TGI).

Every value an adapter uses passes one of these checks (the ranges of ``kvledger.domain.limits``);
a value that fails raises ``SourceError("parse")`` naming the series with its labels, its
value and what is wrong, so a poisoned exposition fails its own source alone with a
message an operator can act on. Impossible-but-well-formed readings (a count above
capacity) are not parse errors: the adapters leave the dependent fact unknown and record
the violated check in ``PoolFacts.source_violations``.
"""

from __future__ import annotations

import math

from kvledger.collect.sources.base import SourceError
from kvledger.collect.sources.model_config import load_model_config
from kvledger.collect.sources.prom_text import Sample
from kvledger.config.types import EngineConfig
from kvledger.domain.block_bytes import ModelConfigError, kv_shape
from kvledger.domain.limits import MAX_SAFE_INT

#: longest series text quoted in a message
_SERIES = 160


def series_text(name: str, sample: Sample) -> str:
    """``name{label="value",...}``, labels sorted, cut to a bounded length (each name and value
    is cut before the text is joined: a 16 MiB label value is never copied whole)."""
    labels = ",".join(f'{k[:_SERIES]}="{v[:_SERIES]}"' for k, v in sorted(sample.labels.items()))
    text = f"{name}{{{labels}}}"
    return text if len(text) <= _SERIES else text[: _SERIES - 3] + "..."


def _fail(name: str, sample: Sample, problem: str) -> SourceError:
    return SourceError("parse", f"{series_text(name, sample)}: value {sample.value!r} {problem}")


def number(name: str, sample: Sample) -> float:
    """A finite, non-negative number of at most 2**53 - 1 (a counter, bytes, a gauge)."""
    v = sample.value
    if not math.isfinite(v):
        raise _fail(name, sample, "is not finite")
    if v < 0:
        raise _fail(name, sample, "is negative")
    if v > MAX_SAFE_INT:
        raise _fail(name, sample, f"exceeds {MAX_SAFE_INT}")
    return v


def count(name: str, sample: Sample, what: str = "count", minimum: int = 0, maximum: int = MAX_SAFE_INT) -> int:
    """A whole number in [minimum, maximum] (blocks, tokens, requests); ``what`` names the unit."""
    v = number(name, sample)
    if not v.is_integer():
        raise _fail(name, sample, f"is not a whole {what}")
    if not minimum <= v <= maximum:
        raise _fail(name, sample, f"is not a {what} in [{minimum}, {maximum}]")
    return int(v)


def ratio(name: str, sample: Sample) -> float:
    """A finite number (a usage ratio); its range is the caller's check (a violation, not a parse error)."""
    v = sample.value
    if not math.isfinite(v):
        raise _fail(name, sample, "is not finite")
    return v


def small_int_label(name: str, sample: Sample, label: str, maximum: int) -> int:
    """A label holding a small canonical decimal (a rank, a version): 0 .. maximum.
    ``int()`` is never applied to 5,000 digits or to a digit-like '²'."""
    text = sample.labels.get(label, "0")
    if text.isascii() and text.isdigit() and len(text) <= len(str(maximum)) and str(int(text)) == text:
        value = int(text)
        if value <= maximum:
            return value
    quoted = repr(text) if len(text) <= 40 else repr(text[:37]) + "..."
    raise SourceError("parse", f"{series_text(name, sample)}: label {label}={quoted} is not a number in 0..{maximum}")


def configured_block_bytes(cfg: EngineConfig, block_size: int, blocks: int) -> int | None:
    """Bytes of one block over all layers and TP ranks, from the configuration: ``block_bytes``,
    else derived from ``model: {config, kv_dtype, tensor_parallel}`` for ``block_size`` tokens;
    None when neither is configured (these engines do not export it). The capacity in bytes
    must stay exact in a float (at most 2**53 - 1): SourceError("config") otherwise."""
    if cfg.block_bytes is not None:
        value = cfg.block_bytes
    elif cfg.model is not None:
        try:
            shape = kv_shape(load_model_config(cfg.model.config), cfg.model.kv_dtype)
        except ModelConfigError as exc:
            raise SourceError("config", f"engine {cfg.name!r}: model.config: {exc}") from None
        value = shape.block_bytes(block_size, cfg.model.tensor_parallel)
    else:
        return None
    if not 1 <= value <= MAX_SAFE_INT // max(1, blocks):
        raise SourceError("config", f"engine {cfg.name!r}: {value} bytes per block x {blocks} blocks is not a "
                                    f"capacity in [1, {MAX_SAFE_INT}] bytes")
    return value

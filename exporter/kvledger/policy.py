"""Accounting policy (DESIGN §2).

TEMPORARY copy on the ``ledger`` branch holding only ``reservation_blocks``; the lead's
policy.py replaces this file at merge (same signature).
"""

from __future__ import annotations


def reservation_blocks(
    prompt_tokens: int,
    max_output_tokens: int,
    block_size: int,
    *,
    max_model_len: int | None,
    contexts: int = 1,
    speculative_slots: int = 0,
    sliding_window: int | None = None,
) -> int:
    """Upper reservation R(r) in blocks of one request (DESIGN §2)."""
    tokens = prompt_tokens + max_output_tokens + speculative_slots
    if max_model_len is not None:
        tokens = min(tokens, max_model_len)
    total = -(-tokens // block_size)
    full_prompt = prompt_tokens // block_size
    reservation = total + (contexts - 1) * max(0, total - full_prompt)
    if sliding_window is not None:
        reservation = min(reservation, contexts * (-(-sliding_window // block_size) + 1))
    return reservation

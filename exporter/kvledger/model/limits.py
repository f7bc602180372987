"""The numeric ranges every input boundary enforces (protocol, vLLM text, KV events, config).

Every number that enters the exporter is checked against these bounds where it is parsed,
so the accounting step (policy.py, numpy int64 columns) can neither overflow nor divide
by zero, and every exported value is finite and exact in a float (a double carries every
integer up to 2**53 exactly):

=========================  ==================  ==============================================
quantity                   range               why
=========================  ==================  ==============================================
counts, bytes, ids         0 .. 2**53 - 1      exact in a float (``MAX_SAFE_INT``)
numbers (counters, limits) finite, 0 .. 2**53 - 1   no NaN/Infinity; exact integral part
token counts and budgets   0 .. 2**30          ``MAX_TOKENS``: P + O + k stays small
block_size                 1 .. 2**30          a divisor and a size
max_model_len, window      1 .. 2**30          divisors (``ceil(L / B)``) and sizes
num_blocks                 1 .. 2**32          ``MAX_BLOCKS``; a pool holds at least one block
block_bytes                1 .. 2**53 - 1      a size
contexts (n)               1 .. 1024           ``MAX_CONTEXTS``: R(r) <= n x T stays < 2**42
layer_groups               1 .. 1024           a divisor
block ref counts           0 .. 2**30          their sum over 2**32 blocks stays < 2**63
requests per document      0 .. 2**20          ``MAX_REQUESTS``: sum of R(r) stays < 2**62
num_blocks x block_bytes   <= 2**53 - 1        capacity bytes exact in a float
num_blocks x block_size    <= 2**53 - 1        token capacity exact in a float
=========================  ==================  ==============================================

With these bounds R(r) <= 1024 x 3 x 2**30 < 2**42 per request and the sum over 2**20
requests < 2**62 fits numpy's int64 columns; capacity in bytes and in tokens is exact.
"""

from __future__ import annotations

import math

MAX_SAFE_INT = 2**53 - 1
MAX_TOKENS = 2**30
MAX_BLOCKS = 2**32
MAX_CONTEXTS = 1024
MAX_LAYER_GROUPS = 1024
MAX_REF_COUNT = 2**30
MAX_REQUESTS = 2**20


def is_safe_number(value: float) -> bool:
    """Finite and within [0, MAX_SAFE_INT] (NaN compares false: rejected)."""
    return math.isfinite(value) and 0 <= value <= MAX_SAFE_INT

#: the integer fields of a request (kvledger/v1 ``requests[]`` and ``request_columns``):
#: name -> (minimum, maximum); ``prompt_tokens`` and ``max_output_tokens`` are required
REQUEST_INT_RANGES: dict[str, tuple[int, int]] = {
    "prompt_tokens": (0, MAX_TOKENS),
    "max_output_tokens": (0, MAX_TOKENS),
    "generated_tokens": (0, MAX_TOKENS),
    "computed_tokens": (0, MAX_TOKENS),
    "contexts": (1, MAX_CONTEXTS),
    "speculative_slots": (0, MAX_TOKENS),
    "blocks_held": (0, MAX_BLOCKS),
}

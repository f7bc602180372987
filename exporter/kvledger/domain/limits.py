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
KV-cache groups of a pool  0 .. 64             ``MAX_KV_GROUPS``; R(r) summed over groups is
                                               held below ``MAX_RESERVATION`` (2**42)
block ref counts           0 .. 2**30          their sum over 2**32 blocks stays < 2**63
requests per document      0 .. 2**20          ``MAX_REQUESTS``: sum of R(r) stays < 2**62
num_blocks x block_bytes   <= 2**53 - 1        capacity bytes exact in a float
num_blocks x block_size    <= 2**53 - 1        token capacity exact in a float
=========================  ==================  ==============================================

With these bounds R(r) <= 1024 x 3 x 2**30 < 2**42 per request and the sum over 2**20
requests < 2**62 fits numpy's int64 columns; capacity in bytes and in tokens is exact.

Sums are not bounded here: a sum over ranks, API servers or series of values each within
range can pass 2**53 - 1. Every exported number is held to that range at one place, the
exposition check (``output.prometheus.check_renderable``): an engine with a larger one
is invalid (its source down, reason ``invalid``), never exported rounded.

Two more bounds on what an engine sends:

- ``RATIO_TOLERANCE``: a block count derived from a ratio (vLLM's KV usage x usable
  blocks) is exact only when it lies within ``RATIO_TOLERANCE x blocks`` of a whole
  number. vLLM computes the ratio as ``1 - free / usable`` in doubles and prints it with
  every digit, so ``usage x usable`` is off a whole number by a few units in the last
  place of 1 times ``usable`` (under 2**-50 x usable); 2**-40 x usable (under 0.004 of a
  block at 2**32 blocks) is far above that and far below any real fraction of a block.
- ``MAX_TEXT_LINES``: the most lines of Prometheus text read from one answer; a longer
  one is refused while it streams in (reason ``too_large``), before any of it is parsed:
  the parser used before (prometheus_client's) read about 30,000 to 50,000 lines a second,
  so a body of 100,000 series outlasted a poll's deadline at every poll; kvledger's own
  (``prom_text``, about 4x faster) also stops at the deadline.
- ``MAX_DOCUMENT_AGE``: a kvledger/v1 document whose ``published_at`` is older than this
  (seconds, against the server's ``Date``) while it shows running requests is not exact:
  a running request moves at every engine step, so a writer that publishes nothing for
  that long has stopped (a hung scheduling loop whose document server thread still
  answers). The vLLM integration publishes at least once a second while it runs requests;
  30 s leaves room for long steps and a loaded machine.
"""

from __future__ import annotations

# the ranges of the wire's numbers are the engine-side library's (writers check against them too)
from kvledger_engine.wire_terms import MAX_BLOCKS as MAX_BLOCKS
from kvledger_engine.wire_terms import MAX_CONTEXTS as MAX_CONTEXTS
from kvledger_engine.wire_terms import MAX_SAFE_INT as MAX_SAFE_INT
from kvledger_engine.wire_terms import MAX_TOKENS as MAX_TOKENS
from kvledger_engine.wire_terms import REQUEST_INT_RANGES as REQUEST_INT_RANGES

MAX_LAYER_GROUPS = 1024
#: KV-cache groups one pool states (vLLM's hybrid models have a handful)
MAX_KV_GROUPS = 64
#: the largest R(r) a pool with KV-cache groups may give one request (each group's is below
#: it already); a request above it makes the pool's reservations unknown (invariant
#: ``reservation_in_range``), so that a sum over MAX_REQUESTS requests stays below 2**62
MAX_RESERVATION = 2**42
#: characters of a KV-cache group id (a label value)
MAX_GROUP_ID = 64
MAX_REF_COUNT = 2**30
MAX_REQUESTS = 2**20


#: a count from a ratio is exact within this fraction of the blocks it counts (module doc)
RATIO_TOLERANCE = 2.0**-40
#: lines of Prometheus text read from one answer before it is refused (module doc)
MAX_TEXT_LINES = 50_000
#: seconds a document showing running requests may go unpublished and still be exact (module doc)
MAX_DOCUMENT_AGE = 30.0

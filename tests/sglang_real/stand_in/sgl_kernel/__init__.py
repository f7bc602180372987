"""A test-only stand-in for SGLang's ``sgl_kernel`` on a CPU without AMX (never shipped).

Checked against **SGLang 0.5.23** (the pin of ``tests/sglang_real/setup_env.sh``); another
SGLang version may import or call other ops, and then fails loudly here rather than silently.

Why it exists: PyPI's ``sgl-kernel``/``sglang-kernel`` wheels are GPU builds that cannot import on
a CPU machine, and the CPU build exists only as source in SGLang's repository. With
``SGLANG_USE_CPU_ENGINE=1`` SGLang modules import CPU ops from ``sgl_kernel`` at import time
(``sglang.srt.mem_cache.allocation``: ``assign_req_to_token_pool_cpu``;
``sglang.kernels.ops.kvcache.cache_move``: ``copy_all_layer_kv_cache_cpu``; the speculative
decoding modules ``sglang.kernels.ops.speculative.*``: ``build_tree_kernel_efficient_cpu``,
``verify_tree_greedy_cpu``, ``assign_draft_cache_locs_contiguous_cpu``,
``assign_extend_cache_locs_cpu``, ``fill_accept_out_cache_loc_cpu``, ``fill_bonus_tokens_cpu``). On a CPU without
AMX every layer of a dense model runs SGLang's plain PyTorch code, and the only op it calls is
``assign_req_to_token_pool_cpu``. The test harness (``tests/sglang_real/server.py``) puts this
folder first on the server's PYTHONPATH.

The contract:

- ``assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset,
  out_cache_loc, pool_len)``: for each request ``i`` in order, the next
  ``end_offset[i] - start_offset[i]`` entries of ``out_cache_loc`` are written into
  ``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]`` (in place; ``pool_len``
  is the row length of ``req_to_token`` and bounds every slice). Implemented in torch.
- every other op imported at import time (``copy_all_layer_kv_cache_cpu``: KV moved between
  pools, e.g. HiCache; the speculative-decoding ops) imports but raises ``NotImplementedError``
  naming the op when called: a model or feature that needs more than the stand-in fails at once instead of computing
  garbage. Any other name is absent (``ImportError``), so SGLang's own fallbacks stay in force.
- No ``torch.ops.sgl_kernel`` operator is registered: SGLang probes
  ``torch.ops.sgl_kernel.convert_weight_packed`` before choosing its AMX path, and that path must
  stay off.
"""

from __future__ import annotations

from typing import Any, NoReturn

#: the SGLang release this stand-in was checked against
SGLANG_VERSION = "0.5.23"


def assign_req_to_token_pool_cpu(
    req_pool_indices: Any,
    req_to_token: Any,
    start_offset: Any,
    end_offset: Any,
    out_cache_loc: Any,
    pool_len: int,
) -> None:
    """Write each request's slice of ``out_cache_loc`` into its row of ``req_to_token``."""
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    at = 0
    for row, start, end in zip(rows, starts, ends, strict=False):
        n = int(end) - int(start)
        if n <= 0:
            continue
        if int(end) > int(pool_len):
            raise ValueError(f"assign_req_to_token_pool_cpu: end {end} beyond the row length {pool_len}")
        req_to_token[int(row), int(start) : int(end)] = out_cache_loc[at : at + n].to(req_to_token.dtype)
        at += n


def _missing(name: str) -> Any:
    def op(*args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(
            f"sgl_kernel.{name}: not provided by kvledger's test-only stand-in "
            f"(tests/sglang_real/sgl_kernel, checked against SGLang {SGLANG_VERSION})"
        )

    op.__name__ = name
    return op


copy_all_layer_kv_cache_cpu = _missing("copy_all_layer_kv_cache_cpu")

build_tree_kernel_efficient_cpu = _missing("build_tree_kernel_efficient_cpu")
verify_tree_greedy_cpu = _missing("verify_tree_greedy_cpu")
assign_draft_cache_locs_contiguous_cpu = _missing("assign_draft_cache_locs_contiguous_cpu")
assign_extend_cache_locs_cpu = _missing("assign_extend_cache_locs_cpu")
fill_accept_out_cache_loc_cpu = _missing("fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = _missing("fill_bonus_tokens_cpu")

"""A model's weights counted from the shapes of its ``config.json`` (``count_weights``), per
component and per GPU with vLLM's tensor-parallel sharding."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvledger.domain.block_bytes import DTYPE_BYTES, ModelConfigError, config_int
from kvledger.tools.plan.layers import LINEAR_ATTENTION, LINEAR_INTERVAL_MODELS, text_config


@dataclass(frozen=True, slots=True)
class WeightPart:
    """One component of the weights: its name, parameters, bytes over all ranks and on one GPU."""

    name: str
    params: int
    bytes: int
    bytes_per_gpu: int


@dataclass(frozen=True, slots=True)
class WeightCount:
    parts: tuple[WeightPart, ...]
    dtype: str  # what the unquantized tensors are stored in
    quantization: str | None  # e.g. "fp8 (block 128x128)"

    @property
    def params(self) -> int:
        return sum(p.params for p in self.parts)

    @property
    def bytes(self) -> int:
        return sum(p.bytes for p in self.parts)

    @property
    def bytes_per_gpu(self) -> int:
        return sum(p.bytes_per_gpu for p in self.parts)


class _Weights:
    """Accumulates matrices and vectors by component with the TP sharding vLLM applies."""

    def __init__(self, dtype_bytes: int, tp: int, fp8_block: tuple[int, int] | None, fp8: bool) -> None:
        self.dtype_bytes = dtype_bytes
        self.tp = tp
        self.fp8 = fp8
        self.fp8_block = fp8_block
        self.parts: dict[str, list[int]] = {}  # name -> [params, bytes, bytes_per_gpu]

    def _add(self, part: str, params: int, nbytes: int, per_gpu: int) -> None:
        acc = self.parts.setdefault(part, [0, 0, 0])
        acc[0] += params
        acc[1] += nbytes
        acc[2] += per_gpu

    def vector(self, part: str, n: int, count: int = 1, dtype_bytes: int | None = None) -> None:
        """Replicated on every rank (norms, biases of row-parallel layers, router bias)."""
        b = (dtype_bytes or self.dtype_bytes) * n * count
        self._add(part, n * count, b, b)

    def matrix(self, part: str, rows: int, cols: int, count: int = 1, *, shard: bool = True,
               quantized: bool = True, shard_rows: int | None = None) -> None:
        """``count`` matrices of ``rows`` (output) x ``cols`` (input). Sharded: split over TP
        ranks (``shard_rows``: the output rows one rank holds when not rows / tp, e.g. KV
        heads replicated when there are fewer than ranks); quantized: fp8 when the checkpoint is."""
        params = rows * cols * count
        if self.fp8 and quantized:
            elem = 1
            scales = self._scales(rows, cols) * count
        else:
            elem, scales = self.dtype_bytes, 0
        nbytes = params * elem + scales
        if not shard:
            per_gpu = nbytes
        elif shard_rows is not None:
            per_gpu = shard_rows * cols * count * elem + (scales * shard_rows) // rows
        else:
            per_gpu = -(-nbytes // self.tp)
        self._add(part, params, nbytes, per_gpu)

    def _scales(self, rows: int, cols: int) -> int:
        """fp32 scales: one per weight block (block quantization) or one per tensor."""
        if self.fp8_block is None:
            return 4
        bo, bi = self.fp8_block
        return -(-rows // bo) * -(-cols // bi) * 4


def _quantization(cfg: Mapping[str, Any]) -> tuple[bool, tuple[int, int] | None, str | None]:
    q = cfg.get("quantization_config")
    if q is None:
        return False, None, None
    if not isinstance(q, Mapping):
        raise ModelConfigError("model config key 'quantization_config': expected an object")
    method = q.get("quant_method")
    if method != "fp8":
        raise ModelConfigError(
            f"model config key 'quantization_config.quant_method': {method!r} weights are not counted "
            "(fp8 is); give the weights' size instead (--weights SIZE:SOURCE)"
        )
    block = q.get("weight_block_size")
    if block is None:
        return True, None, "fp8 (per-tensor scales)"
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in block)):
        raise ModelConfigError(f"model config key 'quantization_config.weight_block_size': expected [rows, cols], got {block!r}")
    return True, (block[0], block[1]), f"fp8 (block {block[0]}x{block[1]})"


#: model types whose class default ties the output head to the embedding
_TIED_BY_DEFAULT = frozenset(("gemma", "gemma2", "gemma3", "gemma3_text"))
#: model types whose attention q/k/v projections carry biases whatever attention_bias says
_QKV_BIAS = frozenset(("qwen2", "qwen2_moe"))
#: model types with a norm before and after both the attention and the MLP (4 per layer)
_SANDWICH_NORMS = frozenset(("gemma2", "gemma3", "gemma3_text"))
#: model types with RMS norms on q and k (head_dim each)
_QK_NORM = frozenset(("gemma3", "gemma3_text", "qwen3", "qwen3_moe"))


def count_weights(cfg: Mapping[str, Any], tensor_parallel: int = 1, dtype: str = "auto") -> WeightCount:
    """The weights' bytes counted from the config's shapes and dtype: embedding, attention
    (MHA/GQA/MQA or MLA), MLP or MoE experts (routed, shared, router), norms and the output
    head unless tied. Per GPU with vLLM's tensor-parallel sharding: embedding, head, heads and
    MLP/expert widths split over the ranks; norms, routers and MLA's down-projections
    replicated; KV heads replicated when fewer than the ranks. Decoder layers only: a
    multi-token-prediction module (``num_nextn_predict_layers``) is not loaded for serving
    unless it drafts speculative tokens, and is not counted."""
    if cfg.get("vision_config") is not None or cfg.get("audio_config") is not None:
        raise ModelConfigError(
            "model config has a vision_config or audio_config: those encoders' weights are not counted; "
            "give the weights' size instead (--weights SIZE:SOURCE)"
        )
    cfg = text_config(cfg)
    model_type = str(cfg.get("model_type", ""))
    types = cfg.get("layer_types")
    if model_type in LINEAR_INTERVAL_MODELS or (isinstance(types, list) and LINEAR_ATTENTION in types):
        raise ModelConfigError(
            "model config has linear_attention layers: their weights are not counted; "
            "give the weights' size instead (--weights SIZE:SOURCE)"
        )
    tp = tensor_parallel
    fp8, fp8_block, quant = _quantization(cfg)
    name = dtype.lower()
    if name == "auto":
        name = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").lower().removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ModelConfigError(f"unknown weights dtype {name!r} (expected auto, bfloat16, float16 or float32)")
    w = _Weights(DTYPE_BYTES[name], tp, fp8_block, fp8)

    def need(key: str) -> int:
        value = config_int(cfg, key)
        if value is None:
            raise ModelConfigError(f"model config lacks {key!r} (needed to count the weights)")
        return value

    layers, hidden, vocab, heads = need("num_hidden_layers"), need("hidden_size"), need("vocab_size"), need("num_attention_heads")
    kv_heads = config_int(cfg, "num_key_value_heads") or heads
    head_dim = config_int(cfg, "head_dim") or hidden // heads
    w.matrix("embedding", vocab, hidden, quantized=False)
    tied = cfg.get("tie_word_embeddings")
    if tied is None:
        tied = model_type in _TIED_BY_DEFAULT
    if not tied:
        w.matrix("lm_head", vocab, hidden, quantized=False)
    w.vector("norms", hidden)  # the final norm

    # attention
    if cfg.get("kv_lora_rank") is not None:
        kv_rank, rope = need("kv_lora_rank"), need("qk_rope_head_dim")
        nope, v_dim = need("qk_nope_head_dim"), need("v_head_dim")
        q_rank = config_int(cfg, "q_lora_rank")
        if q_rank is None:
            w.matrix("attention", heads * (nope + rope), hidden, layers)
        else:
            w.matrix("attention", q_rank, hidden, layers, shard=False)  # q_a_proj (replicated)
            w.vector("norms", q_rank, layers)  # q_a_layernorm
            w.matrix("attention", heads * (nope + rope), q_rank, layers)  # q_b_proj
        w.matrix("attention", kv_rank + rope, hidden, layers, shard=False)  # kv_a_proj_with_mqa (replicated)
        w.vector("norms", kv_rank, layers)  # kv_a_layernorm
        w.matrix("attention", heads * (nope + v_dim), kv_rank, layers)  # kv_b_proj
        w.matrix("attention", hidden, heads * v_dim, layers)  # o_proj
    else:
        kv_rows_per_gpu = max(1, kv_heads // tp) * head_dim
        w.matrix("attention", heads * head_dim, hidden, layers)  # q_proj
        w.matrix("attention", kv_heads * head_dim, hidden, 2 * layers, shard_rows=kv_rows_per_gpu)  # k_proj, v_proj
        w.matrix("attention", hidden, heads * head_dim, layers)  # o_proj
        if cfg.get("attention_bias") or model_type in _QKV_BIAS:
            b = w.dtype_bytes
            w._add("attention", (heads + 2 * kv_heads) * head_dim * layers,
                   (heads + 2 * kv_heads) * head_dim * layers * b,
                   (heads // tp + 2 * max(1, kv_heads // tp)) * head_dim * layers * b)
            if cfg.get("attention_bias"):
                w.vector("attention", hidden, layers)  # o_proj bias (row-parallel: replicated)
        if model_type in _QK_NORM:
            w.vector("norms", head_dim, 2 * layers)
    w.vector("norms", hidden, (4 if model_type in _SANDWICH_NORMS else 2) * layers)

    # MLP / MoE
    experts = config_int(cfg, "n_routed_experts") or config_int(cfg, "num_local_experts") or config_int(cfg, "num_experts")
    intermediate = need("intermediate_size")
    if experts is None:
        w.matrix("mlp", intermediate, hidden, 3 * layers)  # gate, up, down
    else:
        dense_layers = config_int(cfg, "first_k_dense_replace") or 0
        if dense_layers > layers:
            raise ModelConfigError(f"model config key 'first_k_dense_replace': {dense_layers} exceeds the {layers} layers")
        moe_layers = layers - dense_layers
        expert_width = config_int(cfg, "moe_intermediate_size") or intermediate
        if dense_layers:
            w.matrix("mlp", intermediate, hidden, 3 * dense_layers)
        w.matrix("experts", expert_width, hidden, 3 * experts * moe_layers)
        w.matrix("router", experts, hidden, moe_layers, shard=False, quantized=False)
        if cfg.get("topk_method") == "noaux_tc":
            w.vector("router", experts, moe_layers, dtype_bytes=4)  # e_score_correction_bias (fp32)
        shared = config_int(cfg, "n_shared_experts")
        shared_width = config_int(cfg, "shared_expert_intermediate_size")
        if shared:
            w.matrix("shared_experts", expert_width * shared, hidden, 3 * moe_layers)
        elif shared_width:
            w.matrix("shared_experts", shared_width, hidden, 3 * moe_layers)
            w.matrix("router", 1, hidden, moe_layers, shard=False, quantized=False)  # shared_expert_gate
    parts = tuple(WeightPart(k, *v) for k, v in w.parts.items())
    return WeightCount(parts, name, quant)

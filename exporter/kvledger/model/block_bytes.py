"""Bytes of one KV block derived from a Hugging Face ``config.json``.

Per layer and token, a GPU holds ``(1 if MLA else 2) x kv_heads_per_rank x head_size x
dtype_bytes`` bytes, with ``kv_heads_per_rank = max(1, kv_heads // tp)``; MLA models
(``kv_lora_rank`` present) store ``kv_lora_rank + qk_rope_head_dim`` values once per layer,
replicated on every TP rank. ``block_bytes`` (model.PoolFacts) is the size of one block
summed over all layers and all TP ranks of the engine.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_DTYPE_BYTES = {
    "float32": 4, "fp32": 4, "float": 4,
    "float16": 2, "fp16": 2, "half": 2,
    "bfloat16": 2, "bf16": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_inc": 1, "fp8_ds_mla": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1, "uint8": 1,
}


class ModelConfigError(ValueError):
    """The model config cannot give bytes per block; the message names the key or file."""


@dataclass(frozen=True, slots=True)
class ModelKvShape:
    layers: int
    kv_heads: int
    head_size: int
    dtype_bytes: int
    mla_width: int | None  # kv_lora_rank + qk_rope_head_dim for MLA models
    sliding_window: int | None

    def bytes_per_token_per_gpu(self, tensor_parallel: int) -> int:
        if self.mla_width is not None:
            per_layer = self.mla_width * self.dtype_bytes
        else:
            per_layer = 2 * max(1, self.kv_heads // tensor_parallel) * self.head_size * self.dtype_bytes
        return per_layer * self.layers

    def block_bytes(self, block_size: int, tensor_parallel: int = 1) -> int:
        """Bytes of one block over all layers and all TP ranks."""
        return self.bytes_per_token_per_gpu(tensor_parallel) * block_size * tensor_parallel


def load_model_config(path: str | Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ModelConfigError(f"{path}: cannot read model config: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"{path}: invalid JSON at line {exc.lineno}: {exc.msg}") from None
    if not isinstance(data, dict):
        raise ModelConfigError(f"{path}: expected a JSON object")
    return data


def _int(cfg: Mapping[str, Any], key: str) -> int | None:
    value = cfg.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelConfigError(f"model config key {key!r}: expected a positive integer, got {value!r}")
    return value


def dtype_bytes(kv_dtype: str, cfg: Mapping[str, Any]) -> int:
    """Bytes per KV element: the kv_dtype option, or the model's own dtype when "auto"."""
    name = kv_dtype.lower()
    if name == "auto":
        raw = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
        name = str(raw).lower().removeprefix("torch.")
    if name.startswith("fp8") or name.startswith("float8"):
        return 1
    if name not in _DTYPE_BYTES:
        raise ModelConfigError(f"unknown KV dtype {name!r} (expected auto, bfloat16, float16, float32 or fp8*)")
    return _DTYPE_BYTES[name]


def kv_shape(cfg: Mapping[str, Any], kv_dtype: str = "auto") -> ModelKvShape:
    """The KV-relevant shape of a model config (multimodal configs: their ``text_config``)."""
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), Mapping):
        inner = dict(cfg["text_config"])
        inner.setdefault("torch_dtype", cfg.get("torch_dtype"))
        cfg = inner
    layers = _int(cfg, "num_hidden_layers")
    if layers is None:
        raise ModelConfigError("model config lacks 'num_hidden_layers'")
    heads = _int(cfg, "num_attention_heads")
    kv_heads = _int(cfg, "num_key_value_heads") or heads
    head_size = _int(cfg, "head_dim")
    if head_size is None:
        hidden = _int(cfg, "hidden_size")
        if hidden is None or heads is None:
            raise ModelConfigError("model config lacks 'head_dim' (or 'hidden_size' and 'num_attention_heads')")
        head_size = hidden // heads
    mla_width = None
    if cfg.get("kv_lora_rank") is not None:
        rank = _int(cfg, "kv_lora_rank")
        rope = _int(cfg, "qk_rope_head_dim") or 0
        mla_width = (rank or 0) + rope
    if kv_heads is None and mla_width is None:
        raise ModelConfigError("model config lacks 'num_key_value_heads' and 'num_attention_heads'")
    return ModelKvShape(layers, kv_heads or 0, head_size, dtype_bytes(kv_dtype, cfg), mla_width, _uniform_window(cfg))


def _uniform_window(cfg: Mapping[str, Any]) -> int | None:
    """The sliding window when EVERY layer uses it; None when off or mixed with full layers.

    A window applied to the whole pool would understate reservations of hybrid models
    (interleaved sliding/full layers), so those report no window here.
    """
    window = cfg.get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return None
    if cfg.get("use_sliding_window") is False:
        return None
    layer_types = cfg.get("layer_types")
    if isinstance(layer_types, list) and any(t != "sliding_attention" for t in layer_types):
        return None
    if any(cfg.get(k) for k in ("sliding_window_pattern", "max_window_layers", "interleaved_sliding_window")):
        return None
    return window


def block_bytes_from_config(
    cfg: Mapping[str, Any], block_size: int, kv_dtype: str = "auto", tensor_parallel: int = 1
) -> int:
    return kv_shape(cfg, kv_dtype).block_bytes(block_size, tensor_parallel)


# ---------------------------------------------------------------- layer types (pools)

#: the layer types a config may name (``layer_types``): attention over every token, over a
#: sliding window, or linear attention (Gated DeltaNet: a fixed-size recurrent state per
#: sequence, which vLLM keeps in its KV-cache pool as a Mamba state)
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LINEAR_ATTENTION = "linear_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION, LINEAR_ATTENTION)


@dataclass(frozen=True, slots=True)
class LayerPool:
    """The layers of one type: a separate KV pool (or layer group) of its own.

    ``sliding_window`` is None for full attention. ``bytes_per_layer_token_per_gpu`` is one
    token of one layer on one TP rank (attention; 0 for a state layer).
    ``state_bytes_per_layer_per_gpu`` is one sequence's state of one layer on one TP rank
    (linear attention: conv state + recurrent state; None for attention). ``layer_indices``
    are the model's layers of this type, in order.
    """

    id: str
    layers: int
    sliding_window: int | None
    bytes_per_layer_token_per_gpu: int
    kind: str = FULL_ATTENTION
    state_bytes_per_layer_per_gpu: int | None = None
    layer_indices: tuple[int, ...] = ()

    @property
    def bytes_per_token_per_gpu(self) -> int:
        return self.bytes_per_layer_token_per_gpu * self.layers

    @property
    def is_state(self) -> bool:
        """A layer type whose cache is a fixed-size state per sequence, not blocks of tokens."""
        return self.state_bytes_per_layer_per_gpu is not None


def layer_types(cfg: Mapping[str, Any]) -> list[str]:
    """The type of every layer (``full_attention``, ``sliding_attention``,
    ``linear_attention``), as the config's ``layer_types`` or, when it has none, as
    transformers derives them: Qwen3-Next's ``full_attention_interval`` (every Nth layer full,
    the others linear; 4 by default), ``sliding_window_pattern`` (Gemma 3: every Nth layer is
    full, 6 by default), the alternation of Gemma 2 and gpt-oss (even layers slide), Qwen 2's
    ``max_window_layers``, or a window on every layer. gpt-oss follows vLLM's model code,
    which slides on the even layers whatever ``layer_types`` says."""
    cfg = _text_config(cfg)
    layers = _int(cfg, "num_hidden_layers")
    if layers is None:
        raise ModelConfigError("model config lacks 'num_hidden_layers'")
    window = cfg.get("sliding_window")
    if isinstance(window, bool) or (window is not None and (not isinstance(window, int) or window <= 0)):
        raise ModelConfigError(f"model config key 'sliding_window': expected a positive integer or null, got {window!r}")
    model_type = str(cfg.get("model_type", ""))
    if model_type in _ALTERNATING_ALWAYS and window is not None:
        return [SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION for i in range(layers)]
    given = cfg.get("layer_types")
    if given is not None:
        if not isinstance(given, list) or len(given) != layers:
            raise ModelConfigError(f"model config key 'layer_types': expected a list of {layers} layer types")
        for i, kind in enumerate(given):
            if kind not in LAYER_TYPES:
                raise ModelConfigError(f"model config key 'layer_types[{i}]': unknown layer type {kind!r}")
            if kind == SLIDING_ATTENTION and window is None:
                raise ModelConfigError(f"model config: layer_types[{i}] is sliding_attention but 'sliding_window' is null")
        return list(given)
    if model_type in _LINEAR_INTERVAL:
        interval = cfg.get("full_attention_interval", 4)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval <= 0:
            raise ModelConfigError(f"model config key 'full_attention_interval': expected a positive integer, got {interval!r}")
        return [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(layers)]
    if window is None or cfg.get("use_sliding_window") is False:
        return [FULL_ATTENTION] * layers
    pattern = cfg.get("sliding_window_pattern", 6 if model_type in _GEMMA3 else None)
    if pattern is not None:
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern <= 0:
            raise ModelConfigError(f"model config key 'sliding_window_pattern': expected a positive integer, got {pattern!r}")
        return [FULL_ATTENTION if (i + 1) % pattern == 0 else SLIDING_ATTENTION for i in range(layers)]
    if model_type in _ALTERNATING:
        return [SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION for i in range(layers)]
    if cfg.get("max_window_layers") is not None and cfg.get("use_sliding_window"):
        first = _int(cfg, "max_window_layers") or 0
        return [SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(layers)]
    return [SLIDING_ATTENTION] * layers


def layer_windows(cfg: Mapping[str, Any]) -> list[int | None]:
    """The attention window of every layer (None: full attention), from ``layer_types``.
    A model with linear-attention layers has no window per layer: see ``layer_pools``."""
    types = layer_types(cfg)
    if LINEAR_ATTENTION in types:
        raise ModelConfigError("model config has linear_attention layers: they keep a state, not an attention window")
    window = _text_config(cfg).get("sliding_window")
    return [window if t == SLIDING_ATTENTION else None for t in types]


#: model types whose even layers use the sliding window and odd layers full attention
_ALTERNATING = frozenset(("gemma2", "cohere2"))
#: ... whatever their layer_types say (vLLM's model code decides by the layer index)
_ALTERNATING_ALWAYS = frozenset(("gpt_oss",))
#: model types whose default sliding_window_pattern is 6 (transformers' Gemma3TextConfig)
_GEMMA3 = frozenset(("gemma3", "gemma3_text"))
#: model types whose layers are linear attention but every full_attention_interval-th
_LINEAR_INTERVAL = frozenset(("qwen3_next",))


def _text_config(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), Mapping):
        inner = dict(cfg["text_config"])
        inner.setdefault("torch_dtype", cfg.get("torch_dtype"))
        inner.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings"))
        if cfg.get("quantization_config") is not None:
            inner.setdefault("quantization_config", cfg["quantization_config"])
        return inner
    return cfg


def linear_attention_state_bytes(
    cfg: Mapping[str, Any],
    tensor_parallel: int = 1,
    *,
    conv_dtype: str = "auto",
    ssm_dtype: str = "auto",
    speculative_tokens: int = 0,
) -> int:
    """One sequence's state of one linear-attention (Gated DeltaNet) layer on one TP rank, as
    vLLM 0.32 shapes it (``MambaStateShapeCalculator.gated_delta_net_state_shape``):

        conv state      (kernel - 1 + speculative tokens) x (2 x key_heads x key_dim + value_heads x value_dim) / tp
        recurrent state value_heads / tp x value_dim x key_dim

    in ``conv_dtype`` (``--mamba-cache-dtype``; auto: the model's dtype) and ``ssm_dtype``
    (``--mamba-ssm-cache-dtype``; auto: the config's ``mamba_ssm_dtype``, else the conv dtype)."""
    cfg = _text_config(cfg)

    def need(key: str) -> int:
        value = _int(cfg, key)
        if value is None:
            raise ModelConfigError(f"model config lacks {key!r} (needed for the linear-attention state)")
        return value

    key_heads, value_heads = need("linear_num_key_heads"), need("linear_num_value_heads")
    key_dim, value_dim = need("linear_key_head_dim"), need("linear_value_head_dim")
    kernel = need("linear_conv_kernel_dim")
    conv_dim = 2 * key_heads * key_dim + value_heads * value_dim
    if conv_dim % tensor_parallel or value_heads % tensor_parallel:
        raise ModelConfigError(
            f"linear attention: {value_heads} value heads (conv width {conv_dim}) do not split over "
            f"{tensor_parallel} tensor-parallel ranks"
        )
    conv_bytes = dtype_bytes(conv_dtype, cfg)
    ssm_name = ssm_dtype
    if ssm_name.lower() == "auto":
        ssm_name = str(cfg.get("mamba_ssm_dtype") or conv_dtype)
    ssm_bytes = dtype_bytes(ssm_name, cfg)
    conv = (kernel - 1 + speculative_tokens) * conv_dim // tensor_parallel
    recurrent = value_heads // tensor_parallel * value_dim * key_dim
    return conv * conv_bytes + recurrent * ssm_bytes


def layer_pools(
    cfg: Mapping[str, Any],
    kv_dtype: str = "auto",
    tensor_parallel: int = 1,
    *,
    mamba_cache_dtype: str = "auto",
    mamba_ssm_cache_dtype: str = "auto",
    speculative_tokens: int = 0,
) -> list[LayerPool]:
    """One pool per layer type: ``full``, ``sliding-W`` and ``linear-attention`` (hybrid
    models have several); attention pools first, full before the windows."""
    types = layer_types(cfg)
    indices: dict[tuple[str, int | None], list[int]] = {}
    window = _text_config(cfg).get("sliding_window")
    for i, kind in enumerate(types):
        indices.setdefault((kind, window if kind == SLIDING_ATTENTION else None), []).append(i)
    attention_layers = sum(len(v) for (k, _w), v in indices.items() if k != LINEAR_ATTENTION)
    per_layer = 0
    if attention_layers:
        shape = kv_shape(cfg, kv_dtype)
        per_layer = shape.bytes_per_token_per_gpu(tensor_parallel) // shape.layers
    pools = []
    for (kind, w), idx in sorted(indices.items(), key=lambda item: (LAYER_TYPES.index(item[0][0]), item[0][1] or 0)):
        if kind == LINEAR_ATTENTION:
            state = linear_attention_state_bytes(cfg, tensor_parallel, conv_dtype=mamba_cache_dtype,
                                                 ssm_dtype=mamba_ssm_cache_dtype, speculative_tokens=speculative_tokens)
            pools.append(LayerPool("linear-attention", len(idx), None, 0, kind, state, tuple(idx)))
        else:
            pools.append(LayerPool("full" if w is None else f"sliding-{w}", len(idx), w, per_layer, kind, None, tuple(idx)))
    return pools


# ---------------------------------------------------------------- weights


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
    cfg = _text_config(cfg)
    model_type = str(cfg.get("model_type", ""))
    types = cfg.get("layer_types")
    if model_type in _LINEAR_INTERVAL or (isinstance(types, list) and LINEAR_ATTENTION in types):
        raise ModelConfigError(
            "model config has linear_attention layers: their weights are not counted; "
            "give the weights' size instead (--weights SIZE:SOURCE)"
        )
    tp = tensor_parallel
    fp8, fp8_block, quant = _quantization(cfg)
    name = dtype.lower()
    if name == "auto":
        name = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").lower().removeprefix("torch.")
    if name not in _DTYPE_BYTES:
        raise ModelConfigError(f"unknown weights dtype {name!r} (expected auto, bfloat16, float16 or float32)")
    w = _Weights(_DTYPE_BYTES[name], tp, fp8_block, fp8)

    def need(key: str) -> int:
        value = _int(cfg, key)
        if value is None:
            raise ModelConfigError(f"model config lacks {key!r} (needed to count the weights)")
        return value

    layers, hidden, vocab, heads = need("num_hidden_layers"), need("hidden_size"), need("vocab_size"), need("num_attention_heads")
    kv_heads = _int(cfg, "num_key_value_heads") or heads
    head_dim = _int(cfg, "head_dim") or hidden // heads
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
        q_rank = _int(cfg, "q_lora_rank")
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
    experts = _int(cfg, "n_routed_experts") or _int(cfg, "num_local_experts") or _int(cfg, "num_experts")
    intermediate = need("intermediate_size")
    if experts is None:
        w.matrix("mlp", intermediate, hidden, 3 * layers)  # gate, up, down
    else:
        dense_layers = _int(cfg, "first_k_dense_replace") or 0
        if dense_layers > layers:
            raise ModelConfigError(f"model config key 'first_k_dense_replace': {dense_layers} exceeds the {layers} layers")
        moe_layers = layers - dense_layers
        expert_width = _int(cfg, "moe_intermediate_size") or intermediate
        if dense_layers:
            w.matrix("mlp", intermediate, hidden, 3 * dense_layers)
        w.matrix("experts", expert_width, hidden, 3 * experts * moe_layers)
        w.matrix("router", experts, hidden, moe_layers, shard=False, quantized=False)
        if cfg.get("topk_method") == "noaux_tc":
            w.vector("router", experts, moe_layers, dtype_bytes=4)  # e_score_correction_bias (fp32)
        shared = _int(cfg, "n_shared_experts")
        shared_width = _int(cfg, "shared_expert_intermediate_size")
        if shared:
            w.matrix("shared_experts", expert_width * shared, hidden, 3 * moe_layers)
        elif shared_width:
            w.matrix("shared_experts", shared_width, hidden, 3 * moe_layers)
            w.matrix("router", 1, hidden, moe_layers, shard=False, quantized=False)  # shared_expert_gate
    parts = tuple(WeightPart(k, *v) for k, v in w.parts.items())
    return WeightCount(parts, name, quant)

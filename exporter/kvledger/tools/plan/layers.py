"""A model's layers by type, from its ``config.json`` (as transformers and vLLM read it): the
type of every layer (full, sliding-window or linear attention), one pool per type
(``layer_pools``) and the state of a linear-attention layer."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvledger.domain.block_bytes import ModelConfigError, config_int, dtype_bytes, kv_shape

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
    cfg = text_config(cfg)
    layers = config_int(cfg, "num_hidden_layers")
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
    if model_type in LINEAR_INTERVAL_MODELS:
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
        first = config_int(cfg, "max_window_layers") or 0
        return [SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(layers)]
    return [SLIDING_ATTENTION] * layers


#: model types whose even layers use the sliding window and odd layers full attention
_ALTERNATING = frozenset(("gemma2", "cohere2"))
#: ... whatever their layer_types say (vLLM's model code decides by the layer index)
_ALTERNATING_ALWAYS = frozenset(("gpt_oss",))
#: model types whose default sliding_window_pattern is 6 (transformers' Gemma3TextConfig)
_GEMMA3 = frozenset(("gemma3", "gemma3_text"))
#: model types whose layers are linear attention but every full_attention_interval-th
LINEAR_INTERVAL_MODELS = frozenset(("qwen3_next",))


def text_config(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
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
    cfg = text_config(cfg)

    def need(key: str) -> int:
        value = config_int(cfg, key)
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
    window = text_config(cfg).get("sliding_window")
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

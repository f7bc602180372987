"""Bytes of one KV block derived from a Hugging Face ``config.json``.

Per layer and token, a GPU holds ``(1 if MLA else 2) x kv_heads_per_rank x head_size x
dtype_bytes`` bytes, with ``kv_heads_per_rank = max(1, kv_heads // tp)``; MLA models
(``kv_lora_rank`` present) store ``kv_lora_rank + qk_rope_head_dim`` values once per layer,
replicated on every TP rank. ``block_bytes`` (model.PoolFacts) is the size of one block
summed over all layers and all TP ranks of the engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: bytes of one element by dtype name (the names vLLM's --kv-cache-dtype and configs use)
DTYPE_BYTES = {
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


def config_int(cfg: Mapping[str, Any], key: str) -> int | None:
    """The config's ``key`` as a positive integer, None when absent (anything else is an error)."""
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
    if name not in DTYPE_BYTES:
        raise ModelConfigError(f"unknown KV dtype {name!r} (expected auto, bfloat16, float16, float32 or fp8*)")
    return DTYPE_BYTES[name]


def kv_shape(cfg: Mapping[str, Any], kv_dtype: str = "auto") -> ModelKvShape:
    """The KV-relevant shape of a model config (multimodal configs: their ``text_config``)."""
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), Mapping):
        inner = dict(cfg["text_config"])
        inner.setdefault("torch_dtype", cfg.get("torch_dtype"))
        cfg = inner
    layers = config_int(cfg, "num_hidden_layers")
    if layers is None:
        raise ModelConfigError("model config lacks 'num_hidden_layers'")
    heads = config_int(cfg, "num_attention_heads")
    kv_heads = config_int(cfg, "num_key_value_heads") or heads
    head_size = config_int(cfg, "head_dim")
    if head_size is None:
        hidden = config_int(cfg, "hidden_size")
        if hidden is None or heads is None:
            raise ModelConfigError("model config lacks 'head_dim' (or 'hidden_size' and 'num_attention_heads')")
        head_size = hidden // heads
    mla_width = None
    if cfg.get("kv_lora_rank") is not None:
        rank = config_int(cfg, "kv_lora_rank")
        rope = config_int(cfg, "qk_rope_head_dim") or 0
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

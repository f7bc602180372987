"""Write a tiny random-weight Llama as GGUF, fully offline, for the real llama.cpp suite.

Run with the llama.cpp cache venv's interpreter (it needs the ``gguf`` package):

    .cache/llamacpp/venv/bin/python tests/llamacpp_real/make_tiny_model.py OUT.gguf \
        --vocab .cache/llamacpp/sdist/llama.cpp/models/ggml-vocab-llama-spm.gguf

The architecture is ``llama`` (2 layers, width 64, 4 query heads and 2 KV heads of 16
dimensions, feed-forward 128, context 4096, f32 weights, output tied to the token
embedding). llama.cpp needs a tokenizer it knows: every ``tokenizer.*`` key is copied
from the vocabulary-only GGUF that llama.cpp ships for its own tokenizer tests (the
Llama SentencePiece vocabulary, 32,000 tokens). The file is about 9 MB.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

N_LAYERS = 2
N_EMBD = 64
N_HEAD = 4
N_HEAD_KV = 2
HEAD_DIM = N_EMBD // N_HEAD
N_FF = 128
CONTEXT = 4096


def _copy_tokenizer(writer: Any, vocab_path: Path) -> int:
    """Copy every tokenizer.* key of ``vocab_path`` into ``writer``; the vocabulary size."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(vocab_path)
    n_vocab = 0
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        main = field.types[0]
        value = field.contents()
        if main == GGUFValueType.ARRAY:
            sub = field.types[-1]
            writer.add_key_value(name, list(value), main, sub_type=sub)
            if name == "tokenizer.ggml.tokens":
                n_vocab = len(value)
        else:
            writer.add_key_value(name, value, main)
    if not n_vocab:
        raise SystemExit(f"{vocab_path}: no tokenizer.ggml.tokens")
    return n_vocab


def write_model(out: Path, vocab_path: Path, seed: int) -> None:
    from gguf import GGUFWriter

    rng = np.random.default_rng(seed)

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    writer = GGUFWriter(out, "llama")
    writer.add_name("kvledger-tiny-llama")
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(N_LAYERS)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD_KV)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(0)  # all f32
    n_vocab = _copy_tokenizer(writer, vocab_path)
    writer.add_vocab_size(n_vocab)

    # numpy shapes are ggml's dimensions reversed: token_embd is {n_embd, n_vocab} in ggml
    writer.add_tensor("token_embd.weight", weight(n_vocab, N_EMBD))
    writer.add_tensor("output_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    for i in range(N_LAYERS):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.attn_q.weight", weight(N_HEAD * HEAD_DIM, N_EMBD))
        writer.add_tensor(f"blk.{i}.attn_k.weight", weight(N_HEAD_KV * HEAD_DIM, N_EMBD))
        writer.add_tensor(f"blk.{i}.attn_v.weight", weight(N_HEAD_KV * HEAD_DIM, N_EMBD))
        writer.add_tensor(f"blk.{i}.attn_output.weight", weight(N_EMBD, N_HEAD * HEAD_DIM))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", weight(N_FF, N_EMBD))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", weight(N_EMBD, N_FF))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", weight(N_FF, N_EMBD))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("out", type=Path, help="the .gguf file to write")
    parser.add_argument("--vocab", type=Path, required=True, help="a vocabulary-only GGUF (tokenizer.* keys)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    tmp = args.out.with_suffix(".tmp")
    write_model(tmp, args.vocab, args.seed)
    tmp.replace(args.out)
    print(f"tiny model written to {args.out} ({args.out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

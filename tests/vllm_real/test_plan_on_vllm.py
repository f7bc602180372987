"""`kvledger plan` against the real vLLM engine: the block count vLLM chose for the tiny model
at ``--kv-cache-memory-bytes`` equals the plan's, computed from the model's own config.json.

Reads only the session server's /metrics (``vllm:cache_config_info``: num_gpu_blocks,
block_size) and the model directory; it never restarts the server.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvledger.cli import main

from .server import BLOCK_SIZE, KV_CACHE_MEMORY_BYTES, MAX_MODEL_LEN, SERVE_FLAGS, VllmServer

pytestmark = pytest.mark.vllm


def _cache_config(metrics_text: str) -> dict[str, str]:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == "vllm:cache_config_info":
                return dict(sample.labels)
    raise AssertionError("no vllm:cache_config_info in the engine's /metrics")


def _flag(name: str) -> str:
    return SERVE_FLAGS[SERVE_FLAGS.index(name) + 1]


def test_plan_block_count_equals_the_engines(
    vllm_server: VllmServer, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    info = _cache_config(vllm_server.metrics_text())
    engine_blocks = int(info["num_gpu_blocks"])
    block_size = int(info["block_size"])
    assert block_size == BLOCK_SIZE == int(_flag("--block-size"))
    kv_bytes = int(_flag("--kv-cache-memory-bytes"))
    assert kv_bytes == KV_CACHE_MEMORY_BYTES

    code = main([
        "plan", str(tiny_model_dir / "config.json"), "--block-size", str(block_size),
        "--max-model-len", _flag("--max-model-len"), "--kv-cache-memory-bytes", str(kv_bytes), "--json",
    ])
    out = capsys.readouterr().out
    assert code == 0, out
    report = json.loads(out)
    assert report["kv"]["num_blocks"] == engine_blocks  # 128 for the session server
    # kvledger exports the engine's capacity as num_gpu_blocks - 1 (the null block)
    assert report["kv"]["usable_blocks"] == engine_blocks - 1
    assert report["kv"]["block_bytes_per_gpu"] * engine_blocks <= kv_bytes < report["kv"]["block_bytes_per_gpu"] * (engine_blocks + 1)
    # vLLM's "Maximum concurrency for 1,024 tokens per request: 4.00x" is num_gpu_blocks / ceil(L / B)
    assert report["kv"]["blocks_per_request_at_cap"] == -(-MAX_MODEL_LEN // block_size)
    # the weights counted from the model's config.json equal the checkpoint's tensors (bf16)
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    assert report["weights"]["dtype"] == str(cfg.get("torch_dtype") or cfg.get("dtype")).removeprefix("torch.")
    safetensors = tiny_model_dir / "model.safetensors"
    if safetensors.exists():
        header_len = int.from_bytes(safetensors.read_bytes()[:8], "little")
        header = json.loads(safetensors.read_bytes()[8:8 + header_len])
        tensor_bytes = sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
        assert report["weights"]["bytes"] == tensor_bytes

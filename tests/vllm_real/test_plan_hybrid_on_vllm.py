"""`kvledger plan` against a real vLLM serving hybrid models (issue 24, point 5).

vLLM 0.32's hybrid allocator keeps one block pool for every KV-cache group of a model. Two
tiny models of ``make_tiny_model.py`` are served, one at a time, each by its own server
(about a minute each, started and stopped here; the session server is left alone):

- ``--arch gemma3``: sliding window 64 on layers ``[sliding, sliding, full] x 2``: three
  groups of two layers (two sliding-window groups, one full-attention group);
- ``--arch qwen3next``: ``[linear, full] x 2``: vLLM raises the attention block size from 32 to
  544 tokens so that one attention page holds a Gated DeltaNet state, pads the state by 3.82 %,
  two groups of two layers. The server is given ``--mamba-ssm-cache-dtype float32``: vLLM's
  CPU build resets the recurrent state to float32 on CPUs with AVX512-BF16 and keeps the
  model's dtype elsewhere; giving it makes the engine's choice the same on every CPU.

Both run with ``--kv-cache-memory-bytes 4194304 --max-num-batched-tokens 512``. The plan,
computed from the model's own config.json with the same settings, must give the block count
the engine reports (``vllm:cache_config_info``'s ``num_gpu_blocks``), its block size, its
maximum concurrency and KV-cache size in tokens, the Mamba page padding it logs, and its KV-cache
group sizes. The golden file of vLLM's own arithmetic is checked current here too (no server).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvledger.cli import main
from kvledger.tools.plan import ModelPlanInput, parse_term, plan_from_model

from .server import MAX_MODEL_LEN, MODEL_SCRIPT, REPO_ROOT, VllmServer, ensure_vllm_env, free_tcp_port, vllm_python

pytestmark = pytest.mark.vllm

HERE = Path(__file__).resolve().parent
KV_CACHE_MEMORY_BYTES = 4 * 1024 * 1024
MAX_NUM_BATCHED_TOKENS = 512
BLOCK_SIZE = 32  # the session flags' --block-size


@dataclass(frozen=True)
class Hybrid:
    arch: str
    extra_args: tuple[str, ...]
    plan_options: dict[str, Any]  # ModelPlanInput fields beyond the common ones


HYBRIDS = {
    "gemma3": Hybrid("gemma3", (), {}),
    "qwen3next": Hybrid("qwen3next", ("--mamba-ssm-cache-dtype", "float32"), {"mamba_ssm_cache_dtype": "float32"}),
}


@dataclass
class Served:
    hybrid: Hybrid
    model_dir: Path
    server: VllmServer
    log_text: str


def _env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("PYTHONPATH", None)
    return env


@pytest.fixture(scope="module", params=sorted(HYBRIDS))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One server per model, stopped before the next one starts."""
    hybrid = HYBRIDS[request.param]
    ensure_vllm_env()
    model_dir = tmp_path_factory.mktemp(f"tiny-{hybrid.arch}")
    subprocess.run([str(vllm_python()), str(MODEL_SCRIPT), str(model_dir), "--arch", hybrid.arch],
                   check=True, env=_env(), capture_output=True)
    log = tmp_path_factory.mktemp(f"vllm-{hybrid.arch}-log") / "vllm.log"
    server = VllmServer(
        model_dir, free_tcp_port(), free_tcp_port(), free_tcp_port(), ledger=False, log_path=log,
        extra_args=("--kv-cache-memory-bytes", str(KV_CACHE_MEMORY_BYTES),
                    "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS), *hybrid.extra_args),
    )
    try:
        server.start()
        yield Served(hybrid, model_dir, server, log.read_text(errors="replace"))
    finally:
        server.close()


def _cache_config(metrics_text: str) -> dict[str, str]:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == "vllm:cache_config_info":
                return dict(sample.labels)
    raise AssertionError("no vllm:cache_config_info in the engine's /metrics")


def _plan(served: Served) -> dict[str, Any]:
    inp = ModelPlanInput(
        config=str(served.model_dir / "config.json"), block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, kv_cache_memory_bytes=KV_CACHE_MEMORY_BYTES,
        weights=parse_term(f"{_tensor_bytes(served.model_dir)}:measured", "--weights"),
        **served.hybrid.plan_options,
    )
    return plan_from_model(inp).to_json()


def _tensor_bytes(model_dir: Path) -> int:
    data = (model_dir / "model.safetensors").read_bytes()
    header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
    return sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")


def test_plan_blocks_equal_the_engines(served: Served, capsys: pytest.CaptureFixture[str]) -> None:
    info = _cache_config(served.server.metrics_text())
    plan = _plan(served)
    kv = plan["kv"]
    engine_blocks = int(info["num_gpu_blocks"])
    summary = (f"{served.hybrid.arch}: engine num_gpu_blocks={engine_blocks} block_size={info['block_size']} "
               f"max_concurrency={info['kv_cache_max_concurrency']} kv_cache_size_tokens={info['kv_cache_size_tokens']}; "
               f"plan num_blocks={kv['num_blocks']} block_size={kv['block_size']} "
               f"max_concurrency={kv['engine_max_concurrency']} token_capacity={kv['engine_token_capacity']}")
    assert kv["num_blocks"] == engine_blocks, (served.hybrid.arch, kv, info)  # gemma3: 256, qwen3next: 15
    assert kv["usable_blocks"] == engine_blocks - 1  # the null block
    assert kv["block_size"] == int(info["block_size"])  # qwen3next: 544, raised from 32
    assert kv["engine_max_concurrency"] == pytest.approx(float(info["kv_cache_max_concurrency"]), abs=1e-6)
    assert kv["engine_token_capacity"] == int(info["kv_cache_size_tokens"])
    # vLLM's log: "kv cache group sizes (32, 32, 32)": tokens per block of every group, in its order
    sizes = re.findall(r"kv cache group sizes \(([\d, ]+)\)", served.log_text)
    assert sizes, served.server.log_tail()
    assert [g["block_size"] for g in plan["kv_cache_groups"]] == [int(x) for x in sizes[-1].split(",")]
    if served.hybrid.arch == "gemma3":
        # g0 sliding (0, 3), g1 sliding (1, 4), g2 full (2, 5), as VLLM_CPU.md observed
        assert [(g["pool"], g["layers"]) for g in plan["kv_cache_groups"]] == [
            ("sliding-64", [0, 3]), ("sliding-64", [1, 4]), ("full", [2, 5])]
        assert engine_blocks == 256
        # the command itself, with the engine's flags (it has no option for Qwen3-Next's
        # recurrent-state dtype yet), and Gemma 3's weights counted from its config: the
        # checkpoint's tensors, byte for byte
        code = main(["plan", str(served.model_dir / "config.json"), "--block-size", str(BLOCK_SIZE),
                     "--max-model-len", str(MAX_MODEL_LEN), "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS),
                     "--kv-cache-memory-bytes", str(KV_CACHE_MEMORY_BYTES), "--json"])
        out = capsys.readouterr().out
        assert code == 0, out
        doc = json.loads(out)
        assert doc["kv"]["num_blocks"] == engine_blocks
        assert doc["weights"]["bytes"] == _tensor_bytes(served.model_dir)
    else:
        assert [(g["pool"], g["layers"]) for g in plan["kv_cache_groups"]] == [
            ("linear-attention", [0, 2]), ("full", [1, 3])]
        # one attention page: 544 tokens x 2 KV heads x 2 x 32 x 2 B = 139,264 B, the state's
        # 134,144 B (fp32 recurrent state) padded to it
        (state,) = [g for g in plan["kv_cache_groups"] if g["kind"] == "linear_attention"]
        assert (state["page_bytes_per_gpu"], state["state_bytes_per_gpu"]) == (139_264, 134_144)
        logged = re.findall(r"Setting attention block size to (\d+) tokens", served.log_text)
        assert logged and int(logged[-1]) == kv["block_size"] == 544
        padding = re.findall(r"Padding mamba page size by ([\d.]+)%", served.log_text)
        assert padding and f"padded by {padding[-1]} %" in " ".join(plan["notes"])
        assert engine_blocks == 15
    print(summary)  # shown with -rP


def test_golden_file_of_vllms_arithmetic_is_current() -> None:
    """tests/fixtures/plan/vllm-0.32-hybrid-blocks.json is what vllm_kv_golden.py computes now."""
    if not vllm_python().exists():
        ensure_vllm_env()
    proc = subprocess.run([str(vllm_python()), str(HERE / "vllm_kv_golden.py"), "--check"], env=_env(),
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]

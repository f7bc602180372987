"""vLLM startup log -> measured memory terms (0.10.2 and current line formats)."""

from __future__ import annotations

from pathlib import Path

from kvledger.collect.sources.vllm.startup_log import GIB, VllmLogReader, memory_terms, parse_vllm_log
from kvledger.domain.facts import MemoryTerm

LOG_0102 = """\
INFO 09-14 10:00:01 [__init__.py:216] Automatically detected platform cuda.
(EngineCore_0 pid=812) INFO 09-14 10:00:20 [gpu_model_runner.py:2007] Model loading took 14.9889 GiB and 6.112233 seconds
(EngineCore_0 pid=812) INFO 09-14 10:00:31 [gpu_worker.py:276] Available KV cache memory: 54.82 GiB
(EngineCore_0 pid=812) INFO 09-14 10:00:31 [kv_cache_utils.py:849] GPU KV cache size: 449,088 tokens
(EngineCore_0 pid=812) INFO 09-14 10:00:31 [kv_cache_utils.py:853] Maximum concurrency for 8,192 tokens per request: 54.82x
Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 100%|##########| 67/67 [00:03<00:00, 20.1it/s]
(EngineCore_0 pid=812) INFO 09-14 10:00:36 [gpu_model_runner.py:2708] Graph capturing finished in 5 secs, took 0.53 GiB
"""

LOG_CURRENT = """\
(EngineCore pid=326) INFO 10-06 17:00:11 [model_runner.py:407] Model loading took 15.0 GiB memory and 5.420225 seconds
(EngineCore pid=326) INFO 10-06 17:00:33 [gpu_worker.py:692] Available KV cache memory: 56.21 GiB
(EngineCore pid=326) INFO 10-06 17:00:33 [kv_cache_utils.py:2464] GPU KV cache size: 460,496 tokens, Maximum concurrency for 131,072 tokens per request: 3.51x
(EngineCore pid=326) INFO 10-06 17:00:41 [gpu_worker.py:955] Free memory on device (78.84/79.25 GiB) on startup. Desired GPU memory utilization is (0.92, 72.91 GiB). Actual usage is 15.26 GiB for consumed memory (weights + non-torch), 1.44 GiB for peak activation, and 0.23 GiB for CUDAGraph memory. Current kv cache memory in use is 56.21 GiB.
"""

LOG_SPLIT = """\
(EngineCore_DP0 pid=3021) INFO 09-23 18:12:39 [gpu_worker.py:391] Free memory on device (78.66/79.19 GiB) on startup. Desired GPU memory utilization is (0.9, 71.27 GiB). Actual usage is 14.08 GiB for weight, 1.97 GiB for peak activation, 0.07 GiB for non-torch memory, and 0.67 GiB for CUDAGraph memory. Replace gpu_memory_utilization config with `--kv-cache-memory=58333988249` to fit into requested memory.
(EngineCore_DP0 pid=3021) INFO 09-23 18:12:34 [gpu_worker.py:298] Available KV cache memory: 55.15 GiB
"""


def _terms(terms: list[MemoryTerm], gpu: int = 0) -> dict[str, int]:
    return {t.category: t.bytes for t in terms if t.gpu == gpu and t.source == "measured"}


def test_0102_format() -> None:
    facts = parse_vllm_log(LOG_0102)
    assert facts.kv_cache_tokens == 449088 and facts.concurrency_tokens == 8192 and facts.max_concurrency == 54.82
    assert _terms(memory_terms(facts, [0])) == {
        "weights": round(14.9889 * GIB),
        "runtime_buffers": round(0.53 * GIB),  # 0.10.2 logs no non-torch figure: CUDA graphs only
        "kv_pool": round(54.82 * GIB),
    }


def test_current_format_consumed_minus_weights() -> None:
    terms = memory_terms(parse_vllm_log(LOG_CURRENT), [0, 1])
    for gpu in (0, 1):
        assert _terms(terms, gpu) == {
            "weights": 15 * GIB,
            "workspace": round(1.44 * GIB),
            "runtime_buffers": round((15.26 - 15.0 + 0.23) * GIB),
            "kv_pool": round(56.21 * GIB),
        }
    assert parse_vllm_log(LOG_CURRENT).kv_cache_tokens == 460496


def test_split_format() -> None:
    assert _terms(memory_terms(parse_vllm_log(LOG_SPLIT), [])) == {
        "weights": round(14.08 * GIB),
        "workspace": round(1.97 * GIB),
        "runtime_buffers": round((0.07 + 0.67) * GIB),
        "kv_pool": round(55.15 * GIB),
    }


def test_last_occurrence_wins_after_restart() -> None:
    facts = parse_vllm_log(LOG_SPLIT + LOG_0102.replace("54.82 GiB", "20.00 GiB"))
    terms = _terms(memory_terms(facts, [0]))
    assert terms["kv_pool"] == 20 * GIB and terms["weights"] == round(14.9889 * GIB)
    # the split line's non-torch still counts with the newer CUDA-graph figure
    assert terms["runtime_buffers"] == round((0.07 + 0.53) * GIB)


def test_unknown_lines_and_no_profile() -> None:
    facts = parse_vllm_log("hello\nINFO Available memory: lots\nGPU KV cache size: many tokens\n")
    assert memory_terms(facts, [0]) == []


def test_reader_is_incremental_and_handles_truncation(tmp_path: Path) -> None:
    path = tmp_path / "vllm.log"
    path.write_text(LOG_0102[:200])  # ends mid-line
    reader = VllmLogReader(str(path))
    first = reader.read()
    with path.open("a") as fh:
        fh.write(LOG_0102[200:])
    second = reader.read()
    assert first.kv_cache_gib is None and second.kv_cache_gib == 54.82 and second.weights_gib == 14.9889
    path.write_text(LOG_SPLIT)  # rotated/truncated: read again from the start
    third = reader.read()
    assert third.weights_gib == 14.08 and third.kv_cache_gib == 55.15 and third.cuda_graph_gib == 0.67


def test_a_figure_beyond_what_a_float_carries_is_not_read() -> None:
    """A hostile log line (a 400-digit GiB figure, an infinite token count) is skipped: the
    figures read before it stay, and nothing overflows when they become bytes."""
    huge = "9" * 400
    text = LOG_0102 + (
        f"(EngineCore_0 pid=812) INFO 09-14 10:00:21 [gpu_model_runner.py:2007] Model loading took {huge} GiB and 6.1 seconds\n"
        f"INFO 09-14 10:00:22 [kv_cache_utils.py:1087] GPU KV cache size: {huge} tokens\n"
    )
    facts = parse_vllm_log(text)
    assert facts.weights_gib == 14.9889 and facts.kv_cache_tokens == 449088
    assert _terms(memory_terms(facts, [0]))["weights"] == round(14.9889 * GIB)

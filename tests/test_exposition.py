"""The exposition: every catalogue family renders, promtool accepts it, the name lint passes."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from accounting_support import accounts_of
from exposition_lint import lint_exposition
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvledger.domain.accounts import ConfigReload
from kvledger.domain.facts import (
    AdmissionEstimate,
    BlockRef,
    Budgets,
    EngineFacts,
    GpuFacts,
    GpuProcess,
    HostFacts,
    KvGroupFacts,
    Limit,
    MemoryTerm,
    PoolFacts,
    RequestFacts,
    Snapshot,
    SourceHealth,
    TenantQuota,
)
from kvledger.output.catalog import CATALOG
from kvledger.output.prometheus import make_registry, render_text


def rich_snapshot() -> Snapshot:
    refs = [BlockRef(0, 2, True), BlockRef(1, 1, True), BlockRef(2, 0, True)]
    pool = PoolFacts(id="0", block_size=16, num_blocks=10, block_bytes=1000, block_refs=refs, engine_reported_used_blocks=2,
                     preempted_tokens=640, admission_estimate=AdmissionEstimate(new_token_ratio=0.5, output_clip=4096))
    reqs = [
        RequestFacts(id="a", state="running", prompt_tokens=20, max_output_tokens=10, tenant="t1", blocks_held=2,
                     block_ids=[0, 1], computed_tokens=25, contexts=2, speculative_slots=2),
        RequestFacts(id="b", state="running", prompt_tokens=16, max_output_tokens=40, output_bound="estimate",
                     tenant="t1", blocks_held=1, block_ids=[0], computed_tokens=17),
        RequestFacts(id="c", state="waiting", prompt_tokens=16, max_output_tokens=40),
    ]
    e = EngineFacts(
        name="sim", kind="ledger", source="ledger", version="1.0", admission="dynamic", overflow="preempt-recompute",
        budgets=Budgets(8192, 300, 16, 4096), pools=[pool], requests=reqs,
        counters={"preemptions": 1, "reservation_overflows": 2, "admission_rechecks_accepted": 3,
                  "admission_rechecks_rejected": 0, "reservation_leaks": 0,
                  "prefix_cache_queried_tokens": 100, "prefix_cache_hit_tokens": 64,
                  "host_offloaded_tokens": 512, "host_loaded_tokens": 128},
        memory=[MemoryTerm(0, c, 1000, "measured") for c in ("weights", "workspace", "runtime_buffers", "reserve")],
        host=HostFacts(10, Limit(100, "hard"), 2, Limit(50, "estimate"), 0, 5),
        tenants=[TenantQuota("t1", 5000)], gpus=[0], pids=[42],
        kv_events={"BlockStored": 3}, kv_events_lost=0,
    )
    vllm_pool = PoolFacts(id="0", block_size=32, num_blocks=127, block_bytes=16384, in_use=4, cached_blocks=17, running_requests=1)
    v = EngineFacts(name="vllm", kind="vllm", source="vllm", pools=[vllm_pool], budgets=Budgets(max_model_len=1024))
    # TensorRT-LLM: free blocks include reusable cached ones (unreferenced), runtime memory reported
    trt_pool = PoolFacts(id="0", block_size=32, num_blocks=100, block_bytes=4096, in_use=40, unreferenced_blocks=60,
                         engine_reported_used_blocks=40, running_requests=3)
    t = EngineFacts(name="trt", kind="trtllm", source="trtllm", admission="reserve-cap", pools=[trt_pool],
                    budgets=Budgets(max_model_len=2048), reported_memory={"gpu": 123456, "cpu": 1000, "pinned": 64})
    # TGI: the engine states its reservation (per-request), nothing physical
    tgi_pool = PoolFacts(id="0", block_size=16, num_blocks=200, block_bytes=2048, reserved_blocks=150, running_requests=4)
    g = EngineFacts(name="tgi", kind="tgi", source="tgi", admission="reserve-cap", pools=[tgi_pool],
                    budgets=Budgets(max_model_len=1024))
    gpu = GpuFacts(0, True, "GPU-1", "H200", False, 10**6, 5 * 10**5, 4 * 10**5, 10**5, [GpuProcess(42, 12345)])
    health = [SourceHealth("sim", "ledger", True, None, 1.0, 0.01, {"timeout": 1}, document_age_seconds=0.25),
              SourceHealth("sglang", "sglang", True, None, 1.0, 0.01, refresh_interval_steps=40)]
    # a hybrid model's pool shared by a sliding-window and a full-attention group (the vLLM ledger)
    hybrid_pool = PoolFacts(id="0", block_size=32, num_blocks=255, block_bytes=4096, in_use=12, reclaimable=3, free=240,
                            layer_groups=2, groups=(KvGroupFacts("0", "sliding_window", window=64, in_use=3),
                                                    KvGroupFacts("1", "full_attention", in_use=9)))  # fmt: skip
    h = EngineFacts(name="hybrid", kind="vllm", source="ledger", pools=[hybrid_pool], budgets=Budgets(max_model_len=2048),
                    requests=[RequestFacts(id="h", state="running", prompt_tokens=280, max_output_tokens=20, blocks_held=12)])
    return Snapshot(engines=[e, v, t, g, h], gpus=[gpu, GpuFacts(1, False)], driver_version="560.1", health=health)


def exposition() -> str:
    accounts = accounts_of(rich_snapshot())
    accounts.invariant_totals = {("sim", "partition"): 1}
    accounts.labels_limited = {("sim", "tenant", "dropped"): 3}
    accounts.config_reload = ConfigReload(successful=True, success_at=1_700_000_000.0)
    return render_text(accounts).decode()


def test_direct_rendering_equals_prometheus_client() -> None:
    accounts = accounts_of(rich_snapshot())
    accounts.invariant_totals = {("sim", "partition"): 1}
    accounts.labels_limited = {("sim", "tenant", "dropped"): 3}
    accounts.config_reload = ConfigReload(successful=True, success_at=1_700_000_000.0)
    ours = render_text(accounts).decode()
    theirs = generate_latest(make_registry(lambda: accounts, process_metrics=False)).decode()

    def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for f in text_string_to_metric_families(text) for s in f.samples}

    assert samples(ours) == samples(theirs)
    assert len(samples(ours)) > 80


def test_label_values_are_escaped() -> None:
    snap = rich_snapshot()
    snap.engines[0].name = 'we"ird\\name\nx'
    text = render_text(accounts_of(snap)).decode()
    names = {s.labels.get("engine") for f in text_string_to_metric_families(text) for s in f.samples}
    assert 'we"ird\\name\nx' in names


def test_every_catalogue_family_has_samples() -> None:
    text = exposition()
    missing = [m.name for m in CATALOG if f"\n{m.name}{{" not in text and f"\n{m.name} " not in text]
    assert missing == []


def value(text: str, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return None


def test_bounds_carry_their_basis() -> None:
    text = exposition()
    assert value(text, "kvledger_kv_reserved_blocks", basis="upper_bound", engine="vllm", pool="0") == 32.0
    assert value(text, "kvledger_kv_reclaimable_bytes", basis="lower_bound", engine="vllm", pool="0") == 13 * 16384
    assert value(text, "kvledger_kv_reclaimable_bytes", basis="upper_bound", engine="vllm", pool="0") == 17 * 16384
    # bounded states are not presented in the exact partition
    assert value(text, "kvledger_kv_blocks", engine="vllm", pool="0", state="in_use") == 4.0
    assert value(text, "kvledger_kv_blocks", engine="vllm", pool="0", state="free") is None
    # a lost GPU reports up=0 and nothing else
    assert value(text, "kvledger_gpu_up", gpu="1") == 0.0
    assert value(text, "kvledger_gpu_memory_used_bytes", gpu="1") is None


def test_promtool_check_metrics_has_no_findings() -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is required (Debian package prometheus; `make system-deps`)"
    proc = subprocess.run([promtool, "check", "metrics"], input=exposition(), capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "" and proc.stderr.strip() == "", proc.stdout + proc.stderr


def test_name_lint_passes() -> None:
    assert lint_exposition(exposition()) == []


def test_name_lint_catches_bad_names() -> None:
    bad = (
        "# TYPE kvledger_memUsed_mb gauge\nkvledger_memUsed_mb{gpuIndex=\"0\"} 1\n"
        "# TYPE kvledger_thing_total gauge\nkvledger_thing_total 1\n"
        "# TYPE kvledger_x_info gauge\nkvledger_x_info 2\n"
    )
    problems = "\n".join(lint_exposition(bad))
    for expected in ("not snake_case", "base units", "label 'gpuIndex'", "_total on a gauge", "_info must be a gauge equal to 1"):
        assert expected in problems


def test_numbers_rendered_before_are_kept_up_to_a_limit_and_read_back_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """The renderer keeps the text of values it wrote (capacities come back at every render): a
    kept value renders as a fresh one does, NaN is never kept, and past MAX_LINE_ENDS it starts again."""
    from kvledger.output import prometheus

    monkeypatch.setattr(prometheus, "_LINE_ENDS", dict(prometheus._SMALL))
    monkeypatch.setattr(prometheus, "MAX_LINE_ENDS", len(prometheus._SMALL) + 2)
    assert [prometheus._line_end(v) for v in (2.5e9, 2.5e9, 1e300)] == ["2500000000.0\n", "2500000000.0\n", "1e+300\n"]
    assert prometheus._LINE_ENDS[2.5e9] == "2500000000.0\n"
    assert prometheus._line_end(float("nan")) == "NaN\n" and prometheus._line_end(float("inf")) == "+Inf\n"
    assert len(prometheus._LINE_ENDS) == len(prometheus._SMALL) + 2  # NaN and +Inf not kept
    assert prometheus._line_end(7.25) == "7.25\n"  # full: started again from the small numbers
    assert set(prometheus._LINE_ENDS) - set(prometheus._SMALL) == {7.25}

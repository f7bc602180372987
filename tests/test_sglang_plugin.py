"""The in-engine SGLang ledger (kvledger_engine.sglang) on a fake SGLang 0.5.23.

tests/fake_sglang/ is a small fake ``sglang`` with the internals the plugin reads and the
plugin framework it is loaded by (see its docstring); each test imports it afresh and
removes it afterwards. The real engine is tested in tests/sglang_real/. The documents are
read as the daemon reads them (over the plugin's own Unix socket, parsed by
``parse_document``; accounted by the daemon's accounting step, ``accounts_of``) and
compared with a page-by-page recount of the fake scheduler (``fake_sglang.driver.recount``).
"""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from accounting_support import accounts_of
from fake_sglang import ROOT as FAKE_ROOT
from fake_sglang import installed
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from plugin_support import fetch, plugin_environment
from plugin_support import short_dir as short_dir_in_tmp

from kvledger.collect.sources.document import parse_document
from kvledger.domain.accounts import EngineAccount
from kvledger.domain.facts import EngineFacts, Snapshot
from kvledger.protocol.reader import schema_errors
from kvledger_engine.sglang.settings import ENV_INTERVAL, ENV_LEDGER, ENV_TENANT, ENV_UNTESTED, Settings, SettingsError

REPO = Path(__file__).resolve().parent.parent
ENV_VARS = (ENV_LEDGER, ENV_TENANT, ENV_INTERVAL, ENV_UNTESTED, "SGLANG_PLUGINS")
LOGGER = "sglang.kvledger"


def environment(**values: str | None) -> AbstractContextManager[None]:
    """The plugin's variables set to ``values`` (others unset), restored afterwards."""
    return plugin_environment(ENV_VARS, **values)


def short_dir() -> AbstractContextManager[Path]:
    return short_dir_in_tmp("kvs-")


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    with short_dir() as path:
        yield path


@contextmanager
def engine(address: str | None, **kwargs: Any) -> Iterator[tuple[ModuleType, Any]]:
    """A fake SGLang scheduler process: plugins loaded with the ledger at ``address``."""
    env = {ENV_LEDGER: address, ENV_INTERVAL: kwargs.pop("interval", "0.0001"), ENV_TENANT: kwargs.pop("tenant", None)}
    with environment(**env), installed() as driver:
        scheduler = driver.start(**kwargs)
        try:
            yield driver, scheduler
        finally:
            ledger = getattr(scheduler, "_kvledger", None)
            if ledger is not None:
                ledger.close()


def served(scheduler: Any) -> EngineFacts:
    body = fetch(scheduler._kvledger.url)
    assert not schema_errors(json.loads(body))
    return parse_document(body, "test", "e")


def engine_account(facts: EngineFacts) -> EngineAccount:
    """The engine's account as the daemon's accounting step makes it."""
    (account,) = accounts_of(Snapshot(engines=[facts])).engines
    return account


def compare(facts: EngineFacts, count: Any) -> None:
    """The document's pool, requests, counters and reserved figure equal the recount."""
    (pool,) = facts.pools
    assert (pool.in_use, pool.reclaimable, pool.free) == (count.in_use, count.reclaimable, count.free)
    got = {r.id: (r.state, r.prompt_tokens, r.generated_tokens, r.max_output_tokens, r.blocks_held) for r in facts.requests or ()}
    assert got == count.requests
    assert facts.counters.get("preemptions") == count.retractions
    assert pool.preempted_tokens == count.retracted_tokens
    account = engine_account(facts)
    (acc,) = account.pools
    assert acc.reserved_blocks is not None and acc.reserved_blocks.exact == count.reserved_pages


# ---------------------------------------------------------------- loading


def test_the_entry_point_is_sglangs_plugin_group() -> None:
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="sglang.srt.plugins") if e.name == "kvledger"]
    assert ep.value == "kvledger_engine.sglang.plugin:register"


def test_without_the_setting_the_plugin_registers_nothing() -> None:
    with engine(None) as (driver, scheduler):
        from sglang.srt.plugins.hook_registry import HookRegistry

        assert HookRegistry._hooks == {}
        assert getattr(scheduler, "_kvledger", None) is None
        scheduler.add_request(driver.Req("a", list(range(8)), 3))
        while scheduler.step():
            pass
        assert not scheduler.running_batch.reqs and not scheduler.waiting_queue


def test_nothing_of_the_ledger_is_imported_without_the_setting() -> None:
    probe = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(FAKE_ROOT)!r})
        from sglang.srt.plugins import load_plugins
        load_plugins()
        print(sorted(m for m in sys.modules if m.startswith("kvledger")))
    """)
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=60, check=True)
    assert json.loads(done.stdout.replace("'", '"')) == ["kvledger_engine", "kvledger_engine.plugin_settings", "kvledger_engine.sglang",
                                                         "kvledger_engine.sglang.plugin", "kvledger_engine.sglang.settings"]


def test_the_plugin_serves_an_idle_scheduler(sock_dir: Path) -> None:
    with engine(f"unix://{sock_dir}/l.sock", tokens=256, page_size=4) as (_driver, scheduler):
        facts = served(scheduler)
        (pool,) = facts.pools
        assert (pool.block_size, pool.num_blocks, pool.in_use, pool.reclaimable, pool.free) == (4, 64, 0, 0, 64)
        assert pool.block_bytes == 4 * 256
        assert facts.kind == "sglang" and facts.admission == "dynamic" and facts.overflow == "preempt-recompute"
        assert facts.budgets.max_num_seqs == 16 and facts.budgets.max_model_len == 4096
        assert pool.admission_estimate is not None and pool.admission_estimate.output_clip == 4096
        assert oct(os.stat(sock_dir / "l.sock").st_mode & 0o777) == "0o660"


# ---------------------------------------------------------------- exactness


def drive(driver: ModuleType, scheduler: Any, rng: random.Random, steps: int, arrivals: float, prefixes: list[list[int]],
          check: Any = None) -> None:
    n = 0
    for _ in range(steps):
        while rng.random() < arrivals:
            scheduler.add_request(driver.request(rng, f"r{n}", prefixes, priority=rng.choice((None, 1, 2))))
            n += 1
        scheduler.step()
        if check is not None:
            check()


def test_a_burst_sharing_a_prefix_equals_the_recount_at_every_step(sock_dir: Path) -> None:
    with engine(f"unix://{sock_dir}/l.sock", tokens=512, page_size=4) as (driver, scheduler):
        rng = random.Random(7)
        prefix = [rng.randrange(10, 900) for _ in range(24)]
        ledger = scheduler._kvledger

        def check() -> None:
            ledger.publish_now("test")  # the state after this step, as a pause publishes it
            compare(served(scheduler), driver.recount(scheduler))

        drive(driver, scheduler, rng, 60, 0.6, [prefix], check)
        assert driver.recount(scheduler).reserved_pages > 0 or scheduler.waiting_queue == []


def test_idle_shows_nothing_in_use_and_the_cached_prefix_reclaimable(sock_dir: Path) -> None:
    with engine(f"unix://{sock_dir}/l.sock", tokens=512, page_size=4) as (driver, scheduler):
        rng = random.Random(3)
        prefix = [rng.randrange(10, 900) for _ in range(20)]
        drive(driver, scheduler, rng, 40, 0.5, [prefix])
        while scheduler.running_batch.reqs or scheduler.waiting_queue:
            scheduler.step()
        scheduler.step()  # the scheduler looks for work once more, finds none: idle
        facts = served(scheduler)
        (pool,) = facts.pools
        count = driver.recount(scheduler)
        assert pool.in_use == 0 and not list(facts.requests or ())
        assert pool.reclaimable == count.reclaimable >= len(prefix) // 4  # the shared prefix's pages are cached
        assert pool.free == count.free
        account = engine_account(facts)
        assert account.pools[0].reserved_blocks is not None and account.pools[0].reserved_blocks.exact == 0


def test_retractions_and_their_discarded_tokens_are_counted(sock_dir: Path) -> None:
    """A pool too small for the admitted requests' output: SGLang retracts; every
    retraction and the computed tokens it threw away are counted, as the fake tallies them."""
    with engine(f"unix://{sock_dir}/l.sock", tokens=160, page_size=4, max_running_requests=8) as (driver, scheduler):
        rng = random.Random(11)
        for i in range(8):
            scheduler.add_request(driver.Req(f"r{i}", [rng.randrange(10, 900) for _ in range(12)], 40, finish_at=40))
        for _ in range(30):
            scheduler.step()
        count = driver.recount(scheduler)
        assert count.retractions > 0 and count.retracted_tokens > 0
        scheduler._kvledger.publish_now("test")
        facts = served(scheduler)
        compare(facts, count)
        (acc,) = engine_account(facts).pools
        assert acc.engine_new_token_ratio == scheduler.new_token_ratio_tracker.current


def test_the_admission_estimate_is_a_separate_figure(sock_dir: Path) -> None:
    with engine(f"unix://{sock_dir}/l.sock", tokens=1024, page_size=1) as (driver, scheduler):
        for i in range(3):
            scheduler.add_request(driver.Req(f"r{i}", list(range(i, i + 10)), 100 + i, finish_at=100 + i))
        for _ in range(5):
            scheduler.step()
        scheduler._kvledger.publish_now("test")
        facts = served(scheduler)
        (acc,) = engine_account(facts).pools
        ratio = scheduler.new_token_ratio_tracker.current
        remaining = sum(r.sampling_params.max_new_tokens - len(r.output_ids) for r in scheduler.running_batch.reqs)
        assert acc.engine_admission_estimate_tokens == pytest.approx(ratio * remaining)
        assert acc.reserved_blocks is not None
        assert acc.reserved_blocks.exact == sum(10 + 100 + i for i in range(3))  # the caps, not the estimate


_OPS = st.lists(st.tuples(st.integers(0, 3), st.sampled_from([1, 2, 4, 8])), min_size=1, max_size=40)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_OPS, seed=st.integers(0, 2**16), page=st.sampled_from([1, 4, 16]), tokens=st.sampled_from([128, 256, 1024]))
def test_every_publication_equals_a_recount(ops: list[tuple[int, int]], seed: int, page: int, tokens: int) -> None:
    """Whenever the plugin publishes (its own hooks, its own throttle), the document it then
    serves equals a recount of the scheduler taken at that moment."""
    with short_dir() as where, engine(f"unix://{where}/l.sock", tokens=tokens, page_size=page,
                                      max_running_requests=6, context_len=512) as (driver, scheduler):
        ledger = scheduler._kvledger
        ledger.throttle.cost_ratio, ledger.throttle.next_at = 0.0, 0.0  # publish at every change (the throttle: the bench)
        publish = ledger.document.publish
        seen: list[int] = []

        def checked(*args: Any, **kwargs: Any) -> None:
            publish(*args, **kwargs)
            compare(served(scheduler), driver.recount(scheduler))
            seen.append(1)

        failures: list[BaseException] = []

        def recording(*args: Any, **kwargs: Any) -> None:
            try:
                checked(*args, **kwargs)
            except BaseException as exc:  # the ledger would swallow it (and turn itself off)
                failures.append(exc)
                raise

        ledger.document.publish = recording
        rng = random.Random(seed)
        prefixes = [[rng.randrange(10, 900) for _ in range(rng.randint(page, 3 * page))] for _ in range(2)]
        n = 0
        for arrivals, steps in ops:
            for _ in range(arrivals):
                scheduler.add_request(driver.request(rng, f"r{n}", prefixes, max_prompt=min(60, tokens // 4),
                                                     max_new=min(40, tokens // 4)))
                n += 1
            for _ in range(steps):
                scheduler.step()
        if failures:
            raise failures[0]
        assert ledger.on and (seen or n == 0), f"no publication ({ledger.publications}, {ops}, {page}, {tokens})"


# ---------------------------------------------------------------- tenants, saturation, settings


def test_tenants_are_the_requests_priority(sock_dir: Path) -> None:
    with engine(f"unix://{sock_dir}/l.sock", tenant="priority") as (driver, scheduler):
        scheduler.add_request(driver.Req("a", list(range(8)), 5, priority=3))
        scheduler.add_request(driver.Req("b", list(range(8)), 5))
        scheduler.step()
        scheduler._kvledger.publish_now("test")
        tenants = {r.id: r.tenant for r in served(scheduler).requests or ()}
        assert tenants == {"a": "3", "b": None}


def test_saturation_names_max_running_requests_when_it_binds(sock_dir: Path) -> None:
    with engine(f"unix://{sock_dir}/l.sock", tokens=4096, page_size=1, max_running_requests=2) as (driver, scheduler):
        for i in range(4):
            scheduler.add_request(driver.Req(f"r{i}", list(range(8)), 20, finish_at=20))
        scheduler.step()
        scheduler._kvledger.publish_now("test")
        account = engine_account(served(scheduler))
        assert account.binding == "sequences"


def test_saturation_names_the_token_pool_when_it_binds(sock_dir: Path) -> None:
    with engine(f"unix://{sock_dir}/l.sock", tokens=64, page_size=1, max_running_requests=32) as (driver, scheduler):
        for i in range(4):
            scheduler.add_request(driver.Req(f"r{i}", [i * 100 + j for j in range(12)], 4, finish_at=4))
        scheduler.step()
        scheduler._kvledger.publish_now("test")
        account = engine_account(served(scheduler))
        assert account.binding == "kv_physical"


@pytest.mark.parametrize(("env", "expected"), [
    ({ENV_LEDGER: "relative/path"}, "expected unix:///absolute/path"),
    ({ENV_LEDGER: "http://127.0.0.1"}, "expected unix:///absolute/path"),
    ({ENV_LEDGER: "/tmp/x.sock", ENV_TENANT: "request"}, f"{ENV_TENANT}='request'"),
    ({ENV_LEDGER: "/tmp/x.sock", ENV_INTERVAL: "0"}, f"{ENV_INTERVAL}='0'"),
])
def test_bad_settings_are_named(env: dict[str, str], expected: str) -> None:
    with pytest.raises(SettingsError, match=expected.replace("(", r"\(")):
        Settings.from_env(env)


def test_data_parallel_ranks_need_their_own_address() -> None:
    settings = Settings.from_env({ENV_LEDGER: "/tmp/kv-{dp_rank}.sock"})
    assert settings is not None and settings.endpoint(1, 2) == ("unix", "/tmp/kv-1.sock")
    plain = Settings.from_env({ENV_LEDGER: "http://127.0.0.1:9000"})
    assert plain is not None and plain.endpoint(0, 1) == ("http", "127.0.0.1:9000")
    with pytest.raises(SettingsError, match="must contain"):
        plain.endpoint(1, 2)


def test_a_renamed_internal_turns_the_ledger_off_and_sglang_runs(sock_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    with environment(**{ENV_LEDGER: f"unix://{sock_dir}/l.sock"}), installed() as driver:
        from sglang.srt.mem_cache.radix_cache import RadixCache

        del RadixCache.protected_size
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            scheduler = driver.start(tokens=128, page_size=4)
        assert scheduler._kvledger is None
        assert next(r.getMessage() for r in caplog.records if r.name == LOGGER).startswith(
            "kvledger: the SGLang ledger is off for this scheduler: the radix cache has no 'protected_size'")
        scheduler.add_request(driver.Req("a", list(range(8)), 3))
        for _ in range(5):
            scheduler.step()
        assert not scheduler.running_batch.reqs


def test_an_untested_release_is_one_line_and_sglang_is_untouched(sock_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    with environment(**{ENV_LEDGER: f"unix://{sock_dir}/l.sock"}), installed() as driver:
        import sglang.version

        sglang.version.__version__ = "0.6.0"
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            scheduler = driver.start(tokens=128, page_size=4)
        assert getattr(scheduler, "_kvledger", None) is None
        (record,) = [r for r in caplog.records if r.name == LOGGER]
        assert "SGLang 0.6.0 is not a release series" in record.getMessage()


def test_a_hook_that_fails_turns_the_ledger_off_and_sglang_continues(sock_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    with engine(f"unix://{sock_dir}/l.sock", tokens=256, page_size=4) as (driver, scheduler):
        scheduler._kvledger.view.fingerprint = lambda *a: 1 / 0
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            scheduler.add_request(driver.Req("a", list(range(8)), 3))
            for _ in range(5):
                scheduler.step()
        assert not scheduler._kvledger.on and not (sock_dir / "l.sock").exists()
        assert any("stopped after a scheduling step (ZeroDivisionError" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------- the daemon's sglang kind with ledger:


@contextmanager
def metrics_server(text: bytes) -> Iterator[str]:
    """A stand-in for SGLang's /metrics answering ``text`` (a real capture)."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(text)))
            self.end_headers()
            self.wfile.write(text)

        def log_message(self, *args: Any) -> None:
            return

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    finally:
        server.shutdown()
        server.server_close()


def _sglang_config(url: str, ledger: str) -> Any:
    from kvledger.config.loader import config_from_mapping

    return config_from_mapping({"engines": [{"name": "s", "kind": "sglang", "url": url, "ledger": ledger}]}).engines[0]


def test_the_sglang_kind_reads_the_plugins_ledger_beside_metrics(sock_dir: Path) -> None:
    from kvledger.collect.sources.sglang.source import SglangSource

    capture = (REPO / "tests/fixtures/sglang/sglang-kv-gauges-metrics.txt").read_bytes()
    with engine(f"unix://{sock_dir}/l.sock", tokens=160, page_size=4, max_running_requests=8) as (driver, scheduler), \
            metrics_server(capture) as url:
        rng = random.Random(5)
        for i in range(8):
            scheduler.add_request(driver.Req(f"r{i}", [rng.randrange(10, 900) for _ in range(12)], 40, finish_at=40))
        for _ in range(25):
            scheduler.step()
        scheduler._kvledger.publish_now("test")
        source = SglangSource(_sglang_config(url, f"unix://{sock_dir}/l.sock"))
        try:
            facts = source.poll().facts
            count = driver.recount(scheduler)
            compare(facts, count)  # the pools, requests, retractions and reservation: the ledger's
            assert facts.counters["prefix_cache_hit_tokens"] > 0  # what only /metrics says stays
            assert [(r.name, r.up) for r in source.subsource_health()] == [("ledger", True), ("metrics", True)]
            scheduler._kvledger.close()  # the plugin gone: the /metrics figures, and the reason
            fallback = source.poll().facts
            assert fallback.requests is None and fallback.pools[0].num_blocks == 262144 // 16  # the capture's pages
            ledger, metrics = source.subsource_health()
            assert not ledger.up and ledger.message is not None and "l.sock" in ledger.message and metrics.up
        finally:
            source.close()


def test_the_ledger_option_is_for_the_kinds_with_a_plugin() -> None:
    from kvledger.config.loader import ConfigError, config_from_mapping

    with pytest.raises(ConfigError, match=r"ledger is for kind vllm or sglang only \(this engine is kind tgi\)"):
        config_from_mapping({"engines": [{"name": "t", "kind": "tgi", "url": "http://h:1/metrics", "ledger": "unix:///x"}]})

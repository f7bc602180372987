"""The `kvledger` command: serve, demo, snapshot, check, lab, plan."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import gc
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, TextIO

import kvledger.collect.sources.kinds  # noqa: F401  (every engine kind's registration: before any configuration is read)
from kvledger import __version__, version_text
from kvledger.collect.collector import Collector
from kvledger.collect.memory import limit_malloc_arenas
from kvledger.collect.sources.base import Source
from kvledger.config.files import open_regular, why
from kvledger.config.listen import listen_address
from kvledger.config.loader import load_config, parse_duration
from kvledger.config.types import MAX_INTERVAL, MIN_INTERVAL, Config, ConfigError
from kvledger.domain.accounts import Accounts, ConfigReload
from kvledger.domain.facts import EngineFacts, Sharing
from kvledger.domain.limits import MAX_CONTEXTS, MAX_TOKENS
from kvledger.output.json_view import accounts_to_json
from kvledger.process.signals import SignalInbox
from kvledger.web.server import KvledgerHTTPServer

if TYPE_CHECKING:
    from kvledger.sim.demo import Demo

log = logging.getLogger("kvledger")

DEMO_LISTEN = "127.0.0.1:9477"
LAB_LISTEN = "127.0.0.1:9478"
#: seconds from SIGTERM (or SIGINT) to the process's exit, whatever its threads are doing: a
#: poll stuck anywhere (a parse, a file, a socket) is left behind, with a warning naming it
SHUTDOWN_BOUND = 5.0
#: seconds a SIGHUP reload may take before it is reported failed (kvledger_config_last_reload_successful
#: 0); a later SIGHUP starts a new one, and the late one's result, should it come, is dropped
RELOAD_BOUND = 5.0
#: seconds a one-shot command (check, snapshot) waits at exit for threads still busy (a poll
#: past its deadline) before it exits without them
EXIT_GRACE = 1.0


def _lingering() -> list[threading.Thread]:
    """Threads other than this one that would hold the interpreter's exit up."""
    me = threading.current_thread()
    return [t for t in threading.enumerate() if t is not me and t.is_alive() and not t.daemon]


def exit_now(code: int, why: str) -> None:
    """Leave the process with ``code`` at once (stdout and stderr flushed), naming the threads
    left behind: a poll stuck in a parse, a file or a socket must not hold the exit up."""
    names = ", ".join(sorted({t.name.rsplit("_", 1)[0] for t in _lingering()})) or "none"
    log.warning("%s: exiting without the threads still busy (%s)", why, names)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    for handler in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    os._exit(code)


def _exit_bounded(code: int, grace: float = EXIT_GRACE) -> int:
    """Return ``code`` once the other threads are done, or leave without them after ``grace``
    seconds (the process is exiting: a poll past its deadline must not delay it)."""
    deadline = time.monotonic() + grace
    for thread in _lingering():
        thread.join(max(0.0, deadline - time.monotonic()))
    if _lingering():
        exit_now(code, f"exit delayed over {grace:g}s")
    return code


class ReloadRunner:
    """SIGHUP reloads, each in its own thread, so the daemon's main loop (and SIGTERM) never
    waits on one. One runs at a time: a SIGHUP meanwhile is kept and runs when it ends (a
    storm of signals is one more reload, not fifty at once). A reload not finished within
    ``bound`` seconds is reported failed (logged, ``on_overdue`` called) and no longer
    counts as running: the next SIGHUP starts a new one, and the late one applies nothing.
    ``reload(server, applying)`` prepares, then applies inside ``with applying() as current:``
    only when ``current`` (the latest reload, not overdue)."""

    def __init__(self, reload: Callable[[KvledgerHTTPServer, Callable[[], contextlib.AbstractContextManager[bool]]], None],
                 on_overdue: Callable[[], None] | None = None, bound: float = RELOAD_BOUND) -> None:
        self._reload = reload
        self._on_overdue = on_overdue
        self.bound = bound
        self._lock = threading.Lock()
        self._generation = 0
        self._running: int | None = None  # the reload in progress within its bound
        self._again: KvledgerHTTPServer | None = None  # a SIGHUP received meanwhile
        self._settled: set[int] = set()  # finished or overdue

    def request(self, server: KvledgerHTTPServer) -> None:
        with self._lock:
            if self._running is not None:
                self._again = server
                return
            self._generation += 1
            generation = self._running = self._generation
        worker = threading.Thread(target=self._run, args=(server, generation), name=f"kvledger-reload-{generation}",
                                  daemon=True)
        worker.start()
        timer = threading.Timer(self.bound, self._overdue, args=(generation,))
        timer.daemon = True
        timer.start()

    @contextlib.contextmanager
    def _applying(self, generation: int) -> Iterator[bool]:
        with self._lock:
            yield generation == self._generation and generation not in self._settled

    def _run(self, server: KvledgerHTTPServer, generation: int) -> None:
        try:
            self._reload(server, lambda: self._applying(generation))
        except Exception:  # a reload must never take the daemon down
            log.exception("reload failed; the running configuration is kept")
        finally:
            late, again = self._settle(generation)
            if late:
                log.warning("the reload that did not finish within %gs ended; its result was dropped", self.bound)
            if again is not None:
                self.request(again)

    def _settle(self, generation: int) -> tuple[bool, KvledgerHTTPServer | None]:
        """Mark ``generation`` finished or overdue: (whether it was already, the SIGHUP kept meanwhile)."""
        with self._lock:
            if generation in self._settled:
                return True, None
            self._settled.add(generation)
            again = None
            if self._running == generation:
                self._running = None
                again, self._again = self._again, None
            return False, again

    def _overdue(self, generation: int) -> None:
        already, again = self._settle(generation)
        if already:
            return
        log.error("reload not finished within %gs (a file that cannot be read?): reported failed, the running "
                  "configuration is kept; the next SIGHUP starts a new one", self.bound)
        if self._on_overdue is not None:
            self._on_overdue()
        if again is not None:
            self.request(again)


def _collector(config: Config, extra: Sequence[Source] = (), clock: Callable[[], float] = time.time) -> Collector:
    from kvledger.collect.sources.registry import build_sources

    sources, timeouts, base = build_sources(config)
    sources.extend(extra)
    return Collector(
        sources=sources,
        base_engines=base,
        sharing=config.sharing,
        interval=config.interval_seconds,
        timeouts=timeouts,
        limits=config.limits,
        clock=clock,
    )


def _run_until_signal(
    collector: Collector,
    listen: str,
    json_view: bool,
    on_stop: Callable[[], None] | None = None,
    otlp_endpoint: str | None = None,
    reload: ReloadRunner | None = None,
    web_config_file: str | None = None,
    announce: Callable[[KvledgerHTTPServer], None] | None = None,
    hard_exit: bool = False,
) -> int:
    """Bind ``listen``, then (only once bound) ``announce`` and serve until SIGTERM/SIGINT.
    SIGHUP runs ``reload`` in a ReloadRunner (the web config alone without one). With
    ``hard_exit`` (the real process, not a caller in-process) the process exits within
    SHUTDOWN_BOUND seconds of the signal whatever its threads are doing."""
    try:
        server = KvledgerHTTPServer(listen, collector, json_view=json_view, web_config_file=web_config_file)
    except ConfigError:
        collector.stop()
        if on_stop:
            on_stop()
        raise
    except OSError as exc:
        log.error("cannot listen on %s: %s", listen, exc.strerror or exc)
        collector.stop()
        if on_stop:
            on_stop()
        return 2
    stops = (signal.SIGTERM, signal.SIGINT)
    with SignalInbox((*stops, signal.SIGHUP), stops, on_stop=_bounded_exit if hard_exit else None) as inbox:
        return _serve_until_stopped(inbox, server, collector, on_stop, otlp_endpoint, reload, announce)


def _bounded_exit(received: signal.Signals) -> None:
    """Run by the signal thread at the first SIGTERM/SIGINT: whatever the main thread is doing
    (starting up, stopping, the interpreter's own exit), the process is gone within
    SHUTDOWN_BOUND seconds."""
    from kvledger.collect.sources.prom_text import abandon_parses

    abandon_parses()  # a parse in progress stops at its next check
    time.sleep(SHUTDOWN_BOUND - 0.5)
    exit_now(0, f"{received.name}: shutdown took over {SHUTDOWN_BOUND - 0.5:g}s")


def _serve_until_stopped(
    inbox: SignalInbox,
    server: KvledgerHTTPServer,
    collector: Collector,
    on_stop: Callable[[], None] | None,
    otlp_endpoint: str | None,
    reload: ReloadRunner | None,
    announce: Callable[[KvledgerHTTPServer], None] | None,
) -> int:
    """_run_until_signal's body once the port is bound and the signals go to ``inbox``: the
    main thread reads each signal and acts on it as ordinary code (kvledger.process.signals.py
    says why nothing runs in a handler)."""
    otlp = None
    if otlp_endpoint:
        from kvledger.output.otlp import OtlpOutput

        otlp = OtlpOutput(otlp_endpoint, lambda: collector.latest(reader="otlp"))
    if announce is not None:
        announce(server)
    collector.start()
    server.start()
    log.info("kvledger %s serving on %s/metrics", __version__, server.url)
    reloads = reload if reload is not None else ReloadRunner(_web_config_reload)
    while (received := inbox.next()) == signal.SIGHUP:
        reloads.request(server)
    log.info("received %s, shutting down", received.name)
    server.stop()
    if otlp is not None:
        otlp.stop()
    collector.stop()
    if on_stop:
        on_stop()
    log.info("stopped")
    return 0


def _web_config_reload(server: KvledgerHTTPServer, applying: Callable[[], contextlib.AbstractContextManager[bool]]) -> None:
    """SIGHUP without a configuration file (demo, lab): the web config alone."""
    log.info("received SIGHUP: reloading the web config (this command has no configuration file)")
    server.reload_web_config()


def settle_garbage_collector() -> None:
    """Move what start-up built (modules, the catalogue, the configuration) out of the
    collector's way and collect less often: a poll allocates a few thousand short-lived
    containers per engine, and the full collections that their count triggers would
    otherwise walk every long-lived object again each time; and keep glibc to two heaps
    rather than one per poll thread (docs/performance.md)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)
    limit_malloc_arenas()


def cmd_serve(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    for warning in config.warnings:
        log.warning("%s", warning)
    collector = _collector(config)
    collector.config_reload = ConfigReload(True, time.time())
    settle_garbage_collector()
    running = [config]

    def failed() -> None:
        loaded = collector.config_reload
        collector.config_reload = ConfigReload(False, loaded.success_at if loaded else 0.0)

    def reload(server: KvledgerHTTPServer, applying: Callable[[], contextlib.AbstractContextManager[bool]]) -> None:
        """SIGHUP: read the configuration again; a bad one is logged and the old one kept.
        Prepared in its own thread; applied only if still the latest reload (ReloadRunner)."""
        from kvledger.collect.sources.registry import build_sources

        old = running[0]
        log.info("received SIGHUP: reloading %s", args.config)
        try:
            new = load_config(args.config)
            sources, timeouts, base = build_sources(new, previous=(old, collector.sources))
        except Exception as exc:  # any failure keeps the running configuration, and says so
            with applying() as current:
                if current:
                    failed()
            if isinstance(exc, ConfigError):
                log.error("reload failed, the running configuration is kept: %s", exc)
                return
            raise
        with applying() as current:
            if not current:  # overdue, or a later SIGHUP's reload runs: drop what this one built
                for source in sources:
                    if source not in collector.sources:
                        with contextlib.suppress(Exception):
                            source.close()
                return
            _apply_reload(server, new, old, sources, timeouts, base)

    def _apply_reload(server: KvledgerHTTPServer, new: Config, old: Config, sources: list[Source],
                      timeouts: dict[int, float], base: list[EngineFacts]) -> None:
        if new.listen != old.listen and not args.listen:
            log.warning("listen changed to %s: a restart applies it (still on %s)", new.listen, old.listen)
        if new.otlp_endpoint != old.otlp_endpoint:
            log.warning("otlp.endpoint changed: a restart applies it")
        running[0] = new
        assert server.endpoints is not None  # the daemon's server answers with its endpoints
        server.endpoints = dataclasses.replace(server.endpoints, json_view=new.json_view)
        server.reload_web_config()  # certificates and users; the file's path is read at start
        collector.config_reload = ConfigReload(True, time.time())
        server.fit_sources(len(sources))  # the connection cap counts the sources' connections
        if collector.reconfigure(sources, base, timeouts, new.sharing, new.interval_seconds, new.limits):
            log.info("configuration reloaded: %d engine(s)", len(new.engines))
        else:
            log.warning("configuration read: the polling thread is busy and applies it at its next cycle")

    web_config_file = args.web_config_file or config.web_config_file  # the flag wins over the key
    return _run_until_signal(
        collector, args.listen or config.listen, config.json_view, otlp_endpoint=config.otlp_endpoint,
        web_config_file=web_config_file, reload=ReloadRunner(reload, on_overdue=failed), hard_exit=args.hard_exit,
    )


#: which simulated engine a bare --fault MODE applies to
FAULT_TARGETS = {
    "reserve-overcommit": "sim-tgi",  # a reserve-cap engine admitting against free memory, not its quota
    "per-request-used": "sim-vllm",  # used blocks claimed per request instead of unique blocks
    "leak": "sim-vllm",
    "overflow": "sim-vllm",
}


class FaultError(ValueError):
    """A --fault value the demo cannot apply; the message is complete (no prefix to add)."""


def parse_faults(values: Sequence[str]) -> dict[str, str]:
    """``MODE`` (applied to its usual engine) or ``ENGINE=MODE``; ``none`` for no fault."""
    faults: dict[str, str] = {}
    for value in values:
        engine, sep, mode = value.rpartition("=")
        if mode not in FAULT_TARGETS and mode != "none":
            close = difflib.get_close_matches(mode, [*FAULT_TARGETS, "none"], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise FaultError(f"--fault {value}: unknown mode {mode!r} (modes: none, {', '.join(FAULT_TARGETS)}){hint}")
        if not sep:
            if mode == "none":
                continue
            engine = FAULT_TARGETS[mode]
        faults[engine] = mode
    return faults


def demo_config(demo: Demo, listen: str, interval: float, sharing: Sharing) -> Config:
    """The daemon's configuration in `kvledger demo`: the simulated engines, no NVML."""
    from kvledger.config.types import NvmlConfig

    return Config(
        listen=listen,
        interval_seconds=interval,
        sharing=sharing,
        nvml=NvmlConfig("false"),  # the demo's GPUs are simulated
        engines=tuple(demo.engine_configs),
        json_view=True,
    )


def demo_collector(demo: Demo, config: Config) -> Collector:
    """The demo daemon's collector: the engines' sources and the simulated GPUs, on the demo's
    clock when it runs on one (``start_demo(stepping=False)``)."""
    return _collector(config, extra=[demo.gpu_source], clock=time.time if demo.clock is None else demo.clock)


def cmd_demo(args: argparse.Namespace) -> int:
    from kvledger.sim.demo import start_demo

    try:
        faults = parse_faults(args.fault)
        demo = start_demo(faults=faults, seed=args.seed)
    except FaultError as exc:
        print(f"kvledger demo: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # an ENGINE=MODE naming no simulated engine
        print(f"kvledger demo: --fault: {exc}", file=sys.stderr)
        return 2
    config = demo_config(demo, args.listen, args.interval, args.sharing)
    collector = demo_collector(demo, config)

    def announce(server: KvledgerHTTPServer) -> None:  # printed once the port is ours, never before
        print(f"kvledger demo: simulated engines {', '.join(e.name for e in demo.engine_configs)} and "
              f"simulated GPUs; the live ledger on {server.url}/, the cache lab on {server.url}/lab, "
              f"metrics on {server.url}/metrics (Ctrl-C stops)", flush=True)

    return _run_until_signal(collector, args.listen, True, on_stop=demo.stop, web_config_file=args.web_config_file,
                             announce=announce, hard_exit=args.hard_exit)


def format_value(value: float) -> str:
    """A sample as exact text: integers in full (bytes, blocks, counts; never 2.14748e+10),
    other numbers with every digit that identifies them (timestamps, ratios)."""
    if isinstance(value, int):
        return str(value)
    if math.isfinite(value) and value.is_integer():
        return str(int(value))
    return repr(float(value))


def _source_lines(collector: Collector) -> list[str]:
    """One line per source: up, or DOWN with its reason and message (each failure once)."""
    lines = []
    for h, message in collector.health():
        state = "up" if h.up else f"DOWN ({h.reason}): {message}"
        lines.append(f"  {h.engine or '-':20s} {h.source:10s} {state}")
    return lines


def _print_table(accounts: Accounts, collector: Collector) -> None:
    view = accounts_to_json(accounts, collector.health())
    print("sources:")
    print("\n".join(_source_lines(collector)))
    for name, samples in view["metrics"].items():
        for sample in samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sample["labels"].items())
            print(f"{name}{{{labels}}} {format_value(sample['value'])}")


@contextlib.contextmanager
def _one_shot_logging(args: argparse.Namespace) -> Iterator[None]:
    """snapshot and check print every source's failure once, in their own output: the
    collector's "source down" warnings (the same failure again, on stderr) are held back
    unless --log-level debug asks for everything."""
    collector_log = logging.getLogger("kvledger.collect.collector")
    previous = collector_log.level
    if args.log_level != "debug":
        collector_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        collector_log.setLevel(previous)


def _warn_config(config: Config) -> None:
    for warning in config.warnings:
        print(f"kvledger: warning: {warning}", file=sys.stderr)


def cmd_snapshot(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    _warn_config(config)
    with _one_shot_logging(args):
        collector = _collector(config)
        try:
            accounts = collector.poll_once()
            if args.json:
                print(json.dumps(accounts_to_json(accounts, collector.health()), indent=1))
            else:
                _print_table(accounts, collector)
            failed = sum(1 for h, _ in collector.health() if not h.up)
            if failed:
                print(f"kvledger: {failed} of {len(collector.health())} source(s) down (see above)", file=sys.stderr)
            return 1 if failed else 0
        finally:
            collector.stop()


def _check_web_config(path: str | None) -> None:
    """The web config as serve loads it (its TLS files, its users); ConfigError when it cannot."""
    if path is None:
        return
    from kvledger.web.runtime import WebRuntime

    state = WebRuntime(path).state
    what = [w for w, on in (("TLS", state.ssl_context is not None),
                            (f"basic auth ({len(state.config.basic_auth_users)} user(s))", state.auth is not None)) if on]
    print(f"{path}: web config is valid ({', '.join(what) or 'no TLS, no basic auth'})")


def cmd_check(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    _warn_config(config)
    with _one_shot_logging(args):
        collector = _collector(config)  # builds every source: a configuration it cannot use fails here
        print(f"{args.config}: configuration is valid ({len(config.engines)} engine(s), sharing={config.sharing})")
        try:
            _check_web_config(args.web_config_file or config.web_config_file)  # the flag wins over the key, as in serve
        except ConfigError:
            collector.stop()
            raise
        try:
            collector.poll_once()
            bad = 0
            for h, message in collector.health():
                if h.up:
                    print(f"  ok    {h.engine or '-'}/{h.source}")
                else:
                    bad += 1
                    print(f"  FAIL  {h.engine or '-'}/{h.source}: {h.reason}: {message}")
            return 1 if bad else 0
        finally:
            collector.stop()


def serve_lab(listen: str, web_config_file: str | None, query: str = "", hard_exit: bool = False) -> int:
    """`kvledger lab --serve`: the interactive lab page until SIGINT or SIGTERM (within
    SHUTDOWN_BOUND seconds of it with ``hard_exit``, the real process)."""
    from kvledger.web.pages import LabSite

    try:
        server = KvledgerHTTPServer(listen, None, web_config_file=web_config_file, responder=LabSite())
    except OSError as exc:
        log.error("cannot listen on %s: %s", listen, exc.strerror or exc)
        return 2
    stops = (signal.SIGTERM, signal.SIGINT)
    with SignalInbox((*stops, signal.SIGHUP), stops, on_stop=_bounded_exit if hard_exit else None) as inbox:
        server.start()
        print(f"kvledger lab: the cache lab on {server.url}/{query} (Ctrl-C stops)", flush=True)
        while (received := inbox.next()) == signal.SIGHUP:
            server.reload_web_config()
        log.info("received %s, shutting down", received.name)
    server.stop()
    return 0


def cmd_lab(args: argparse.Namespace) -> int:
    from urllib.parse import urlencode

    from kvledger.tools.lab import format_lab, run_lab

    if args.serve:
        given = {k: v for k, v in (("capacity", args.capacity), ("working_set", args.working_set)) if v is not None}
        return serve_lab(args.listen or LAB_LISTEN, args.web_config_file, f"?{urlencode(given)}" if given else "",
                         args.hard_exit)
    if args.listen or args.web_config_file:
        print("kvledger lab: --web.listen-address and --web.config.file go with --serve", file=sys.stderr)
        return 2
    if args.capacity is None or args.working_set is None:
        print("kvledger lab: --capacity and --working-set are required (or --serve for the interactive page)",
              file=sys.stderr)
        return 2
    try:
        result = run_lab(args.capacity, args.working_set, args.requests)
    except ValueError as exc:
        print(f"kvledger lab: {exc}", file=sys.stderr)
        return 2
    print(format_lab(result, args.capacity, args.working_set))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """Exit 0 when the budget closes, 1 when it does not or cannot be decided (with
    --check), 2 on bad input."""
    from kvledger.config.loader import parse_size
    from kvledger.tools.plan import (
        ModelPlanInput,
        PlanError,
        fetch_live,
        parse_lengths,
        parse_live,
        parse_term,
        plan_from_live,
        plan_from_model,
        render_table,
    )

    try:
        lengths = tuple(parse_lengths(args.length, args.lengths_file))
        spec = ", ".join([*args.length, *([f"file {args.lengths_file}"] if args.lengths_file else [])]) or None
        if args.from_url:
            if args.model_config:
                raise PlanError("give a model config or --from URL, not both")
            report = plan_from_live(parse_live(fetch_live(args.from_url), args.from_url), args.from_url, args.engine,
                                    lengths, spec, args.min_concurrency)
        else:
            if not args.model_config:
                raise PlanError("give a model config.json (or --from URL of a running kvledger)")

            def size(option: str, text: str | None) -> int | None:
                if text is None:
                    return None
                try:
                    return parse_size(text)
                except ValueError as exc:
                    raise PlanError(f"{option} {text!r}: {exc}") from None

            inp = ModelPlanInput(
                config=args.model_config, gpu=args.gpu, gpu_memory=size("--gpu-memory", args.gpu_memory),
                tensor_parallel=args.tensor_parallel, kv_dtype=args.kv_dtype, weights_dtype=args.weights_dtype,
                block_size=args.block_size, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, speculative_tokens=args.speculative_tokens,
                n=args.n, in_flight_batches=args.in_flight_batches,
                weights=None if args.weights_bytes is None else parse_term(args.weights_bytes, "--weights"),
                workspace=None if args.workspace is None else parse_term(args.workspace, "--workspace"),
                runtime_buffers=None if args.runtime_buffers is None else parse_term(args.runtime_buffers, "--runtime-buffers"),
                reserve=None if args.reserve is None else parse_term(args.reserve, "--reserve"),
                gpu_memory_utilization=args.gpu_memory_utilization,
                kv_cache_memory_bytes=size("--kv-cache-memory-bytes", args.kv_cache_memory_bytes),
                lengths=lengths, lengths_spec=spec, min_concurrency=args.min_concurrency,
                mamba_cache_dtype=args.mamba_cache_dtype, mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
                mamba_cache_mode="align" if args.prefix_caching else "none",
            )
            report = plan_from_model(inp)
    except PlanError as exc:
        print(f"kvledger plan: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.to_json(), indent=1))
    else:
        print(render_table(report))
    if args.check and report.verdict["closes"] is not True:
        term = report.verdict["breaking_term"] or "device"
        print(f"kvledger plan: check failed: {term}: {report.verdict['message']}", file=sys.stderr)
        return 1
    if args.check and args.strict and report.verdict["rests_on_estimates"]:
        print(f"kvledger plan: check failed (--strict): rests on estimates: {', '.join(report.verdict['rests_on_estimates'])}",
              file=sys.stderr)
        return 1
    return 0


def _flag(check: Callable[[str], object]) -> Callable[[str], str]:
    """An argparse type from a configuration value's check: the value as given, or argparse's
    error (exit 2, the flag named) with the check's message: flags and keys read alike."""

    def conv(text: str) -> str:
        try:
            check(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text

    return conv


def _nonempty(text: str) -> str:
    if not text:
        raise ValueError("expected a value, got an empty one")
    return text


_listen_flag = _flag(listen_address)  # the configuration's listen: reads the same way
_path_flag = _flag(_nonempty)


def _interval_flag(text: str) -> float:
    """--interval as interval_seconds is read: seconds (1.5) or a duration (500ms) in its range."""
    try:
        seconds = parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not MIN_INTERVAL <= seconds <= MAX_INTERVAL:
        raise argparse.ArgumentTypeError(f"must be between {MIN_INTERVAL:g} s and {MAX_INTERVAL:g} s, got {text!r}")
    return seconds


def _int_in(minimum: int, maximum: int) -> Callable[[str], int]:
    """An argparse type: an integer in [minimum, maximum]."""

    def conv(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(f"expected an integer in {minimum}..{maximum}, got {text!r}")
        return value

    return conv


_positive = _int_in(1, MAX_TOKENS)  # token counts and budgets (limits.MAX_TOKENS)
_nonnegative = _int_in(0, MAX_TOKENS)


PLAN_HELP = (
    "Does the device budget close at the maximum supported shapes? weights (counted from config.json) + "
    "workspace + runtime_buffers + reserve + kv_pool <= device memory, per GPU; the KV pool left, its blocks "
    "and token capacity, the worst-case concurrency under reserve-cap and the expected concurrency under "
    "dynamic admission for a length distribution. Terms the config cannot give are SIZE:SOURCE with SOURCE "
    "measured, configured or estimate. --from URL reads a running kvledger instead. See docs/plan.md."
)


def _add_plan_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    from kvledger.tools.plan import GPUS

    pl = sub.add_parser("plan", help="validate a deployment's memory budget at its maximum shapes before it serves",
                        description=PLAN_HELP, parents=[common])
    pl.add_argument("model_config", nargs="?", metavar="CONFIG_JSON", help="the model's Hugging Face config.json")
    pl.add_argument("--from", dest="from_url", metavar="URL",
                    help="a running kvledger's JSON view (/api/v1/accounts) or /metrics, instead of a model config")
    pl.add_argument("--engine", help="with --from: the engine to plan (when the daemon watches several)")
    pl.add_argument("--gpu", metavar="NAME", help=f"a GPU of the table: {', '.join(GPUS)}")
    pl.add_argument("--gpu-memory", metavar="SIZE", help="device memory per GPU (e.g. 80GiB), instead of --gpu")
    pl.add_argument("--tensor-parallel", "--tp", type=_int_in(1, 1024), default=1, metavar="N")
    pl.add_argument("--kv-dtype", default="auto", help="auto (the model's dtype), bfloat16, float16, fp8 ...")
    pl.add_argument("--weights-dtype", default="auto", help="dtype of unquantized weights (auto: the config's)")
    pl.add_argument("--block-size", type=_positive, default=16, metavar="TOKENS")
    pl.add_argument("--mamba-cache-dtype", default="auto",
                    help="linear-attention (Mamba) conv state dtype, as vLLM's flag (auto: the model's)")
    pl.add_argument("--mamba-ssm-cache-dtype", default="auto",
                    help="linear-attention recurrent state dtype, as vLLM's flag (auto: the conv state's)")
    pl.add_argument("--no-enable-prefix-caching", dest="prefix_caching", action="store_false",
                    help="as vLLM's flag: linear-attention states take one block per request (mamba cache mode none)")
    pl.add_argument("--max-model-len", type=_positive, metavar="TOKENS", help="default: max_position_embeddings")
    pl.add_argument("--max-num-seqs", type=_positive, default=256, help="default 256 (give the engine's)")
    pl.add_argument("--max-num-batched-tokens", type=_positive, metavar="TOKENS",
                    help="per-iteration token budget (default 2048; give the engine's)")
    pl.add_argument("--speculative-tokens", type=_nonnegative, default=0, metavar="K")
    pl.add_argument("-n", type=_int_in(1, MAX_CONTEXTS), default=1, help="parallel samples per request")
    pl.add_argument("--in-flight-batches", type=_int_in(1, 64), default=1, metavar="N",
                    help="batches scheduled but not settled (2 with async scheduling, PP size with pipeline stages); "
                         "sliding windows hold N x max_num_batched_tokens more tokens")
    pl.add_argument("--weights", dest="weights_bytes", metavar="SIZE:SOURCE", help="the weights' size per GPU, "
                    "instead of counting them (e.g. 15GiB:measured)")
    pl.add_argument("--workspace", metavar="SIZE:SOURCE", help="workspace / activation peak per GPU")
    pl.add_argument("--runtime-buffers", metavar="SIZE:SOURCE", help="CUDA graphs, non-torch memory, ... per GPU")
    pl.add_argument("--reserve", metavar="SIZE:SOURCE", help="headroom kept free per GPU")
    pl.add_argument("--gpu-memory-utilization", type=float, metavar="U",
                    help="vLLM's fraction: the reserve is total - ceil(total x U) (configured)")
    pl.add_argument("--kv-cache-memory-bytes", metavar="SIZE", help="the KV pool per GPU, as configured (vLLM's flag)")
    pl.add_argument("--length", action="append", default=[], metavar="PROMPT:OUTPUT",
                    help="one request of the length distribution (repeatable)")
    pl.add_argument("--lengths-file", metavar="FILE", help="length distribution: lines 'PROMPT OUTPUT [COUNT]'")
    pl.add_argument("--min-concurrency", type=_positive, metavar="N",
                    help="the budget must admit N requests at their cap (reserve-cap)")
    pl.add_argument("--json", action="store_true", help="the report as JSON")
    pl.add_argument("--check", action="store_true", help="exit 1 when the budget does not close (naming the term)")
    pl.add_argument("--strict", action="store_true", help="with --check: fail too when the answer rests on an estimate")
    pl.set_defaults(func=cmd_plan)


LAB_HELP = (
    "Replay a repeating sequence of S identifiers through an LRU cache of capacity C and print each "
    "step with the totals of hits, misses and evictions. It illustrates a working set fitting or "
    "failing to fit a capacity (C=4, S=4: 12 hits of 16; C=3, S=4: none). It is NOT a model of safe "
    "KV eviction: an engine may only evict blocks that no request references, and can drop a live "
    "request's KV only by recomputing it (or another correctness-preserving policy). With --serve, the "
    "same lab as an interactive page: set C and S, Reset, then Step or Play (to the 4,096-request cap)."
)


# ---------------------------------------------------------------- logs, as Prometheus exporters write them

#: --log.level values (Prometheus' names; "warning" is kept for the older --log-level spelling)
LOG_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warn": logging.WARNING, "warning": logging.WARNING,
              "error": logging.ERROR}
_LEVEL_NAMES = {logging.DEBUG: "debug", logging.INFO: "info", logging.WARNING: "warn", logging.ERROR: "error",
                logging.CRITICAL: "error"}


def _log_fields(record: logging.LogRecord) -> list[tuple[str, str]]:
    """time, level, logger, msg and (when an exception is logged) err: the fields of one line."""
    when = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
    fields = [("time", when), ("level", _LEVEL_NAMES.get(record.levelno, record.levelname.lower())),
              ("logger", record.name), ("msg", record.getMessage())]
    if record.exc_info:
        fields.append(("err", logging.Formatter().formatException(record.exc_info)))
    return fields


_LOGFMT_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _logfmt_value(value: str) -> str:
    """A value as is when it needs no quotes, else quoted with \\, \\", \\n, \\r, \\t and \\uXXXX escapes
    (an engine's text never writes a terminal control sequence or a second line into the log)."""
    if value and not any(c in value for c in ' ="\\') and value.isprintable():
        return value
    return '"' + "".join(_LOGFMT_ESCAPES.get(c) or (c if c.isprintable() else f"\\u{ord(c):04x}") for c in value) + '"'


class LogfmtFormatter(logging.Formatter):
    """``time=... level=info logger=kvledger msg="..."``: one line per record, quoted and
    escaped where needed (a multi-line traceback stays on its line)."""

    def format(self, record: logging.LogRecord) -> str:
        return " ".join(f"{k}={_logfmt_value(v)}" for k, v in _log_fields(record))


class JsonFormatter(logging.Formatter):
    """One JSON object per line, with the fields of the logfmt line."""

    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(dict(_log_fields(record)), ensure_ascii=False)


class _KvledgerHandler(logging.StreamHandler[TextIO]):
    """The handler ``configure_logging`` installs (and replaces when called again)."""


def configure_logging(level: str, log_format: str) -> None:
    """Log to stderr at ``level`` in ``log_format``. Like logging.basicConfig, it leaves a
    root logger that someone else has already given handlers (an embedding program, pytest
    running main() in its process) as it is."""
    root = logging.getLogger()
    ours = [h for h in root.handlers if isinstance(h, _KvledgerHandler)]
    if len(ours) < len(root.handlers):
        return
    for old in ours:
        root.removeHandler(old)
    handler = _KvledgerHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else LogfmtFormatter())
    root.addHandler(handler)
    root.setLevel(LOG_LEVELS[level])


def _add_log_flags(parser: argparse.ArgumentParser, *, top: bool) -> None:
    """--log.level and --log.format, given before or after the subcommand (the subcommand's
    own copies default to nothing, so they never undo what the top level set)."""
    parser.add_argument("--log.level", "--log-level", dest="log_level", choices=tuple(LOG_LEVELS),
                        default="info" if top else argparse.SUPPRESS, metavar="LEVEL",
                        help="only log messages of this level or above: debug, info, warn, error (default info)")
    parser.add_argument("--log.format", dest="log_format", choices=("logfmt", "json"),
                        default="logfmt" if top else argparse.SUPPRESS,
                        help="output format of log messages: logfmt or json (default logfmt)")


class _VersionAction(argparse.Action):
    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0,
                         help="print the version, revision and build date, and exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        print(version_text())
        parser.exit()


def _add_web_flags(parser: argparse.ArgumentParser, listen_help: str, *, listen_default: str | None = None,
                   web_help: str = "exporter-toolkit web-config.yml: TLS and basic auth") -> None:
    parser.add_argument("--web.listen-address", "--listen", dest="listen", default=listen_default, metavar="HOST:PORT",
                        type=_listen_flag,
                        help=f"address to listen on for the web interface and /metrics ({listen_help}); "
                             "--listen is the older spelling")
    parser.add_argument("--web.config.file", dest="web_config_file", metavar="PATH", type=_path_flag, help=web_help)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvledger", description="KV-cache accounting exporter for LLM inference servers.")
    p.add_argument("--version", action=_VersionAction)
    _add_log_flags(p, top=True)
    common = argparse.ArgumentParser(add_help=False)
    _add_log_flags(common, top=False)
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the exporter on a configuration file", parents=[common])
    s.add_argument("--config", required=True, type=_path_flag)
    _add_web_flags(s, "overrides the config's listen",
                   web_help="exporter-toolkit web-config.yml: TLS and basic auth (overrides web_config_file)")
    s.set_defaults(func=cmd_serve)

    d = sub.add_parser("demo", help="simulated engines and GPUs, exported live; no GPU or engine needed", parents=[common])
    _add_web_flags(d, f"default {DEMO_LISTEN}", listen_default=DEMO_LISTEN)
    d.add_argument("--fault", action="append", default=[], metavar="[ENGINE=]MODE",
                   help="inject a fault into the simulator (repeatable): none, reserve-overcommit (sim-tgi), "
                        "per-request-used, leak, overflow (sim-vllm); ENGINE=MODE picks the engine")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--interval", type=_interval_flag, default=1.0,
                   help="poll interval: seconds (1.5) or a duration (500ms), as interval_seconds")
    d.add_argument("--sharing", default="per-request", choices=("per-request", "reference-aware"))
    d.set_defaults(func=cmd_demo)

    sn = sub.add_parser("snapshot", help="poll every source once and print the accounts; non-zero if a source failed",
                        parents=[common])
    sn.add_argument("--config", required=True, type=_path_flag)
    sn.add_argument("--json", action="store_true")
    sn.set_defaults(func=cmd_snapshot)

    c = sub.add_parser("check", help="validate the configuration (and the web config) and probe every source",
                       parents=[common])
    c.add_argument("--config", required=True, type=_path_flag)
    _add_web_flags(c, "checked as serve reads it; nothing is bound",
                   web_help="exporter-toolkit web-config.yml, checked as serve loads it (overrides web_config_file)")
    c.set_defaults(func=cmd_check)

    lab = sub.add_parser("lab", help="cache lab: a working set fitting or failing to fit an LRU capacity",
                         description=LAB_HELP, parents=[common])
    lab.add_argument("--capacity", type=int, metavar="C", help="LRU capacity (required unless --serve)")
    lab.add_argument("--working-set", type=int, metavar="S", help="repeating identifiers 0..S-1 (required unless --serve)")
    lab.add_argument("--requests", type=int, default=16, metavar="N", help="requests to replay (default 16, at most 4096)")
    lab.add_argument("--serve", action="store_true", help="serve the interactive lab page instead of printing a run")
    _add_web_flags(lab, f"the page, with --serve; default {LAB_LISTEN}",
                   web_help="exporter-toolkit web-config.yml: TLS and basic auth, with --serve")
    lab.set_defaults(func=cmd_lab)

    _add_plan_parser(sub, common)
    return p


def _web_config_flag_readable(path: str | None) -> None:
    """A --web.config.file that cannot be read is refused naming the flag (the key
    web_config_file is checked by the loader, naming the key)."""
    if path:
        try:
            os.close(open_regular(path))  # a FIFO is refused, never waited on
        except OSError as exc:
            raise ConfigError(f"--web.config.file {path}: cannot read: {why(exc)}") from None


def main(argv: Sequence[str] | None = None) -> int:
    """The command line. Run as the program (``argv`` None), the process exits within
    SHUTDOWN_BOUND seconds of SIGTERM and within EXIT_GRACE of a command's end whatever its
    threads do; called with ``argv`` (in-process), it only returns."""
    args = build_parser().parse_args(argv)
    args.hard_exit = argv is None
    configure_logging(args.log_level, args.log_format)
    try:
        _web_config_flag_readable(getattr(args, "web_config_file", None))
        code = int(args.func(args))
    except ConfigError as exc:
        print(f"kvledger: configuration error: {exc}", file=sys.stderr)
        code = 2
    return _exit_bounded(code) if args.hard_exit else code


if __name__ == "__main__":
    sys.exit(main())


"""The `kvledger` command: serve, demo, snapshot, check, lab."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import signal
import sys
import threading
from collections.abc import Callable, Sequence

from kvledger import __version__
from kvledger.collector import Collector
from kvledger.config import Config, ConfigError, load_config
from kvledger.json_view import accounts_to_json
from kvledger.memory import limit_malloc_arenas
from kvledger.policy import Accounts
from kvledger.server import KvledgerHTTPServer
from kvledger.sources.base import Source

log = logging.getLogger("kvledger")

DEMO_LISTEN = "127.0.0.1:9477"


def _collector(config: Config, extra: Sequence[Source] = ()) -> Collector:
    from kvledger.sources.registry import build_sources

    sources, timeouts, base = build_sources(config)
    sources.extend(extra)
    return Collector(
        sources=sources,
        base_engines=base,
        sharing=config.sharing,
        interval=config.interval_seconds,
        timeouts=timeouts,
        limits=config.limits,
    )


def _run_until_signal(
    collector: Collector,
    listen: str,
    json_view: bool,
    on_stop: Callable[[], None] | None = None,
    otlp_endpoint: str | None = None,
    reload: Callable[[KvledgerHTTPServer], None] | None = None,
    web_config_file: str | None = None,
) -> int:
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
    stop = threading.Event()
    hangup = threading.Event()
    wake = threading.Event()

    def handle(signum: int, _frame: object) -> None:
        log.info("received %s, shutting down", signal.Signals(signum).name)
        stop.set()
        wake.set()

    def handle_hangup(_signum: int, _frame: object) -> None:
        hangup.set()
        wake.set()

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)
    signal.signal(signal.SIGHUP, handle_hangup)
    otlp = None
    if otlp_endpoint:
        from kvledger.otlp_output import OtlpOutput

        otlp = OtlpOutput(otlp_endpoint, collector.latest)
    collector.start()
    server.start()
    log.info("kvledger %s serving on %s/metrics", __version__, server.url)
    while not stop.is_set():
        wake.wait()
        wake.clear()
        if hangup.is_set() and not stop.is_set():
            hangup.clear()
            if reload is None:
                log.info("received SIGHUP: reloading the web config (this command has no configuration file)")
                server.reload_web_config()
            else:
                try:
                    reload(server)
                except Exception:  # a reload must never take the daemon down
                    log.exception("reload failed; the running configuration is kept")
    server.stop()
    if otlp is not None:
        otlp.stop()
    collector.stop()
    if on_stop:
        on_stop()
    log.info("stopped")
    return 0


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
    collector = _collector(config)
    settle_garbage_collector()
    running = [config]

    def reload(server: KvledgerHTTPServer) -> None:
        """SIGHUP: read the configuration again; a bad one is logged and the old one kept."""
        from kvledger.sources.registry import build_sources

        old = running[0]
        log.info("received SIGHUP: reloading %s", args.config)
        try:
            new = load_config(args.config)
            sources, timeouts, base = build_sources(new, previous=(old, collector.sources))
        except ConfigError as exc:
            log.error("reload failed, the running configuration is kept: %s", exc)
            return
        if new.listen != old.listen and not args.listen:
            log.warning("listen changed to %s: a restart applies it (still on %s)", new.listen, old.listen)
        if new.otlp_endpoint != old.otlp_endpoint:
            log.warning("otlp.endpoint changed: a restart applies it")
        running[0] = new
        server.endpoints = dataclasses.replace(server.endpoints, json_view=new.json_view)
        server.reload_web_config()  # certificates and users; the file's path is read at start
        if collector.reconfigure(sources, base, timeouts, new.sharing, new.interval_seconds, new.limits):
            log.info("configuration reloaded: %d engine(s)", len(new.engines))
        else:
            log.warning("configuration read: the polling thread is busy and applies it at its next cycle")

    web_config_file = args.web_config_file or config.web_config_file  # the flag wins over the key
    return _run_until_signal(
        collector, args.listen or config.listen, config.json_view, otlp_endpoint=config.otlp_endpoint,
        web_config_file=web_config_file, reload=reload,
    )


#: which simulated engine a bare --fault MODE applies to
FAULT_TARGETS = {
    "reserve-overcommit": "sim-tgi",  # a reserve-cap engine admitting against free memory, not its quota
    "per-request-used": "sim-vllm",  # used blocks claimed per request instead of unique blocks
    "leak": "sim-vllm",
    "overflow": "sim-vllm",
}


def parse_faults(values: Sequence[str]) -> dict[str, str]:
    """``MODE`` (applied to its usual engine) or ``ENGINE=MODE``; ``none`` for no fault."""
    faults: dict[str, str] = {}
    for value in values:
        engine, sep, mode = value.rpartition("=")
        if not sep:
            if mode == "none":
                continue
            if mode not in FAULT_TARGETS:
                raise ConfigError(f"--fault: unknown mode {mode!r} (one of none, {', '.join(FAULT_TARGETS)})")
            engine = FAULT_TARGETS[mode]
        faults[engine] = mode
    return faults


def cmd_demo(args: argparse.Namespace) -> int:
    from kvledger.config import NvmlConfig
    from kvledger.sim.demo import start_demo

    try:
        demo = start_demo(faults=parse_faults(args.fault), seed=args.seed)
    except ValueError as exc:
        raise ConfigError(f"--fault: {exc}") from None
    config = Config(
        listen=args.listen,
        interval_seconds=args.interval,
        sharing=args.sharing,
        nvml=NvmlConfig("false"),  # the demo's GPUs are simulated
        engines=tuple(demo.engine_configs),
        json_view=True,
    )
    collector = _collector(config, extra=[demo.gpu_source])
    print(f"kvledger demo: simulated engines {', '.join(e.name for e in demo.engine_configs)} and "
          f"simulated GPUs; metrics on {args.listen}/metrics (Ctrl-C stops)", flush=True)
    return _run_until_signal(collector, args.listen, True, on_stop=demo.stop, web_config_file=args.web_config_file)


def _print_table(accounts: Accounts, collector: Collector) -> None:
    view = accounts_to_json(accounts, collector)
    print("sources:")
    for s in view["sources"]:
        state = "up" if s["up"] else f"DOWN ({s['reason']}): {s['message']}"
        print(f"  {s['engine'] or '-':20s} {s['source']:10s} {state}")
    for name, samples in view["metrics"].items():
        for sample in samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sample["labels"].items())
            print(f"{name}{{{labels}}} {sample['value']:g}")


def cmd_snapshot(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    collector = _collector(config)
    try:
        accounts = collector.poll_once()
        if args.json:
            print(json.dumps(accounts_to_json(accounts, collector), indent=1))
        else:
            _print_table(accounts, collector)
        failed = [(h, m) for h, m in collector.health() if not h.up]
        for h, m in failed:
            print(f"kvledger: source {h.engine or '-'}/{h.source} failed ({h.reason}): {m}", file=sys.stderr)
        return 1 if failed else 0
    finally:
        collector.stop()


def cmd_check(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    collector = _collector(config)  # builds every source: a configuration it cannot use fails here
    print(f"{args.config}: configuration is valid ({len(config.engines)} engine(s), sharing={config.sharing})")
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


def cmd_lab(args: argparse.Namespace) -> int:
    from kvledger.lab import format_lab, run_lab

    try:
        result = run_lab(args.capacity, args.working_set, args.requests)
    except ValueError as exc:
        print(f"kvledger lab: {exc}", file=sys.stderr)
        return 2
    print(format_lab(result, args.capacity, args.working_set))
    return 0


LAB_HELP = (
    "Replay a repeating sequence of S identifiers through an LRU cache of capacity C and print each "
    "step with the totals of hits, misses and evictions. It illustrates a working set fitting or "
    "failing to fit a capacity (C=4, S=4: 12 hits of 16; C=3, S=4: none). It is NOT a model of safe "
    "KV eviction: an engine may only evict blocks that no request references, and can drop a live "
    "request's KV only by recomputing it (or another correctness-preserving policy)."
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvledger", description="KV-cache accounting exporter for LLM inference servers.")
    p.add_argument("--version", action="version", version=f"kvledger {__version__}")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the exporter on a configuration file")
    s.add_argument("--config", required=True)
    s.add_argument("--listen", help="HOST:PORT (overrides the config's listen)")
    s.add_argument("--web.config.file", dest="web_config_file", metavar="PATH",
                   help="exporter-toolkit web-config.yml: TLS and basic auth (overrides web_config_file)")
    s.set_defaults(func=cmd_serve)

    d = sub.add_parser("demo", help="simulated engines and GPUs, exported live; no GPU or engine needed")
    d.add_argument("--listen", default=DEMO_LISTEN, help=f"HOST:PORT (default {DEMO_LISTEN})")
    d.add_argument("--fault", action="append", default=[], metavar="[ENGINE=]MODE",
                   help="inject a fault into the simulator (repeatable): none, reserve-overcommit (sim-tgi), "
                        "per-request-used, leak, overflow (sim-vllm); ENGINE=MODE picks the engine")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--web.config.file", dest="web_config_file", metavar="PATH",
                   help="exporter-toolkit web-config.yml: TLS and basic auth")
    d.add_argument("--interval", type=float, default=1.0, help="poll interval in seconds")
    d.add_argument("--sharing", default="per-request", choices=("per-request", "reference-aware"))
    d.set_defaults(func=cmd_demo)

    sn = sub.add_parser("snapshot", help="poll every source once and print the accounts; non-zero if a source failed")
    sn.add_argument("--config", required=True)
    sn.add_argument("--json", action="store_true")
    sn.set_defaults(func=cmd_snapshot)

    c = sub.add_parser("check", help="validate the configuration and probe every source")
    c.add_argument("--config", required=True)
    c.set_defaults(func=cmd_check)

    lab = sub.add_parser("lab", help="cache lab: a working set fitting or failing to fit an LRU capacity",
                         description=LAB_HELP)
    lab.add_argument("--capacity", type=int, required=True, metavar="C")
    lab.add_argument("--working-set", type=int, required=True, metavar="S")
    lab.add_argument("--requests", type=int, default=16, metavar="N", help="requests to replay (default 16, at most 4096)")
    lab.set_defaults(func=cmd_lab)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"kvledger: configuration error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())


"""Step-time overhead of the in-engine vLLM ledger on the real CPU engine (issue 11).

    .venv/bin/python bench/bench_vllm_integration.py [--pairs 2] [--requests 16] [--poll 1.0]

Needs the real-engine environment (tests/vllm_real/setup_env.sh). For each pair it starts
the tiny-model server once per mode (``off``; ``ledger``: the integration on; ``ledger+mw``:
also the optional ``TenantHeader`` middleware, which vLLM loads through ``--middleware``),
order rotating, and runs the same workload on each: ``--rounds`` waves of ``--requests`` concurrent completions (a
shared 128-token prefix, a distinct 32-token suffix, ``--max-tokens`` generated tokens,
EOS ignored: every running request's tokens move every step, requests arrive and finish).
While the integration is on, the ledger socket is read every ``--poll`` seconds, as a
daemon would. Step time = wall time of the workload / engine steps (the change of
``vllm:iteration_tokens_total_count``). Printed: median step time off and on, their ratio,
and the integration's own publication time as a share of the engine's busy time (from the
document's ``integration.publish_seconds_total``). Numbers on 2 shared cores are noisy:
read the ratio with its spread, over several pairs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # tests/vllm_real/server.py imports harness/

import tests.vllm_real.server as server_module  # noqa: E402
from tests.vllm_real.server import (  # noqa: E402
    LEDGER_FLAGS,
    VllmServer,
    complete,
    ensure_vllm_env,
    free_tcp_port,
    gauge_sum,
    make_tiny_model,
    shared_prefix_ids,
    unique_suffix_ids,
    words,
)


def steps(server: VllmServer) -> float:
    return gauge_sum(server.metrics_text(), "vllm:iteration_tokens_total_count")


def workload(server: VllmServer, rounds: int, requests: int, max_tokens: int) -> tuple[float, float]:
    """(seconds, engine steps) of the workload."""
    prefix = shared_prefix_ids(128)
    steps_before = steps(server)
    began = time.monotonic()
    for wave in range(rounds):
        threads = [
            threading.Thread(target=complete, args=(server.base_url, words(prefix + unique_suffix_ids(wave * 1000 + i, 32)),
                                                     max_tokens))
            for i in range(requests)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    seconds = time.monotonic() - began
    return seconds, steps(server) - steps_before


MODES = ("off", "ledger", "ledger+mw")


def run_one(model: Path, mode: str, args: argparse.Namespace) -> dict[str, float]:
    ledger = mode != "off"
    server_module.LEDGER_FLAGS = LEDGER_FLAGS if mode == "ledger+mw" else ()
    server = VllmServer(model, free_tcp_port(), free_tcp_port(), free_tcp_port(), ledger=ledger)
    stop = threading.Event()
    reads = [0]

    def poll() -> None:
        while not stop.wait(args.poll):
            try:
                server.ledger_document()
                reads[0] += 1
            except OSError:
                pass

    try:
        server.start()
        workload(server, 1, 4, 16)  # warm-up
        poller = threading.Thread(target=poll, daemon=True)
        if ledger:
            poller.start()
        seconds, n_steps = workload(server, args.rounds, args.requests, args.max_tokens)
        stop.set()
        out = {"seconds": seconds, "steps": n_steps, "step_ms": 1000 * seconds / max(n_steps, 1)}
        if ledger:
            doc = server.ledger_document()
            stats = doc["integration"]
            out["publish_seconds"] = float(stats["publish_seconds_total"])  # type: ignore[index]
            out["publications"] = float(stats["publications"])  # type: ignore[index]
            out["ledger_reads"] = reads[0]
        return out
    finally:
        stop.set()
        server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--poll", type=float, default=1.0)
    parser.add_argument("--modes", default=",".join(MODES), type=lambda v: v.split(","))
    args = parser.parse_args()
    ensure_vllm_env()
    model = make_tiny_model(Path(tempfile.mkdtemp(prefix="kvledger-bench-model-")))
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in args.modes}
    for pair in range(args.pairs):
        order = args.modes[pair % len(args.modes):] + args.modes[:pair % len(args.modes)]
        for mode in order:
            result = run_one(model, mode, args)
            results[mode].append(result)
            print(f"round {pair + 1} {mode}: {result}", flush=True)
    base = statistics.median(r["step_ms"] for r in results["off"]) if "off" in results else None
    print()
    print(f"workload: {args.rounds} x {args.requests} requests, {args.max_tokens} tokens, ledger read every {args.poll:g} s")
    print()
    print("| mode | step time (median) | vs off | publication time / wall time | step times |")
    print("|---|---|---|---|---|")
    for mode, runs in results.items():
        ms = statistics.median(r["step_ms"] for r in runs)
        ratio = f"{ms / base:.3f}" if base else "-"
        share = (f"{100 * statistics.median(r['publish_seconds'] / r['seconds'] for r in runs):.3f} %"
                 if mode != "off" else "-")
        print(f"| {mode} | {ms:.2f} ms | {ratio} | {share} | {[round(r['step_ms'], 2) for r in runs]} |")


if __name__ == "__main__":
    main()

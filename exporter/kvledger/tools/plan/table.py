"""A plan's report as a table for people (``render_table``; ``Report.to_json`` is for tools)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from kvledger.tools.plan.report import GIB, Report


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n:,} B ({n / GIB:.2f} GiB)" if n >= GIB // 16 else f"{n:,} B"


def render_table(r: Report) -> str:
    out: list[str] = []
    add = out.append
    if r.origin == "model":
        add(f"plan for {r.source}")
    else:
        add(f"plan from the live kvledger at {r.source} (engine {r.shapes.get('engine')})")
    dev = r.device
    if dev.get("memory_bytes") is not None:
        add(f"device: {dev.get('name') or ('GPU ' + str(dev['gpu']) if dev.get('gpu') is not None else 'GPU')}"
            f" {_size(dev['memory_bytes'])} [{dev['source']}]")
    shapes = ", ".join(f"{k}={v}" for k, v in r.shapes.items() if v is not None)
    add(f"shapes: {shapes}")
    if r.weights is not None:
        w = r.weights
        add(f"weights: {_size(w['bytes_per_gpu'])} per GPU, {w['params']:,} parameters ({w['dtype']}"
            + (f", {w['quantization']}" if w["quantization"] else "") + ") [counted]")
        for p in w["parts"]:
            add(f"  {p['name']:<15} {p['params']:>16,} params {_size(p['bytes_per_gpu']):>28} per GPU")
    add("")
    add("KV pools:")
    add(f"  {'pool':<16} {'layers':>6} {'window':>7} {'groups':>6} {'B/token':>10} {'B/token/GPU':>12} "
        f"{'B/block':>12} {'blocks at cap':>13}")
    for p in r.pools:
        add(f"  {p.id:<16} {_d(p.layers):>6} {_d(p.sliding_window):>7} {_d(p.layer_groups):>6} {_d(p.bytes_per_token):>10} "
            f"{_d(p.bytes_per_token_per_gpu):>12} {_d(p.block_bytes):>12} {_d(p.blocks_per_request_at_cap):>13}")
    if len(r.groups) > 1:
        add("")
        add("KV-cache groups (one block pool: a block belongs to one group at a time):")
        add(f"  {'group':>5} {'pool':<16} {'layers':<40} {'B':>6} {'page B/GPU':>12} {'padding':>9} {'blocks at cap':>13}")
        for g in r.groups:
            add(f"  {g.index:>5} {g.pool:<16} {_layers(g.layers, g.padding_layers):<40} {g.block_size:>6,} "
                f"{g.page_bytes_per_gpu:>12,} {g.page_padding_bytes_per_gpu:>9,} {g.blocks_per_request_at_cap:>13,}")
    add("")
    others = " + other_engines" if any(t.category == "other_engines" for t in r.terms) else ""
    add(f"budget per GPU (weights + workspace + runtime_buffers + reserve{others} + kv_pool <= total):")
    for t in r.terms:
        add(f"  {t.category:<16} {_size(t.bytes):>32}  [{t.source}]")
    for u in r.unknown_terms:
        add(f"  {u:<16} {'not given':>32}")
    if dev.get("memory_bytes") is not None:
        add(f"  {'total':<16} {_size(dev['memory_bytes']):>32}")
    add("")
    kv = r.kv
    basis = kv.get("basis")
    tag = " (estimate: rests on an estimated term, not a hard cap)" if basis == "estimate" else ""
    if kv.get("pool_bytes_per_gpu") is not None:
        label = "KV pool left" if kv.get("pool_source") == "derived" else "KV pool"
        add(f"{label}: {_size(kv['pool_bytes_per_gpu'])} per GPU [{kv.get('pool_source')}]{tag}")
    if kv.get("num_blocks") is not None:
        add(f"  blocks: {kv['num_blocks']:,} of {_size(kv['block_bytes_per_gpu'])} per GPU "
            f"({kv['layer_groups']} layer group(s) of {kv['layer_group_size']} layers), "
            f"{kv['usable_blocks']:,} usable (null block excluded)")
    elif kv.get("usable_blocks") is not None:
        add(f"  blocks: {kv['usable_blocks']:,} usable")
    if kv.get("token_capacity") is not None:
        add(f"  token capacity: {kv['token_capacity']:,} tokens")
    if len(r.groups) > 1 and kv.get("engine_max_concurrency") is not None:
        add(f"  as vLLM sizes it: {kv['engine_token_capacity']:,} tokens, maximum concurrency "
            f"{kv['engine_max_concurrency']:.2f}x for {r.shapes['max_model_len']:,} tokens per request "
            f"({kv['engine_blocks_per_request_at_max_model_len']:,} blocks each)")
    add(f"  one request at its cap: {kv['blocks_per_request_at_cap']:,} blocks")
    c = r.concurrency
    if c.get("reserve_cap") is not None:
        rc = c["reserve_cap"]
        add(f"worst-case concurrency (reserve-cap, every request at its cap): {rc['requests']:,} requests "
            f"(limited by {rc['limited_by']})" + (" [estimate]" if rc["basis"] == "estimate" else ""))
    if c.get("admitted_now") is not None:
        add(f"admitted now: {c['admitted_now']} requests; at their cap they need {c['admitted_at_cap_blocks']:,} blocks "
            f"({c['admitted_at_cap_basis']}): " + ("fits" if c["admitted_at_cap_fits"] else "DOES NOT FIT"))
    if c.get("dynamic") is not None:
        d = c["dynamic"]
        add(f"expected concurrency (dynamic, lengths {d['lengths']}): {d['requests']:,} requests "
            f"(limited by {d['limited_by']}; mean {d['mean_blocks_per_request']} blocks held per request) "
            "[estimate, not a cap]")
    elif r.origin == "model":
        add("expected concurrency (dynamic): give --length PROMPT:OUTPUT or --lengths-file FILE")
    add("")
    v = r.verdict
    state = {True: "CLOSES", False: "DOES NOT CLOSE", None: "UNDECIDED"}[v["closes"]]
    add(f"verdict: {state}: {v['message']}")
    for f in v["failures"][1:]:
        add(f"  also: {f['term']}: {f['why']}")
    for note in r.notes:
        add(f"note: {note}")
    return "\n".join(out)


def _d(v: int | None) -> str:
    return "-" if v is None else f"{v:,}"


def _layers(layers: Sequence[int], padding: int) -> str:
    """Layer indices, an arithmetic run of four or more shortened to 'a, b, .., z (n)'."""
    if len(layers) >= 4 and len({b - a for a, b in itertools.pairwise(layers)}) == 1:
        text = f"{layers[0]}, {layers[1]}, .., {layers[-1]} ({len(layers)})"
    else:
        text = ", ".join(map(str, layers))
    return text + (f" +{padding} pad" if padding else "")

"""The two pages the daemon serves from the package (no build step, no external assets):
the live ledger page at ``/`` and the cache lab at ``/lab`` (also ``kvledger lab --serve``).

The pages are static HTML, CSS and JavaScript under ``kvledger/web/``; they draw what two
small JSON documents built here say:

- ``/ui/ledger.json``: the latest Accounts per engine and pool, read through the metric
  catalogue's own extractors, so every number on the ledger page is a sample /metrics
  exports (same value, same basis) from the same accounting cycle (``taken_at``). Tenant
  names only when the JSON view is enabled. The page's data, not a stable API.
- ``/lab/run.json``: one run of ``kvledger.tools.lab.run_lab`` (the code behind ``kvledger lab``)
  to the 4,096-request cap, step by step with running totals; the lab page only replays it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, urlsplit

from kvledger import __version__
from kvledger.domain.accounts import Accounts
from kvledger.output.catalog import BY_NAME
from kvledger.tools.lab import MAX_REQUESTS, run_lab
from kvledger.web.connection import Request, Response, ascii_int

HTML = "text/html; charset=utf-8"
JSON = "application/json"
TEXT = "text/plain; charset=utf-8"
#: the pages load nothing from elsewhere and run no inline script
PAGE_HEADERS = (("Content-Security-Policy", "default-src 'self'; frame-ancestors 'none'"),
                ("X-Content-Type-Options", "nosniff"), ("Cache-Control", "no-cache"))
#: the response header naming the accounting cycle an answer shows (Accounts.taken_at, Unix seconds)
ACCOUNTS_HEADER = "X-Kvledger-Accounts-Taken-At"

#: the lab page draws every slot of the cache: capacity is bounded for the page, not for `kvledger lab`
LAB_MAX_CAPACITY = 256
LAB_MAX_WORKING_SET = MAX_REQUESTS

#: what /static/ serves (the HTML pages are templates, served only at their own paths)
STATIC_TYPES = {".css": "text/css; charset=utf-8", ".js": "text/javascript; charset=utf-8", ".svg": "image/svg+xml"}


# ---------------------------------------------------------------- static files


_ASSETS: dict[str, bytes] = {}  # the files read so far (only files that exist: the names are few)


def asset(name: str) -> bytes | None:
    """The bytes of ``kvledger/web/NAME`` (a plain file name, no folders), or None."""
    if not name or "/" in name or "\\" in name or name.startswith("."):
        return None
    body = _ASSETS.get(name)
    if body is None:
        path = resources.files("kvledger.web").joinpath("static", name)
        if not path.is_file():
            return None
        body = _ASSETS[name] = path.read_bytes()
    return body


def static_response(name: str) -> Response | None:
    """/static/NAME: a stylesheet or script of the package, or None."""
    ext = name[name.rfind("."):] if "." in name else ""
    body = asset(name) if ext in STATIC_TYPES else None
    if body is None:
        return None
    return Response(200, body, (("Content-Type", STATIC_TYPES[ext]), *PAGE_HEADERS))


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def page(name: str, links: Iterable[tuple[str, str]] = ()) -> Response:
    """An HTML page of the package with its version and its list of links filled in."""
    body = asset(name)
    assert body is not None, name
    items = "".join(f'<li><a href="{_escape(href)}">{_escape(text)}</a></li>' for href, text in links)
    html = body.decode().replace("{{version}}", _escape(__version__)).replace("{{links}}", items)
    return Response(200, html.encode(), (("Content-Type", HTML), *PAGE_HEADERS))


def json_response(doc: Mapping[str, Any], status: int = 200, extra: tuple[tuple[str, str], ...] = ()) -> Response:
    body = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
    return Response(status, body, (("Content-Type", JSON), ("Cache-Control", "no-store"), *extra))


# ---------------------------------------------------------------- the ledger document

Labels = tuple[str, ...]
#: one quantity as /metrics exports it: {basis: value}, basis "exact", "lower_bound" or "upper_bound"
Quantity = dict[str, float]

#: the page's quantities and the families they are read from (bytes; blocks when a pool has no bytes)
BYTES = {"in_use": "kvledger_kv_in_use_bytes", "reclaimable": "kvledger_kv_reclaimable_bytes",
         "free": "kvledger_kv_free_bytes", "allocated": "kvledger_kv_allocated_bytes",
         "reserved": "kvledger_kv_reserved_bytes"}


def _samples(name: str, accounts: Accounts) -> list[tuple[dict[str, str], float]]:
    spec = BY_NAME[name]
    return list(spec.labelled(accounts))


def _measures(name: str, accounts: Accounts, key: tuple[str, ...]) -> dict[Labels, Quantity]:
    """{(label values of ``key``): {basis: value}} of a family with a basis label."""
    out: dict[Labels, Quantity] = {}
    for labels, value in _samples(name, accounts):
        out.setdefault(tuple(labels[k] for k in key), {})[labels["basis"]] = value
    return out


def _values(name: str, accounts: Accounts, key: tuple[str, ...]) -> dict[Labels, float]:
    return {tuple(labels[k] for k in key): value for labels, value in _samples(name, accounts)}


@dataclass(frozen=True)
class _PoolSamples:
    """The pool families of one Accounts, keyed by (engine, pool[, state or view])."""

    capacity_bytes: dict[Labels, float]
    capacity_blocks: dict[Labels, float]
    block_size: dict[Labels, float]
    blocks: dict[Labels, float]  # (engine, pool, state), exact states only
    headroom: dict[Labels, Quantity]  # (engine, pool, view)
    reserved_blocks: dict[Labels, Quantity]
    bytes: dict[str, dict[Labels, Quantity]]  # quantity of BYTES -> (engine, pool) -> quantity
    groups: dict[Labels, list[dict[str, Any]]]  # (engine, pool) -> its KV-cache groups, in order

    @staticmethod
    def of(accounts: Accounts) -> _PoolSamples:
        ep = ("engine", "pool")
        return _PoolSamples(
            capacity_bytes=_values("kvledger_kv_capacity_bytes", accounts, ep),
            capacity_blocks=_values("kvledger_kv_capacity_blocks", accounts, ep),
            block_size=_values("kvledger_kv_block_size_tokens", accounts, ep),
            blocks=_values("kvledger_kv_blocks", accounts, (*ep, "state")),
            headroom=_measures("kvledger_kv_headroom_bytes", accounts, (*ep, "view")),
            reserved_blocks=_measures("kvledger_kv_reserved_blocks", accounts, ep),
            bytes={quantity: _measures(family, accounts, ep) for quantity, family in BYTES.items()},
            groups=_groups(accounts),
        )

    def pool(self, engine: str, pool: str) -> dict[str, Any]:
        ep = (engine, pool)
        doc: dict[str, Any] = {
            "pool": pool,
            "capacity_blocks": self.capacity_blocks.get(ep),
            "block_size_tokens": self.block_size.get(ep),
        }
        capacity_bytes = self.capacity_bytes.get(ep)
        if capacity_bytes is not None:
            doc["unit"] = "bytes"
            doc["capacity"] = capacity_bytes
            for quantity, by_pool in self.bytes.items():
                if (m := by_pool.get(ep)) is not None:
                    doc[quantity] = m
            for view in ("quota", "physical"):
                if (m := self.headroom.get((*ep, view))) is not None:
                    doc[f"{view}_headroom"] = m
        else:  # no bytes per block: the bar is drawn in blocks, from the exact block partition
            doc["unit"] = "blocks"
            doc["capacity"] = doc["capacity_blocks"]
            for state in ("in_use", "reclaimable", "free"):
                if (v := self.blocks.get((*ep, state))) is not None:
                    doc[state] = {"exact": v}
            if (m := self.reserved_blocks.get(ep)) is not None:
                doc["reserved"] = m
        if ep in self.groups:
            doc["groups"] = self.groups[ep]  # in blocks: a group's blocks are the pool's
        return doc


def _groups(accounts: Accounts) -> dict[Labels, list[dict[str, Any]]]:
    """Per pool shared by KV-cache groups: each group's kind, window, blocks in use and
    reservation (blocks, with their basis), as /metrics shows them."""
    in_use = _values("kvledger_kv_group_in_use_blocks", accounts, ("engine", "pool", "group"))
    reserved = _measures("kvledger_kv_group_reserved_blocks", accounts, ("engine", "pool", "group"))
    out: dict[Labels, list[dict[str, Any]]] = {}
    for labels, _ in _samples("kvledger_kv_group_info", accounts):
        key = (labels["engine"], labels["pool"], labels["group"])
        out.setdefault(key[:2], []).append({
            "group": labels["group"],
            "layer_type": labels["layer_type"],
            "window_tokens": labels["window_tokens"] or None,
            "in_use": None if key not in in_use else {"exact": in_use[key]},
            "reserved": reserved.get(key),
        })  # fmt: skip
    return out


def ledger_page_data(accounts: Accounts | None, json_view: bool,
                    messages: Mapping[tuple[str, str], str | None] | None = None) -> dict[str, Any]:
    """What the ledger page draws, from one Accounts: per engine its policy, source health,
    requests and, per pool, capacity split into in use / reclaimable / free, the reservation
    and the two headrooms, every number a sample of /metrics with its basis. ``json_view``
    adds tenants (their names) and the sources' failure messages (``messages``)."""
    doc: dict[str, Any] = {"version": __version__, "taken_at": None, "sharing": None, "json_view": json_view,
                           "engines": [], "node_sources": []}
    if accounts is None:
        return doc
    doc["taken_at"] = accounts.taken_at
    doc["sharing"] = accounts.sharing
    pools = _PoolSamples.of(accounts)
    policy = {labels["engine"]: labels for labels, _ in _samples("kvledger_policy_info", accounts)}
    info = {labels["engine"]: labels for labels, _ in _samples("kvledger_engine_info", accounts)}
    requests: dict[str, dict[str, float]] = {}
    for labels, value in _samples("kvledger_requests", accounts):
        requests.setdefault(labels["engine"], {})[labels["state"]] = value
    sources: dict[str, list[dict[str, Any]]] = {}
    for h in accounts.health:
        entry: dict[str, Any] = {"source": h.source, "up": h.up, "reason": None if h.up else h.reason,
                                 "last_success": h.last_success}
        if json_view and messages is not None and not h.up:
            entry["message"] = messages.get((h.engine, h.source))
        sources.setdefault(h.engine, []).append(entry)
    doc["node_sources"] = sources.pop("", [])
    tenants: dict[str, list[dict[str, Any]]] = {}
    if json_view:
        reserved = _values("kvledger_tenant_reserved_bytes", accounts, ("engine", "tenant"))
        quota = _values("kvledger_tenant_quota_bytes", accounts, ("engine", "tenant"))
        for e in accounts.engines:
            for t in e.tenants:
                tenants.setdefault(e.name, []).append({"tenant": t.tenant, "reserved_bytes": reserved.get((e.name, t.tenant)),
                                                       "quota_bytes": quota.get((e.name, t.tenant))})
    for e in accounts.engines:
        p = policy.get(e.name, {})
        i = info.get(e.name, {})
        engine: dict[str, Any] = {
            "engine": e.name,
            "kind": i.get("kind"),
            "version": i.get("version") or None,
            "policy": {k: p[k] for k in ("sharing", "admission", "overflow", "tenant_rule") if k in p},
            "requests": requests.get(e.name, {}),
            "sources": sources.get(e.name, []),
            "pools": [pools.pool(e.name, pool.pool) for pool in e.pools],
        }
        if json_view:
            engine["tenants"] = tenants.get(e.name, [])
        doc["engines"].append(engine)
    return doc


def accounts_header(accounts: Accounts | None) -> tuple[tuple[str, str], ...]:
    """The header naming the accounting cycle an answer shows; none before the first one."""
    return () if accounts is None else ((ACCOUNTS_HEADER, repr(accounts.taken_at)),)


# ---------------------------------------------------------------- the lab document


class LabRequestError(ValueError):
    """A query the lab cannot run; the message says which parameter and why."""


def _int_param(query: dict[str, list[str]], name: str, low: int, high: int, default: int | None = None) -> int:
    values = query.get(name)
    if not values:
        if default is None:
            raise LabRequestError(f"{name} is required")
        return default
    value = ascii_int(values[-1])  # ASCII digits only: int() would read "%D9%A3" (Arabic-Indic three) as 3
    if value is None:
        raise LabRequestError(f"{name} must be an integer (ASCII digits 0-9 only)")
    if not low <= value <= high:
        raise LabRequestError(f"{name} must be between {low} and {high}")
    return value


def lab_params(query_string: str) -> tuple[int, int, int]:
    """(capacity, working_set, requests) of a /lab/run.json query; LabRequestError names the bad one."""
    query = parse_qs(query_string, keep_blank_values=True)
    capacity = _int_param(query, "capacity", 1, LAB_MAX_CAPACITY)
    working_set = _int_param(query, "working_set", 1, LAB_MAX_WORKING_SET)
    return capacity, working_set, _int_param(query, "requests", 1, MAX_REQUESTS, MAX_REQUESTS)


def lab_page_data(query_string: str) -> dict[str, Any]:
    """``capacity=C&working_set=S[&requests=N]`` → the run of ``run_lab(C, S, N)`` (N defaults
    to the cap), columnar: per step the identifier requested, hit or miss, the identifier
    evicted (null when none) and the running totals of hits, misses and evictions after it."""
    capacity, working_set, n = lab_params(query_string)
    result = run_lab(capacity, working_set, n)
    keys: list[int] = []
    hit: list[bool] = []
    evicted: list[int | None] = []
    hits: list[int] = []
    misses: list[int] = []
    evictions: list[int] = []
    h = e = 0
    for step in result.steps:
        h += step.hit
        e += step.evicted is not None
        keys.append(step.key)
        hit.append(step.hit)
        evicted.append(step.evicted)
        hits.append(h)
        misses.append(step.index - h)
        evictions.append(e)
    return {
        "capacity": capacity,
        "working_set": working_set,
        "requests": n,
        "max_requests": MAX_REQUESTS,
        "steps": {"key": keys, "hit": hit, "evicted": evicted, "hits": hits, "misses": misses, "evictions": evictions},
        "totals": {"hits": result.hits, "misses": result.misses, "evictions": result.evictions},
        "cache": list(result.steps[-1].cache),  # after the last step, least recently used first
    }


def lab_response(target: str) -> Response:
    try:
        return json_response(lab_page_data(urlsplit(target).query))
    except LabRequestError as exc:
        return json_response({"error": str(exc)}, status=400)


@dataclass(frozen=True)
class LabSite:
    """What `kvledger lab --serve` answers: the lab page (at / and /lab), its assets, its
    run document, /-/healthy and /-/ready."""

    def respond(self, request: Request) -> Response:
        if request.method not in ("GET", "HEAD"):
            return Response(405, b"only GET and HEAD are served\n", (("Content-Type", TEXT), ("Allow", "GET, HEAD")))
        path = urlsplit(request.target).path
        if path in ("/", "/lab"):
            return page("lab.html")
        if path == "/lab/run.json":
            return lab_response(request.target)
        if path in ("/-/healthy", "/-/ready"):
            return Response(200, b"kvledger lab is ready.\n", (("Content-Type", TEXT),))
        if path.startswith("/static/") and (response := static_response(path.removeprefix("/static/"))) is not None:
            return response
        return Response(404, b"not found\n", (("Content-Type", TEXT),))

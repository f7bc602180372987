"""The configuration reference, derived from the typed configuration (``config.types``): every key of
a kvledger configuration file with its type, its default and the kinds that take it.

The keys, types and defaults come from the dataclasses themselves; what each key means is
written once here (``MEANING``), and a test fails when a field of the model has no meaning
or a meaning names no field. ``kvledger.tools.docgen`` renders ``rows()`` into
docs/configuration.md.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from kvledger.config import types as config_types

#: the YAML key of a field where it differs from the field's name; None: not a key of the file
KEY: dict[tuple[type, str], str | None] = {
    (config_types.Config, "sharing"): "policy.sharing",
    (config_types.Config, "otlp_endpoint"): "otlp.endpoint",
    (config_types.Config, "path"): None,  # the file's own path
    (config_types.Config, "warnings"): None,  # what the loader noticed
    (config_types.EngineConfig, "options"): None,  # the kinds' own keys: listed from the kinds' registrations
}

#: the memory budget terms' keys (memory.<key>: {value, source}); the loader reads the same names
MEMORY_KEYS: dict[str, str] = {
    "weights_bytes": "the model's weights",
    "workspace_bytes": "activation workspace at the engine's largest shapes",
    "runtime_buffers_bytes": "CUDA graphs, communication buffers and other runtime allocations",
    "reserve_bytes": "headroom kept free on purpose (not an allocation)",
    "kv_pool_bytes": "the KV pool, when the engine does not say",
}

#: what each key means, by its key path (``engines[].`` for an engine entry's keys)
MEANING: dict[str, str] = {
    "listen": "HOST:PORT of /metrics and the pages (`--web.listen-address` overrides it)",
    "interval_seconds": "poll interval, 0.1 s to 1 h",
    "policy.sharing": "how shared prefix blocks count toward reservations: `per-request` or `reference-aware`",
    "nvml.enabled": "GPU memory from NVML: `auto` (when libnvidia-ml.so.1 loads), `true` or `false`",
    "engines": "the engines to read, one entry each",
    "json_view": "serve /api/v1/accounts; tenant names and failure messages on the ledger page",
    "otlp.endpoint": "push the same metrics by OTLP/HTTP to this collector (a restart applies a change)",
    "limits.tenants_per_engine": "tenants beyond this many are dropped (sorted by name) and counted",
    "limits.pools_per_engine": "an engine reporting more pools has its facts refused (source down, reason invalid)",
    "limits.label_value_length": "longer label values from engine data are shortened to a prefix and a hash, 16 to 4096",
    "limits.memory_budget_bytes": "engine answers in flight and their parses, all engines together (an answer counts "
                                  "8x its size: its body and its parse); one that does not fit is refused (reason "
                                  "too_large) and asked again next cycle, 1MiB to 1TiB",
    "web_config_file": "exporter-toolkit web configuration (TLS, basic auth), relative to this file; checked at load",
    "engines[].name": "the `engine` label; unique",
    "engines[].kind": "the engine kind (docs/engines/)",
    "engines[].url": "the engine's /metrics, or for `ledger` its kvledger/v1 document: http(s)://... or unix:///absolute/path",
    "engines[].timeout_seconds": "per poll: connect, headers and body together, 0.1 s to 10 min",
    "engines[].admission": "override the engine's admission rule: `reserve-cap` or `dynamic`",
    "engines[].overflow": "override what happens when an estimate is exceeded",
    "engines[].block_bytes": "bytes of one KV block over all layers and TP ranks, when the engine does not export it "
                             "(or `model`, not both)",
    "engines[].model.config": "a model's Hugging Face config.json, relative to this file; read and checked at load",
    "engines[].model.kv_dtype": "KV cache element type (`auto` follows the model's dtype; `fp8`, ...)",
    "engines[].model.tensor_parallel": "tensor-parallel ranks the KV heads are split over",
    "engines[].max_model_len": "maximum context per request, when the engine does not export it",
    "engines[].max_num_batched_tokens": "per-iteration token budget, when the engine does not export it",
    "engines[].max_num_seqs": "maximum running requests, when the engine does not export it",
    "engines[].gpus": "GPU indices the engine runs on (the device budget, NVML attribution)",
    "engines[].processes.match": "a substring of the engine processes' command line (NVML per-process memory)",
    "engines[].processes.pids": "the engine's process IDs, instead of `match`",
    "engines[].memory": "device budget terms per GPU, each `{value: SIZE, source: measured|configured|estimate}`",
    "engines[].host.port": "the engine's serving port: its kernel socket queues from /proc/net/tcp{,6}",
    "engines[].host.output_buffer_limit_bytes": "the engine's host output buffer limit, `{value: SIZE, kind: hard|estimate}`",
    "engines[].host.network_queue_limit": "the engine's network queue limit, `{value: N, kind: hard|estimate}`",
    "engines[].tenants": "tenants and their KV quotas",
    "engines[].tenants[].name": "the `tenant` label",
    "engines[].tenants[].quota_bytes": "the tenant's KV quota",
    "engines[].max_response_bytes": "a larger answer is refused (reason too_large), 4KiB to 1GiB",
    "engines[].max_response_lines": "an answer of Prometheus text with more lines is refused while it streams in "
                                    "(reason too_large), before any parse; 50,000 by default, 1 to 10,000,000",
    "engines[].authorization.type": "the Authorization header's type (Basic is basic_auth's)",
    "engines[].authorization.credentials": "the credentials, inline (or credentials_file, not both)",
    "engines[].authorization.credentials_file": "a file holding the credentials, read at every request (rotation)",
    "engines[].basic_auth.username": "basic auth user",
    "engines[].basic_auth.password": "basic auth password, inline (or password_file)",
    "engines[].basic_auth.password_file": "a file holding the password, read at every request",
    "engines[].tls_config.ca_file": "CA certificates that verify the engine (else the system's)",
    "engines[].tls_config.cert_file": "a client certificate (mTLS), with key_file",
    "engines[].tls_config.key_file": "the client certificate's key",
    "engines[].tls_config.server_name": "the name the engine's certificate must carry (and SNI), else the URL's host",
    "engines[].tls_config.insecure_skip_verify": "do not verify the engine's certificate",
}


@dataclass(frozen=True)
class Row:
    key: str
    type: str
    default: str
    kinds: str  # "every kind", or the kinds that take the key
    meaning: str


def _literal(tp: Any) -> list[str] | None:
    if typing.get_origin(tp) is Literal:
        return [str(v) for v in typing.get_args(tp)]
    return None


def _describe(name: str, tp: Any) -> str:
    """The type as a user writes it in YAML."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        tp = next(a for a in args if a is not type(None))
        args = typing.get_args(tp)
    if (choices := _literal(tp)) is not None:
        return " \\| ".join(f"`{c}`" for c in choices)
    if tp is bool:
        return "`true` \\| `false`"
    if tp is float and name.endswith("_seconds"):
        return "duration (seconds, or `500ms`, `2s`, `1m`)"
    if tp is int and name.endswith("_bytes"):
        return "size (bytes, or `2GiB`, `500MB`)"
    if tp is int:
        return "integer"
    if tp is float:
        return "number"
    if typing.get_origin(tp) is tuple and args and args[0] is int:
        return "list of integers"
    if tp is config_types.Secret:
        return "text (secret: shown as `<secret>`)"
    if (tp is str and name.endswith("_file")) or name == "config":
        return "file path"
    if tp is str and (name == "url" or name.endswith("_endpoint")):
        return "URL"
    if tp is str:
        return "text"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    if typing.get_origin(tp) is tuple:
        return "list of mappings"
    return str(tp)


def _default(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if value is None or value == () or value == {} or dataclasses.is_dataclass(value):
        return "-"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, int) and f.name.endswith("_bytes") and value >= 1 << 20 and value % (1 << 20) == 0:
        return f"`{value >> 20}MiB`"
    return f"`{value}`"


def _walk(cls: Any, prefix: str, common: bool) -> Iterator[Row]:
    """The rows of a dataclass's fields; ``common``: they are keys of an engine entry."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = KEY.get((cls, f.name), f.name)
        if key is None:
            continue
        path = prefix + key
        tp = hints[f.name]
        inner = tp
        if typing.get_origin(tp) in (typing.Union, types.UnionType):
            inner = next(a for a in typing.get_args(tp) if a is not type(None))
        args = typing.get_args(inner)
        if inner is config_types.MemoryConfig:
            yield Row(path, "mapping", "-", _kinds(common), MEANING[path])
            for term, meaning in MEMORY_KEYS.items():
                yield Row(f"{path}.{term}", "`{value: SIZE, source: measured \\| configured \\| estimate}`", "-",
                          _kinds(common), meaning)
        elif inner in (config_types.LimitConfig,):
            yield Row(path, f"`{{value: {'SIZE' if key.endswith('_bytes') else 'N'}, kind: hard \\| estimate}}`", "-",
                      _kinds(common), MEANING[path])
        elif dataclasses.is_dataclass(inner):
            yield from _walk(inner, f"{path}.", common)
        elif typing.get_origin(inner) is tuple and args and dataclasses.is_dataclass(args[0]):
            yield Row(path, "list of mappings", "-", _kinds(bool(prefix)), MEANING[path])
            yield from _walk(args[0], f"{path}[].", common or args[0] is config_types.EngineConfig)
        else:
            yield Row(path, _describe(f.name, tp), _default(f), _kinds(prefix.startswith("engines")),
                      MEANING[path])


def _kinds(engine_key: bool) -> str:
    return "every kind" if engine_key else ""


def rows(kinds: Mapping[str, Any] | None = None) -> list[Row]:
    """Every key of the file: the model's fields, then each engine kind's own keys (``kinds``:
    the registrations of kvledger.config.engine_kinds, given by the caller)."""
    out = list(_walk(config_types.Config, "", False))
    option_types = {"address": "URL", "zmq": "ZMQ endpoint (`tcp://HOST:PORT`, `ipc:///path`)", "path": "file path",
                    "boolean": "`true` \\| `false`", "tokens": "integer (tokens)",
                    "steps": "integer (engine steps)"}
    owners: dict[str, list[str]] = {}
    first: dict[str, Any] = {}
    for kind in (kinds or {}).values():
        for option in kind.options:
            owners.setdefault(option.name, []).append(kind.name)
            first.setdefault(option.name, option)
    if kinds:
        out = [dataclasses.replace(r, type=" \\| ".join(f"`{k}`" for k in kinds)) if r.key == "engines[].kind" else r
               for r in out]
    for name, option in first.items():
        out.append(Row(f"engines[].{name}", option_types[option.value], "-", ", ".join(f"`{k}`" for k in owners[name]),
                       option.help))
    return out


def field_paths() -> set[str]:
    """Every key path of the model (not the kinds' own keys): what MEANING must describe."""
    return {r.key for r in _walk(config_types.Config, "", False) if not r.key.startswith("engines[].memory.")}

"""Fuzzing the configuration loader: random mappings (as data and as YAML files) and
text mutations of deploy/examples/*.yml (extreme scalars, .nan/.inf, duplicated and
dropped lines, invalid UTF-8, deep nesting).

Each case: ``load_config``/``config_from_mapping`` raise ConfigError (``file: key.path:
message``) or return a Config whose numbers are finite and within the documented
bounds; each accepted engine's settings, applied to an engine's facts as the ledger
source applies them, account and render cleanly.
"""

from __future__ import annotations

import dataclasses
import math
import re
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from fuzz_support import EXTREMES, FUZZ, assert_exports_cleanly, assert_facts_in_range, healthy_engine
from hypothesis import event, given
from hypothesis import strategies as st

from kvledger.collect.merge import configured_facts, merge
from kvledger.config.engine_kinds import KINDS
from kvledger.config.loader import config_from_mapping, load_config
from kvledger.config.types import MAX_INTERVAL, MAX_TIMEOUT, MIN_INTERVAL, MIN_TIMEOUT, Config, ConfigError
from kvledger.domain.limits import MAX_SAFE_INT, MAX_TOKENS

EXAMPLES = {p.name: p.read_text() for p in sorted((Path(__file__).parent.parent / "deploy" / "examples").glob("*.yml"))}
_TMP = tempfile.TemporaryDirectory(prefix="kvledger-fuzz-config-")

TOP_KEYS = ("listen", "interval_seconds", "policy", "nvml", "engines", "json_view", "otlp", "typo")
ENGINE_KEYS = ("name", "kind", "url", "timeout_seconds", "kv_events", "kv_events_replay", "log_file", "admission",
               "overflow", "block_bytes", "model", "max_model_len", "max_num_batched_tokens", "max_num_seqs", "gpus",
               "processes", "memory", "host", "tenants", "typo")
PLAUSIBLE: dict[str, Any] = {
    "listen": ["127.0.0.1:9477", ":0", "host:65536"], "interval_seconds": [0.1, 0.25, 1, "500ms", "1ms", "2h", 3600],
    "policy": [{"sharing": "reference-aware"}], "nvml": [{"enabled": "auto"}, {"enabled": False}],
    "json_view": [True], "otlp": [{"endpoint": "http://127.0.0.1:4318"}],
    "name": ["e", "healthy", ""], "kind": list(KINDS),
    "url": ["http://127.0.0.1:8000/metrics", "unix:///run/e.sock", "unix://etc/passwd", "unix:///", "http://", "https://h",
            "tcp://1.2.3.4:5", "ftp://x"],
    "timeout_seconds": [0.05, 0.1, 2, "1s", "10m", "11m"], "kv_events": ["tcp://127.0.0.1:5557", "ipc:///tmp/x"],
    "admission": ["dynamic", "eager"], "overflow": ["swap"], "block_bytes": [2097152, "2MiB", "1.5MiB", "99999999TiB"],
    "model": [{"config": "/nonexistent.json", "tensor_parallel": 2}], "max_model_len": [8192, 2**30, 2**30 + 1],
    "gpus": [[0, 1], [-1], [2**40]], "processes": [{"match": "vllm"}, {"pids": [1, 2]}, {}],
    "memory": [{"reserve_bytes": {"value": "2GiB", "source": "configured"}}, {"weights_bytes": 1.0e300},
               {"kv_pool_bytes": "8GiB"}],
    "host": [{"port": 8000, "output_buffer_limit_bytes": {"value": 67108864, "kind": "hard"}, "network_queue_limit": 1024},
             {"port": 70000}, {"network_queue_limit": {"value": 2**40, "kind": "estimate"}}],
    "tenants": [[{"name": "a", "quota_bytes": "10GiB"}], [{"name": "a", "quota_bytes": 1}, {"name": "a", "quota_bytes": 2}],
                [{"name": "b", "quota_bytes": 2**60}]],
}
_value_of = {k: st.one_of(st.sampled_from(v), st.sampled_from(EXTREMES)) for k, v in PLAUSIBLE.items()}
_any = st.sampled_from(EXTREMES)


@st.composite
def engines(draw: st.DrawFn, i: int) -> dict[str, Any]:
    out: dict[str, Any] = {"name": f"e{i}", "kind": "ledger", "url": "http://127.0.0.1:8000/"}
    for key in draw(st.lists(st.sampled_from(ENGINE_KEYS), max_size=6, unique=True)):
        out[key] = draw(_value_of.get(key, _any))
    return out


@st.composite
def mappings(draw: st.DrawFn) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in draw(st.lists(st.sampled_from(TOP_KEYS), max_size=4, unique=True)):
        out[key] = draw(_value_of.get(key, _any))
    if draw(st.booleans()):
        out["engines"] = [draw(engines(i)) for i in range(draw(st.integers(1, 3)))]
    return out


def _walk(value: Any, path: str) -> list[tuple[str, Any]]:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [x for f in dataclasses.fields(value) for x in _walk(getattr(value, f.name), f"{path}.{f.name}")]
    if isinstance(value, dict):
        return [x for k, v in value.items() for x in _walk(v, f"{path}[{k!r}]")]
    if isinstance(value, (list, tuple)):
        return [x for i, v in enumerate(value) for x in _walk(v, f"{path}[{i}]")]
    return [(path, value)]


def _check_accepted(config: Config) -> None:
    for path, v in _walk(config, "config"):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        assert math.isfinite(v) and 0 <= v <= MAX_SAFE_INT, f"{path} = {v!r}"
    assert MIN_INTERVAL <= config.interval_seconds <= MAX_INTERVAL
    for e in config.engines:
        assert MIN_TIMEOUT <= e.timeout_seconds <= MAX_TIMEOUT
        for budget in (e.max_model_len, e.max_num_batched_tokens, e.max_num_seqs):
            assert budget is None or 1 <= budget <= MAX_TOKENS
        for url in (e.url, e.option("kv_events"), e.option("kv_events_replay")):
            assert url is None or not url.startswith("unix://") or re.match(r"^unix:///[^/]", url), url
        facts = merge(healthy_engine(), configured_facts(e))  # what only the configuration knows, on a document's facts
        assert_facts_in_range(facts)
        assert_exports_cleanly(facts, config.sharing)


def _load_text(data: bytes) -> Config:
    path = Path(_TMP.name) / "fuzz.yml"
    path.write_bytes(data)
    return load_config(path)


@FUZZ
@given(mappings())
def test_fuzz_config_mappings(data: dict[str, Any]) -> None:
    try:
        config = config_from_mapping(data, "fuzz.yml")
    except ConfigError as exc:
        assert str(exc).startswith("fuzz.yml: "), exc
        event("rejected")
        return
    event("accepted")
    _check_accepted(config)


@FUZZ
@given(mappings())
def test_fuzz_config_yaml_files(data: dict[str, Any]) -> None:
    text = yaml.safe_dump(data, allow_unicode=True).encode()
    try:
        config = _load_text(text)
    except ConfigError as exc:
        assert str(exc).startswith(str(Path(_TMP.name) / "fuzz.yml") + ": "), exc
        event("rejected")
        return
    event("accepted")
    _check_accepted(config)


YAML_SCALARS = (".nan", ".NaN", ".inf", "-.inf", "1ms", "0", "-1", "1e999", "1.0e+999", "99999999999999999999999",
                "0x7fffffffffffffff", "unix://etc/passwd", "unix:///", "http://", "0.001", "2001-02-30", "[", "{a: 1}",
                "~", "''", "!!python/object/apply:os.system ['true']", "&a x", "*a", "'" + "x" * 5000 + "'", "1_000",
                "0o17", "yes", "null", "2GiB", "1.5MiB")


@st.composite
def mutated_examples(draw: st.DrawFn) -> bytes:
    lines = EXAMPLES[draw(st.sampled_from(sorted(EXAMPLES)))].split("\n")
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.integers(0, 5))
        scalars = [i for i, line in enumerate(lines) if re.match(r"^\s*-?\s*[A-Za-z_]+: \S", line)]
        if kind <= 1 and scalars:
            i = draw(st.sampled_from(scalars))
            key, _, _ = lines[i].partition(": ")
            lines[i] = f"{key}: {draw(st.sampled_from(YAML_SCALARS))}"
        elif kind == 2 and lines:  # duplicated line: a duplicate key
            i = draw(st.integers(0, len(lines) - 1))
            lines.insert(i, lines[i])
        elif kind == 3 and lines:
            del lines[draw(st.integers(0, len(lines) - 1))]
        elif kind == 4:
            depth = draw(st.sampled_from([10, 200, 400, 3000]))  # 3000: RecursionError path, ~1 s
            lines.append("deep: " + "[" * depth + "]" * depth)
        else:
            text = "\n".join(lines).encode()
            i = draw(st.integers(0, len(text)))
            return text[:i] + bytes([draw(st.integers(128, 255))]) + text[i:]
    return "\n".join(lines).encode()


@FUZZ
@given(mutated_examples())
def test_fuzz_example_configs(text: bytes) -> None:
    try:
        config = _load_text(text)
    except ConfigError:
        event("rejected")
        return
    event("accepted")
    _check_accepted(config)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_examples_are_accepted(name: str) -> None:
    _check_accepted(_load_text(EXAMPLES[name].encode()))


# ---------------------------------------------------------------- the probe's findings, pinned


def _error(text: str | bytes) -> str:
    with pytest.raises(ConfigError) as err:
        _load_text(text.encode() if isinstance(text, str) else text)
    return str(err.value).removeprefix(str(Path(_TMP.name) / "fuzz.yml") + ": ")


def test_non_utf8_names_the_byte_offset() -> None:
    assert _error(b"listen: '\xff'\n") == "not UTF-8 text: invalid start byte at byte offset 9"


def test_duplicate_keys_name_key_and_line() -> None:
    assert _error("listen: a:1\ninterval_seconds: 1\nlisten: b:2\n") == (
        "invalid YAML at line 3, column 1: duplicate key 'listen' (first given at line 1)")
    assert _error("engines:\n  - name: a\n    url: http://x\n    kind: ledger\n    url: http://y\n") == (
        "invalid YAML at line 5, column 5: duplicate key 'url' (first given at line 3)")


def test_merge_keys_may_override() -> None:
    text = "base: &b {name: a, kind: ledger, url: 'http://x'}\n"
    with pytest.raises(ConfigError, match="unknown key"):  # 'base' is unknown, but the merge itself is no duplicate
        _load_text((text + "engines:\n  - <<: *b\n    name: c\n").encode())


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("interval_seconds: 1ms\n", "interval_seconds: must be between 0.1 s and 3600 s, got '1ms'"),
        ("interval_seconds: .nan\n", "interval_seconds: a duration must be a finite number of seconds, got nan"),
        ("interval_seconds: .inf\n", "interval_seconds: a duration must be a finite number of seconds, got inf"),
        ("engines:\n  - {name: a, kind: ledger, url: 'http://x', timeout_seconds: 0.001}\n",
         "engines[0].timeout_seconds: must be between 0.1 s and 600 s, got 0.001"),
        ("engines:\n  - {name: a, kind: ledger, url: 'unix://etc/passwd'}\n",
         "engines[0].url: a unix URL is unix:///absolute/path (three slashes), e.g. unix:///run/engine.sock; got 'unix://etc/passwd'"),
        ("engines:\n  - {name: a, kind: ledger, url: 'http://x', block_bytes: 99999999999TiB}\n",
         "engines[0].block_bytes: size '99999999999TiB' exceeds 9007199254740991 bytes (2**53 - 1)"),
        ("engines:\n  - {name: a, kind: ledger, url: 'http://x', block_bytes: .inf}\n",
         "engines[0].block_bytes: expected a size such as 2147483648, '2GiB' or '500MB', got inf"),
        ("engines:\n  - {name: a, kind: ledger, url: 'http://x', max_model_len: 1073741825}\n",
         "engines[0].max_model_len: must be at most 1073741824, got 1073741825"),
        ("engines:\n  - {name: a, kind: ledger, url: 'http://x', host: {network_queue_limit: .nan}}\n",
         "engines[0].host.network_queue_limit: expected a positive integer, got nan"),
    ],
)
def test_probe_findings(text: str, message: str) -> None:
    assert _error(text) == message


def test_deep_nesting_is_a_config_error() -> None:
    assert _error("x: " + "[" * 5000 + "]" * 5000 + "\n") == "invalid YAML: nested too deeply"

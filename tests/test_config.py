"""Configuration: typed objects, clear errors naming the file and key path."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvledger.config.engine_kinds import KINDS
from kvledger.config.loader import load_config, parse_duration, parse_size
from kvledger.config.types import ConfigError

GOOD = """
listen: "127.0.0.1:9500"
interval_seconds: 0.5
policy:
  sharing: reference-aware
nvml:
  enabled: false
engines:
  - name: llama-8b
    kind: vllm
    url: http://127.0.0.1:8000/metrics
    timeout_seconds: 500ms
    kv_events: tcp://127.0.0.1:5557
    block_bytes: 2MiB
    max_model_len: 8192
    max_num_batched_tokens: 8192
    max_num_seqs: 256
    gpus: [0, 1]
    processes: {match: "vllm"}
    memory: {reserve_bytes: {value: 2GiB, source: configured}, weights_bytes: 16GB}
    host: {port: 8000, output_buffer_limit_bytes: {value: 64MiB, kind: hard},
           network_queue_limit: {value: 1024, kind: estimate}}
    tenants: [{name: team-a, quota_bytes: 10GiB}]
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "kvledger.yml"
    p.write_text(text)
    return p


def test_full_config(tmp_path: Path) -> None:
    c = load_config(write(tmp_path, GOOD))
    assert c.listen == "127.0.0.1:9500" and c.interval_seconds == 0.5 and c.sharing == "reference-aware"
    assert c.nvml.enabled == "false"
    e = c.engines[0]
    assert e.timeout_seconds == 0.5 and e.block_bytes == 2 * 2**20 and e.gpus == (0, 1)
    assert e.memory.terms["reserve"].value == 2 * 2**30 and e.memory.terms["weights"].value == 16 * 10**9
    assert e.host.output_buffer_limit_bytes.value == 64 * 2**20  # type: ignore[union-attr]
    assert e.host.network_queue_limit.kind == "estimate"  # type: ignore[union-attr]
    assert e.tenants[0].quota_bytes == 10 * 2**30


def test_defaults(tmp_path: Path) -> None:
    c = load_config(write(tmp_path, "engines: []\n"))
    assert c.listen == "0.0.0.0:9477" and c.interval_seconds == 1.0 and c.sharing == "per-request"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("listn: x\n", "<top>: unknown key(s): listn"),
        ("policy: {sharing: unique}\n", "policy.sharing: must be one of per-request, reference-aware"),
        ("engines:\n  - {name: a, kind: vllm}\n", "engines[0].url: is required"),
        ("engines:\n  - {name: a, kind: foo, url: 'http://x'}\n", "engines[0].kind: must be one of"),
        ("engines:\n  - {name: a, kind: vllm, url: 'http://x', block_bytes: 2XB}\n", "engines[0].block_bytes: expected a size"),
        ("engines:\n  - {name: a, kind: vllm, url: 'http://x', timeout_seconds: -1}\n", "engines[0].timeout_seconds"),
        ("engines:\n  - {name: a, kind: vllm, url: 'http://x', host: {prot: 1}}\n", "engines[0].host: unknown key(s): prot"),
        ("engines:\n  - {name: a, kind: vllm, url: 'http://x', tenants: [{name: t}]}\n", "engines[0].tenants[0].quota_bytes: is required"),
        ("engines:\n  - {name: a, kind: vllm, url: 'http://x'}\n  - {name: a, kind: vllm, url: 'http://y'}\n", "duplicate engine name"),
        ("engines: [\n", "invalid YAML at line"),
        ("listen: nohost\n", "listen: expected HOST:PORT"),
    ],
)
def test_errors_name_file_and_key(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(path) in str(err.value)
    assert message in str(err.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.yml")


def test_sizes_and_durations() -> None:
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("500MB") == 500 * 10**6
    assert parse_size(123) == 123
    assert parse_size("1.5KiB") == 1536
    for bad in ("-1", "1.5B", "abc", True, -3):
        with pytest.raises(ValueError):
            parse_size(bad)
    assert parse_duration("500ms") == 0.5 and parse_duration(2) == 2.0 and parse_duration("1m") == 60.0
    with pytest.raises(ValueError):
        parse_duration(0)


def test_otlp_and_json_view(tmp_path: Path) -> None:
    c = load_config(write(tmp_path, "json_view: true\notlp: {endpoint: 'http://127.0.0.1:4318'}\n"))
    assert c.json_view is True and c.otlp_endpoint == "http://127.0.0.1:4318"
    with pytest.raises(ConfigError, match="otlp: unknown key"):
        load_config(write(tmp_path, "otlp: {endpoint: 'http://x:4318', headers: {}}\n"))


# ---------------------------------------------------------------- engine kinds (config/engine_kinds.py)


def _one_engine(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "k.yml"
    path.write_text("engines:\n  - {name: e, url: 'http://127.0.0.1:1/', " + body + "}\n")
    return path


@pytest.fixture
def planned_kind(monkeypatch: pytest.MonkeyPatch) -> str:
    """A kind on the roadmap (PLANNED), whatever the release has already accepted."""
    import kvledger.config.loader

    monkeypatch.setattr(kvledger.config.loader, "PLANNED", ("futurekind",))
    return "futurekind"


def test_unknown_kind_lists_only_kinds_that_work(tmp_path: Path, planned_kind: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(_one_engine(tmp_path, "kind: nope"))
    assert f"must be one of {', '.join(KINDS)}" in str(err.value)
    assert planned_kind not in str(err.value)


def test_planned_kind_is_refused_with_the_way_forward(tmp_path: Path, planned_kind: str) -> None:
    with pytest.raises(ConfigError, match=r"kind 'futurekind' has no adapter in this release .*kind: ledger"):
        load_config(_one_engine(tmp_path, f"kind: {planned_kind}"))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_accepted_engine_kinds_load_with_kind_and_url_alone(tmp_path: Path, kind: str) -> None:
    from kvledger.config.engine_kinds import PLANNED

    assert kind not in PLANNED
    assert load_config(_one_engine(tmp_path, f"kind: {kind}")).engines[0].kind == kind


def test_tokens_option_is_a_token_count(tmp_path: Path) -> None:
    assert load_config(_one_engine(tmp_path, "kind: tgi, block_size: 16")).engines[0].option("block_size") == "16"
    for bad in ("0", "-16", "2.5", "'16'", "true"):
        with pytest.raises(ConfigError, match=r"engines\[0\]\.block_size: expected a positive integer"):
            load_config(_one_engine(tmp_path, f"kind: tgi, block_size: {bad}"))
    with pytest.raises(ConfigError, match=r"engines\[0\]\.block_size: must be at most 1073741824"):
        load_config(_one_engine(tmp_path, f"kind: tgi, block_size: {2**30 + 1}"))
    with pytest.raises(ConfigError, match=r"block_size is for kind tgi only \(this engine is kind sglang\)"):
        load_config(_one_engine(tmp_path, "kind: sglang, block_size: 16"))


def test_steps_option_is_a_step_count(tmp_path: Path) -> None:
    """SGLang's --decode-log-interval, stated in the configuration (kvledger_source_refresh_interval_steps)."""
    cfg = load_config(_one_engine(tmp_path, "kind: sglang, decode_log_interval: 40"))
    assert cfg.engines[0].option("decode_log_interval") == "40"
    for bad in ("0", "-1", "2.5", "'40'", "true"):
        with pytest.raises(ConfigError, match=r"engines\[0\]\.decode_log_interval: expected a positive integer"):
            load_config(_one_engine(tmp_path, f"kind: sglang, decode_log_interval: {bad}"))
    with pytest.raises(ConfigError, match=r"decode_log_interval is for kind sglang only \(this engine is kind tgi\)"):
        load_config(_one_engine(tmp_path, "kind: tgi, decode_log_interval: 40"))


def test_a_key_of_another_kind_is_rejected_by_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"engines\[0\]: kv_events is for kind vllm only \(this engine is kind ledger\)"):
        load_config(_one_engine(tmp_path, "kind: ledger, kv_events: 'tcp://127.0.0.1:5557'"))


def test_kind_options_are_parsed_by_their_declared_type(tmp_path: Path) -> None:
    cfg = load_config(_one_engine(tmp_path, "kind: vllm, kv_events: 'tcp://127.0.0.1:5557', log_file: /var/log/v.log"))
    e = cfg.engines[0]
    assert e.option("kv_events") == "tcp://127.0.0.1:5557" and e.option("log_file") == "/var/log/v.log"
    assert e.option("kv_events_replay") is None
    with pytest.raises(ConfigError, match=r"engines\[0\]\.kv_events: expected"):
        load_config(_one_engine(tmp_path, "kind: vllm, kv_events: 'not an address'"))


def test_check_never_says_valid_before_failing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], planned_kind: str
) -> None:
    from kvledger.cli import main

    path = _one_engine(tmp_path, f"kind: {planned_kind}")
    assert main(["check", "--config", str(path)]) == 2
    out = capsys.readouterr()
    assert "valid" not in out.out and "has no adapter" in out.err


# ---------------------------------------------------------------- first-hour frictions (issue 13)

@pytest.mark.parametrize(
    ("text", "message"),
    [
        # a typo of a required nested key names the unknown key, not only the missing one
        ("engines:\n  - {name: a, kind: vllm, url: 'http://x', tenants: [{name: t, quota_byte: 1GiB}]}\n",
         "engines[0].tenants[0]: unknown key(s): quota_byte (did you mean quota_bytes?); quota_bytes is required"),
        ("engines:\n  - {name: a, kind: vllm, url: 'http://x', tenants: [{name: t, quota: 1GiB}]}\n",
         "engines[0].tenants[0]: unknown key(s): quota (did you mean quota_bytes?); quota_bytes is required"),
        ("engines:\n  - {name: a, kind: vllm, ulr: 'http://x'}\n",
         "engines[0]: unknown key(s): ulr (did you mean url?); url is required"),
        ("engines:\n  - {nmae: a, kind: vllm, url: 'http://x'}\n",
         "engines[0]: unknown key(s): nmae (did you mean name?); name is required"),
        ("engines:\n  - {name: a, kind: vllm, url: 'http://x', memory: {reserve_bytes: {valu: 2GiB}}}\n",
         "engines[0].memory.reserve_bytes: unknown key(s): valu (did you mean value?); value is required"),
        ("engines:\n  - {name: a, kind: vllm, url: 'http://x', host: {output_buffer_limit_bytes: {vaule: 1, kind: hard}}}\n",
         "engines[0].host.output_buffer_limit_bytes: unknown key(s): vaule (did you mean value?); value is required"),
        ("engines:\n  - {name: a, kind: vllm, url: 'http://x', model: {confg: c.json}}\n",
         "engines[0].model: unknown key(s): confg (did you mean config?); config is required"),
        ("otlp: {endpiont: 'http://c:4318'}\n", "otlp: unknown key(s): endpiont (did you mean endpoint?); endpoint is required"),
        # a key that resembles nothing is still named
        ("engines:\n  - {name: a, kind: vllm, url: 'http://x', tenants: [{name: t, limit: 1GiB}]}\n",
         "engines[0].tenants[0]: unknown key(s): limit; quota_bytes is required"),
        # unknown keys elsewhere get the hint too; a wholly missing key is still just "is required"
        ("engnes: []\n", "<top>: unknown key(s): engnes (did you mean engines?)"),
        ("engines:\n  - {name: a, kind: vllm, url: 'http://x', timout_seconds: 1}\n",
         "engines[0]: unknown key(s): timout_seconds (did you mean timeout_seconds?)"),
        ("engines:\n  - {name: a, kind: vllm, url: 'http://x', kv_event: 'tcp://x:1'}\n",
         "engines[0]: unknown key(s): kv_event (did you mean kv_events?)"),
        ("engines:\n  - {name: a, kind: vllm, url: 'http://x', tenants: [{name: t}]}\n", "engines[0].tenants[0].quota_bytes: is required"),
    ],
)
def test_unknown_nested_keys_are_named(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(write(tmp_path, text))
    assert str(exc.value) == f"{tmp_path / 'kvledger.yml'}: {message}"


@pytest.mark.parametrize(
    ("text", "warnings"),
    [
        ("", ["the file is empty: every setting is at its default",
              "no engines configured (engines: is missing or empty): nothing to account; only the GPUs (NVML) "
              "and kvledger's own health are exported"]),
        ("engines: []\n", ["no engines configured (engines: is missing or empty): nothing to account; only the GPUs "
                           "(NVML) and kvledger's own health are exported"]),
        ("nvml: {enabled: false}\n", ["no engines configured (engines: is missing or empty): nothing to account; "
                                      "only kvledger's own health is exported"]),
        (GOOD, []),
    ],
    ids=["empty-file", "no-engines", "nothing-at-all", "good"],
)
def test_valid_but_empty_configurations_warn(tmp_path: Path, text: str, warnings: list[str]) -> None:
    path = write(tmp_path, text)
    assert list(load_config(path).warnings) == [f"{path}: {w}" for w in warnings]


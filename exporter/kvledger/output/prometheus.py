"""Prometheus output: metric families built from the latest Accounts at each scrape,
straight from the catalogue (no global gauges are mutated).

Three renderings of the same families:
- ``AccountsCollector``: a prometheus_client custom collector (registries);
- ``render_text``: the text exposition format 0.0.4 written directly from the catalogue.
  prometheus_client 0.2x spends ~14 µs per sample validating and escaping names that
  the catalogue already guarantees; at 10,000 in-flight requests over 8 engines that is
  over the scrape budget, so /metrics uses this renderer (tests check that both
  renderings parse to the same samples);
- ``render_openmetrics``: OpenMetrics 1.0.0 written the same way, for a scraper that asks
  for it (``negotiate``: the choice prometheus_client's ``choose_encoder`` makes).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Hashable, Iterator
from operator import itemgetter

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector, CollectorRegistry

from kvledger.domain.accounts import Accounts, EngineAccount
from kvledger.domain.limits import MAX_SAFE_INT
from kvledger.output.catalog import CATALOG, Labels, MetricSpec

log = logging.getLogger("kvledger.output")

TEXT_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS_CONTENT_TYPE = "application/openmetrics-text; version=1.0.0; charset=utf-8"

#: the exposition formats /metrics writes: the text format, OpenMetrics
TEXT, OPENMETRICS = "text", "openmetrics"


def build_family(spec: MetricSpec, accounts: Accounts | None) -> Metric:
    family: GaugeMetricFamily | CounterMetricFamily
    if spec.type == "counter":
        family = CounterMetricFamily(spec.name, spec.help, labels=spec.labels)
    else:
        family = GaugeMetricFamily(spec.name, spec.help, labels=spec.labels)
    if accounts is not None:
        for labels, value in spec.labelled(accounts):
            family.add_metric(list(labels.values()), value)  # in the family's order (``labelled``)
    return family


class AccountsCollector(Collector):
    """Reads the latest Accounts through ``latest`` (never waits on an engine)."""

    def __init__(self, latest: Callable[[], Accounts | None]) -> None:
        self._latest = latest

    def collect(self) -> Iterator[Metric]:
        accounts = self._latest()
        for spec in CATALOG:
            yield build_family(spec, accounts)


def make_registry(latest: Callable[[], Accounts | None], process_metrics: bool = True) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AccountsCollector(latest))
    if process_metrics:
        ProcessCollector(registry=registry)
    return registry


# ---------------------------------------------------------------- direct text rendering


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _escape_value(text: str) -> str:
    if "\\" in text or '"' in text or "\n" in text:
        return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
    return text


def _number(value: float) -> str:
    if -math.inf < value < math.inf:  # finite: the one test most values take
        return repr(float(value))
    if value == math.inf:
        return "+Inf"
    if value == -math.inf:
        return "-Inf"
    if math.isnan(value):
        return "NaN"
    return repr(float(value))


_HEADERS = {
    spec.name: f"# HELP {spec.name} {_escape_help(spec.help)}\n# TYPE {spec.name} {spec.type}\n" for spec in CATALOG
}


def _openmetrics_header(spec: MetricSpec) -> str:
    """HELP, TYPE and (where the name ends with it) UNIT of a family. A counter's family is
    named without ``_total``, which its samples keep; HELP escapes double quotes too."""
    family = spec.name.removesuffix("_total") if spec.type == "counter" else spec.name
    text = _escape_help(spec.help).replace('"', '\\"')
    unit = f"# UNIT {family} {spec.unit}\n" if spec.unit and family.endswith(f"_{spec.unit}") else ""
    return f"# HELP {family} {text}\n# TYPE {family} {spec.type}\n{unit}"


_OPENMETRICS_HEADERS = {spec.name: _openmetrics_header(spec) for spec in CATALOG}


def negotiate(accept: str) -> tuple[str, str]:
    """The format and Content-Type for an Accept header, chosen as prometheus_client 0.2x's
    ``choose_encoder`` chooses (q-values are not weighed, the first match wins):
    ``application/openmetrics-text`` without a version or with a version of 1.0.0 or later
    gets OpenMetrics (Content-Type naming that version and, when one was asked, the name
    escaping, a no-op on the catalogue's names); ``text/plain`` with a version of 1.0.0 or
    later gets the text format under that Content-Type; anything else the text format
    0.0.4. Prometheus 2.x asks ``application/openmetrics-text;version=1.0.0,...``."""
    for accepted in accept.split(","):
        media, *params = (p.strip() for p in accepted.split(";"))
        if media not in ("application/openmetrics-text", "text/plain"):
            continue
        values = dict(p.split("=", 1) for p in params if "=" in p)
        version = values.get("version", "")
        escaping = values.get("escaping", "underscores")
        if escaping not in ("allow-utf-8", "underscores", "dots", "values"):
            escaping = "underscores"
        if media == "application/openmetrics-text" and not version:
            return OPENMETRICS, OPENMETRICS_CONTENT_TYPE
        if not _at_least_1(version):
            continue
        if media == "application/openmetrics-text":
            return OPENMETRICS, f"application/openmetrics-text; version={version}; charset=utf-8; escaping={escaping}"
        return TEXT, f"text/plain; version=1.0.0; charset=utf-8; escaping={escaping}"
    return TEXT, TEXT_CONTENT_TYPE


#: a longer version parameter is not read (not a version this exporter can name back)
MAX_VERSION_CHARS = 64


def _at_least_1(version: str) -> bool:
    """version >= 1.0.0, compared part by part as integers ("1" is less, "2" more); a
    version with a part that is no integer is not (prometheus_client fails on it)."""
    if len(version) > MAX_VERSION_CHARS:
        return False
    parts = version.split(".")
    if not all(p.isascii() and p.isdigit() for p in parts):
        return False
    # compared as digit strings, never converted: int() refuses more than 4,300 digits (and a
    # longer number would cost quadratic time); leading zeros do not count
    # ((length, digits) orders as the number does); a list compares as the tuple of ints did
    numbers = [(len(n), n) for n in (p.lstrip("0") for p in parts)]
    return numbers >= [(1, "1"), (0, ""), (0, "")]


def render(accounts: Accounts | None, process_registry: CollectorRegistry | None = None, fmt: str = TEXT) -> bytes:
    """The catalogue's families (then the process metrics) in ``fmt``."""
    return render_openmetrics(accounts, process_registry) if fmt == OPENMETRICS else render_text(accounts, process_registry)


def render_openmetrics(accounts: Accounts | None, process_registry: CollectorRegistry | None = None) -> bytes:
    """The catalogue's families in OpenMetrics 1.0.0, ending with ``# EOF``: the samples of
    ``render_text``, under OpenMetrics' family headers."""
    body = _render(accounts, _OPENMETRICS_HEADERS)
    if process_registry is not None:
        process = openmetrics_latest(process_registry)  # type: ignore[no-untyped-call]  # prometheus_client's openmetrics module is unannotated
        body += bytes(process).removesuffix(b"# EOF\n")
    return body + b"# EOF\n"


def render_text(accounts: Accounts | None, process_registry: CollectorRegistry | None = None) -> bytes:
    """The catalogue's families in the text exposition format 0.0.4."""
    body = _render(accounts, _HEADERS)
    if process_registry is not None:
        body += generate_latest(process_registry)
    return body


def _render(accounts: Accounts | None, headers: dict[str, str]) -> bytes:
    """Every family's header and samples. The collector only publishes Accounts it has
    checked engine by engine (``check_renderable``); should a family still fail, it is
    left empty and logged rather than failing the whole scrape. The engine families are
    the engines' lines made once per account (``engine_lines``), joined in engine order."""
    out: list[str] = []
    engines = accounts.engines if accounts is not None else []
    per_engine = [engine_lines(e, accounts, check=False) for e in engines] if accounts is not None else []
    for spec in CATALOG:
        out.append(headers[spec.name])
        if accounts is None:
            continue
        if spec.name in ENGINE_FAMILIES:  # every engine's lines name every engine family
            out.extend(map(itemgetter(spec.name), per_engine))
            continue
        try:
            out.append(_family_lines(spec, accounts, check=False))
        except Exception:  # a bug of ours: lose one family, never the scrape
            log.exception("rendering %s failed; the family is left empty", spec.name)
    return "".join(out).encode("utf-8", "backslashreplace")


#: the families whose samples are each engine's alone (read from ``Accounts.engines`` only),
#: in engine order: rendered once per engine account (``engine_lines``); tests/test_poll_scale.py
#: checks that these families of a whole Accounts are their engines' lines joined
ENGINE_FAMILIES = frozenset(
    spec.name for spec in CATALOG
    if spec.group in ("kv", "scheduler", "tenant", "host")
    or spec.name in ("kvledger_policy_info", "kvledger_engine_info", "kvledger_engine_reported_memory_bytes")
)
_ENGINE_SPECS = tuple(spec for spec in CATALOG if spec.name in ENGINE_FAMILIES)


def engine_lines(account: EngineAccount, accounts: Accounts | None = None, *, check: bool = True) -> dict[str, str]:
    """``account``'s sample lines in each engine family (kept on the account: made once).
    With ``check`` (the collector's render check), checked as ``check_renderable`` checks
    them: ValueError naming the sample, and nothing kept. Without (a scrape of Accounts
    whose lines were not made yet), a family that fails is left empty and logged."""
    rendered = account.rendered
    if rendered is None:
        alone = Accounts([account], [], [], None, [], accounts.sharing if accounts else account.sharing,
                         accounts.taken_at if accounts else 0.0)
        rendered = {}
        for spec in _ENGINE_SPECS:
            if check:
                rendered[spec.name] = _family_lines(spec, alone, check=True)
                continue
            try:
                rendered[spec.name] = _family_lines(spec, alone, check=False)
            except Exception:  # a bug of ours: lose one family, never the scrape
                log.exception("rendering %s failed; the family is left empty", spec.name)
                rendered[spec.name] = ""
        account.rendered = rendered
    return rendered


def _family_lines(spec: MetricSpec, accounts: Accounts, *, check: bool) -> str:
    """The sample lines of one family (no header); with ``check``, ValueError for a value or
    a label value the exposition cannot carry (``check_renderable``). A sample's labels are
    read by name, written in the family's order (``spec.labels``); a sample whose names are
    not the family's is a ValueError (a name it lacks: KeyError)."""
    names = spec.labels
    count = len(names)
    key_of = _KEYS[spec.name]
    lines: list[str] = []
    prefixes = _PREFIXES[spec.name]
    if len(prefixes) > MAX_PREFIXES:
        prefixes.clear()
    for labels, value in spec.samples(accounts):
        if check and not -MAX_SAFE_INT <= value <= MAX_SAFE_INT:
            _check_value(spec, labels, value)
        key = key_of(labels)  # the values of the family's names, taken by name (one missing: KeyError)
        if len(labels) != count:  # every name there and no other, whether or not the prefix is kept
            _check_names(spec, labels)
        prefix = prefixes.get(key)  # made from Accounts the collector checked (check_renderable)
        if prefix is None:
            _check_labels(spec, labels)  # always: a kept prefix is of checked label values (_checked_lines)
            if names:
                pairs = ",".join(f'{n}="{_escape_value(labels[n])}"' for n in names)
                prefix = f"{spec.name}{{{pairs}}} "
            else:
                prefix = f"{spec.name} "
            prefixes[key] = prefix
        end = _LINE_ENDS.get(value)
        if end is None:
            end = _line_end(value)
        lines.append(prefix + end)
    return "".join(lines)


def _key_of(names: tuple[str, ...]) -> Callable[[Labels], Hashable]:
    """What keys a family's sample prefix: the values of its label names, each taken by name
    (one name: the value itself; none: the empty tuple)."""
    if not names:
        return lambda labels: ()
    getter: Callable[[Labels], Hashable] = itemgetter(*names)
    return getter


#: each family's sample prefixes (``name{labels} ``) by label values (``_KEYS``): the same series
#: come back at every render, and formatting their labels was half of a render's time; emptied
#: past MAX_PREFIXES entries in a family (series come and go)
_PREFIXES: dict[str, dict[Hashable, str]] = {spec.name: {} for spec in CATALOG}
_KEYS: dict[str, Callable[[Labels], Hashable]] = {spec.name: _key_of(spec.labels) for spec in CATALOG}
MAX_PREFIXES = 100_000
#: the values most samples take, formatted once (with the line's end), and the values rendered
#: since (capacities, budgets and sizes come back at every render), up to MAX_LINE_ENDS of them
_SMALL = {float(v): repr(float(v)) + "\n" for v in range(0, 1025)}
_LINE_ENDS = dict(_SMALL)
MAX_LINE_ENDS = 20_000


def _line_end(value: float) -> str:
    end = _number(value) + "\n"
    if -math.inf < value < math.inf:  # NaN is never equal to itself: never kept
        if len(_LINE_ENDS) >= MAX_LINE_ENDS:  # values come and go (timestamps): start again
            _LINE_ENDS.clear()
            _LINE_ENDS.update(_SMALL)
        _LINE_ENDS[value] = end
    return end


def _check_value(spec: MetricSpec, labels: Labels, value: float) -> None:
    if not -MAX_SAFE_INT <= value <= MAX_SAFE_INT:  # NaN compares false too
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{spec.name}: value {value!r} is not finite")
        shown = ",".join(f'{n}="{v}"' for n, v in labels.items())
        number = repr(value) if abs(value) < 1e30 else "of more than 30 digits"
        raise ValueError(f"{spec.name}{{{shown[:200]}}}: value {number} is beyond 2**53 - 1, "
                         "where a float no longer holds every integer")


def _check_names(spec: MetricSpec, labels: Labels) -> None:
    """A sample names exactly its family's labels (a bug of ours otherwise: tests/test_metric_names.py)."""
    if len(labels) != len(spec.labels) or not all(n in labels for n in spec.labels):
        raise ValueError(f"{spec.name}: a sample's labels {sorted(labels)} are not the family's {list(spec.labels)}")


def _check_labels(spec: MetricSpec, labels: Labels) -> None:
    for label in labels.values():
        if not isinstance(label, str) or "\x00" in label:
            raise ValueError(f"{spec.name}: label value {label!r} is not text")
        label.encode("utf-8")


def check_renderable(accounts: Accounts) -> None:
    """Raise ValueError unless every catalogue sample of ``accounts`` can be exported: a
    finite number within [-(2**53 - 1), 2**53 - 1] and label values that are text (UTF-8
    encodable, no NUL).

    The render check the collector asks of the output side, for each engine alone
    (``collect.accounting.account_snapshot``): an engine that fails it is marked down
    (``invalid``) instead of breaking the exposition of the others. It is the one place
    where every exported number, sums and counters included, is held to the range a
    double carries exactly (``MAX_SAFE_INT``): the parsers check each value they read, but
    a sum over data-parallel ranks, API servers or series (running requests, prefix-cache
    tokens), a count of lost KV events or a reservation bound computed from them is only
    known here, after the policy. A larger value would be exported rounded (2**53 + 1 reads
    2**53): the engine is invalid instead.

    Accounts of one engine whose lines are not made yet get them made by the check itself, in
    its pass over each engine family's samples (kept on the account, as ``engine_lines`` keeps
    them): a scrape of a fleet whose every engine changed then joins lines instead of reading
    every sample a second time, and label values are checked once per family while their
    prefix is kept, not at every check (docs/performance.md)."""
    engine = accounts.engines[0] if len(accounts.engines) == 1 and accounts.engines[0].rendered is None else None
    rendered: dict[str, str] = {}
    ends = _LINE_ENDS
    for spec in CATALOG:
        if engine is not None and spec.name in ENGINE_FAMILIES:  # _checked_lines inlined: a call per family cost as much as its samples
            get = _PREFIXES[spec.name].get
            key_of = _KEYS[spec.name]
            count = len(spec.labels)
            out: list[str] = []
            append = out.append
            for labels, value in spec.samples(accounts):
                if not -MAX_SAFE_INT <= value <= MAX_SAFE_INT:  # NaN compares false too
                    _check_value(spec, labels, value)
                try:
                    prefix = get(key_of(labels))
                except TypeError:
                    raise ValueError(f"{spec.name}: a label value is not text: {labels!r}"[:300]) from None
                if len(labels) != count:  # every name there and no other, as _family_lines checks
                    _check_names(spec, labels)
                if prefix is None:  # label values not checked yet: the family's values, then its labels
                    rendered[spec.name] = _checked_lines(spec, accounts)
                    break
                end = ends.get(value)
                if end is None:
                    end = _line_end(value)
                append(prefix)
                append(end)
            else:
                rendered[spec.name] = "".join(out)
            continue
        seen: set[object] = set()  # each distinct label value is checked once (they repeat: engine, pool, basis)
        for labels, value in spec.samples(accounts):
            if not -MAX_SAFE_INT <= value <= MAX_SAFE_INT:  # NaN compares false too
                _check_value(spec, labels, value)
            try:
                seen.update(labels.values())
            except TypeError:
                raise ValueError(f"{spec.name}: a label value is not text: {labels!r}"[:300]) from None
        for label in seen:
            if not isinstance(label, str) or "\x00" in label:
                raise ValueError(f"{spec.name}: label value {label!r} is not text")
            label.encode("utf-8")
    if engine is not None:
        engine.rendered = rendered


def _checked_lines(spec: MetricSpec, accounts: Accounts) -> str:
    """The lines of one family of ``accounts``, checked as ``check_renderable`` checks a family
    (every value, then the label values): the values in a first pass, then, for the samples
    whose label values have no prefix yet, their names and values (``_family_lines`` with its
    check makes and keeps their prefixes, of checked label values only)."""
    key_of = _KEYS[spec.name]
    for labels, value in spec.samples(accounts):
        if not -MAX_SAFE_INT <= value <= MAX_SAFE_INT:  # NaN compares false too
            _check_value(spec, labels, value)
        try:
            hash(key_of(labels))
        except TypeError:
            raise ValueError(f"{spec.name}: a label value is not text: {labels!r}"[:300]) from None
    return _family_lines(spec, accounts, check=True)


def process_registry() -> CollectorRegistry:
    """The exporter's own process metrics (RSS, CPU), rendered after the catalogue."""
    registry = CollectorRegistry(auto_describe=False)
    ProcessCollector(registry=registry)
    return registry

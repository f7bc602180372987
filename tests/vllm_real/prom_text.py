"""Read values out of a Prometheus text exposition (what vLLM's /metrics returns)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Every sample called exactly ``name`` (suffix included, e.g. ``..._total``)."""
    return [
        (dict(s.labels), float(s.value))
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    ]


def value(text: str, name: str, **labels: str) -> float:
    """The one sample of ``name`` whose labels include ``labels``; KeyError otherwise."""
    found = [v for lab, v in samples(text, name) if labels.items() <= lab.items()]
    if len(found) != 1:
        raise KeyError(f"{len(found)} samples of {name} with labels {labels}, expected 1")
    return found[0]


def labels_of(text: str, name: str) -> dict[str, str]:
    """The labels of the one sample of ``name`` (an info metric such as cache_config_info)."""
    found = samples(text, name)
    if len(found) != 1:
        raise KeyError(f"{len(found)} samples of {name}, expected 1")
    return found[0][0]
